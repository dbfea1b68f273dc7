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

Every line a helper reads is untrusted input, answered and never fatal: a line longer than
:data:`MAX_LINE` (it is skipped up to its newline), one that is not UTF-8 JSON of an object, a job or
``retain`` line that is not the shape above (integers where integers go, ``0 <= LO < HI`` with no page
shared by two windows or ranges of one file, each piece inside its window, ``HANDLE_INDEX`` naming one of
``handles`` (each 128 hex digits), ``DEST_OFFSET >= 0`` and the piece inside its allocation, ``threads``
in ``0..MAX_THREADS``, one part per file), a file that is not a regular one (opened non-blocking: a FIFO
does not hold the helper) or ranges outside it: each is answered ``{"error": "RequestError: ..."}``
before any driver call, and the next line is read as usual. Only a driver failure that leaves the
context unusable (:meth:`Helper.context_usable`) ends a service helper, after its session. A client reads
each reply whole under one deadline (:class:`LineReader`): a peer that says half a line is given up on.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import select
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
# The longest line either side of the protocol reads (a helper's request, a client's reply), newline included.
# A job line lists every piece of a helper's share at ~45 bytes a piece: a model of 130k destination pieces (a
# MoE bundle stored per expert) needs ~6 MB with one helper; 32 MiB is five times that, while a line that never
# ends costs a helper at most this much (and the parsed job ~10x more) instead of growing it without bound.
MAX_LINE = 32 << 20
_READ_CHUNK = 1 << 20  # bytes asked of the kernel per read: a job line comes in a few reads
# Registered copy threads a job may ask for: the loader's io_threads option allows 1..64.
MAX_THREADS = 64
_HANDLE_HEX = 128  # a cuIpcGetMemHandle handle: 64 bytes, as hex digits


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaError(RuntimeError):
    """A CUDA driver call failed: the helper's context may be unusable from now on."""


class RequestError(ValueError):
    """A request the helper refuses before any driver call (not UTF-8 or JSON, malformed, out of range, naming no
    regular file): answered with an ``{"error": ...}`` line, never fatal."""


class LineTooLong(RequestError):
    """A line longer than the reader's limit: its bytes are skipped up to its newline, the next line is read as usual."""


class LineReader:
    """Lines of bytes read from the file descriptor ``fd`` (a socket or a pipe), each at most ``limit`` bytes
    (default :data:`MAX_LINE`), with one deadline over every read of a line.

    A line is read here and not through a buffered file: ``select`` on a file object says only that *some*
    byte came, after which its ``readline`` blocks until the newline (a peer sending half a line held it
    forever), and it buffers lines that ``select`` then no longer sees. Never more than ``limit`` bytes of
    one line are held: a longer line raises :class:`LineTooLong` and the rest of it is skipped.
    """

    def __init__(self, fd: int, limit: int | None = None) -> None:
        self.fd = fd
        self.limit = MAX_LINE if limit is None else limit
        self.buf = bytearray()
        self.scanned = 0  # bytes of buf known to hold no newline
        self.skipping = False  # inside a line found too long: its bytes are dropped up to its newline
        self.eof = False

    def readline(self, deadline: float | None = None) -> bytes:
        """The next line with its newline; the bytes left without one when the input ends; ``b""`` after that.

        Raises :class:`TimeoutError` when ``deadline`` (``time.monotonic()``; None: none) passes first (what
        came of the line is kept for the next call), :class:`LineTooLong` for a line over the limit.
        """
        while True:
            line = self._take_line()
            if line is not None:
                return line
            if self.eof:
                rest, self.skipping = (b"" if self.skipping else bytes(self.buf)), False
                self.buf.clear()
                self.scanned = 0
                return rest
            self._fill(deadline)

    def _take_line(self) -> bytes | None:
        """A whole line out of the buffer, or None; drops a line being skipped, raises on one that grew too long."""
        while True:
            nl = self.buf.find(b"\n", self.scanned)
            if nl < 0:
                break
            line = bytes(self.buf[: nl + 1])
            del self.buf[: nl + 1]
            self.scanned = 0
            if self.skipping:
                self.skipping = False
                continue
            if len(line) > self.limit:
                raise LineTooLong(f"a line of {len(line)} bytes, longer than the protocol's {self.limit}")
            return line
        self.scanned = len(self.buf)
        if self.skipping:
            self.buf.clear()
            self.scanned = 0
        elif len(self.buf) > self.limit:
            self.buf.clear()
            self.scanned = 0
            self.skipping = True
            raise LineTooLong(f"a line longer than the protocol's {self.limit} bytes (skipped up to its newline)")
        return None

    def _fill(self, deadline: float | None) -> None:
        """One read into the buffer, once ``fd`` is readable (by ``deadline``, else :class:`TimeoutError`)."""
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise TimeoutError("no whole line in time")
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise TimeoutError("no whole line in time")
        try:
            chunk = os.read(self.fd, _READ_CHUNK)
        except BlockingIOError:  # a non-blocking socket that select woke spuriously
            return
        if chunk:
            self.buf += chunk
        else:
            self.eof = True


