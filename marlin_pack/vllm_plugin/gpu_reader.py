"""Fast reads of file byte ranges (bundle tensors) straight into GPU tensors.

:class:`ParallelReader` splits the requested byte ranges into chunks and hands them to
a few threads. Each thread ``preadv``s a chunk from the page cache into one of its two
pinned host buffers and issues an asynchronous host-to-device copy on its own CUDA
stream, so reading the next chunk overlaps the copy of the previous one. File reads and
copies release the GIL, so Python overhead is per chunk, not per byte. CPU destinations
are read into directly (no staging), which is also what the CPU tests exercise.

Tuning knobs (``--model-loader-extra-config``): ``io_threads`` and ``chunk_mb``; pinned
memory held while loading is ``io_threads * 2 * chunk_mb`` MiB.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlin_pack.errors import BundleError

__all__ = ["CopyItem", "ParallelReader"]


@dataclass(frozen=True)
class CopyItem:
    """Copy ``nbytes`` file bytes at ``offset`` into the contiguous tensor ``dst``."""

    offset: int
    nbytes: int
    dst: torch.Tensor


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("destination tensors must be contiguous")
    return t.view(-1).view(torch.uint8)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise BundleError(f"unexpected end of file at offset {offset}: the bundle file is truncated")
        buf = buf[n:]
        offset += n


@dataclass
class _Slot:
    """One thread's staging resources: a CUDA stream and two pinned buffers with events."""

    stream: torch.cuda.Stream
    bufs: list[torch.Tensor]
    views: list[memoryview]
    events: list[torch.cuda.Event]
    pending: list[bool] = field(default_factory=lambda: [False, False])


class ParallelReader:
    """Reads byte ranges of files into tensors with ``threads`` threads.

    Example:
        >>> with ParallelReader(threads=4, chunk_bytes=32 << 20) as r:
        ...     r.copy(path, [CopyItem(info.start, info.nbytes, gpu_tensor)])
    """

    def __init__(self, threads: int = 4, chunk_bytes: int = 32 << 20) -> None:
        self.threads = max(1, threads)
        self.chunk = max(1 << 16, chunk_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._slots: dict[tuple[int, int], _Slot] = {}
        self.bytes_read = 0

    def __enter__(self) -> ParallelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        had_pinned = bool(self._slots)
        self._slots.clear()
        if had_pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the staging buffers back to the OS

    def _slot(self, worker: int, device: torch.device) -> _Slot:
        key = (worker, device.index if device.index is not None else torch.cuda.current_device())
        slot = self._slots.get(key)
        if slot is None:
            bufs = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            slot = _Slot(
                stream=torch.cuda.Stream(device=device),
                bufs=bufs,
                views=[memoryview(b.numpy()) for b in bufs],
                events=[torch.cuda.Event(), torch.cuda.Event()],
            )
            self._slots[key] = slot
        return slot

    def copy(self, path: str | Path, items: Iterable[CopyItem]) -> int:
        """Copy every item's file bytes into its tensor; returns the bytes copied.

        All copies are complete when this returns. Destinations may be on one CUDA
        device or on the CPU.
        """
        pieces: list[tuple[int, int, torch.Tensor]] = []
        for it in items:
            flat = _byte_view(it.dst)
            if flat.numel() != it.nbytes:
                raise ValueError(f"destination holds {flat.numel()} bytes, the file range {it.nbytes}")
            for off in range(0, it.nbytes, self.chunk):
                n = min(self.chunk, it.nbytes - off)
                pieces.append((it.offset + off, n, flat[off : off + n]))
        if not pieces:
            return 0
        pieces.sort(key=lambda p: p[0])
        devices = {p[2].device for p in pieces if p[2].device.type != "cpu"}
        if len(devices) > 1:
            raise ValueError(f"destinations span several devices: {sorted(map(str, devices))}")
        device = devices.pop() if devices else None
        start_event = None
        if device is not None:
            # Destinations were allocated on the caller's stream: order our copies after it.
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(device))
        lock = threading.Lock()
        queue = iter(pieces)
        failed = threading.Event()

        def take() -> tuple[int, int, torch.Tensor] | None:
            if failed.is_set():
                return None
            with lock:
                return next(queue, None)

        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            workers = min(self.threads, len(pieces))
            if workers == 1:
                self._work(0, fd, take, device, start_event, in_pool=False)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="marlin-pack-io")
                futures = [
                    self._pool.submit(self._work, w, fd, take, device, start_event) for w in range(workers)
                ]
                for f in futures:
                    f.add_done_callback(lambda f: f.exception() is not None and failed.set())
                wait(futures)  # every thread is done with ``fd`` before it is closed
                for f in futures:
                    f.result()
        finally:
            os.close(fd)
        total = sum(p[1] for p in pieces)
        self.bytes_read += total
        return total

    def _work(
        self,
        worker: int,
        fd: int,
        take: Callable[[], tuple[int, int, torch.Tensor] | None],
        device: torch.device | None,
        start_event: torch.cuda.Event | None,
        in_pool: bool = True,
    ) -> None:
        slot = None
        if device is not None:
            if in_pool:
                torch.cuda.set_device(device)  # the current device is per thread
            slot = self._slot(worker, device)
            slot.stream.wait_event(start_event)
        k = 0
        try:
            while (piece := take()) is not None:
                offset, n, dst = piece
                if dst.device.type == "cpu":
                    _pread_into(fd, memoryview(dst.numpy()), offset)
                    continue
                assert slot is not None
                b = k % 2
                k += 1
                if slot.pending[b]:
                    slot.events[b].synchronize()  # the copy out of this buffer has finished
                _pread_into(fd, slot.views[b][:n], offset)
                with torch.cuda.stream(slot.stream):
                    dst.copy_(slot.bufs[b][:n], non_blocking=True)
                    slot.events[b].record(slot.stream)
                slot.pending[b] = True
        finally:
            if slot is not None:
                slot.stream.synchronize()
                slot.pending = [False, False]
