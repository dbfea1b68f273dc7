"""Byte ranges of files (bundle tensors) into GPU tensors, as an :class:`~marlin_pack.gpu.plan.IoPlan` says.

:class:`ParallelReader` cuts each file into page-aligned *windows* of ``plan.window`` bytes and moves
them with ``plan.threads`` threads, each on its own CUDA stream:

``staged``
    ``preadv`` a window into one of the thread's two pinned buffers, then an asynchronous copy, so the
    next read overlaps the previous copy (one CPU copy per byte).
``registered``
    page-lock the window of a read-only map of the file in place (``cudaHostRegister``, read-only) and
    let the copy engine read the page cache's pages (no CPU copy); two windows in flight per thread.
    A thread whose registration fails stages its windows instead, with a warning.
``helpers``
    the windows go to copy helper processes (:class:`~marlin_pack.gpu.helpers.HelperPool`, given or
    started here); whatever they leave this process copies ``registered`` itself.
``direct``
    as ``staged``, with the reads through a second, ``O_DIRECT`` descriptor: aligned reads past the page
    cache (a cold bundle), the window widened to whole blocks. Where the file will not open that way,
    or a read ends off a block boundary, the buffered descriptor reads instead.

A file whose digest is asked for (``copy_files(..., hashed=...)``) is read whole, header and gaps included, staged
through this process's buffers in every mode (:meth:`~marlin_pack.gpu.plan.IoPlan.hashing`; ``O_DIRECT`` where the plan
is ``direct``), and each window's buffer is handed to a :class:`~marlin_pack.io.hashing.CopyHash` before its bytes go on:
the one read serves the copy and the digest (``digests``). A buffer is reused only once its window is hashed.
A file held in memory already (:meth:`ParallelReader.hold`, a :class:`~marlin_pack.gpu.host_map.HostMap` read whole)
is copied from there, not read again.

A read that fails (``EIO``, a truncated file) raises :class:`~marlin_pack.errors.BundleError` naming
the file and the offset.

CPU destinations are read into directly (which is what the CPU tests exercise). File reads,
registration and copies release the GIL, so Python's overhead is per window, not per byte.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlin_pack.errors import BundleError
from marlin_pack.gpu.helpers import HelperPool
from marlin_pack.gpu.host_map import FileMap, HostMap
from marlin_pack.gpu.plan import IoPlan
from marlin_pack.io.hashing import CopyHash, HashedFile
from marlin_pack.io.residency import DIRECT_ALIGN

__all__ = ["CopyItem", "ParallelReader", "Window", "populate_read", "pread_direct", "windows_of"]

logger = logging.getLogger("vllm.marlin_pack")

_PAGE = mmap.PAGESIZE
# cudaHostRegister flags (cuda_runtime_api.h): the map is PROT_READ, so the driver must be told it is
# only read; portable so any device of the process may copy from it.
_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_READ_ONLY = 0x08
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault a range's page-table entries in, in one call


@functools.cache
def _libc_madvise() -> Callable[..., int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def populate_read(address: int, length: int) -> None:
    """Fault in the page-table entries of ``[address, address + length)`` of a file map (``MADV_POPULATE_READ``).

    Pinning otherwise faults them in page by page (25.6 against 23.1 GB/s with 16 threads). Through
    ``ctypes``, which releases the GIL, not ``mmap.madvise``, which holds it: with the GIL held the
    threads populate one at a time and starve the rest of the process (vLLM building the model).

    Raises:
        OSError: the kernel refused (older than 5.14: ``EINVAL``).
    """
    if _libc_madvise()(address, length, _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")


@dataclass(frozen=True)
class CopyItem:
    """Copy ``nbytes`` file bytes at ``offset`` into the contiguous tensor ``dst``."""

    offset: int
    nbytes: int
    dst: torch.Tensor


@dataclass
class Window:
    """A page-aligned file range ``[lo, hi)`` and the destination pieces inside it."""

    lo: int
    hi: int
    pieces: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (file offset, n, dst bytes)


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


def pread_direct(direct_fd: int, fd: int, buf: memoryview, lo: int, hi: int) -> int:
    """Read file bytes ``[lo, hi)`` into ``buf`` with aligned ``O_DIRECT`` reads from the block holding ``lo``;
    returns where ``lo``'s byte landed in ``buf``.

    ``buf`` starts at an address aligned to :data:`DIRECT_ALIGN` and holds ``hi - lo`` rounded out to whole
    blocks (at most ``hi - lo + 2 * DIRECT_ALIGN`` bytes). A read that ends off a block boundary before ``hi``
    (the kernel may cut a direct read short) has the rest read through the buffered ``fd``.

    Raises:
        BundleError: the file ends before ``hi`` (truncated).
        OSError: a read failed.
    """
    start = lo - lo % DIRECT_ALIGN
    need = hi - start
    span = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
    got = 0
    while got < need:
        if got % DIRECT_ALIGN:
            _pread_into(fd, buf[got:need], start + got)
            break
        n = os.preadv(direct_fd, [buf[got:span]], start + got)
        if n <= 0:
            raise BundleError(f"unexpected end of file at offset {start + got}: the bundle file is truncated")
        got += n
    return lo - start


def _open_direct(path: str | Path) -> int | None:
    """A second descriptor of ``path`` with ``O_DIRECT``; None where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        logger.warning("marlin-pack: %s does not open for direct reads (%s); reading it through the page cache", path, e)
        return None


