"""A helper process of the ``processes`` reader mode: registered copies of file windows into GPU memory.

Run as ``python -S copy_helper_main.py DEVICE_ORDINAL [--staged N] [--stage-mib M] [--defer-unregister]
[--nice N] [--listen DIR --slot K]`` by :mod:`.copy_helpers` (one engine's helper, for one load) or by
:mod:`.helper_service` (``marlin-pack helpers``: a helper that outlives engines). Standard library
only (``ctypes`` on the CUDA driver, ``libcuda.so.1``): no torch, no site packages, so it starts in a
fraction of a second. One process's page-locking of
page-cache pages (``cuMemHostRegister``) plateaus at ~21-25 GB/s whatever its thread count, while
several processes together reach ~30 GB/s (``benchmarks/bench_h2d_procs.py``), hence helpers.

Options, fixed for the helper's life:

``--staged N``
    N more threads that pull from the same windows but *stage* them: ``pread`` into two pinned
    buffers of ``--stage-mib`` MiB each (allocated before the helper says it is ready, so while
    vLLM builds the model), then an asynchronous copy. They cost a CPU copy per byte instead of
    page-locking, so they add bandwidth where pinning is what limits the registered threads. A
    job of 0 ``threads`` leaves it all to them (no page-locking while loading); without staging
    threads a job still gets one registered thread.
``--defer-unregister``
    registered windows stay page-locked until the job's copies have all completed and the reply
    is sent, then are unregistered (before the next job is read): unregistering is taken off the
    copy's path. Each thread then has every window of its share registered at once (page-cache
    pages, no new memory).
``--nice N``
    the helper lowers its scheduling priority by N (0..19) before it starts any thread, so that
    the engine's own work beside the copy keeps its CPU time.
``--retain-mib M``
    a service helper keeps up to M MiB of the windows it registered page-locked after its
    sessions, with their files' maps: a later engine loading the same bundle has those windows
    copied at once, without page-locking them again (the page cache's pages stay pinned in host
    memory meanwhile, which is why it is off unless asked). A retained file is let go when it
    changes (another inode, size or time: a rewritten bundle), is deleted, is read in windows cut
    otherwise, or, when a session's windows did not fit, was not used by that session (the latest
    bundle then takes the room); each check runs as a session ends, after the engine was
    answered, and again before a job. The ready line lists what is retained, so that an engine
    hands those windows to this helper; a ``retain`` line (``marlin-pack helpers --preload``)
    page-locks ranges before any engine asks.
``--listen DIR --slot K``
    a service helper: it binds the Unix socket ``DIR/<GPU UUID>.K.sock`` and serves one engine
    (one connection of the same user) at a time, each a *session* of the protocol below, until
    its standard input ends (its service stopped). Its CUDA context is created once, before any
    engine asks: an engine then finds it ready at once. A session ends with the engine's
    ``{"end": true}`` (answered ``{"closed": true}`` once the engine's memory is no longer
    mapped here) or its connection closing; a connection while a session runs is answered
    ``{"error": "busy"}``.

Measured on an H200 host (``benchmarks/bench_h2d.py --gb 16 --cold ''``, 4 helpers of 4 registered
threads, pinned 55.5 GB/s): 27.8-31.2 GB/s as is; unregistering costs as much as registering
(py-spy: 299 against 272 samples), and deferring it gives 39.3-40.2 GB/s; with 2 staging threads
per helper as well 44.1 GB/s (0.79 of pinned); staging threads alone 35.6-36.3 GB/s. Inside an
engine the faster copy slowed the engine's own steps beside it as much as it gained, so both
are off there unless the loader is told (``io_defer_unregister``, ``io_staged``); a weight-cache
daemon's fill defers unregistering by default (it does not wait for its helpers to exit).

Protocol, one JSON object per line:

* helper -> parent, once: ``{"ready": true, "protocol": PROTOCOL}`` after creating its CUDA context, or
  ``{"error": ...}`` (a service helper says it to its service, with ``"socket"``, and again to each engine);
* parent -> helper, per job: ``{"parts": [{"file": PATH, "windows": [[LO, HI, [[FILE_OFFSET, NBYTES,
  HANDLE_INDEX, DEST_OFFSET], ...]], ...]}, ...], "handles": [HEX, ...], "threads": T}``: each window's
  pages ``[LO, HI)`` of its part's file are registered in place (read-only) and its pieces copied to
  ``DEST_OFFSET`` bytes into the allocation of ``handles[HANDLE_INDEX]`` (a ``cuIpcGetMemHandle``).
  The threads take the windows of every part from one queue: a job of two files (the rank file and
  the common tensors) has no pause between them, and ``--defer-unregister`` keeps the pages of both
  until the one reply;
* helper -> parent, per job: ``{"ok": BYTES}`` once every copy has completed, or ``{"error": ...}``.

* service -> service helper (``--preload``): ``{"retain": [{"file": PATH, "ranges": [[LO, HI], ...]}, ...]}``,
  answered ``{"ok": BYTES}`` (newly retained) once they are page-locked;
* parent -> helper: ``{"end": true}``, answered ``{"closed": true}`` once its IPC mappings are closed
  (a service helper, which goes on serving; a helper of its own engine exits at the end of its input).

End of input: the helper closes its IPC mappings and exits (a service helper: ends the session).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_PROT_READ, _MAP_SHARED = 1, 1
_MADV_POPULATE_READ = 22
_REGISTER_FLAGS = 0x01 | 0x08  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x1
_STREAM_NON_BLOCKING = 0x1
_PAGE = os.sysconf("SC_PAGE_SIZE")
# Bumped when the lines change meaning: an engine only uses service helpers that speak its protocol.
PROTOCOL = 1
# Set for every helper, an engine's own or a service's. One hardware work queue per helper context
# instead of 8: creating and tearing down the queues is what slows the engine's own CUDA calls while
# helpers start and exit. benchmarks/bench_helpers_start.py on an H200, 4 helpers beside a
# 640-allocation stand-in construction: +0.42 s -> +0.18 s, ending them 0.26 -> 0.11 s; bench_h2d.py
# processes/4 36.3 vs 37.1 GB/s with it (copies lose nothing).
HELPER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaError(RuntimeError):
    """A CUDA driver call failed: the helper's context may be unusable from now on."""


