"""A file written front to back that bypasses the page cache (``O_DIRECT``) where the file system allows it.

Why. A conversion writes its bundle once and fsyncs it before publishing, so every byte goes to
the disk before ``convert`` returns either way. Through the page cache each byte is first copied
into freshly allocated cache pages: on the 2-core CI-class VM that copy cost 0.3-2.3 s of CPU
per GB (fresh pages are dear on a VM that hands freed memory back to its host), as much as the
whole Marlin repack, and the fsync after it waited another 0.35-0.5 s. Written with ``O_DIRECT``
from an aligned staging buffer, the same GB took 0.63-0.74 s of wall time and ~0.05 s of CPU,
with nothing left to fsync. The cost: the bundle is not in the page cache afterwards (a first
load reads it from the disk).

How. ``O_DIRECT`` needs the buffer address, the file offset and the length aligned to the device's
logical block; data is gathered into page-aligned staging buffers and written in whole chunks,
the last chunk padded and the file truncated to its real size at the end. An ``O_DIRECT`` write
returns only once the device has the data, so written from one buffer the caller's copy into it
and the disk's write took turns (queue depth 1, the copy's time added to the disk's). So there
are several stages: a full one is handed to a writer thread (``os.pwrite`` at its own offset,
which releases the GIL, as numpy's copy into the stage does) while the caller fills the next,
and ``writers`` threads keep that many writes queued at the disk. Where the file system refuses
``O_DIRECT`` (some FUSE and network file systems: ``EINVAL`` on open or on a write), or a write
comes back short, the file continues through the page cache: refused at open, the caller's data
is written as it comes, synchronously; refused later, ``O_DIRECT`` is cleared on the descriptor
and the stages go on through the page cache (a positioned write does not care which writes are
still under way).

A file on a memory file system (tmpfs, ramfs) is written through the page cache from the start:
there the page cache is the storage, so ``O_DIRECT`` bypasses nothing and only adds the staging
copy. Measured on the 2-core VM (Linux 6.18, whose tmpfs takes ``O_DIRECT``), llama-1gb GPTQ
converted into ``/dev/shm``, alternating, 8 runs each: 0.95 s through the page cache against 1.10 s.

A file on a disk written through the page cache on purpose (``direct=False``: the bundle is to stay
cached for the first start, :func:`marlin_pack.io.residency.write_through_cache`) goes through the
same stages and writer threads, and each stage's writeback is started as soon as it is written
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``). Written synchronously instead, the writes stalled the
conversion once the kernel's dirty limit was reached and the final fsync then waited for the rest:
70B AWQ on the H200, 36.1 s against 22.7 s around the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import mmap
import os
import threading
import traceback
from concurrent import futures
from pathlib import Path
from types import TracebackType

import numpy as np

from marlin_pack.io.files import MEMORY_FILESYSTEMS, create_file, filesystem_type

__all__ = ["SequentialFile", "start_writeback"]

_ALIGN = 4096  # covers 512-byte and 4K logical blocks
_CHUNK = 8 << 20  # measured: 8 and 32 MiB write at the same speed; smaller keeps many rank files cheap
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``sync_file_range`` (Linux), or None where there is none (Python's os has no binding)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to the disk now, without waiting for it.

    Only an early start: durability still comes from the fsync at close. Where the call is missing or
    refused, nothing happens (the kernel writes the pages back in its own time).
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class SequentialFile:
    """Write ``path`` (created or truncated, or created new in a held directory) from front to back; :meth:`close` makes it durable.

    Args:
        path: the file (created or truncated), or with ``dir_fd`` the file's name in messages and where its file system is
            looked up.
        direct: try ``O_DIRECT`` (see the module docstring); False: through the page cache, in the
            background, each stage's writeback started at once (on a memory file system: as it comes).
        writers: threads writing full stages at once (the disk's queue depth); ``writers + 1`` stages
            of ``_CHUNK`` bytes, so the caller fills one while they write.
        dir_fd: create ``path.name`` in this held directory instead: a new file (``O_EXCL``), never through a
            symlink (see :mod:`marlin_pack.io.files`).

    A write that fails in a writer thread fails the file: the next :meth:`write`, and
    :meth:`close`, raise that error (the same exception); :meth:`abort` does not.

    Not thread-safe: one writer thread at a time.
    """

    def __init__(self, path: Path, direct: bool = True, *, writers: int = 1, dir_fd: int | None = None) -> None:
        if writers < 1:
            raise ValueError(f"writers must be at least 1, not {writers}")
        self.path = path
        self.size = 0
        self.direct = False
        # In memory (tmpfs) there is no device to write around: the page cache is the file, and O_DIRECT
        # (accepted there since Linux 6.6) is our staging copy plus the kernel's, instead of the kernel's alone.
        on_disk = filesystem_type(path) not in MEMORY_FILESYSTEMS
        want_direct = direct and hasattr(os, "O_DIRECT") and on_disk
        self._fd: int = self._open(path, want_direct) if dir_fd is None else self._create(path.name, dir_fd, want_direct)
        self._setup(writers, direct, on_disk)

    def _open(self, path: Path, want_direct: bool) -> int:
        """``path`` created or truncated, with ``O_DIRECT`` where wanted and taken."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if want_direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.direct = True
                return fd
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT
                    raise
        return os.open(path, flags, 0o666)

    def _create(self, name: str, dir_fd: int, want_direct: bool) -> int:
        """A new file ``name`` in the held directory ``dir_fd`` (:func:`~marlin_pack.io.files.create_file`), ``O_DIRECT`` set after the
        open where wanted and taken (an ``O_DIRECT`` open refused with ``EINVAL`` may already have made the file)."""
        fd = create_file(name, dir_fd, 0o666)
        if want_direct:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT
                    os.close(fd)
                    raise
        return fd

    def _setup(self, writers: int, direct: bool, on_disk: bool) -> None:
        """Stages and writer threads for the open file."""
        self._closed = False
        self._chunk = _CHUNK
        # Staged: O_DIRECT, or the page cache of a disk asked for (a refused O_DIRECT open writes as it comes).
        staged = self.direct or (not direct and on_disk)
        # Anonymous mappings are page-aligned, which O_DIRECT needs of the memory it writes from.
        # Their pages are only allocated once touched: a file smaller than a chunk costs one stage.
        self._stages = [mmap.mmap(-1, self._chunk) for _ in range(writers + 1)] if staged else []
        # The stages as numpy arrays: numpy copies into them without the GIL (a memoryview slice assignment holds it).
        self._arrays = [np.frombuffer(s, dtype=np.uint8) for s in self._stages]
        self._free = list(range(len(self._stages)))[::-1]  # stages no write is using
        self._current = self._free.pop() if self._stages else -1  # the stage being filled,
        self._fill = 0  # up to here,
        self._offset = 0  # to go at this file offset
        self._pending: list[tuple[futures.Future[None], int]] = []  # (its write, the stage) per stage handed over
        # Threads start on the first full stage: a file under a chunk is written by close() alone.
        self._writers = futures.ThreadPoolExecutor(writers, thread_name_prefix="marlin-pack-direct") if staged else None
        self._direct_lock = threading.Lock()  # writer threads may all fall back at once
        self._error: BaseException | None = None  # the first failed write: the file is failed
        self._error_tb: TracebackType | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""
        if self._closed:
            raise ValueError(f"{self.path} is closed")
        mv = memoryview(data).cast("B")
        if self._writers is None:  # the page cache from the open: no staging copy
            self.size += len(mv)
            self._write_all(mv)
            return
        if self._pending or self._error is not None:
            self._reap()  # a failed write surfaces here
        self.size += len(mv)
        source = np.frombuffer(mv, dtype=np.uint8)
        pos = 0
        while pos < len(mv):
            n = min(len(mv) - pos, self._chunk - self._fill)
            np.copyto(self._arrays[self._current][self._fill : self._fill + n], source[pos : pos + n])
            self._fill += n
            pos += n
            if self._fill == self._chunk:
                self._hand_over()

    def _hand_over(self) -> None:
        """Give the full stage to a writer thread and take a free one, waiting for a write to finish if none is."""
        assert self._writers is not None
        future = self._writers.submit(self._write_stage, self._current, self._fill, self._offset)
        self._pending.append((future, self._current))
        self._offset += self._fill
        self._fill = 0
        while not self._free:
            self._reap(wait=True)
        self._current = self._free.pop()

    def _reap(self, wait: bool = False) -> None:
        """Take back the stages of finished writes (``wait``: once one has finished); raise the file's error if one failed."""
        if wait:
            futures.wait([f for f, _ in self._pending], return_when=futures.FIRST_COMPLETED)
        running = []
        for future, stage in self._pending:
            if not future.done():
                running.append((future, stage))
                continue
            self._free.append(stage)
            e = future.exception()
            if e is not None and self._error is None:
                self._error, self._error_tb = e, e.__traceback__
        self._pending = running
        if self._error is not None:
            # Raised again from the writer's traceback each time, not one growing with every raise.
            raise self._error.with_traceback(self._error_tb)

    def _write_stage(self, stage: int, n: int, offset: int) -> None:
        """Write the first ``n`` bytes of a stage at ``offset`` (a writer thread; close() for the last one)."""
        try:
            self._pwrite_all(memoryview(self._stages[stage])[:n], offset)
            if not self.direct:  # through the page cache: its writeback starts now, not at the dirty limit or the fsync
                start_writeback(self._fd, offset, n)
        except BaseException as e:
            # The error is kept (and raised again); its frames' views of the stage would keep the stage from closing.
            traceback.clear_frames(e.__traceback__)
            raise

    def _pwrite_all(self, mv: memoryview, offset: int) -> None:
        while len(mv):
            direct = self.direct  # as this write is issued: another thread may clear it meanwhile
            try:
                n = os.pwrite(self._fd, mv, offset)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self._stop_direct()  # the file system opened with O_DIRECT but refuses its writes: once more without
                continue
            mv = mv[n:]
            offset += n
            if len(mv) and self.direct:
                self._stop_direct()  # a short write leaves the rest unaligned: go on through the page cache

    def _write_all(self, mv: memoryview) -> None:
        """Write at the file position (the page cache from the open)."""
        while len(mv):
            mv = mv[os.write(self._fd, mv) :]

    def _stop_direct(self) -> None:
        with self._direct_lock:
            if self.direct:
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def close(self) -> None:
        """Write what is staged, cut the padding off, fsync and close; on an error, release everything and raise it."""
        if self._closed:  # again: the file's error if it failed (it is not durable), else nothing to do
            if self._error is not None:
                raise self._error.with_traceback(self._error_tb)
            return
        try:
            if self._writers is not None:
                futures.wait([f for f, _ in self._pending])
                self._reap()
                if self._fill:
                    n = self._fill
                    if self.direct and n % _ALIGN:
                        padded = n + (-n % _ALIGN)
                        self._arrays[self._current][n:padded] = 0
                        n = padded
                    self._write_stage(self._current, n, self._offset)  # here: there is nothing left to overlap
                os.ftruncate(self._fd, self.size)  # the last chunk's padding (a no-op when there was none)
            os.fsync(self._fd)
        except BaseException:
            self._release()
            raise
        self._release()

    def abort(self) -> None:
        """Close without writing what is staged (the caller removes the file); a failed write is not raised."""
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writers is not None:
            # Writes not started are dropped; one under way cannot be stopped, and is waited for: it uses the fd and a stage.
            self._writers.shutdown(wait=True, cancel_futures=True)
            self._writers = None
        self._pending = []
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._arrays = []  # their exports of the stages must go before the maps close
        for stage in self._stages:
            # BufferError: a view of it still held somewhere (a traceback's frame); unmapped when that goes.
            with contextlib.suppress(BufferError):
                stage.close()
        self._stages = []