def parse_line(line: bytes) -> dict:
    """A protocol line as a JSON object; :class:`RequestError` when it is not UTF-8, not JSON or not an object."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(f"a line that is not UTF-8 (byte {e.start}: {line[e.start : e.start + 1]!r})") from None
    except ValueError as e:  # json.JSONDecodeError, an integer of too many digits
        raise RequestError(f"a line that is not JSON ({e})") from None
    except RecursionError:  # arrays nested deeper than the decoder goes
        raise RequestError("a line of JSON nested too deep") from None
    if not isinstance(obj, dict):
        raise RequestError(f"a line that is not a JSON object ({type(obj).__name__})")
    return obj


def _int(value: object, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float) in ``lo..hi``; :class:`RequestError` otherwise."""
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise RequestError(f"{what} must be an integer {bounds}, not {str(value)[:40]!r}")
    return value


def _list(value: object, what: str, length: int | None = None) -> list:
    """``value`` if it is a JSON array (of ``length`` items, when given); :class:`RequestError` otherwise."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise RequestError(f"{what} must be an array{f' of {length}' if length is not None else ''}, not {str(value)[:40]!r}")
    return value


def _file(part: object, what: str) -> str:
    """A part's ``"file"``: a non-empty path without NUL bytes."""
    if not isinstance(part, dict):
        raise RequestError(f"{what} must be an object")
    file = part.get("file")
    if not isinstance(file, str) or not file or "\0" in file:
        raise RequestError(f"{what}: \"file\" must be a path, not {str(file)[:40]!r}")
    return file


