"""A copy helper process: page-locked copies of file windows into its parent's GPU memory, over CUDA IPC.

Run as ``python -S .../marlin_pack/gpu/helper_main.py DEVICE_ORDINAL [--defer-unregister]`` by
:class:`.helpers.HelperPool`, and spoken to over its stdin/stdout pipes only (:mod:`.helper_protocol`).
Standard library only (``ctypes`` on the CUDA driver, ``libcuda.so.1``): no torch, no site packages, so it
is ready in a fraction of a second. One process's page-locking of page-cache pages (``cuMemHostRegister``)
plateaus at ~21-25 GB/s whatever its thread count, while several processes together reach ~30 GB/s; hence
helpers.

``--defer-unregister``
    a job's page-locked windows stay registered until its copies have all completed and its reply is sent,
    then are unregistered on a thread of their own (a next job of the same file waits for it): unregistering,
    which costs as much as registering, is taken off the copy's path.

``retain`` lines page-lock whole files (in blocks) ahead of the jobs: a job's window inside a retained block is
copied without page-locking. A job whose file's retained blocks no longer match (the path names another file
now, or its windows straddle a block: a copy may not cross two registrations) has that file's blocks let go
first and is copied as without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

if __package__:  # imported as marlin_pack.gpu.helper_main (tests)
    from marlin_pack.gpu import helper_protocol as protocol
else:  # run as a script: sys.path[0] is this folder
    import helper_protocol as protocol  # type: ignore[no-redef]

RequestError = protocol.RequestError
PROTOCOL = protocol.PROTOCOL

_PROT_READ, _MAP_SHARED = 1, 1
_MADV_POPULATE_READ = 22
_REGISTER_FLAGS = 0x01 | 0x08  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x1
_STREAM_NON_BLOCKING = 0x1
_EVENT_DISABLE_TIMING = 0x2
_PAGE = protocol.PAGE


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


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
    return libc


@dataclass(frozen=True)
class Settings:
    """The helper's command line."""

    ordinal: int
    defer_unregister: bool = False

    @classmethod
    def parse(cls, argv: list[str]) -> Settings:
        ordinal, rest = int(argv[0]), argv[1:]
        defer = False
        for flag in rest:
            if flag != "--defer-unregister":
                raise ValueError(f"unknown helper argument {flag!r}")
            defer = True
        return cls(ordinal, defer)


