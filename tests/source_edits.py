"""Edits of a source checkpoint for tests of the start's source check (samples, marlin_pack.io.sampling), and a
bundle as an older marlin-pack wrote it (no samples: the start hashes the checkpoint whole, stamps apply)."""

from __future__ import annotations

import json
from pathlib import Path

from marlin_pack.io.safetensors_io import read_header
from marlin_pack.io.sampling import sample_spans


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def sampled_offset(path: Path) -> int:
    """A byte of ``path`` a start samples (inside the first sample of the file)."""
    offset, length = sample_spans(read_header(path))[0]
    return offset + length // 2


def unsampled_offset(path: Path) -> int:
    """A tensor byte of ``path`` no sample covers (the file must hold a tensor larger than one sample)."""
    header = read_header(path)
    inside = {o + i for o, n in sample_spans(header) for i in range(n)}
    for t in sorted(header.tensors.values(), key=lambda t: t.end - t.start, reverse=True):
        for x in range(t.start, t.end):
            if x not in inside:
                return x
    raise AssertionError(f"every tensor byte of {path.name} is sampled")


def flip_sampled_byte(path: Path) -> None:
    flip_byte(path, sampled_offset(path))


def without_samples(model_dir: Path, bundle: str = "marlin-pack") -> None:
    """The bundle's manifest as an older marlin-pack wrote it: no ``sample_sha256`` in its source files."""
    manifest = model_dir / bundle / "manifest.json"
    data = json.loads(manifest.read_text())
    for f in data["source"]["files"]:
        f.pop("sample_sha256", None)
    manifest.chmod(0o644)
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
