"""Verified blocks to GPU memory through a ring of page-locked buffers: the copy of one block to the GPU overlaps the
network read and the verification of the next.

Run:ai's streamer hands each block in a pageable host buffer that it reuses once the block is consumed. A copy from
pageable memory to the GPU is synchronous (the driver stages it through its own page-locked memory): the consumer, and
with it the streamer's ring of buffers, would wait for every copy. :class:`StagedCopy` instead copies each block once on
the CPU into a free buffer of a small ring of page-locked buffers, queues that buffer's copies to their destinations on
a copy stream of its own (asynchronous from page-locked memory) and records an event after them; the block goes back
to the streamer at once. A buffer is reused only once its event has completed: completed copies free their buffers as
they are found done, and the oldest in-flight copy is waited for only when every buffer is in flight. :meth:`finish`
waits for every queued copy (before the destinations are used, or the buffers freed: also when the read failed).

The device side is an object (:class:`CudaCopies`: a CUDA stream, page-locked buffers, events) so that the ring's
logic is tested on the CPU with one whose copies land only when their event completes (tests/remote/test_staging.py).
No option: the ring holds at most 64 MiB (four 8 MiB blocks of the default record).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["RING_BYTES", "CudaCopies", "Copies", "Event", "StagedCopy", "ring_buffers"]

RING_BYTES = 64 << 20  # page-locked bytes the ring may hold
_MAX_BUFFERS = 4


class Event(Protocol):
    def query(self) -> bool: ...  # the copies before it have completed

    def synchronize(self) -> None: ...  # wait for them


class Copies(Protocol):
    """Where staged blocks are copied: page-locked buffers, copies queued in order, events after them."""

    def buffer(self, nbytes: int) -> torch.Tensor: ...  # a page-locked uint8 buffer

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # queued: ``src`` must stay as it is until done

    def record(self) -> Event: ...  # completes once every copy queued before it has

    def finish(self) -> None: ...  # wait for every queued copy


class CudaCopies:
    """Copies on a CUDA stream of their own, from page-locked buffers (asynchronous), for destinations on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        # what the current stream did before (the destinations' allocation, their release) comes first
        self._stream.wait_stream(torch.cuda.current_stream(device))

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def finish(self) -> None:
        self._stream.synchronize()


def ring_buffers(block: int) -> int:
    """How many buffers of ``block`` bytes the ring holds: up to four, within :data:`RING_BYTES`, at least two (one
    being filled while the other's copy runs)."""
    return max(2, min(_MAX_BUFFERS, RING_BYTES // max(block, 1)))


class StagedCopy:
    """Blocks to device destinations through a ring of page-locked buffers (see the module's docstring).

    ``put(data, copies)``: ``data`` (uint8, 1-D, at most ``block`` bytes) is valid only during the call; each copy
    ``(dst, lo, hi)`` sends ``data[lo:hi]`` to ``dst`` (a uint8 view of ``hi - lo`` bytes). ``waits``: how often a put
    had to wait for a buffer; ``most_in_flight``: the most buffers whose copies were queued at once.
    """

    def __init__(self, copies: Copies, block: int, buffers: int | None = None) -> None:
        self._copies = copies
        self._block = block
        self._limit = buffers if buffers is not None else ring_buffers(block)
        self._buffers: list[torch.Tensor] = []  # made as needed, up to the limit
        self._free: deque[int] = deque()
        self._in_flight: deque[tuple[int, Event]] = deque()
        self._finished = False
        self.waits = 0
        self.most_in_flight = 0
        self.bytes = 0

    def _reclaim(self) -> None:
        """Buffers whose copies have completed go back to the free list, oldest first (copies complete in order)."""
        while self._in_flight and self._in_flight[0][1].query():
            self._free.append(self._in_flight.popleft()[0])

    def _take(self) -> int:
        self._reclaim()
        if self._free:
            return self._free.popleft()
        if len(self._buffers) < self._limit:
            self._buffers.append(self._copies.buffer(self._block))
            return len(self._buffers) - 1
        index, event = self._in_flight.popleft()  # every buffer in flight: wait for the oldest
        self.waits += 1
        event.synchronize()
        return index

    def put(self, data: torch.Tensor, copies: Sequence[tuple[torch.Tensor, int, int]]) -> None:
        if self._finished:
            raise RuntimeError("internal error: a block staged after the copies were finished")
        if not copies:
            return
        n = data.numel()
        if n > self._block:
            raise ValueError(f"internal error: a {n:,}-byte block for staging buffers of {self._block:,}")
        index = self._take()
        staged = self._buffers[index][:n]
        staged.copy_(data)  # the one CPU copy: data goes back to the streamer after this call
        for dst, lo, hi in copies:
            self._copies.copy(dst, staged[lo:hi])
            self.bytes += hi - lo
        self._in_flight.append((index, self._copies.record()))
        self.most_in_flight = max(self.most_in_flight, len(self._in_flight))

    def finish(self) -> None:
        """Wait for every queued copy; the buffers are let go. Called once, whether the read succeeded or not."""
        if self._finished:
            return
        self._finished = True
        try:
            self._copies.finish()
            for _, event in self._in_flight:
                event.synchronize()
        finally:
            self._in_flight.clear()
            self._free.clear()
            self._buffers.clear()
