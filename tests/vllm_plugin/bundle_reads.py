"""What the loader reads of a bundle's files, recorded at the reads: the pipeline-stage and expert-share tests assert
that a GPU reads exactly its share (each byte range of it, nothing else) (:class:`BundleReads`); the cold-start tests
that every byte of a file is read once, whoever reads it (:class:`BundleBytes`)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch


def file_key(path: Path) -> str:
    """A bundle file as the records name it: ``tp2/rank-1.safetensors``, ``marlin-pack/common.safetensors``."""
    return f"{path.parent.name}/{path.name}"


def merged_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` ranges as sorted, merged ``[lo, hi)`` spans."""
    spans: list[list[int]] = []
    for lo, n in sorted(ranges):
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], lo + n)
        else:
            spans.append([lo, lo + n])
    return [(a, b) for a, b in spans]


class BundleReads:
    """Every byte range ``pread`` into the arena per file (:func:`file_key`), and with ``maps`` every tensor taken from a
    mapped file (the common tensors handed to vLLM)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, maps: bool = False) -> None:
        from marlin_pack.gpu import host_map
        from marlin_pack.gpu import reader as gpu_reader

        self.ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        pread_into, tensor = gpu_reader._pread_into, host_map.HostMap.tensor

        def recorded_pread(fd: int, buf: memoryview, offset: int) -> None:
            self.ranges[file_key(Path(os.readlink(f"/proc/self/fd/{fd}")))].append((offset, len(buf)))
            pread_into(fd, buf, offset)

        def recorded_tensor(hm: Any, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            self.ranges[file_key(Path(hm.path))].append((offset, nbytes))
            return tensor(hm, offset, nbytes, dtype, shape)

        monkeypatch.setattr(gpu_reader, "_pread_into", recorded_pread)
        if maps:
            monkeypatch.setattr(host_map.HostMap, "tensor", recorded_tensor)

    def bytes(self, path: Path) -> int:
        return sum(n for _, n in self.ranges[file_key(path)])

    def spans(self, path: Path) -> list[tuple[int, int]]:
        return merged_spans(self.ranges[file_key(path)])


# The first block of a rank or common file is read before the copy: the header (a few KiB: the decision checks it) and
# the plan's probe of O_DIRECT (residency.takes_direct_reads: one aligned block).
FIRST_BLOCK = 4096


class BundleBytes:
    """Every byte range read of the files under ``bundle``, per file: ``os.preadv`` on any descriptor (the copy's
    buffered and ``O_DIRECT`` reads, the hash's reads, the direct-read probe), safetensors headers, and tensors taken
    from a map of the file (``HostMap.tensor``). A file is named by its path (or its path relative to ``bundle``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, bundle: Path) -> None:
        from marlin_pack.gpu import host_map
        from marlin_pack.io import safetensors_io

        self.bundle = str(bundle.resolve())
        self.ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        preadv, tensor, header = os.preadv, host_map.HostMap.tensor, safetensors_io._read_header_bytes

        def header_read(path: Path) -> tuple[bytes, int]:
            raw, size = header(path)
            self._add(os.path.realpath(path), 0, len(raw))
            return raw, size

        monkeypatch.setattr(safetensors_io, "_read_header_bytes", header_read)

        def counted(fd: int, bufs: list, offset: int) -> int:
            n = preadv(fd, bufs, offset)
            self._add(os.readlink(f"/proc/self/fd/{fd}"), offset, n)
            return n

        def mapped(hm: Any, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            if not hm.whole:  # a file read whole is memory, not a read of the file
                self._add(str(hm.path.resolve()), offset, nbytes)
            return tensor(hm, offset, nbytes, dtype, shape)

        monkeypatch.setattr(os, "preadv", counted)
        monkeypatch.setattr(host_map.HostMap, "tensor", mapped)

    def key(self, path: Path | str) -> str:
        """The file as :attr:`ranges` names it: its path relative to the bundle."""
        return os.path.relpath(os.path.realpath(path), self.bundle) if os.path.isabs(path) else str(path)

    def _add(self, path: str, offset: int, n: int) -> None:
        if path.startswith(self.bundle + os.sep) and path.endswith(".safetensors"):
            with self._lock:
                self.ranges[self.key(path)].append((offset, n))

    def total(self, path: Path | str) -> int:
        return sum(n for _, n in self.ranges[self.key(path)])

    def times_read(self, path: Path | str, size: int, start: int = 0) -> set[int]:
        """How many times each byte of ``[start, size)`` was read (the distinct counts)."""
        seen = bytearray(size)
        for lo, n in self.ranges[self.key(path)]:
            for i in range(lo, min(lo + n, size)):
                seen[i] += 1
        return set(seen[start:])

    def only_samples(self, path: Path | str, most: int) -> bool:
        """A source checkpoint file: past its header, only the bytes a start samples (marlin_pack.io.sampling) were read,
        each at least once and at most ``most`` times (once per rank checked), the header at most ``most`` times too."""
        from marlin_pack.io.safetensors_io import parse_header
        from marlin_pack.io.sampling import sample_spans

        data = Path(path).read_bytes()  # not a pread: not counted
        end = 8 + int.from_bytes(data[:8], "little")
        allowed = bytearray(len(data))
        allowed[:end] = b"\1" * end
        sampled = sample_spans(parse_header(data[:end], len(data), Path(path)))
        for lo, n in sampled:
            allowed[lo:lo + n] = b"\1" * n
        seen = bytearray(len(data))
        for lo, n in self.ranges[self.key(path)]:
            for i in range(lo, min(lo + n, len(data))):
                seen[i] += 1
        return (all(allowed[i] for i in range(len(data)) if seen[i]) and max(seen) <= most
                and all(seen[lo] for lo, _ in sampled))

    def once_past_the_first_block(self, path: Path | str, size: int, first: int = FIRST_BLOCK, most: int = 3) -> bool:
        """Every byte after the ``first`` bytes read exactly once, those at most ``most`` times (the O_DIRECT probe, the
        header check, the copy)."""
        return self.times_read(path, size, first) == {1} and self.times_read(path, first) <= set(range(1, most + 1))


def truncate_mid_copy(monkeypatch: pytest.MonkeyPatch, path: Path) -> threading.Event:
    """Cut ``path`` to half its size once the direct copy has read three 64 KiB windows of it (the copy under way);
    the returned event is set when that happened. Sets a direct I/O plan of 64 KiB windows, two threads."""
    import json

    size = path.stat().st_size
    monkeypatch.setenv("MARLIN_PACK_IO", json.dumps({"mode": "direct", "threads": 2, "window": 1 << 16}))
    preadv, cut = os.preadv, threading.Event()

    def truncating(fd: int, bufs: list, offset: int) -> int:
        if not cut.is_set() and os.readlink(f"/proc/self/fd/{fd}") == str(path.resolve()) and offset >= 3 << 16:
            cut.set()
            os.truncate(path, size // 2)
        return preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", truncating)
    return cut
