"""A file's bytes as CPU tensors over a read-only memory map (:class:`HostMap`), and the map itself (:class:`FileMap`).

``FileMap`` is what registered copies page-lock window by window; ``HostMap`` hands the tensors vLLM's
own weight loaders narrow and copy (``common.safetensors``): no copy and no read until a tensor is used.

A bundle file truncated while it is mapped. The CPU reading a page of a map past the file's new end gets
SIGBUS, which Python cannot turn into an exception: the engine dies without a word. Everything else that
reads bundle or checkpoint bytes on the CPU (hashing, ``convert``, ``verify``) reads them with ``pread``
instead (:mod:`marlin_pack.io.preads`) and refuses a short read in one line. Here:

* ``FileMap`` (registered copies, and the copy helpers' maps in :mod:`.helper_main`): the CPU never reads the
  map. ``MADV_POPULATE_READ`` of pages past the end fails with ``EFAULT`` (no signal), and so does
  ``cudaHostRegister`` (``cuMemHostRegister``): the window is then staged with ``pread`` (a helper's by this
  process), which reads short, a :class:`~marlin_pack.errors.BundleError` naming the file. Pages registered
  before the truncation stay pinned (the driver holds them, the truncation only takes them out of the page
  cache), so the GPU's copy engine reads the bytes the file held when they were pinned, never a missing page.
  A file already shorter than the map asked for is a ``BundleError`` ("changed while it was read").
* ``HostMap``: a CPU-side touch remains. vLLM's weight loaders copy the tensors it hands them (the common
  tensors at TP > 1; at TP = 1 those under ``common_tensors.LARGE_COMMON``; none it skips) out of the map on
  the CPU, in ``load_weights``; a ``common.safetensors`` truncated during those copies ends the engine with
  SIGBUS. Reading them with ``pread`` instead would read each rank's whole embedding and head where it uses
  its shard, and what a pipeline stage skips. marlin-pack never truncates a bundle file in place (``convert
  --force`` publishes a new directory by rename; a map of a replaced file keeps its bytes), so only another
  writer of the file can, and whoever may write a bundle file can make the engine serve anything anyway.
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
        """Raises:
        BundleError: the file is now shorter than ``size`` (truncated since it was opened)."""
        try:
            self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except ValueError as e:  # "mmap length is greater than file size"
            raise BundleError(f"the file changed while it was read (it no longer holds the {size} bytes it held)") from e
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
    copies large tensors with :class:`ParallelReader` instead. vLLM's weight loaders
    narrow and copy what they are fed, they never write into it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.whole = False  # read whole into this process's memory (ParallelReader.read_whole), not mapped
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._mapping: FileMap | None = FileMap(fd, self.size) if self.size else None
        finally:
            os.close(fd)
        self._bytes: torch.Tensor | None = None if self._mapping is None else self._mapping.bytes

    @classmethod
    def in_memory(cls, path: Path, image: torch.Tensor) -> HostMap:
        """A file's bytes already in this process's memory (``image``, uint8, the file's size) as a held HostMap;
        ``path`` is what readers name it by (a bundle in object storage: its URL, :mod:`marlin_pack.vllm_plugin.remote_load`)."""
        host = cls.__new__(cls)
        host.path, host.whole, host._mapping, host.size = path, True, None, image.numel()
        host._bytes = image if host.size else None
        return host

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The file bytes ``[offset, offset + nbytes)`` as a CPU tensor (a view when aligned, else a copy)."""
        if offset < 0 or offset + nbytes > self.size or self._bytes is None:
            raise BundleError(
                f"tensor bytes {offset}..{offset + nbytes} lie outside {self.path.name} ({self.size} bytes): "
                "the bundle file is truncated"
            )
        raw = self._bytes[offset : offset + nbytes]
        if offset % dtype.itemsize:
            raw = raw.clone()  # a view of another dtype must start at a multiple of its item size
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        # Not mmap.close(): a view vLLM kept would point at unmapped memory. The tensors hold a
        # reference to the map, which is unmapped when the last of them goes.
        self._mapping = None
        self._bytes = None

    def __enter__(self) -> HostMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
