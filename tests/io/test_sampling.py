"""Samples of every tensor (marlin_pack.io.sampling): what a start compares instead of hashing the whole checkpoint."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from source_edits import flip_byte

from marlin_pack.io import sampling
from marlin_pack.io.files import FileChangedError
from marlin_pack.io.safetensors_io import read_header, read_header_bytes
from marlin_pack.io.sampling import SAMPLE_BYTES, sample_digest, sample_spans


def _write(path: Path, seed: int = 0, big: int = 3 * 4096 + 5) -> Path:
    g = torch.Generator().manual_seed(seed)
    save_file({
        "small": torch.randint(0, 255, (100,), generator=g, dtype=torch.uint8),
        "big": torch.randint(0, 255, (big,), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, dtype=torch.float16),
    }, str(path))
    return path


def test_the_digest_is_of_the_sampled_bytes_in_name_order(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.safetensors")
    header = read_header(path)
    spans = sample_spans(header)
    data = path.read_bytes()
    want = hashlib.sha256(b"".join(data[o:o + n] for o, n in spans)).hexdigest()
    assert sample_digest(path) == (hashlib.sha256(read_header_bytes(path)).hexdigest(), want)
    big, small = header.tensors["big"], header.tensors["small"]
    # "big" < "empty" < "small": the big tensor's one sample (4 KiB inside it), nothing of the empty one, all of small
    (bo, bn), (so, sn) = spans
    assert bn == SAMPLE_BYTES and big.start <= bo and bo + bn <= big.end
    assert (so, sn) == (small.start, small.end - small.start)


def test_one_sample_per_started_stride(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "SAMPLE_STRIDE", 8192)
    path = _write(tmp_path / "a.safetensors", big=3 * 8192 + 1)
    spans = sample_spans(read_header(path))
    assert len(spans) == 4 + 1  # 4 strides started in "big", then "small" whole
    assert len({o for o, _ in spans}) == 5


def test_same_places_on_every_machine(tmp_path: Path) -> None:
    """The places hang on names and sizes only: two checkpoints of one shape are sampled alike."""
    a, b = _write(tmp_path / "a.safetensors", seed=1), _write(tmp_path / "b.safetensors", seed=2)
    assert sample_spans(read_header(a)) == sample_spans(read_header(b))
    assert sample_digest(a)[1] != sample_digest(b)[1]  # other weights, same header: told apart


def test_a_sampled_byte_changes_the_digest_an_unsampled_one_does_not(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.safetensors")
    header, digest = sample_digest(path)
    spans = sample_spans(read_header(path))
    big = read_header(path).tensors["big"]
    inside = {o + i for o, n in spans for i in range(n)}
    outside = next(x for x in range(big.start, big.end) if x not in inside)
    flip_byte(path, outside)
    assert sample_digest(path) == (header, digest)  # what samples cannot prove: `verify` hashes the file whole
    flip_byte(path, spans[0][0] + 7)
    assert sample_digest(path)[1] != digest


def test_another_header_reads_no_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "a.safetensors")
    monkeypatch.setattr(sampling, "sample_spans", lambda h: pytest.fail("sampled although the header differs"))
    header, digest = sample_digest(path, "0" * 64)
    assert header != "0" * 64 and digest == ""


def test_a_file_cut_short_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.safetensors")
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(Exception) as e:  # the header's offsets no longer fit: refused as corrupt, nothing sampled
        sample_digest(path)
    assert "truncated" in str(e.value) or isinstance(e.value, FileChangedError)


def test_a_file_written_while_sampled_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "a.safetensors")
    real = sampling.sample_spans

    def write_meanwhile(h):  # type: ignore[no-untyped-def]
        spans = real(h)
        with open(path, "r+b") as f:  # another process rewrites the file in place
            f.seek(spans[0][0])
            f.write(b"\0")
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return spans

    monkeypatch.setattr(sampling, "sample_spans", write_meanwhile)
    with pytest.raises(FileChangedError, match="changed while it was read"):
        sample_digest(path)
