"""Recycled output buffers for a streaming writer: the same few pages, layer after layer.

A converter hands the writer several multi-megabyte tensors per layer. Allocated fresh, each is
returned to the OS when freed and faults in again page by page the next time (llama-1gb:
~200k minor page faults, a large part of the conversion's system time; on a VM that returns
freed memory to its host, first touches are dearer still: ~1.5-2.3 GB/s against ~9 GB/s for a
copy into memory already touched). A :class:`BufferPool` keeps the buffers a writer has in flight
and gives them out again once their bytes are written. Pinned (page-locked) buffers are what a
GPU copies into without blocking the host; they are dear to allocate, so recycling them matters more.

Buffers are kept per exact byte size: a model's layers repeat the same few shapes, so every
buffer is reused as it is, and the pool holds exactly what the writer's in-flight limit lets
out plus the one being filled, per shape.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool"]


class BufferPool:
    """CPU byte buffers, handed out by :meth:`take` and given back by :meth:`give_back`.

    Args:
        max_bytes: the largest tensor the pool is asked for (a larger request is an internal error).
        pin_memory: page-locked buffers (for non-blocking device-to-host copies).

    Thread-safe: a writer thread gives back what the main thread takes.
    """

    def __init__(self, max_bytes: int, pin_memory: bool = False) -> None:
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}  # byte size -> buffers not handed out
        self._out: dict[int, torch.Tensor] = {}  # data pointer -> buffer, for buffers taken
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized tensor of ``dtype`` and ``shape`` (at most :attr:`max_bytes`) over a pooled buffer."""
        import torch

        numel = 1
        for d in shape:
            numel *= d
        size = numel * dtype.itemsize
        if size > self.max_bytes:
            raise ValueError(f"internal error: a {size}-byte tensor from a pool of buffers of at most {self.max_bytes} bytes")
        key = max(size, 1)  # an empty tensor still needs a buffer with an address of its own
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
        if buf is None:
            buf = torch.empty(key, dtype=torch.uint8, pin_memory=self.pin_memory)
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
                self._free.setdefault(buf.numel(), []).append(buf)
