"""Recycled output buffers for a streaming writer: the same few pages, layer after layer.

A converter hands the writer one multi-megabyte tensor per layer. Allocated fresh, each is
returned to the OS when freed and faults in again page by page the next time (llama-1gb:
~200k minor page faults, a large part of the conversion's system time; on a VM that returns
freed memory to its host, first touches are dearer still). A :class:`BufferPool` keeps the few
buffers a writer has in flight and gives them out again once their bytes are written.

The pool bounds nothing by itself: buffers come back when the writer has written them, and the
writer's in-flight limit bounds how many are out, so the pool holds at most that many plus
the one being filled, each the size of the largest tensor of the file.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool"]


class BufferPool:
    """CPU byte buffers of ``nbytes`` each, handed out by :meth:`take` and given back by :meth:`give_back`.

    Thread-safe: a writer thread gives back what the main thread takes.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._out: dict[int, torch.Tensor] = {}  # data pointer -> buffer, for buffers taken
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized tensor of ``dtype`` and ``shape`` (at most :attr:`nbytes`) over a pooled buffer."""
        import torch

        numel = 1
        for d in shape:
            numel *= d
        size = numel * dtype.itemsize
        if size > self.nbytes:
            raise ValueError(f"internal error: a {size}-byte tensor from a pool of {self.nbytes}-byte buffers")
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
        with self._lock:
            self._out[buf.data_ptr()] = buf
        return buf[:size].view(dtype).view(shape)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a buffer taken from this pool (and not yet given back)."""
        with self._lock:
            return tensor.untyped_storage().data_ptr() in self._out

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return the buffer under ``tensor`` to the pool (nothing if it is not the pool's); its
        contents may be overwritten from now on."""
        with self._lock:
            buf = self._out.pop(tensor.untyped_storage().data_ptr(), None)
            if buf is not None:
                self._free.append(buf)