def windows_of(items: Iterable[CopyItem], size: int, file_size: int, whole: bool = False) -> list[Window]:
    """The items' bytes grouped by aligned window of ``size`` bytes (a multiple of the page size).

    Windows never share a page, so two threads never register the same page. ``whole``: the windows tile the
    whole file (``[k * size, (k + 1) * size)``, the last one to its end), bytes no item wants included: a file
    that is hashed as it is copied.
    """
    by_index: dict[int, Window] = {}
    for it in items:
        flat = _byte_view(it.dst)
        if flat.numel() != it.nbytes:
            raise ValueError(f"destination holds {flat.numel()} bytes, the file range {it.nbytes}")
        if it.offset < 0 or it.offset + it.nbytes > file_size:
            raise BundleError(
                f"tensor bytes {it.offset}..{it.offset + it.nbytes} lie outside the file ({file_size} bytes): "
                "the bundle file is truncated"
            )
        pos = 0
        while pos < it.nbytes:
            off = it.offset + pos
            index = off // size
            n = min(it.nbytes - pos, (index + 1) * size - off)
            w = by_index.setdefault(index, Window(lo=off, hi=off + n))
            w.lo, w.hi = min(w.lo, off), max(w.hi, off + n)
            w.pieces.append((off, n, flat[pos : pos + n]))
            pos += n
    if whole:
        for k in range(-(-file_size // size)):
            w = by_index.setdefault(k, Window(lo=0, hi=0))
            w.lo, w.hi = k * size, min((k + 1) * size, file_size)
    return [by_index[k] for k in sorted(by_index)]


@dataclass
class _Slot:
    """One staging thread's resources: a CUDA stream and two pinned buffers with events."""

    stream: torch.cuda.Stream
    bufs: list[torch.Tensor]
    views: list[memoryview]
    events: list[torch.cuda.Event]
    pending: list[bool] = field(default_factory=lambda: [False, False])


@dataclass(eq=False)
class _OpenFile:
    """One file of a :meth:`ParallelReader.copy_files` call: open, its windows cut."""

    path: str | Path
    fd: int
    file_size: int
    windows: list[Window]
    device: torch.device | None
    digest: CopyHash | None = None  # hashed as it is copied (its windows tile the file)


def _device_of(windows: list[Window]) -> torch.device | None:
    """The one CUDA device the windows' destinations are on (None: all on the CPU)."""
    devices = {p[2].device for w in windows for p in w.pieces if p[2].device.type != "cpu"}
    if len(devices) > 1:
        raise ValueError(f"destinations span several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else None


class ParallelReader:
    """Reads byte ranges of files into tensors as ``plan`` says.

    ``helpers``: a pool the caller started (it stays the caller's to close) for a ``helpers`` plan;
    without one such a plan starts its own.

    Example:
        >>> with ParallelReader(plan) as r:
        ...     r.copy(path, [CopyItem(info.start, info.nbytes, gpu_tensor)])
    """

    def __init__(self, plan: IoPlan | None = None, helpers: HelperPool | None = None, populate: bool = True) -> None:
        self.plan = plan if plan is not None else IoPlan()
        if self.plan.window % _PAGE:
            raise ValueError(f"window of {self.plan.window} bytes: expected a multiple of the page size {_PAGE}")
        self.populate = populate
        self._helpers, self._owns_helpers = helpers, False
        self.modes_used: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._registration_failed = False
        self.bytes_read = 0
        # Per file asked to be hashed (copy_files' ``hashed``, by str(path)): its digest, or why there is none.
        self.digests: dict[str, HashedFile | OSError] = {}
        self._images: dict[str, HostMap] = {}  # files held in memory whole: copied from there (hold)

    def __enter__(self) -> ParallelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_helpers and self._helpers is not None:
            self._helpers.close()
            self._helpers, self._owns_helpers = None, False
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        had_pinned = bool(self._slots)
        self._slots.clear()
        if had_pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the staging buffers back to the OS

    def read_whole(self, path: str | Path) -> HostMap:
        """``path`` read once, whole, into memory of this process, hashed on the way (its digest in :attr:`digests`);
        this reader copies the file's items from that memory from then on (:meth:`hold`).

        For ``common.safetensors`` on a cold start whose digest is left to the copy: its tensors, large ones for the
        reader and small ones for vLLM's weight loaders, then come from the one read that also hashed them, where a
        map would read the file a second time. Pageable memory (the file's size, the time of the load), never a map of
        the file: a truncation cannot reach it.

        Raises:
            BundleError: the file is shorter than when its size was taken (truncated), or a read failed.
        """
        image = torch.empty(os.stat(path).st_size, dtype=torch.uint8)
        self.copy_files([(path, [CopyItem(0, image.numel(), image)])], hashed=[path])
        host = HostMap.in_memory(Path(path), image)
        self.hold(host)
        return host

    def hold(self, host: HostMap) -> None:
        """Copy ``host.path``'s items from ``host`` (a file read whole into memory, :meth:`read_whole`) from now on,
        instead of reading the file again."""
        if not host.whole:
            raise ValueError(f"{host.path} is mapped, not held in memory: read it with ParallelReader.read_whole")
        self._images[str(host.path)] = host

    def copy(self, path: str | Path, items: Iterable[CopyItem]) -> int:
        """Copy every item's file bytes into its tensor; returns the bytes copied.

        All copies are complete when this returns. Destinations may be on one CUDA device or on the CPU.
        """
        return self.copy_files([(path, items)])

    def copy_files(self, jobs: Sequence[tuple[str | Path, Iterable[CopyItem]]], hashed: Collection[str | Path] = ()) -> int:
        """:meth:`copy` of several files, in order; returns the bytes copied.

        With helpers, each helper gets its share of every file in one job, so the files follow one
        another without a pause. ``hashed``: files read whole and hashed as they are copied (see the module
        docstring); each one's :class:`~marlin_pack.io.hashing.HashedFile`, or the ``OSError`` that says why it has
        none (it changed while it was copied), is in :attr:`digests` once this returns.
        """
        want = {str(p) for p in hashed}
        held = [(path, items) for path, items in jobs if str(path) in self._images and str(path) not in want]
        total = sum(self._copy_held(self._images[str(path)], items) for path, items in held)
        with contextlib.ExitStack() as stack:
            opened = []
            for path, items in jobs:
                if str(path) in self._images and str(path) not in want:
                    continue
                fd = os.open(path, os.O_RDONLY)
                stack.callback(os.close, fd)
                file_size = os.fstat(fd).st_size
                digest = None
                if str(path) in want:
                    digest = CopyHash(Path(path), fd)
                    stack.callback(digest.abort)  # joined before the descriptor closes (callbacks run last first)
                try:
                    windows = windows_of(items, self.plan.window, file_size, whole=digest is not None)
                except BundleError as e:  # the file is shorter than its header says
                    raise BundleError(f"reading {path}: {e}; convert the model again, or start with fallback on") from e
                opened.append(_OpenFile(path, fd, file_size, windows, _device_of(windows), digest))
            on_gpu = [f for f in opened if f.windows and f.device is not None]
            _device_of([w for f in on_gpu for w in f.windows])  # one device for every file
            helped = [f for f in on_gpu if f.digest is None]
            if self.plan.mode == "helpers" and helped:
                self._copy_with_helpers(helped)
            for f in opened:
                if f.digest is not None:
                    self._read(self.plan.hashing(), f, f.windows)
                    self._finish_digest(f)
                elif f.windows and (self.plan.mode != "helpers" or f.device is None):
                    self._read(self.plan, f, f.windows)
        total += sum(p[1] for f in opened for w in f.windows for p in w.pieces)
        self.bytes_read += total
        return total

    def _finish_digest(self, f: _OpenFile) -> None:
        assert f.digest is not None
        try:
            self.digests[str(f.path)] = f.digest.finish()
        except OSError as e:  # FileChangedError: it changed while it was copied
            self.digests[str(f.path)] = e

    @staticmethod
    def _copy_held(host: HostMap, items: Iterable[CopyItem]) -> int:
        """Copy items of a file held in memory from there (no read)."""
        n = 0
        for it in items:
            _byte_view(it.dst).copy_(host.tensor(it.offset, it.nbytes, torch.uint8, (it.nbytes,)))
            n += it.nbytes
        return n

    def _copy_with_helpers(self, files: list[_OpenFile]) -> None:
        """The helpers copy ``files``; this process registers whatever they leave itself."""
        self.modes_used.add("helpers")
        device = files[0].device
        assert device is not None
        if self._helpers is None:
            self._owns_helpers = True
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._helpers = HelperPool(self.plan.helpers, index, defer_unregister=self.plan.defer_unregister)
        lefts = self._helpers.copy_files([(f.path, f.windows) for f in files], self.plan.threads)
        local = self.plan.local()
        for f, left in zip(files, lefts, strict=True):
            if left:
                self._read(local, f, left)  # shows as "registered" beside "helpers"

    def _read(self, plan: IoPlan, f: _OpenFile, windows: list[Window]) -> None:
        """Move ``windows`` of the open file ``f`` to their destinations on ``plan.threads`` threads."""
        device = f.device
        mapping: FileMap | None = None
        direct_fd: int | None = None
        try:
            start_event = None
            workers = min(max(1, plan.threads), len(windows))
            if device is not None:
                self.modes_used.add(plan.mode)
                # Destinations were allocated on the caller's stream: order our copies after it.
                start_event = torch.cuda.Event()
                start_event.record(torch.cuda.current_stream(device))
                if plan.mode == "registered" and not self._registration_failed and f.digest is None:
                    mapping = FileMap(f.fd, f.file_size)
            if plan.mode == "direct" and (device is not None or f.digest is not None):
                direct_fd = _open_direct(f.path)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            lock = threading.Lock()
            queue = iter(windows)
            failed = threading.Event()

            def take() -> Window | None:
                if failed.is_set():
                    return None
                with lock:
                    return next(queue, None)

            def work(worker: int, in_pool: bool = True) -> None:
                if f.digest is not None:
                    if device is not None and in_pool:
                        torch.cuda.set_device(device)
                    self._work_hashed(plan, worker, f, take, device, start_event, direct_fd, failed)
                    return
                if device is None:
                    while (window := take()) is not None:
                        for offset, _, dst in window.pieces:
                            _pread_into(f.fd, memoryview(dst.numpy()), offset)
                    return
                if in_pool:
                    torch.cuda.set_device(device)  # the current device is per thread
                if mapping is not None:
                    self._work_registered(plan, worker, f.fd, mapping, take, device, start_event)
                else:
                    self._work_staged(plan, worker, f.fd, take, device, start_event, direct_fd=direct_fd)

            if workers == 1:
                work(0, in_pool=False)
                return
            if self._pool is None or self._pool._max_workers < workers:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="marlin-pack-io")
            futures = [self._pool.submit(work, w) for w in range(workers)]
            for fut in futures:
                fut.add_done_callback(lambda fut: fut.exception() is not None and failed.set())
            wait(futures)  # every thread is done with the file and its map before they are closed
            for fut in futures:
                fut.result()
        except BundleError as e:  # a read past the end: the file shrank after its windows were cut
            if str(f.path) in str(e):
                raise
            raise BundleError(f"reading {f.path}: {e}; convert the model again, or start with fallback on") from e
        except OSError as e:
            raise BundleError(
                f"reading {f.path} failed ({e.strerror or e}): the disk or file system under the bundle returned an "
                "error; check it (dmesg), or start with fallback on to load the checkpoint instead"
            ) from e
        finally:
            if mapping is not None:
                mapping.close()
            if direct_fd is not None:
                os.close(direct_fd)

    def _slot(self, worker: int, device: torch.device, window: int) -> _Slot:
        key = (worker, device.index if device.index is not None else torch.cuda.current_device(), window)
        slot = self._slots.get(key)
        if slot is None:
            bufs = [torch.empty(window, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            slot = _Slot(
                stream=torch.cuda.Stream(device=device),
                bufs=bufs,
                views=[memoryview(b.numpy()) for b in bufs],
                events=[torch.cuda.Event(), torch.cuda.Event()],
            )
            self._slots[key] = slot
        return slot

    def _work_staged(
        self, plan: IoPlan, worker: int, fd: int, take: Callable[[], Window | None], device: torch.device,
        start_event: torch.cuda.Event | None, first: Window | None = None, direct_fd: int | None = None,
    ) -> None:
        # Direct reads widen a window to whole blocks: two more blocks of buffer at most.
        slot = self._slot(worker, device, plan.window + (2 * DIRECT_ALIGN if direct_fd is not None else 0))
        if direct_fd is not None and any(b.data_ptr() % DIRECT_ALIGN for b in slot.bufs):
            direct_fd = None  # not aligned for O_DIRECT (never seen: pinned blocks start on pages)
        slot.stream.wait_event(start_event)
        k = 0
        try:
            while (window := first or take()) is not None:
                first = None
                b = k % 2
                k += 1
                if slot.pending[b]:
                    slot.events[b].synchronize()  # the copy out of this buffer has finished
                if direct_fd is not None:
                    skip = pread_direct(direct_fd, fd, slot.views[b], window.lo, window.hi)
                else:
                    skip = 0
                    _pread_into(fd, slot.views[b][: window.hi - window.lo], window.lo)
                with torch.cuda.stream(slot.stream):
                    for offset, n, dst in window.pieces:
                        at = skip + offset - window.lo
                        dst.copy_(slot.bufs[b][at : at + n], non_blocking=True)
                    slot.events[b].record(slot.stream)
                slot.pending[b] = True
        finally:
            slot.stream.synchronize()
            slot.pending = [False, False]

    def _work_hashed(
        self, plan: IoPlan, worker: int, f: _OpenFile, take: Callable[[], Window | None], device: torch.device | None,
        start_event: torch.cuda.Event | None, direct_fd: int | None, failed: threading.Event,
    ) -> None:
        """Staged reads (two buffers per thread) whose every window is also handed to the file's hash; a buffer is
        reused once both its copy and its hash are done. CPU destinations are staged the same way (page-aligned
        buffers of this thread, copied out at once): the path the CPU tests take."""
        digest = f.digest
        assert digest is not None
        size = plan.window + (2 * DIRECT_ALIGN if direct_fd is not None else 0)
        slot = None
        if device is not None:
            slot = self._slot(worker, device, size)
            bufs, views = slot.bufs, slot.views
            slot.stream.wait_event(start_event)
        else:
            maps = [mmap.mmap(-1, size) for _ in range(2)]  # anonymous maps are page-aligned (O_DIRECT)
            views = [memoryview(m) for m in maps]
            bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        if direct_fd is not None and any(b.data_ptr() % DIRECT_ALIGN for b in bufs):
            direct_fd = None  # not aligned for O_DIRECT (never seen: pinned blocks and maps start on pages)
        hashing: list[threading.Event | None] = [None, None]  # the hash's claim on each buffer
        k = 0
        try:
            while (window := take()) is not None:
                b = k % 2
                k += 1
                if slot is not None and slot.pending[b]:
                    slot.events[b].synchronize()  # the copy out of this buffer has finished
                if (claim := hashing[b]) is not None:
                    claim.wait()  # and so has its hash
                if direct_fd is not None:
                    skip = pread_direct(direct_fd, f.fd, views[b], window.lo, window.hi)
                else:
                    skip = 0
                    _pread_into(f.fd, views[b][: window.hi - window.lo], window.lo)
                hashing[b] = digest.submit(window.lo, views[b][skip : skip + window.hi - window.lo])
                if slot is None:
                    for offset, n, dst in window.pieces:
                        at = skip + offset - window.lo
                        dst.copy_(bufs[b][at : at + n])
                    continue
                with torch.cuda.stream(slot.stream):
                    for offset, n, dst in window.pieces:
                        at = skip + offset - window.lo
                        dst.copy_(bufs[b][at : at + n], non_blocking=True)
                    slot.events[b].record(slot.stream)
                slot.pending[b] = True
        except BaseException:
            failed.set()  # the other threads take no more windows,
            digest.abort()  # and none waits for a window this one will never hand over
            raise
        finally:
            for claim in hashing:  # the hash reads the buffers until then (abort releases them)
                if claim is not None:
                    claim.wait()
            if slot is not None:
                slot.stream.synchronize()
                slot.pending = [False, False]

    def _work_registered(
        self, plan: IoPlan, worker: int, fd: int, mapping: FileMap, take: Callable[[], Window | None],
        device: torch.device, start_event: torch.cuda.Event | None,
    ) -> None:
        cudart = torch.cuda.cudart()
        stream = torch.cuda.Stream(device=device)
        stream.wait_event(start_event)
        in_flight: deque[tuple[int, torch.cuda.Event]] = deque()  # registered pointers, copies pending

        def release_oldest() -> None:
            ptr, event = in_flight.popleft()
            event.synchronize()
            cudart.cudaHostUnregister(ptr)

        try:
            while (window := take()) is not None:
                if len(in_flight) == 2:
                    release_oldest()
                lo = window.lo - window.lo % _PAGE
                hi = -(-window.hi // _PAGE) * _PAGE  # within the map: it covers the file's last page
                ptr = mapping.base + lo
                if self.populate:
                    try:
                        populate_read(ptr, hi - lo)
                    except OSError:  # an older kernel: pin as usual
                        self.populate = False
                err = cudart.cudaHostRegister(ptr, hi - lo, _HOST_REGISTER_READ_ONLY | _HOST_REGISTER_PORTABLE)
                if int(err) != 0:
                    # Some hosts refuse to pin file pages (no read-only registration, memory lock limits):
                    # this thread stages the rest of its windows instead.
                    logger.warning("marlin-pack: cudaHostRegister of the bundle map failed (%s); staging instead", err)
                    self._registration_failed = True
                    self._work_staged(plan, worker, fd, take, device, start_event, first=window)
                    return
                event = torch.cuda.Event()
                in_flight.append((ptr, event))
                with torch.cuda.stream(stream):
                    for offset, n, dst in window.pieces:
                        dst.copy_(mapping.bytes[offset : offset + n], non_blocking=True)
                    event.record(stream)
        finally:
            while in_flight:
                release_oldest()
            stream.synchronize()
