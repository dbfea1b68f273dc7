"""A file's bytes as CPU tensors over a read-only memory map (:class:`HostMap`), and the map itself (:class:`FileMap`).

``FileMap`` is what registered copies page-lock window by window; ``HostMap`` hands the tensors vLLM's
own weight loaders narrow and copy (``common.safetensors``): no copy and no read until a tensor is used.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import torch

from marlin_pack.errors import BundleError

__all__ = ["FileMap", "HostMap"]


class FileMap:
    """A read-only memory map of one file, as a CPU byte tensor, for registered copies."""

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only buffer: we never write through this tensor
            warnings.simplefilter("ignore")
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()

    def close(self) -> None:
        del self.bytes
        self.mm.close()


class HostMap:
    """A whole file as CPU tensors that view a read-only memory map (no copy, no read until used).

    For the tensors vLLM's own weight loaders copy to the device (``common.safetensors``).
    Not page-locked: a CUDA copy whose source crosses two ``cudaHostRegister`` ranges fails
    with "invalid argument" (seen on an H200), tensors sharing a page cannot be registered
    separately, and pinning one large tensor in a single call runs on one thread. The loader
    copies large tensors with :class:`ParallelReader` instead. vLLM 0.33.0's weight loaders
    narrow and copy what they are fed, they never write into it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._mapping: FileMap | None = FileMap(fd, self.size) if self.size else None
        finally:
            os.close(fd)

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The file bytes ``[offset, offset + nbytes)`` as a CPU tensor (a view when aligned, else a copy)."""
        if offset < 0 or offset + nbytes > self.size or self._mapping is None:
            raise BundleError(
                f"tensor bytes {offset}..{offset + nbytes} lie outside {self.path.name} ({self.size} bytes): "
                "the bundle file is truncated"
            )
        raw = self._mapping.bytes[offset : offset + nbytes]
        if offset % dtype.itemsize:
            raw = raw.clone()  # a view of another dtype must start at a multiple of its item size
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        # Not mmap.close(): a view vLLM kept would point at unmapped memory. The tensors hold a
        # reference to the map, which is unmapped when the last of them goes.
        self._mapping = None

    def __enter__(self) -> HostMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