@dataclass(frozen=True)
class _Map:
    """One file, mapped read-only."""

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
    """A file whose page ranges a ``retain`` line registered: they stay registered until ``end`` or the end of input."""

    map: _Map  # its descriptor stays open while it is retained
    identity: tuple[int, ...]  # of the file mapped
    ranges: list[tuple[int, int]] = field(default_factory=list)  # registered page ranges, each its own registration

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
    """One helper's CUDA context and what it holds: the parent's IPC mappings, retained files, deferred pages."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cu = _Driver()
        self.libc = _libc()
        self.cu("cuInit", 0)
        dev = ctypes.c_int()
        self.cu("cuDeviceGet", ctypes.byref(dev), settings.ordinal)
        self.ctx = ctypes.c_void_p()
        self.cu("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.cu("cuCtxSetCurrent", self.ctx)
        self.opened: dict[str, int] = {}  # handle hex -> mapped device pointer
        self.extents: dict[str, int | None] = {}  # handle hex -> its allocation's bytes (None: the driver did not say)
        self.populate = True
        self.registered: list[tuple[str, int]] = []  # --defer-unregister: (file, pointer) registered by the last job
        self.kept_maps: list[_Map] = []  # and the file maps they lie in, unmapped after them
        self.releasing: list[tuple[set[str], threading.Thread]] = []  # (files, thread) unregistering earlier jobs' pages
        self.retained: dict[str, _Retained] = {}  # real path -> what stays registered of it

    # -- the parent's memory ---------------------------------------------------------------------

    def _open(self, handle_hex: str) -> int:
        """The device pointer a parent's IPC handle maps to here (opened once until ``end``), its extent noted."""
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
            return None  # the copies are then bounded by the driver alone
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

    def close_mappings(self) -> None:
        """Close the IPC mappings of the parent's memory (a later job opens its handles again)."""
        opened, self.opened = self.opened, {}
        self.extents.clear()
        for ptr in opened.values():
            self.cu("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    # -- files -----------------------------------------------------------------------------------

    @staticmethod
    def _check_inside(m: _Map, ranges: list[tuple[int, int]]) -> None:
        """Refuse file ranges that end past the mapped file: those addresses are no file's pages."""
        for lo, hi in ranges:
            if hi > m.size:
                raise RequestError(f"bytes {lo}..{hi} lie outside {m.file} ({m.size} bytes)")

    @staticmethod
    def _check_distinct(maps: list[_Map]) -> None:
        """Refuse a request naming one file in two parts (under two names too): its pages would be registered twice."""
        seen: set[tuple[int, int]] = set()
        for m in maps:
            st = os.fstat(m.fd)
            if (st.st_dev, st.st_ino) in seen:
                raise RequestError(f"{m.file} is named by two parts of the request")
            seen.add((st.st_dev, st.st_ino))

    def _map(self, file: str) -> _Map:
        """``file`` mapped read-only; :class:`RequestError` unless it is a regular file with bytes.

        Opened non-blocking: opening a FIFO for reading otherwise waits for a writer (forever), and a device
        or a directory has no pages to copy from.
        """
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RequestError(f"{file} is not a regular file")
            if st.st_size == 0:
                raise RequestError(f"{file} is empty")  # no window lies in it, and mmap refuses 0 bytes
            addr = self.libc.mmap(None, st.st_size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
        except BaseException:
            os.close(fd)
            raise
        return _Map(file, fd, addr, st.st_size)

    def _unmap(self, m: _Map) -> None:
        os.close(m.fd)
        self.libc.munmap(m.addr, m.size)

    def _open_files(self, named: list[tuple[str, list[tuple[int, int]]]]) -> list[_Map]:
        """The map to use for each ``(file, ranges)``: the file's retained map where it serves those ranges, else
        a new one. Refuses ranges outside their file and a file named twice before anything else is done (the
        new maps closed again); then lets go of the named retained files that no longer serve (the path names
        another file now, or a range straddles a retained block: a copy may not cross two registrations)."""
        maps: list[_Map] = []
        stale: list[str] = []
        try:
            for file, ranges in named:
                real = os.path.realpath(file)
                retained = self.retained.get(real)
                if retained is not None and _identity(os.stat(real)) == retained.identity and not any(
                    retained.clashes(*_page_range(lo, hi, retained.map.size)) for lo, hi in ranges
                ):
                    maps.append(retained.map)
                else:
                    if retained is not None:
                        stale.append(real)
                    maps.append(self._map(file))
                self._check_inside(maps[-1], ranges)
            self._check_distinct(maps)
        except BaseException:
            for m in maps:
                if self._retained_of(m) is None:
                    self._unmap(m)
            raise
        self._release([self.retained.pop(real) for real in stale])  # their deferred pages were settled first
        return maps

    def _retained_of(self, m: _Map) -> _Retained | None:
        retained = self.retained.get(m.file)
        return retained if retained is not None and retained.map is m else None

    def _release(self, gone: list[_Retained]) -> None:
        """Unregister, unmap and close what the files ``gone`` (already out of :attr:`retained`) held."""
        for r in gone:
            try:
                for lo, _ in r.ranges:
                    self.cu("cuMemHostUnregister", ctypes.c_void_p(r.map.addr + lo))
            finally:
                self._unmap(r.map)

    def _pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of a file map at ``ptr`` for copies (read-only), its page-table entries faulted in first."""
        if self.populate and self.libc.madvise(ctypes.c_void_p(ptr), nbytes, _MADV_POPULATE_READ) != 0:
            self.populate = False  # a kernel before 5.14: pinning faults the pages in itself
        self.cu("cuMemHostRegister", ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(_REGISTER_FLAGS))

    # -- requests --------------------------------------------------------------------------------

    def job(self, job: dict) -> int:
        """Copy the job's windows (the protocol's job line); the bytes copied."""
        protocol.check_job(job)
        parts = job["parts"]
        self._settle({part["file"] for part in parts} | {os.path.realpath(part["file"]) for part in parts})
        maps = self._open_files([(part["file"], [(lo, hi) for lo, hi, _ in part["windows"]]) for part in parts])
        try:
            bases = [self._open(h) for h in job["handles"]]
            self._check_dest(job)
            windows = [(m, w) for m, part in zip(maps, parts, strict=True) for w in part["windows"]]
            return self._copy_windows(bases, windows, max(1, job["threads"]))
        finally:
            for m in maps:
                if self._retained_of(m) is not None:
                    continue  # stays mapped and open while retained
                os.close(m.fd)  # the map stays valid without it
                if self.registered:
                    self.kept_maps.append(m)  # unmapped once its pages are unregistered
                else:
                    self.libc.munmap(m.addr, m.size)

    def retain(self, parts: object) -> int:
        """Page-lock and retain the ranges ``[{"file": PATH, "ranges": [[LO, HI], ...]}, ...]``; the bytes newly retained.

        Every part is checked (its shape, then its file and its ranges inside it) before any page is locked.
        """
        checked = protocol.check_retain(parts)
        files = [os.path.realpath(part["file"]) for part in parts]  # type: ignore[union-attr]  # one entry per file
        self._settle(None)
        maps = self._open_files(list(zip(files, checked, strict=True)))
        for file, m in zip(files, maps, strict=True):
            if self._retained_of(m) is None:
                self.retained[file] = _Retained(m, _identity(os.fstat(m.fd)))
        done = 0
        for file, ranges in zip(files, checked, strict=True):
            retained = self.retained[file]
            for lo, hi in ranges:
                lo, hi = _page_range(lo, hi, retained.map.size)
                if retained.holds(lo, hi):
                    continue
                self._pin(retained.map.addr + lo, hi - lo)
                retained.ranges.append((lo, hi))
                done += hi - lo
        return done

    def retained_bytes(self) -> int:
        """Bytes of file pages this helper keeps registered for later jobs."""
        return sum(r.nbytes for r in self.retained.values())

    def end(self) -> None:
        """Let go of the parent: every deferred page unregistered, the IPC mappings closed, the retained pages
        unregistered and their files unmapped (the ``end`` line; also at the end of input)."""
        self._settle(None)
        try:
            self.close_mappings()
        finally:
            gone, self.retained = list(self.retained.values()), {}
            self._release(gone)

    # -- copies ----------------------------------------------------------------------------------

    def _settle(self, files: set[str] | None) -> None:
        """Wait for the unregistering of earlier jobs' pages of ``files`` (None: of every file)."""
        waiting = []
        for names, thread in self.releasing:
            if files is None or names & files:
                thread.join()  # the same file's pages again: pinned through one map at a time
            elif thread.is_alive():
                waiting.append((names, thread))
        self.releasing = waiting

    def unregister_kept(self) -> threading.Thread | None:
        """Unregister (then unmap) what ``--defer-unregister`` kept, on a thread of its own; None if nothing was kept.

        Called after the job's reply: a next job starts meanwhile. Its maps lie elsewhere (the old ones are
        unmapped only after their pages), so its registrations cannot clash; a job of one of the same files
        waits for it all the same (:meth:`_settle`: its pages pinned through one map at a time).
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
        # With them, windows of a retained file outside its blocks: registered through its map, which stays.
        self.releasing.append(({m.file for m in maps} | {file for file, _ in kept}, thread))
        return thread

    def _copy_windows(self, bases: list[int], windows: list[tuple[_Map, list]], threads: int) -> int:
        lock = threading.Lock()
        queue = iter(windows)
        errors: list[BaseException] = []

        def take() -> tuple[_Map, list] | None:
            with lock:
                return None if errors else next(queue, None)

        def work() -> None:
            try:
                self._work(bases, take)
            except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
                with lock:
                    errors.append(e)

        pool = [threading.Thread(target=work) for _ in range(min(threads, len(windows)))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        return sum(n for _, (_, _, pieces) in windows for _, n, _, _ in pieces)

    def _work(self, bases: list[int], take) -> None:  # noqa: ANN001
        """One copy thread: windows from ``take()`` page-locked in turn (two in flight), copied, unregistered."""
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
                if len(in_flight) == 2 and not keep:
                    release_oldest()
                lo, hi = _page_range(lo, hi, m.size)
                ptr: int | None = m.addr + lo
                retained = self._retained_of(m)
                if retained is not None and retained.holds(lo, hi):
                    ptr = None  # registered by a retain line: nothing to pin, nothing to release
                else:
                    self._pin(ptr, hi - lo)  # type: ignore[arg-type]
                event = ctypes.c_void_p()
                try:
                    cu("cuEventCreate", ctypes.byref(event), ctypes.c_uint(_EVENT_DISABLE_TIMING))
                except BaseException:
                    if ptr is not None:
                        cu("cuMemHostUnregister", ctypes.c_void_p(ptr))
                    raise
                in_flight.append((m.file, ptr, event))
                for offset, n, handle_index, dest in pieces:
                    cu("cuMemcpyHtoDAsync", ctypes.c_uint64(bases[handle_index] + dest), ctypes.c_void_p(m.addr + offset),
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


def _say(obj: dict, out: TextIO) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _answer(helper: Helper, request: dict) -> dict:
    """The reply to a job, ``retain`` or ``end`` line. A failure (a refused line, a file that is not there, an
    IPC handle the driver does not know, a driver call that failed) is that request's: answered, never fatal."""
    try:
        if request.get("end") is True:
            helper.end()
            return {"closed": True}
        if "retain" in request:
            return {"ok": helper.retain(request["retain"])}
        return {"ok": helper.job(request)}
    except Exception as e:  # noqa: BLE001 - the parent reads this request's windows itself
        return {"error": f"{type(e).__name__}: {e}"}


def serve(helper: Helper, fd_in: int, out: TextIO) -> int:
    """Say ready, then answer the requests read from ``fd_in`` on ``out`` until the input ends; then let go of
    everything. Returns the exit status: 1 when any request was answered with an error, else 0."""
    _say({"ready": True, "protocol": PROTOCOL}, out)
    status = 0
    reader = protocol.LineReader(fd_in)
    while True:
        request, reply = protocol.next_request(reader)
        if request is None and reply is None:
            break
        if request is not None:
            reply = _answer(helper, request)
        if "error" in reply:  # type: ignore[operator]
            status = 1
        _say(reply, out)  # type: ignore[arg-type]
        helper.unregister_kept()  # after the reply: off the parent's path
    with contextlib.suppress(Exception):  # a failed unregistering costs nothing: exiting unpins whatever is left
        helper.end()
    return status


def main(argv: list[str]) -> int:
    try:
        helper = Helper(Settings.parse(argv[1:]))
    except Exception as e:  # noqa: BLE001 - no CUDA driver, no device: the parent reads on its own
        _say({"error": f"{type(e).__name__}: {e}"}, sys.stdout)
        return 1
    return serve(helper, sys.stdin.fileno(), sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
