"""Overlapping a conversion's stages: reading ahead on a thread, and device copies that leave the host free.

``convert`` runs three stages per layer: read the source tensors, repack them (CPU or GPU), write
and hash the results. Run one after the other, each waits for the others; here they overlap:

- :class:`ReadAhead` reads layer N+1 (memory-mapped views; on a GPU also the host-to-device
  copies, on a CUDA stream of its own) on a thread while the caller repacks layer N;
- :class:`Device` hands what was read to the repack's stream and copies results back into
  the writer's (pinned) buffers without waiting; the writer's own threads
  (:class:`~marlin_pack.io.safetensors_io.StreamWriter`) write and hash layer N-1 meanwhile,
  within their in-flight limit, so memory stays bounded to a few layers.

On the CPU :class:`Device` does nothing: the same code runs with plain tensors, which is what the
CPU test suite exercises. Every CUDA call sits behind ``Device.cuda``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

__all__ = ["ReadAhead", "Device"]

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """``read(0) … read(count - 1)`` on a thread of its own, at most ``depth`` results ahead of the consumer.

    Iterating yields the results in order. An exception ``read`` raises is raised, as it is, by
    the iteration that would have yielded that result (so a worker's one-line error reaches the
    caller unchanged), and the thread stops there. Use as a context manager: leaving it, normally
    or by an exception (Ctrl-C included), stops the thread and waits for it.
    """

    def __init__(self, read: Callable[[int], T], count: int, depth: int = 1, name: str = "marlin-pack-read") -> None:
        self._read = read
        self._count = count
        # A bounded queue is the back-pressure: the thread blocks once `depth` results wait unread.
        self._queue: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in range(self._count):
            if self._stop.is_set():
                return
            try:
                item: tuple[bool, object] = (True, self._read(i))
            except BaseException as e:  # handed to the consumer, which raises it
                item = (False, e)
            if not self._put(item) or not item[0]:
                return

    def _put(self, item: tuple[bool, object]) -> bool:
        # A timeout, so that close() is never left waiting on a thread blocked on a full queue.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        for _ in range(self._count):
            ok, value = self._queue.get()
            if not ok:
                assert isinstance(value, BaseException)
                raise value
            yield value  # type: ignore[misc]

    def close(self) -> None:
        """Stop reading ahead and wait for the thread (a read in progress finishes first)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Device:
    """Where the repack runs, and the copies into and out of it.

    On a GPU, source tensors are copied to it on a stream of the read thread (:meth:`reading`),
    the repack's stream waits for them (:meth:`receive`), and results come back with
    non-blocking copies into pinned host buffers (:meth:`to_host`) that the writer's threads
    wait for. On the CPU each of these is a no-op.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # The read thread's copies go on their own stream, so they overlap the repack's kernels.
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read on the read thread: its device copies and kernels go on the copy stream."""
        if self._copy_stream is None:
            yield
            return
        with torch.cuda.stream(self._copy_stream):
            yield

    def read_done(self) -> torch.cuda.Event | None:
        """After a read on the read thread: an event the repack's stream will wait for (None on the CPU)."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def receive(self, done: torch.cuda.Event | None, tensors: Iterable[torch.Tensor]) -> None:
        """On the repack's thread, before using what was read: wait (on the GPU, not the host) for its copies.

        The tensors were allocated on the copy stream; ``record_stream`` keeps the caching
        allocator from handing their memory to the next read before the repack is done with it.
        """
        if done is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        for t in tensors:
            if t.device.type == "cuda":
                t.record_stream(stream)

    def to_host(self, tensor: torch.Tensor, empty: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], object] | None]:
        """``(host tensor, ready)`` for a result: itself on the CPU; on a GPU, a non-blocking copy
        into ``empty()`` (a pinned writer buffer) and the wait for that copy, for the writer's threads."""
        if tensor.device.type != "cuda":
            return tensor, None
        host = empty()
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # the writer threads sleep on it instead of spinning on a core
        event.record(torch.cuda.current_stream(self.device))
        return host, event.synchronize