def _disjoint_pages(ranges: list[tuple[int, int]], what: str) -> None:
    """Refuse ranges of one file that share a page: registering a page twice fails in the driver."""
    ordered = sorted(ranges)
    for (_, hi), (lo, _) in itertools.pairwise(ordered):
        if -(-hi // _PAGE) > lo // _PAGE:
            raise RequestError(f"{what}: ranges ending at {hi} and starting at {lo} share a page")


def check_job(job: dict) -> None:
    """Refuse a job line that is not the protocol's (:class:`RequestError`), before any file or driver call:
    integers where integers go, every window ``0 <= LO < HI`` with no page shared with another window of its
    file, every piece inside its window, every handle index naming a handle of the job, ``DEST_OFFSET >= 0``,
    ``threads`` in ``0..MAX_THREADS``. That the windows lie inside their files is checked once they are open
    (:meth:`Helper._check_inside`), that the pieces fit their allocations once the handles are (:meth:`Helper._check_dest`)."""
    handles = _list(job.get("handles"), "\"handles\"")
    for h in handles:
        if not isinstance(h, str) or len(h) != _HANDLE_HEX or any(c not in "0123456789abcdefABCDEF" for c in h):
            raise RequestError(f"a handle must be {_HANDLE_HEX} hex digits, not {str(h)[:40]!r}")
    _int(job.get("threads"), "\"threads\"", 0, MAX_THREADS)
    for k, part in enumerate(_list(job.get("parts"), "\"parts\"")):
        what = f"part {k}"
        _file(part, what)
        spans = []
        for window in _list(part.get("windows"), f"{what}: \"windows\""):
            lo, hi, pieces = _list(window, f"{what}: a window", 3)
            lo, hi = _int(lo, f"{what}: a window's LO"), _int(hi, f"{what}: a window's HI", lo + 1)
            spans.append((lo, hi))
            for piece in _list(pieces, f"{what}: a window's pieces"):
                offset, n, index, dest = _list(piece, f"{what}: a piece", 4)
                offset = _int(offset, f"{what}: a piece's FILE_OFFSET", lo, hi)
                _int(n, f"{what}: a piece's NBYTES", 0, hi - offset)
                _int(index, f"{what}: a piece's HANDLE_INDEX", 0, len(handles) - 1)
                _int(dest, f"{what}: a piece's DEST_OFFSET")
        _disjoint_pages(spans, what)


def check_retain(parts: object) -> list[list[tuple[int, int]]]:
    """A ``retain`` line's ranges per part, refused (:class:`RequestError`) unless each part names a file and
    its ranges are ``0 <= LO < HI`` sharing no page; that they lie inside the file is checked once it is open."""
    found = []
    for k, part in enumerate(_list(parts, "\"retain\"")):
        what = f"retain part {k}"
        _file(part, what)
        ranges = []
        for r in _list(part.get("ranges"), f"{what}: \"ranges\""):
            lo, hi = _list(r, f"{what}: a range", 2)
            lo = _int(lo, f"{what}: a range's LO")
            ranges.append((lo, _int(hi, f"{what}: a range's HI", lo + 1)))
        _disjoint_pages(ranges, what)
        found.append(ranges)
    return found


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
        self.extents: dict[str, int | None] = {}  # handle hex -> its allocation's bytes (None: the driver did not say)
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
        """The device pointer an engine's IPC handle maps to here (opened once per session), its extent noted."""
        ptr = self.opened.get(handle_hex)
        if ptr is None:
            raw = bytes.fromhex(handle_hex)
            if len(raw) != ctypes.sizeof(_IpcHandle):  # check_job saw to it; memmove must never read past raw
                raise RequestError(f"an IPC handle of {len(raw)} bytes")
            handle = _IpcHandle()
            ctypes.memmove(ctypes.addressof(handle), raw, len(raw))
            dptr = ctypes.c_uint64()
            self.cu("cuIpcOpenMemHandle", ctypes.byref(dptr), handle, ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS))
            ptr = self.opened[handle_hex] = dptr.value
            self.extents[handle_hex] = self._extent(ptr)
        return ptr

    def _extent(self, ptr: int) -> int | None:
        """Bytes of the allocation mapped at ``ptr`` from ``ptr`` on (``cuMemGetAddressRange``); None if the driver cannot say."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        try:
            self.cu("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        except CudaError:
            return None  # the copies are then bounded by the driver alone, as before this check
        return base.value + size.value - ptr if size.value else None

    def _check_dest(self, job: dict) -> None:
        """Refuse pieces that end past their destination allocation (a copy there faults the context)."""
        extents = [self.extents.get(h) for h in job["handles"]]
        for part in job["parts"]:
            for _, _, pieces in part["windows"]:
                for _, n, index, dest in pieces:
                    extent = extents[index]
                    if extent is not None and dest + n > extent:
                        raise RequestError(f"a piece of {n} bytes at DEST_OFFSET {dest} ends past its allocation ({extent} bytes)")

    @staticmethod
    def _check_inside(m: _Map, ranges: list[tuple[int, int]]) -> None:
        """Refuse file ranges that end past the mapped file: those addresses are no file's pages."""
        for lo, hi in ranges:
            if hi > m.size:
                raise RequestError(f"bytes {lo}..{hi} lie outside {m.file} ({m.size} bytes)")

    def context_usable(self) -> bool:
        """Whether this helper's CUDA context still works after a failed driver call: a fault in a copy
        (an illegal address) sticks to the context and every later call reports it; an invalid argument does not."""
        try:
            self.cu("cuCtxSetCurrent", self.ctx)
            self.cu("cuCtxSynchronize")
        except CudaError:
            return False
        return True

    def job(self, job: dict) -> int:
        """Copy the job's windows (the protocol's job line); the bytes copied."""
        with self.job_lock:
            return self._job(job)

    def _job(self, job: dict) -> int:
        check_job(job)
        parts = job["parts"]
        # As given and as a retained map names them (its windows past the budget are among the released).
        files = {part["file"] for part in parts} | {os.path.realpath(part["file"]) for part in parts}
        releasing, self.releasing = self.releasing, None
        if releasing is not None and releasing[0] & files:
            releasing[1].join()  # the same file's pages again: pinned through one map at a time
        maps: list[_Map] = []
        try:
            for part in parts:
                maps.append(self._retained_map(part) or self._map(part["file"]))
                self._check_inside(maps[-1], [(lo, hi) for lo, hi, _ in part["windows"]])
            self._check_distinct(maps)
            bases = [self._open(h) for h in job["handles"]]
            self._check_dest(job)
            # 0 registered threads only beside staging ones: a job must never be answered with nothing copied.
            threads = max(0 if self.settings.staged else 1, job["threads"])
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

    @staticmethod
    def _check_distinct(maps: list[_Map]) -> None:
        """Refuse a job naming one file in two parts (under two names too): its pages would be registered twice."""
        seen: set[tuple[int, int]] = set()
        for m in maps:
            st = os.fstat(m.fd)
            if (st.st_dev, st.st_ino) in seen:
                raise RequestError(f"{m.file} is named by two parts of the job")
            seen.add((st.st_dev, st.st_ino))

    def _map(self, file: str) -> _Map:
        """``file`` mapped read-only; :class:`RequestError` unless it is a regular file.

        Opened non-blocking: opening a FIFO for reading otherwise waits for a writer (forever, the helper
        busy with a client that left), and a device or a directory has no pages to copy from.
        """
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RequestError(f"{file} is not a regular file")
            size = st.st_size
            if size == 0:
                raise RequestError(f"{file} is empty")  # no window lies in it, and mmap refuses 0 bytes
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
            raise RequestError("this helper retains nothing (started without --retain-mib)")
        checked = check_retain(parts)
        done = 0
        with self.job_lock:
            for part, ranges in zip(parts, checked, strict=True):
                m = self._retained_map({"file": part["file"], "windows": [[lo, hi, []] for lo, hi in ranges]})
                retained = self._retained_of(m) if m is not None else None
                if retained is None:  # replaced while we looked: nothing to keep
                    if m is not None:
                        os.close(m.fd)
                        self.libc.munmap(m.addr, m.size)
                    continue
                self._check_inside(m, ranges)
                for lo, hi in ranges:
                    lo, hi = _page_range(lo, hi, m.size)
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


