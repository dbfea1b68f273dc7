"""Fast reads of file byte ranges (bundle tensors) straight into GPU tensors.

:class:`ParallelReader` cuts the file into page-aligned *windows* of ``chunk_bytes`` and
hands them to a few threads. Each thread moves a window to the GPU in one of two ways:

``staged``
    ``preadv`` the window from the page cache into one of the thread's two pinned host
    buffers, then an asynchronous host-to-device copy on the thread's own CUDA stream, so
    reading the next window overlaps the copy of the previous one. Costs one CPU memcpy
    per byte (the kernel's), which is what limits it (~28 GB/s with 16 threads on an H200 host).
``registered``
    page-lock the window of a read-only memory map of the file in place
    (``cudaHostRegister`` with ``cudaHostRegisterReadOnly``) and let the GPU's copy engine
    read the page-cache pages directly (no CPU copy). A thread keeps two windows in flight;
    a window is unregistered once its copies have finished.

``hybrid`` gives half the threads each way, pulling from the same queue of windows.

``processes``
    ``registered`` in a few helper processes (:mod:`.copy_helpers`), each with its own share of the
    windows: part of the pinning limit is per process. With ``own_share`` this process copies a
    share too (from the start, or once ``own_after`` is set). What the helpers leave (one could not
    start or failed) this process reads ``registered`` itself. Same host, 16 GB:
    4 helpers x 4 threads plus this process 36.3-37.1 GB/s against 22.7-23.5 GB/s ``registered``;
    a 70B bundle in the engine 35.4 vs 22.3 GB/s.

Measured on an H200 host (16 cores, 16 GB file on disk in the page cache, ``benchmarks/bench_h2d.py``,
pinned host-to-GPU 55.5 GB/s): registered 16 threads x 256 MiB 25.9 GB/s, 8 x 256 MiB
25.5 GB/s; staged 8 x 64 MiB 11.2 GB/s (allocating its pinned buffers included); hybrid
4.7-9.7 GB/s. Hence :data:`MODE_DEFAULTS` (registered: 16 threads, 256 MiB windows). A thread whose
registration fails stages its windows instead (with a warning).

A bundle on a default tmpfs (``/dev/shm``, 4 KiB pages) behaves differently: a 70B rank file there
measured 10.1 GB/s registered against 12.7-19.7 GB/s staged, because page-locking walks every page
(``benchmarks/bench_pin.py``: ``cuMemHostRegister`` 16.1 GB/s there against 37.1 GB/s on ext4 and
37.2 GB/s on a ``huge=always`` tmpfs). So ``auto`` (the default) stages files on a tmpfs without
huge pages (:func:`marlin_pack.io.files.in_base_memory_pages`); on a huge-page tmpfs a 70B rank
file measured 2.69 s staged against 1.66-2.05 s ``processes`` ("Model loading took"). Other
files go ``processes`` when the reader was given a :class:`HelperPool` (the loader starts one when
they can help, see :func:`helpers_help`), else ``registered``. File reads, registration and copies
release the GIL, so Python overhead is per window, not per byte. CPU destinations are
read into directly (no staging), which is also what the CPU tests exercise.

Tuning knobs (``--model-loader-extra-config``): ``io_mode``, ``io_threads`` and ``chunk_mb``;
staged threads hold ``2 * chunk_mb`` MiB of pinned memory each while loading, registered
threads pin at most two windows of the page cache each.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from marlin_pack.errors import BundleError
from marlin_pack.io.files import in_base_memory_pages
from marlin_pack.vllm_plugin.copy_helpers import HelperPool
from marlin_pack.vllm_plugin.options import IO_MODES, IoMode

__all__ = ["CopyItem", "HostMap", "ParallelReader"]


logger = logging.getLogger("vllm.marlin_pack")

_PAGE = mmap.PAGESIZE
# cudaHostRegister flags (cuda_runtime_api.h): the mapping is PROT_READ, so the driver must
# be told it will only be read; portable so any device of the process may copy from it.
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

    Through ``ctypes``, which releases the GIL for the call, not ``mmap.madvise``, which holds it:
    populating a 256 MiB window takes milliseconds, and with the GIL held the reader's threads
    populate one at a time and starve every other thread of the process (in an engine that built
    the model while the bundle was copying, its construction waited out the whole copy).

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
class _Window:
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


def _windows(items: Iterable[CopyItem], size: int, file_size: int) -> list[_Window]:
    """Group the items' bytes by aligned window (``size`` a multiple of the page size).

    Windows never share a page, so two threads never register the same page.
    """
    by_index: dict[int, _Window] = {}
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
            w = by_index.setdefault(index, _Window(lo=off, hi=off + n))
            w.lo, w.hi = min(w.lo, off), max(w.hi, off + n)
            w.pieces.append((off, n, flat[pos : pos + n]))
            pos += n
    return [by_index[k] for k in sorted(by_index)]


@dataclass
class _Slot:
    """One staged thread's resources: a CUDA stream and two pinned buffers with events."""

    stream: torch.cuda.Stream
    bufs: list[torch.Tensor]
    views: list[memoryview]
    events: list[torch.cuda.Event]
    pending: list[bool] = field(default_factory=lambda: [False, False])