class _Driver:
    """The few CUDA driver calls the helper makes, each raising :class:`CudaError` on a non-zero result."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args: object) -> None:
        fn = getattr(self.lib, name + "_v2", None) or getattr(self.lib, name)
        err = fn(*args)
        if err != 0:
            raise CudaError(f"{name} failed with CUDA error {err}")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.pread.restype = ctypes.c_ssize_t
    libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    return libc


@dataclass(frozen=True)
class Settings:
    """The helper's command line."""

    ordinal: int
    staged: int = 0  # staging threads beside the registered ones
    stage_bytes: int = 64 << 20  # each staging thread's two pinned buffers
    defer_unregister: bool = False
    nice: int = 0  # added to the helper's niceness before its threads start (they inherit it)
    listen: str | None = None  # a service helper: the directory of its socket
    slot: int = 0  # and its number among the device's service helpers
    retain_bytes: int = 0  # registered windows a service helper keeps between sessions (--retain-mib)

    @classmethod
    def parse(cls, argv: list[str]) -> Settings:
        ordinal, rest = int(argv[0]), argv[1:]
        kw: dict[str, object] = {}
        while rest:
            flag = rest.pop(0)
            if flag == "--defer-unregister":
                kw["defer_unregister"] = True
            elif flag == "--staged" and rest:
                kw["staged"] = max(0, int(rest.pop(0)))
            elif flag == "--nice" and rest:
                kw["nice"] = min(19, max(0, int(rest.pop(0))))
            elif flag == "--stage-mib" and rest:
                kw["stage_bytes"] = max(1, int(rest.pop(0))) << 20
            elif flag == "--listen" and rest:
                kw["listen"] = rest.pop(0)
            elif flag == "--slot" and rest:
                kw["slot"] = max(0, int(rest.pop(0)))
            elif flag == "--retain-mib" and rest:
                kw["retain_bytes"] = max(0, int(rest.pop(0))) << 20
            else:
                raise ValueError(f"unknown helper argument {flag!r}")
        return cls(ordinal, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Map:
    """One file of a job, mapped read-only."""

    file: str
    fd: int
    addr: int
    size: int


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file's bytes apart from a rewritten file's: a retained map is used only while the path still has it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _page_range(lo: int, hi: int, size: int) -> tuple[int, int]:
    """A window's pages as registered: ``[lo, hi)`` widened to whole pages, not past the file's last page."""
    return lo - lo % _PAGE, min(-(-hi // _PAGE) * _PAGE, -(-size // _PAGE) * _PAGE)


@dataclass
class _Retained:
    """A file whose registered windows a service helper keeps between sessions (``--retain-mib``)."""

    map: _Map  # its descriptor stays open: staging threads read through it
    identity: tuple[int, ...]  # of the file when it was mapped
    ranges: list[tuple[int, int]] = field(default_factory=list)  # registered page ranges, each its own registration
    used: float = 0.0  # time.monotonic() of the last job that had it

    @property
    def nbytes(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)

    def holds(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` lies inside one retained registration (a copy must not cross two: CUDA refuses it)."""
        return any(a <= lo and hi <= b for a, b in self.ranges)

    def clashes(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` overlaps a retained registration without lying inside it (windows cut otherwise)."""
        return any(a < hi and lo < b for a, b in self.ranges) and not self.holds(lo, hi)


class Helper:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        if settings.nice:
            os.nice(settings.nice)  # Linux: this thread's; every thread started later inherits it
        self.cu = _Driver()
        self.libc = _libc()
        self.cu("cuInit", 0)
        dev = ctypes.c_int()
        self.cu("cuDeviceGet", ctypes.byref(dev), settings.ordinal)
        self.dev = dev
        self.ctx = ctypes.c_void_p()
        self.cu("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.cu("cuCtxSetCurrent", self.ctx)
        self.opened: dict[str, int] = {}  # handle hex -> mapped device pointer
        self.populate = True
        # Two pinned buffers per staging thread, allocated now: the parent starts helpers early.
        self.stage_buffers: list[int] = []
        for _ in range(2 * settings.staged):
            ptr = ctypes.c_void_p()
            self.cu("cuMemHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(settings.stage_bytes), ctypes.c_uint(0))
            self.stage_buffers.append(ptr.value or 0)
        self.registered: list[tuple[str, int]] = []  # --defer-unregister: (file, pointer) registered by the last job
        self.kept_maps: list[_Map] = []  # and the file maps they lie in, unmapped after them
        self.releasing: tuple[set[str], threading.Thread] | None = None  # (files, thread) unregistering the last job's pages
        self.retained: dict[str, _Retained] = {}  # --retain-mib: file path -> what stays registered of it
        self.retain_lock = threading.Lock()  # the threads of a job, and a session ending beside the next one
        self.overflowed = False  # a window of this session found no room among the retained ones
        self.job_lock = threading.Lock()  # held by a job, and by let_go releasing retained files

    def uuid(self) -> str:
        """The device's UUID as ``nvidia-smi`` writes it (``GPU-xxxxxxxx-xxxx-...``): the same in every process."""
        return device_uuid(self.cu, self.dev)

    def _open(self, handle_hex: str) -> int:
        ptr = self.opened.get(handle_hex)
        if ptr is None:
            handle = _IpcHandle()
            ctypes.memmove(ctypes.addressof(handle), bytes.fromhex(handle_hex), 64)
            dptr = ctypes.c_uint64()
            self.cu("cuIpcOpenMemHandle", ctypes.byref(dptr), handle, ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS))
            ptr = self.opened[handle_hex] = dptr.value
        return ptr

    def job(self, job: dict) -> int:
        """Copy the job's windows (the protocol's job line); the bytes copied."""
        with self.job_lock:
            return self._job(job)

    def _job(self, job: dict) -> int:
        parts = job["parts"]
        # As given and as a retained map names them (its windows past the budget are among the released).
        files = {part["file"] for part in parts} | {os.path.realpath(part["file"]) for part in parts}
        releasing, self.releasing = self.releasing, None
        if releasing is not None and releasing[0] & files:
            releasing[1].join()  # the same file's pages again: pinned through one map at a time
        bases = [self._open(h) for h in job["handles"]]
        maps: list[_Map] = []
        try:
            for part in parts:
                maps.append(self._retained_map(part) or self._map(part["file"]))
            # 0 registered threads only beside staging ones: a job must never be answered with nothing copied.
            threads = max(0 if self.settings.staged else 1, int(job["threads"]))
            windows = [(m, w) for m, part in zip(maps, parts, strict=True) for w in part["windows"]]
            return self._copy_windows(bases, windows, threads)
        finally:
            for m in maps:
                if self._retained_of(m) is not None:
                    continue  # stays mapped and open for the next engines
                os.close(m.fd)  # the map stays valid without it
                if self.registered:
                    self.kept_maps.append(m)  # unmapped once its pages are unregistered
                else:
                    self.libc.munmap(m.addr, m.size)

    def _map(self, file: str) -> _Map:
        fd = os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            addr = self.libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
        except BaseException:
            os.close(fd)
            raise
        return _Map(file, fd, addr, size)

    def _copy_windows(self, bases: list[int], windows: list[tuple[_Map, list]], threads: int) -> int:
        lock = threading.Lock()
        queue = iter(windows)
        errors: list[BaseException] = []

        def take() -> tuple[_Map, list] | None:
            with lock:
                return None if errors else next(queue, None)

        def work(staging: int | None) -> None:
            try:
                if staging is None:
                    self._work(bases, take)
                else:
                    self._work_staged(bases, take, self.stage_buffers[2 * staging : 2 * staging + 2])
            except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
                with lock:
                    errors.append(e)

        kinds: list[int | None] = [None] * threads + list(range(self.settings.staged))
        pool = [threading.Thread(target=work, args=(k,)) for k in kinds[: len(windows)]]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        return sum(n for _, (_, _, pieces) in windows for _, n, _, _ in pieces)

    def _work(self, bases: list[int], take) -> None:  # noqa: ANN001
        cu = self.cu
        cu("cuCtxSetCurrent", self.ctx)  # the current context is per thread
        stream = ctypes.c_void_p()
        cu("cuStreamCreate", ctypes.byref(stream), ctypes.c_uint(_STREAM_NON_BLOCKING))
        # (its file, the registered pointer or None for a retained window, the event after its copies)
        in_flight: list[tuple[str, int | None, ctypes.c_void_p]] = []

        def release_oldest() -> None:
            _, ptr, event = in_flight.pop(0)
            cu("cuEventSynchronize", event)
            cu("cuEventDestroy", event)
            if ptr is not None:
                cu("cuMemHostUnregister", ctypes.c_void_p(ptr))

        keep = self.settings.defer_unregister  # registered pointers stay until the job is answered
        try:
            while (taken := take()) is not None:
                m, (lo, hi, pieces) = taken
                addr = m.addr
                if len(in_flight) == 2 and not keep:
                    release_oldest()
                lo, hi = _page_range(lo, hi, m.size)
                ptr: int | None = addr + lo
                retained = self._retained_of(m)
                if retained is not None and retained.holds(lo, hi):
                    ptr = None  # registered by an earlier job and retained: nothing to pin, nothing to release
                else:
                    self._pin(ptr, hi - lo)
                event = ctypes.c_void_p()
                try:
                    cu("cuEventCreate", ctypes.byref(event), ctypes.c_uint(0x2))  # CU_EVENT_DISABLE_TIMING
                except BaseException:
                    if ptr is not None:
                        cu("cuMemHostUnregister", ctypes.c_void_p(ptr))
                    raise
                if ptr is not None and retained is not None and self._retain(retained, lo, hi):
                    ptr = None  # registered now, retained for the next engines
                in_flight.append((m.file, ptr, event))
                for offset, n, handle_index, dest in pieces:
                    cu("cuMemcpyHtoDAsync", ctypes.c_uint64(bases[handle_index] + dest), ctypes.c_void_p(addr + offset),
                       ctypes.c_size_t(n), stream)
                cu("cuEventRecord", event, stream)
        finally:
            if keep:
                cu("cuStreamSynchronize", stream)
                for file, ptr, event in in_flight:
                    cu("cuEventDestroy", event)
                    if ptr is not None:
                        self.registered.append((file, ptr))  # list.append is atomic: threads share the list safely
                in_flight.clear()
            while in_flight:
                release_oldest()
            cu("cuStreamSynchronize", stream)
            cu("cuStreamDestroy", stream)

    def _work_staged(self, bases: list[int], take, buffers: list[int]) -> None:  # noqa: ANN001
        """Windows read into two pinned buffers in turn, each copied while the other is read."""
        cu = self.cu
        cu("cuCtxSetCurrent", self.ctx)
        stream = ctypes.c_void_p()
        cu("cuStreamCreate", ctypes.byref(stream), ctypes.c_uint(_STREAM_NON_BLOCKING))
        events = []
        for _ in buffers:
            event = ctypes.c_void_p()
            cu("cuEventCreate", ctypes.byref(event), ctypes.c_uint(0x2))
            events.append(event)
        pending = [False] * len(buffers)
        step = self.settings.stage_bytes
        k = 0
        try:
            while (taken := take()) is not None:
                m, (lo, hi, pieces) = taken
                retained = self._retained_of(m)
                if retained is not None and retained.holds(*_page_range(lo, hi, m.size)):
                    for offset, n, handle_index, dest in pieces:  # already page-locked: no staging
                        cu("cuMemcpyHtoDAsync", ctypes.c_uint64(bases[handle_index] + dest), ctypes.c_void_p(m.addr + offset),
                           ctypes.c_size_t(n), stream)
                    continue
                for start in range(lo, hi, step):
                    end = min(hi, start + step)
                    b = k % len(buffers)
                    k += 1
                    if pending[b]:
                        cu("cuEventSynchronize", events[b])  # the copy out of this buffer has finished
                    buf = buffers[b]
                    self._pread(m.fd, buf, end - start, start)
                    for offset, n, handle_index, dest in pieces:
                        a, z = max(offset, start), min(offset + n, end)
                        if a < z:
                            cu("cuMemcpyHtoDAsync", ctypes.c_uint64(bases[handle_index] + dest + a - offset),
                               ctypes.c_void_p(buf + a - start), ctypes.c_size_t(z - a), stream)
                    cu("cuEventRecord", events[b], stream)
                    pending[b] = True
        finally:
            cu("cuStreamSynchronize", stream)
            for event in events:
                cu("cuEventDestroy", event)
            cu("cuStreamDestroy", stream)

    def _pread(self, fd: int, buf: int, n: int, offset: int) -> None:
        done = 0
        while done < n:
            got = self.libc.pread(fd, ctypes.c_void_p(buf + done), n - done, offset + done)
            if got <= 0:
                err = ctypes.get_errno()
                raise OSError(err, f"read at offset {offset + done}: {os.strerror(err) if got < 0 else 'end of file'}")
            done += got

    def _pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of a file map at ``ptr`` for copies (read-only), its page-table entries faulted in first."""
        if self.populate and self.libc.madvise(ctypes.c_void_p(ptr), nbytes, _MADV_POPULATE_READ) != 0:
            self.populate = False  # a kernel before 5.14: pinning faults the pages in itself
        self.cu("cuMemHostRegister", ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(_REGISTER_FLAGS))

    def _has_room(self, nbytes: int) -> bool:
        return self.retained_bytes() + nbytes <= self.settings.retain_bytes

    def _retained_map(self, part: dict) -> _Map | None:
        """The map of ``part``'s file to use and retain (``--retain-mib``), or None: map it for this job only.

        A retained map is reused while the path still names the same file. A rewritten file's
        retained pages are let go first, and so are they when this job's windows are cut otherwise
        (a copy may not cross two registrations).
        """
        if not self.settings.retain_bytes:
            return None
        file = os.path.realpath(part["file"])  # one entry per file, however an engine names it
        identity = _identity(os.stat(file))
        with self.retain_lock:
            retained = self.retained.get(file)
            stale = None
            if retained is not None and (
                retained.identity != identity
                or any(retained.clashes(*_page_range(lo, hi, retained.map.size)) for lo, hi, _ in part["windows"])
            ):
                stale, retained = self.retained.pop(file), None
        if stale is not None:
            self._release([stale])
        if retained is None:
            m = self._map(file)
            if _identity(os.fstat(m.fd)) != identity:  # replaced while we looked: used once, not retained
                return m
            retained = _Retained(m, identity)
            with self.retain_lock:
                self.retained[file] = retained
        retained.used = time.monotonic()
        return retained.map

    def _retained_of(self, m: _Map) -> _Retained | None:
        retained = self.retained.get(m.file)
        return retained if retained is not None and retained.map is m else None

    def _retain(self, retained: _Retained, lo: int, hi: int) -> bool:
        """Retain the registration of ``[lo, hi)`` if the budget has room; False (and noted) when it has not."""
        with self.retain_lock:
            if not self._has_room(hi - lo):
                self.overflowed = True
                return False
            retained.ranges.append((lo, hi))
            return True

    def retain(self, parts: list[dict]) -> int:
        """Page-lock and retain the ranges ``[{"file": PATH, "ranges": [[LO, HI], ...]}, ...]`` ahead of any
        engine (``marlin-pack helpers --preload``); the bytes newly retained. Ranges past the budget are
        left alone (not registered)."""
        if not self.settings.retain_bytes:
            raise ValueError("this helper retains nothing (started without --retain-mib)")
        done = 0
        with self.job_lock:
            for part in parts:
                m = self._retained_map({"file": part["file"], "windows": [[lo, hi, []] for lo, hi in part["ranges"]]})
                retained = self._retained_of(m) if m is not None else None
                if retained is None:  # replaced while we looked: nothing to keep
                    if m is not None:
                        os.close(m.fd)
                        self.libc.munmap(m.addr, m.size)
                    continue
                for lo, hi in part["ranges"]:
                    lo, hi = _page_range(int(lo), min(int(hi), m.size), m.size)
                    if hi <= lo or retained.holds(lo, hi):
                        continue
                    if not self._has_room(hi - lo):
                        break
                    self._pin(m.addr + lo, hi - lo)
                    with self.retain_lock:
                        retained.ranges.append((lo, hi))
                    done += hi - lo
        return done

    def retained_ranges(self) -> list[list]:
        """``[[file, [[lo, hi], ...]], ...]``: what this helper keeps registered, as its ready line says it."""
        with self.retain_lock:
            return [[file, [list(r) for r in sorted(k.ranges)]] for file, k in self.retained.items()]

    def retained_bytes(self) -> int:
        """Bytes of file pages this helper keeps registered between sessions."""
        return sum(r.nbytes for r in list(self.retained.values()))

    def let_go(self, since: float | None = None) -> int:
        """Release retained files that changed or vanished and, after a session (begun at ``since``) whose
        windows did not all fit, those it did not use: the latest bundle gets the room. Returns how many.

        Waits for a job running meanwhile (the next engine's session may have begun): nothing it
        copies from is released under it.
        """
        with self.job_lock:
            releasing, self.releasing = self.releasing, None
            if releasing is not None:
                releasing[1].join()  # windows past the budget lie in retained maps too: unregistered before an unmap
            with self.retain_lock:
                overflowed, self.overflowed = self.overflowed, False
                gone = []
                for file, retained in list(self.retained.items()):
                    try:
                        changed = _identity(os.stat(file)) != retained.identity
                    except OSError:
                        changed = True
                    if changed or (overflowed and since is not None and retained.used < since):
                        gone.append(self.retained.pop(file))
            self._release(gone)
        return len(gone)

    def _release(self, gone: list[_Retained]) -> None:
        """Unregister, unmap and close what the files ``gone`` (already out of :attr:`retained`) held."""
        if not gone:
            return
        self.cu("cuCtxSetCurrent", self.ctx)  # the current context is per thread
        for r in gone:
            try:
                for lo, _ in r.ranges:
                    self.cu("cuMemHostUnregister", ctypes.c_void_p(r.map.addr + lo))
            finally:
                self.libc.munmap(r.map.addr, r.map.size)
                os.close(r.map.fd)

    def unregister_kept(self) -> threading.Thread | None:
        """Unregister (then unmap) what ``--defer-unregister`` kept, on a thread of its own; None if nothing was kept.

        Called after the job's reply: a next job starts meanwhile. Its maps lie elsewhere (the old
        ones are unmapped only after their pages), so its registrations cannot clash; a job of one of
        the same files waits for it all the same (its pages pinned through one map at a time).
        """
        kept, self.registered = self.registered, []
        maps, self.kept_maps = self.kept_maps, []
        if not kept and not maps:
            return None

        def release() -> None:
            try:
                self.cu("cuCtxSetCurrent", self.ctx)  # the current context is per thread
                for _, ptr in kept:
                    self.cu("cuMemHostUnregister", ctypes.c_void_p(ptr))
            finally:
                for m in maps:
                    self.libc.munmap(m.addr, m.size)

        thread = threading.Thread(target=release, name="unregister")
        thread.start()
        # With them, a retained file's windows that found no room: its map stays, its file is in the set.
        self.releasing = ({m.file for m in maps} | {file for file, _ in kept}, thread)
        return thread

    def close(self) -> None:
        for ptr in self.opened.values():
            self.cu("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
        self.opened.clear()


def device_uuid(cu: _Driver, dev: ctypes.c_int) -> str:
    """``cuDeviceGetUuid`` of ``dev``, formatted by :func:`format_uuid`."""
    raw = (ctypes.c_char * 16)()
    cu("cuDeviceGetUuid", raw, dev)
    return format_uuid(bytes(raw))


def format_uuid(raw: bytes) -> str:
    """A device's 16 UUID bytes as ``nvidia-smi`` writes them (``GPU-`` and 8-4-4-4-12 hex digits): the
    service helpers' socket names, which an engine's pool looks up the same way."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _say(obj: dict, out=None) -> None:  # noqa: ANN001 - a text file
    out = out or sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()


def bind_listener(path: str) -> socket.socket:
    """A Unix socket listening at ``path``; a stale socket file (nobody answers there) is replaced.

    Refuses when a live helper answers at ``path`` or something other than a socket lies there.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by a helper that died
        else:
            raise FileExistsError(f"a helper already listens at {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is the owner's only (its directory is too)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(8)
    return listener


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of the Unix socket ``conn`` (``SO_PEERCRED``)."""
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def serve_session(helper: Helper, conn: socket.socket, free: Callable[[], None] | None = None) -> bool:
    """One engine's session on a service helper: the jobs of the protocol until ``{"end": true}`` or EOF.

    The engine's memory is unmapped (its IPC handles closed) before ``{"closed": true}`` and in any
    case before the next session; deferred unregistering runs after each reply, as in a helper of
    its own engine. Returns False when a CUDA call failed in it (the context may be unusable).
    ``free`` is called, when it went well, just before ``{"closed": true}`` (or before the connection
    closes, when it ended at EOF): an engine that hears it and connects again at once is served, not told
    ``busy``. Retained files that changed, or that the latest bundle needs the room of, are let go last
    (:meth:`Helper.let_go`), off the engine's path.

    With ``--retain-mib``, the ready line also says ``"retained_bytes"`` and ``"retained"`` (``[[FILE,
    [[LO, HI], ...]], ...]``): what stays registered from earlier sessions, and where.
    """
    rfile, wfile = conn.makefile("r", encoding="utf-8"), conn.makefile("w", encoding="utf-8")
    ended, healthy = False, True
    began = time.monotonic()
    try:
        helper.cu("cuCtxSetCurrent", helper.ctx)  # this thread opens and closes the IPC mappings
        ready: dict[str, object] = {"ready": True, "protocol": PROTOCOL}
        if helper.settings.retain_bytes:
            ready["retained_bytes"] = helper.retained_bytes()
            ready["retained"] = helper.retained_ranges()  # the engine hands these windows to this helper
        _say(ready, wfile)
        for line in rfile:
            try:
                job = json.loads(line)
                if job.get("end") is True:
                    ended = True
                    break
                _say({"ok": helper.retain(job["retain"]) if "retain" in job else helper.job(job)}, wfile)
            except Exception as e:  # noqa: BLE001 - the engine re-reads this job's windows itself
                healthy = healthy and not isinstance(e, CudaError)
                _say({"error": f"{type(e).__name__}: {e}"}, wfile)
            helper.unregister_kept()  # after the reply: off the engine's path
    except CudaError:
        healthy = False
    except OSError:
        pass  # the engine went away: its memory is unmapped below all the same
    finally:
        with contextlib.suppress(Exception):
            helper.close()
        if healthy and free is not None:
            free()  # before the connection closes, also at EOF: whoever saw it close finds this helper free
        if ended:
            with contextlib.suppress(OSError):
                _say({"closed": True}, wfile)
        for f in (rfile, wfile):
            with contextlib.suppress(OSError):
                f.close()
        conn.close()
    if healthy and helper.settings.retain_bytes:
        try:
            helper.let_go(began)
        except CudaError:
            healthy = False
        except OSError:
            pass
    return healthy


def serve(helper: Helper, listener: socket.socket, on_unhealthy: Callable[[], None] | None = None) -> None:
    """Accept engines of this user until the listener closes, one session at a time (others are told ``busy``).

    ``on_unhealthy``: called after a session in which a CUDA call failed, before the next one
    (a service helper exits there, and its service starts a fresh one).
    """
    busy = threading.Lock()
    me = os.getuid()

    def session(conn: socket.socket) -> None:
        freed = []

        def free() -> None:
            freed.append(True)
            busy.release()

        healthy = False
        try:
            healthy = serve_session(helper, conn, free)
        finally:
            if not healthy and on_unhealthy is not None:
                on_unhealthy()  # still holding busy: no session starts on this context meanwhile
            if not freed:
                busy.release()

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the listener was closed
        try:
            if peer_uid(conn) != me:
                conn.close()  # another user's process: it gets nothing, not even a reason
                continue
            if not busy.acquire(blocking=False):
                conn.sendall((json.dumps({"error": "busy"}) + "\n").encode())
                conn.close()
                continue
        except OSError:
            conn.close()
            continue
        threading.Thread(target=session, args=(conn,), name="session", daemon=True).start()


def _main_service(helper: Helper) -> int:
    """A service helper: listen, say where, serve until standard input ends (the service stopped)."""
    settings = helper.settings
    try:
        path = os.path.join(settings.listen or "", f"{helper.uuid()}.{settings.slot}.sock")
        listener = bind_listener(path)
    except Exception as e:  # noqa: BLE001 - told to the service in one line
        _say({"error": f"{type(e).__name__}: {e}"})
        return 1
    def unhealthy() -> None:  # a CUDA call failed: a fresh helper (its service restarts it) rather than this context
        with contextlib.suppress(OSError):
            os.unlink(path)
        os._exit(3)

    threading.Thread(target=serve, args=(helper, listener, unhealthy), name="accept", daemon=True).start()
    _say({"ready": True, "protocol": PROTOCOL, "socket": path, "uuid": helper.uuid()})
    sys.stdin.read()  # until the service closes our input (or dies)
    with contextlib.suppress(OSError):
        os.unlink(path)
    sys.stdout.flush()
    os._exit(0)  # a session still running ends with us: its engine reads what is left itself


def main(argv: list[str]) -> int:
    try:
        helper = Helper(Settings.parse(argv[1:]))
    except Exception as e:  # noqa: BLE001 - no CUDA driver, no device: the parent reads on its own
        _say({"error": f"{type(e).__name__}: {e}"})
        return 1
    if helper.settings.listen is not None:
        return _main_service(helper)
    _say({"ready": True, "protocol": PROTOCOL})
    status = 0
    releasing: list[threading.Thread] = []
    for line in sys.stdin:
        try:
            _say({"ok": helper.job(json.loads(line))})
        except Exception as e:  # noqa: BLE001 - the parent re-reads this job's windows itself
            _say({"error": f"{type(e).__name__}: {e}"})
            status = 1
        thread = helper.unregister_kept()  # after the reply: off the parent's path
        if thread is not None:
            releasing.append(thread)
    for thread in releasing:  # a failed unregistering costs nothing: exiting unpins whatever is left
        thread.join()
    with contextlib.suppress(Exception):  # exiting frees the mappings anyway
        helper.close()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