def _next_request(reader: LineReader) -> tuple[dict | None, dict | None]:
    """The next request line as ``(request, None)``; ``(None, {"error": ...})`` for a line that is none (too long, not
    UTF-8, not a JSON object: the reply to send before reading on); ``(None, None)`` at the end of input."""
    try:
        line = reader.readline()
    except LineTooLong as e:
        return None, {"error": f"RequestError: {e}"}
    if not line:
        return None, None
    try:
        return parse_line(line), None
    except RequestError as e:
        return None, {"error": f"RequestError: {e}"}


def _answer(helper: Helper, request: dict) -> tuple[dict, bool]:
    """The reply to a job or ``retain`` line (``{"ok": BYTES}`` or ``{"error": ...}``), and False when it failed in
    a driver call that left the helper's context unusable (a service helper is replaced after its session).

    Every other failure is the request's (a refused line, a file that is not there, an IPC handle the driver
    does not know): answered, and the helper serves the next one.
    """
    try:
        return {"ok": helper.retain(request["retain"]) if "retain" in request else helper.job(request)}, True
    except Exception as e:  # noqa: BLE001 - the engine re-reads this job's windows itself
        return {"error": f"{type(e).__name__}: {e}"}, not (isinstance(e, CudaError) and not helper.context_usable())


def serve_session(helper: Helper, conn: socket.socket, free: Callable[[], None] | None = None) -> bool:
    """One engine's session on a service helper: the jobs of the protocol until ``{"end": true}`` or EOF.

    The engine's memory is unmapped (its IPC handles closed) before ``{"closed": true}`` and in any
    case before the next session; deferred unregistering runs after each reply, as in a helper of
    its own engine. Returns False when a CUDA call failed in it and left the context unusable
    (:meth:`Helper.context_usable`). Each line is untrusted input (:class:`LineReader`, :func:`parse_line`,
    :func:`check_job`): one that is not the protocol's is answered ``{"error": ...}`` and the session goes on.
    ``free`` is called, when it went well, just before ``{"closed": true}`` (or before the connection
    closes, when it ended at EOF): an engine that hears it and connects again at once is served, not told
    ``busy``. Retained files that changed, or that the latest bundle needs the room of, are let go last
    (:meth:`Helper.let_go`), off the engine's path.

    With ``--retain-mib``, the ready line also says ``"retained_bytes"`` and ``"retained"`` (``[[FILE,
    [[LO, HI], ...]], ...]``): what stays registered from earlier sessions, and where.
    """
    reader, wfile = LineReader(conn.fileno()), conn.makefile("w", encoding="utf-8")
    ended, healthy = False, True
    began = time.monotonic()
    try:
        helper.cu("cuCtxSetCurrent", helper.ctx)  # this thread opens and closes the IPC mappings
        ready: dict[str, object] = {"ready": True, "protocol": PROTOCOL}
        if helper.settings.retain_bytes:
            ready["retained_bytes"] = helper.retained_bytes()
            ready["retained"] = helper.retained_ranges()  # the engine hands these windows to this helper
        _say(ready, wfile)
        while True:
            request, reply = _next_request(reader)
            if request is None and reply is None:
                break  # the engine's end of input
            if request is not None and request.get("end") is True:
                ended = True
                break
            if request is not None:
                reply, usable = _answer(helper, request)
                healthy = healthy and usable
            _say(reply, wfile)  # type: ignore[arg-type]
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
        with contextlib.suppress(OSError):
            wfile.close()
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
    while os.read(0, _READ_CHUNK):  # until the service closes our input (or dies); what it says is dropped
        pass
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
    reader = LineReader(sys.stdin.fileno())
    while True:
        request, reply = _next_request(reader)
        if request is None and reply is None:
            break
        if request is not None:
            reply, _ = _answer(helper, request)  # an unusable context: this helper exits with its engine's input anyway
        if "error" in reply:  # type: ignore[operator]
            status = 1
        _say(reply)  # type: ignore[arg-type]
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