class _Mapping:
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
            self._mapping: _Mapping | None = _Mapping(fd, self.size) if self.size else None
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


# (threads, window bytes) per mode when the caller does not say: measured, see the module docstring.
MODE_DEFAULTS: dict[str, tuple[int, int]] = {
    "staged": (8, 64 << 20),  # more or larger pinned buffers cost more to allocate than they gain
    "registered": (16, 256 << 20),
    "hybrid": (16, 64 << 20),
    "processes": (4, 256 << 20),  # threads per helper process
}
# io_mode auto starts copy helpers only with this many usable cores (4 helpers x 4 threads measured best on 16).
_HELPER_MIN_CORES = 8


def helpers_help(vllm_config: Any, model_config: Any) -> bool:
    """Whether ``io_mode: auto`` should copy a bundle with helper processes (``processes``), for vLLM's
    ``VllmConfig`` / ``ModelConfig`` (read, not imported: a daemon's page-locking plan asks this too).

    Only where that was measured to pay and to work: one engine process on the host's GPUs
    (TP=1, no pipeline or data parallelism: several ranks would each start helpers and contend
    for cores and page pins), enough cores, and device memory from PyTorch's ordinary
    allocator (the helpers open it with legacy CUDA IPC, which the sleep-mode allocator and
    ``expandable_segments`` do not support). Elsewhere ``auto`` stays ``registered``.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return (
        vllm_config.parallel_config.world_size_across_dp == 1
        and not model_config.enable_sleep_mode
        and "expandable_segments:true" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        and cores >= _HELPER_MIN_CORES
    )


def uses_helpers(io_mode: str, path: Callable[[], Path], usable: Callable[[], bool]) -> bool:
    """Whether ``io_mode`` copies the bundle file at ``path()`` with helper processes (``processes``).

    ``auto`` does where helpers are ``usable()`` and the file is not on a tmpfs of 4 KiB pages
    (:func:`resolve_mode`); both are asked only for ``auto``.
    """
    if io_mode != "auto":
        return io_mode == "processes"
    return resolve_mode(io_mode, path(), helpers=usable()) == "processes"


def resolve_mode(mode: str, path: str | Path, helpers: bool = False) -> str:
    """``auto``: ``staged`` for a file in memory held in 4 KiB pages (a tmpfs without huge pages), else
    ``processes`` when copy helpers are available (``helpers``: the caller started or may start a
    :class:`HelperPool`), else ``registered``."""
    if mode != "auto":
        return mode
    if in_base_memory_pages(path):
        return "staged"
    return "processes" if helpers else "registered"


@dataclass(frozen=True)
class _Plan:
    mode: str
    threads: int
    chunk: int


@dataclass(eq=False)
class _OpenFile:
    """One file of a :meth:`ParallelReader.copy_files` call: open, its windows planned."""

    path: str | Path
    plan: _Plan
    fd: int
    file_size: int
    windows: list[_Window]
    device: torch.device | None


def _device_of(windows: list[_Window]) -> torch.device | None:
    """The one CUDA device the windows' destinations are on (None: all on the CPU)."""
    devices = {p[2].device for w in windows for p in w.pieces if p[2].device.type != "cpu"}
    if len(devices) > 1:
        raise ValueError(f"destinations span several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else None


class ParallelReader:
    """Reads byte ranges of files into tensors with several threads.

    ``threads`` and ``chunk_bytes`` default to :data:`MODE_DEFAULTS` of the mode chosen for
    each file (``auto``: see :func:`resolve_mode`).

    Example:
        >>> with ParallelReader(mode="auto") as r:
        ...     r.copy(path, [CopyItem(info.start, info.nbytes, gpu_tensor)])
    """

    def __init__(
        self,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        mode: IoMode = "auto",
        populate: bool = True,
        helpers: HelperPool | None = None,
        processes: int | None = None,
        own_share: bool = True,
        own_after: threading.Event | None = None,
    ) -> None:
        if mode not in IO_MODES:
            raise ValueError(f"io mode {mode!r}: expected one of {', '.join(IO_MODES)}")
        self.threads = None if threads is None else max(0, threads)  # 0: processes mode, helpers' staging threads only
        self.chunk = None if chunk_bytes is None else self._round(chunk_bytes)
        self.mode = mode
        # Registered windows: map the window's page-table entries in one madvise before pinning
        # (pinning otherwise faults them in page by page): benchmarks/bench_h2d.py measured 25.6 vs
        # 23.1 GB/s and bench_h2d_procs.py 21.1 vs 17.5 GB/s with 16 threads.
        self.populate = populate
        # ``processes`` mode: a pool the caller started early (it stays the caller's to close), or our own.
        self._helpers, self._owns_helpers = helpers, False
        self.processes = processes  # None: HelperPool's default
        # ``processes`` mode: this process copies a share beside the helpers (one more party pinning pages).
        self.own_share = own_share
        # ``processes`` mode: this process's own copying (its share, what the helpers leave) waits for this
        # event. The loader sets it once vLLM has built the model: pages pinned in the engine's process
        # slow the construction's own CUDA calls, pages pinned by the helpers do not.
        self.own_after = own_after
        self.modes_used: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._registration_failed = False
        self.bytes_read = 0

    @staticmethod
    def _round(chunk_bytes: int) -> int:
        return max(1 << 16, -(-chunk_bytes // _PAGE) * _PAGE)

    def plan(self, path: str | Path) -> _Plan:
        """The mode, threads and window size used for ``path``."""
        mode = resolve_mode(self.mode, path, helpers=self._helpers is not None)
        threads, chunk = MODE_DEFAULTS[mode]
        if self.threads is not None:  # 0 (helpers' staging threads only) means the default in the other modes
            threads = self.threads if mode == "processes" else self.threads or threads
        return _Plan(mode, threads, self.chunk or self._round(chunk))

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

    def _registers(self, plan: _Plan, worker: int) -> bool:
        """Whether this worker registers windows in place (else it stages them)."""
        if self._registration_failed:
            return False
        return plan.mode in ("registered", "processes") or (plan.mode == "hybrid" and worker % 2 == 1)

    def _slot(self, worker: int, device: torch.device, chunk: int) -> _Slot:
        key = (worker, device.index if device.index is not None else torch.cuda.current_device(), chunk)
        slot = self._slots.get(key)
        if slot is None:
            bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
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
        return self.copy_files([(path, items)])

    def copy_files(self, jobs: Sequence[tuple[str | Path, Iterable[CopyItem]]]) -> int:
        """:meth:`copy` of several files, in order; returns the bytes copied.

        In ``processes`` mode the helpers get every file's windows in one job each (see
        :meth:`HelperPool.copy_files`), so the files follow one another without a pause.
        """
        with contextlib.ExitStack() as stack:
            opened = []
            for path, items in jobs:
                plan = self.plan(path)
                fd = os.open(path, os.O_RDONLY)
                stack.callback(os.close, fd)
                file_size = os.fstat(fd).st_size
                windows = _windows(items, plan.chunk, file_size)
                opened.append(_OpenFile(path, plan, fd, file_size, windows, _device_of(windows)))
            helped = [f for f in opened if f.windows and f.device is not None and f.plan.mode == "processes"]
            _device_of([w for f in helped for w in f.windows])  # one job per helper: one device for every file
            if helped:
                self._copy_with_helpers(helped)
            for f in opened:
                if f not in helped and f.windows:
                    self._read(f.plan, f.fd, f.file_size, f.windows, f.device)
        total = sum(p[1] for f in opened for w in f.windows for p in w.pieces)
        self.bytes_read += total
        return total

    def _copy_with_helpers(self, files: list[_OpenFile]) -> None:
        """The ``processes`` mode: the helpers copy ``files`` (and this process its share, for one file
        with ``own_share``); this process registers whatever they leave itself."""
        self.modes_used.add("processes")
        device = files[0].device
        assert device is not None
        threads = max(f.plan.threads for f in files)
        # This process registers its own share (and whatever the helpers leave) in place.
        here = [_Plan("registered", MODE_DEFAULTS["registered"][0], f.plan.chunk) for f in files]
        pool = self._pool_for(device)
        if len(files) == 1:
            f = files[0]

            def own(share: list[_Window]) -> None:
                self._wait_own_turn()
                self._read(here[0], f.fd, f.file_size, share, device, record=False)

            lefts = [pool.copy(f.path, f.windows, threads, own=own if self.own_share else None)]
        else:
            lefts = pool.copy_files([(f.path, f.windows) for f in files], threads)
        for f, plan, left in zip(files, here, lefts, strict=True):
            if left:
                self._wait_own_turn()
                self._read(plan, f.fd, f.file_size, left, device)  # shows as "registered" beside "processes"

    def _wait_own_turn(self) -> None:
        if self.own_after is not None:
            self.own_after.wait()

    def _read(
        self, plan: _Plan, fd: int, file_size: int, windows: list[_Window], device: torch.device | None, record: bool = True
    ) -> None:
        """Move ``windows`` of the open file ``fd`` to their destinations on ``plan.threads`` threads."""
        if not windows:
            return
        mapping: _Mapping | None = None
        try:
            start_event = None
            workers = min(max(1, plan.threads), len(windows))
            if device is not None:
                if record:
                    self.modes_used.add(plan.mode)
                # Destinations were allocated on the caller's stream: order our copies after it.
                start_event = torch.cuda.Event()
                start_event.record(torch.cuda.current_stream(device))
                if any(self._registers(plan, w) for w in range(workers)):
                    mapping = _Mapping(fd, file_size)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            lock = threading.Lock()
            queue = iter(windows)
            failed = threading.Event()

            def take() -> _Window | None:
                if failed.is_set():
                    return None
                with lock:
                    return next(queue, None)

            if workers == 1:
                self._work(plan, 0, fd, mapping, take, device, start_event, in_pool=False)
            else:
                if self._pool is None or self._pool._max_workers < workers:
                    if self._pool is not None:
                        self._pool.shutdown(wait=True)
                    self._pool = ThreadPoolExecutor(workers, thread_name_prefix="marlin-pack-io")
                futures = [
                    self._pool.submit(self._work, plan, w, fd, mapping, take, device, start_event)
                    for w in range(workers)
                ]
                for f in futures:
                    f.add_done_callback(lambda f: f.exception() is not None and failed.set())
                wait(futures)  # every thread is done with ``fd`` and the mapping before they are closed
                for f in futures:
                    f.result()
        finally:
            if mapping is not None:
                mapping.close()

    def _pool_for(self, device: torch.device) -> HelperPool:
        if self._helpers is None:
            self._owns_helpers = True
            self._helpers = HelperPool(
                self.processes, device.index if device.index is not None else torch.cuda.current_device()
            )
        return self._helpers

    def _work(
        self,
        plan: _Plan,
        worker: int,
        fd: int,
        mapping: _Mapping | None,
        take: Callable[[], _Window | None],
        device: torch.device | None,
        start_event: torch.cuda.Event | None,
        in_pool: bool = True,
    ) -> None:
        if device is None:
            while (window := take()) is not None:
                for offset, _, dst in window.pieces:
                    _pread_into(fd, memoryview(dst.numpy()), offset)
            return
        if in_pool:
            torch.cuda.set_device(device)  # the current device is per thread
        if self._registers(plan, worker):
            assert mapping is not None
            self._work_registered(plan, worker, fd, mapping, take, device, start_event)
        else:
            self._work_staged(plan, worker, fd, take, device, start_event)

    def _work_staged(
        self,
        plan: _Plan,
        worker: int,
        fd: int,
        take: Callable[[], _Window | None],
        device: torch.device,
        start_event: torch.cuda.Event | None,
        first: _Window | None = None,
    ) -> None:
        slot = self._slot(worker, device, plan.chunk)
        slot.stream.wait_event(start_event)
        k = 0
        try:
            while (window := first or take()) is not None:
                first = None
                b = k % 2
                k += 1
                if slot.pending[b]:
                    slot.events[b].synchronize()  # the copy out of this buffer has finished
                _pread_into(fd, slot.views[b][: window.hi - window.lo], window.lo)
                with torch.cuda.stream(slot.stream):
                    for offset, n, dst in window.pieces:
                        dst.copy_(slot.bufs[b][offset - window.lo : offset - window.lo + n], non_blocking=True)
                    slot.events[b].record(slot.stream)
                slot.pending[b] = True
        finally:
            slot.stream.synchronize()
            slot.pending = [False, False]

    def _work_registered(
        self,
        plan: _Plan,
        worker: int,
        fd: int,
        mapping: _Mapping,
        take: Callable[[], _Window | None],
        device: torch.device,
        start_event: torch.cuda.Event | None,
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
