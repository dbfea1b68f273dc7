"""What the loader reads of a bundle's files, recorded at the reads: the pipeline-stage and expert-share tests assert
that a GPU reads exactly its share (each byte range of it, nothing else)."""

from __future__ import annotations

import os
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
