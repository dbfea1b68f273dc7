"""Digests of files (BLAKE3) and bytes (SHA-256), each file's digest bound to the identity of the bytes hashed.

Files are hashed with BLAKE3 (format version 3): a tree hash that uses every core on one
file (a TP=1 rank file of a 70B model is a single 38 GB file) and runs at several GB/s per
core, where SHA-256 runs one core at ~1.5 GB/s. Small byte strings (headers, canonical JSON)
keep SHA-256.

:func:`hash_file` returns the digest together with the file's *identity*
``(size, mtime_ns, ctime_ns, inode, device)`` taken from the open descriptor before and
after hashing (and from the path after): a file written, truncated or replaced while it is
hashed is refused (:class:`FileChangedError`, "changed while it was hashed"), never reported with a
digest of bytes it no longer holds. The per-user stamp store (:mod:`marlin_pack.io.stamps`) remembers
such results.

Files are read with ``pread`` into two buffers of :data:`CHUNK` bytes, never through a memory map: the
next chunk is read (by up to :data:`MAX_READERS` threads) while BLAKE3 hashes the current one on every
core (both release the GIL). A file truncated while it is hashed then reads short and is refused in one
line, where a mapped page past the new end killed the process with SIGBUS (:mod:`marlin_pack.io.preads`).
The price is a copy out of the page cache: on 16 cores a warm file hashes at about half the map's speed
(figures at :data:`CHUNK`); one BLAKE3 thread (a conversion's source files) hashes faster than through
the map.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from marlin_pack.io.files import FileChangedError, identity_of, open_regular, pread_full

__all__ = [
    "CopyHash", "FileChangedError", "HashedFile", "file_digest", "file_digests", "file_identity", "hash_file", "hash_workers",
    "identity_of", "new_file_hasher", "remembered", "sha256_bytes",
]

# A file whose change time is this close to the start of its hash (or later) is hashed but not
# stamped: file-system clocks are coarse (a jiffy on ext4, the server's clock on NFS), so a write
# in the same tick as the last one would leave the identity unchanged (git's "racily clean" files).
RACY_NS = 1_000_000_000
# Bytes read per chunk while hashing, into each of two buffers (chunk k + 1 read while chunk k is hashed),
# and threads reading a chunk (one per four hashing threads, at most MAX_READERS: one copies ~5 GB/s out of
# the page cache, which BLAKE3 on more than four cores outruns). 2 GB in the page cache, BLAKE3 on every core,
# medians with the memory map this replaced in the same run: 16-core Xeon (H200 host), 4 readers: 8 MiB chunks
# 10.2 GB/s (4 MiB 8.1, 16 MiB 11.6, 32 MiB 11.3, 64 MiB 8.7; one reader 5.4), the map 25.9; one BLAKE3
# thread 4.4 GB/s, the map 3.6. 2-core EPYC VM (32 MiB L3), busy: 8 MiB 1.31 GB/s, 16 MiB 1.05, the map 1.43:
# larger chunks leave the last-level cache there. 8 MiB: within 12% of the best of either machine.
CHUNK = 8 << 20
MAX_READERS = 4

def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def new_file_hasher(threads: int = 1) -> Any:
    """An incremental BLAKE3 hasher, as used for file digests (``update(bytes)``, ``hexdigest()``).

    ``threads``: BLAKE3 threads per ``update`` (the digest is the same for any number).
    """
    import blake3

    return blake3.blake3(max_threads=threads) if threads > 1 else blake3.blake3()


class HashedFile(NamedTuple):
    """A file's digest and the identity of the bytes hashed (the same before and after hashing).

    ``stampable``: the file had not changed within :data:`RACY_NS` before the hash began, so a
    later write cannot hide behind an unchanged identity; only such results are stamped.
    """

    path: Path
    digest: str
    identity: tuple[int, ...]
    stampable: bool


def file_identity(path: Path) -> tuple[int, ...]:
    """:func:`identity_of` the file at ``path`` (symlinks followed)."""
    return identity_of(path.stat())


_REMEMBERED: list[dict[tuple[str, tuple[int, ...]], HashedFile]] = []  # the innermost remembered() scope's results
_REMEMBERED_LOCK = threading.Lock()


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within: :func:`hash_file` of a file hashed already in this scope, under the same path and identity, gives that
    result without reading the file again.

    For one command that checks several ranks (``marlin-pack check -tp 8``): each rank's check hashes the source
    checkpoint and the common file, which a stamp spares the next rank's only where stamps can be written; the
    scope reads each file once whatever the store. Only files no one but this user and root may write are
    remembered (the rule stamps follow, :func:`~marlin_pack.io.stamps.writable_by_others`).
    """
    with _REMEMBERED_LOCK:
        _REMEMBERED.append({})
    try:
        yield
    finally:
        with _REMEMBERED_LOCK:
            _REMEMBERED.pop()


def hash_file(path: Path, threads: int | None = None) -> HashedFile:
    """:func:`_hash_file`, or within :func:`remembered` the result of the same file hashed earlier in that scope."""
    if not _REMEMBERED:
        return _hash_file(path, threads)
    from marlin_pack.io.stamps import writable_by_others  # (stamps imports this module)

    try:
        key = (str(path), file_identity(path))
    except OSError:
        return _hash_file(path, threads)
    with _REMEMBERED_LOCK:
        found = _REMEMBERED[-1].get(key) if _REMEMBERED else None
    if found is not None and writable_by_others(path) is None:
        return found
    hashed = _hash_file(path, threads)
    if writable_by_others(path) is None:
        with _REMEMBERED_LOCK:
            if _REMEMBERED:
                _REMEMBERED[-1][(str(path), hashed.identity)] = hashed
    return hashed


def _hash_file(path: Path, threads: int | None = None) -> HashedFile:
    """BLAKE3 of a whole regular file, read with ``pread`` (:func:`_hash_bytes`), with the identity of what was hashed.

    ``threads``: BLAKE3 threads for this file (default: every core); the tree hash splits one
    file across them, so a single large file hashes as fast as many small ones.

    Raises:
        FileChangedError: the file changed while it was hashed (it read short, identity before != after), or
            the path names another file afterwards.
        NotRegularFileError, OSError: as :func:`~marlin_pack.io.files.open_regular`, or a read failed.
    """
    import blake3

    h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    started = time.time_ns()
    fd = open_regular(path)
    try:
        before = identity_of(os.fstat(fd))
        _hash_bytes(fd, before[0], h, path, readers=max(1, min(MAX_READERS, (threads or os.cpu_count() or 1) // 4)))
        after = identity_of(os.fstat(fd))
    finally:
        os.close(fd)
    return _result(path, h.hexdigest(), before, after, started)


def _result(path: Path, digest: str, before: tuple[int, ...], after: tuple[int, ...], started: int) -> HashedFile:
    """The :class:`HashedFile` of bytes hashed between identities ``before`` and ``after`` (the descriptor's), the path
    looked at again now.

    Raises:
        FileChangedError: the identity moved, or the path names another file (or none).
    """
    try:
        named = file_identity(path)
    except OSError as e:
        raise FileChangedError(errno.ESTALE, f"changed while it was hashed (removed: {e.strerror})", str(path)) from e
    if after != before or named != before:
        what = "replaced" if named[3:] != before[3:] else "written"
        if what == "written" and after[0] < before[0]:
            what = f"truncated to {after[0]} of its {before[0]} bytes"
        raise FileChangedError(errno.ESTALE, f"changed while it was hashed ({what})", str(path))
    return HashedFile(path, digest, before, stampable=max(before[1], before[2]) < started - RACY_NS)


class CopyHash:
    """BLAKE3 of a whole file from the bytes a copy reads anyway: one read of the file serves the copy and its digest.

    The copy's threads read the file window by window, in any order, and hand each window's bytes over with
    :meth:`submit` (their staging buffer, not a copy of it); one thread of this object hashes them in file order,
    BLAKE3 itself on every core (``update`` releases the GIL), and sets the :class:`threading.Event` that
    :meth:`submit` returned once a window is hashed: only then may its buffer be reused. A copy keeps a few windows
    per thread in flight, so the hash runs behind the reads by at most that much, and the copy waits for it only
    where BLAKE3 on every core is slower than the disk (on 16 cores it hashes several times a disk's rate).

    The digest is bound to the identity ``(size, mtime_ns, ctime_ns, inode, device)`` of the copy's own descriptor
    before the first read and after the last, and to the path's afterwards (:meth:`finish`), as :func:`hash_file`
    binds its own: so a stamp can be recorded from it by the same rule (:meth:`~marlin_pack.io.stamps.StampStore.record`).

    Args:
        path: the file, as its stamp and messages name it.
        fd: the copy's descriptor of it (read-only; the caller closes it after :meth:`finish` or :meth:`abort`).
        threads: BLAKE3 threads (default: every core).
    """

    def __init__(self, path: Path, fd: int, threads: int | None = None) -> None:
        import blake3

        self.path = Path(path)
        self._fd = fd
        self._started = time.time_ns()
        self._before = identity_of(os.fstat(fd))
        self.size = self._before[0]
        self._h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[memoryview, threading.Event]] = {}
        self._next = 0  # bytes [0, _next) are hashed
        self._closing = False  # every window is submitted (finish)
        self._stopped = False  # aborted, or the hash failed
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="marlin-pack-copy-hash", daemon=True)
        self._thread.start()

    @property
    def hashed(self) -> int:
        """Bytes hashed so far (from the file's start)."""
        return self._next

    def submit(self, offset: int, data: memoryview) -> threading.Event:
        """Hand over the file's bytes ``[offset, offset + len(data))``; the event is set once they are hashed (or the hash
        was abandoned): until then ``data`` must not change. Windows must tile the file, each handed over once."""
        done = threading.Event()
        with self._cond:
            if self._stopped:
                done.set()
            elif offset < self._next or offset in self._ready:
                self._fail(RuntimeError(f"internal error: bytes at {offset} of {self.path} handed to its hash twice"))
                done.set()
            else:
                self._ready[offset] = (data, done)
                self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._next not in self._ready and not self._closing:
                    self._cond.wait()
                if self._stopped or self._next not in self._ready:
                    return
                data, done = self._ready.pop(self._next)
            try:
                self._h.update(data)
            except BaseException as e:  # noqa: BLE001 - raised by finish()
                with self._cond:
                    self._fail(e)
                done.set()
                return
            with self._cond:
                self._next += len(data)
            done.set()

    def _fail(self, error: BaseException) -> None:
        """(with the lock held) Stop hashing: every window handed over is released."""
        self._error = self._error or error
        self._stopped = True
        for _, done in self._ready.values():
            done.set()
        self._ready.clear()
        self._cond.notify_all()

    def abort(self) -> None:
        """Give the hash up (the copy failed): every window handed over is released; idempotent."""
        with self._cond:
            self._stopped = True
            for _, done in self._ready.values():
                done.set()
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join()

    def finish(self) -> HashedFile:
        """The digest, once every window is handed over (the copy's threads are done), bound to what was hashed.

        Raises:
            FileChangedError: the file changed while it was copied (its identity moved, it is shorter than its windows
                covered, or the path names another file now).
            RuntimeError: the copy left bytes of the file out (an internal error), or the hash failed.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error
        after = identity_of(os.fstat(self._fd))
        if self._next != self.size and after[0] == self.size:
            raise RuntimeError(f"internal error: the copy of {self.path} handed {self._next} of its {self.size} bytes to its hash")
        return _result(self.path, self._h.hexdigest(), self._before, after, self._started)


def _hash_bytes(fd: int, size: int, h: Any, path: Path, readers: int = 1) -> None:
    """``h.update`` with bytes ``[0, size)`` of ``fd``, :data:`CHUNK` at a time: chunk ``k + 1`` is read (in ``readers``
    parts, one thread each) while chunk ``k`` is hashed.

    Raises:
        FileChangedError: the file ends before ``size`` (truncated while it is hashed).
        OSError: a read failed.
    """
    chunks = -(-size // CHUNK)
    if chunks == 0:
        return
    bufs = [memoryview(bytearray(min(size, CHUNK))) for _ in range(min(chunks, 2))]

    def span(k: int) -> memoryview:
        return bufs[k % 2][: min(CHUNK, size - k * CHUNK)]

    def read(k: int, part: int) -> bool:
        """Part ``part`` of chunk ``k`` (page-aligned cuts) into its buffer; whether all of it was there."""
        n = len(span(k))
        lo, hi = (n * part // readers) & ~4095, n if part == readers - 1 else (n * (part + 1) // readers) & ~4095
        return pread_full(fd, span(k)[lo:hi], k * CHUNK + lo) == hi - lo

    def check(done: list[bool]) -> None:
        if not all(done):  # the file ended early; it may be shorter still by now
            now = os.fstat(fd).st_size
            raise FileChangedError(errno.ESTALE, f"changed while it was hashed (truncated to {now} of its {size} bytes)", str(path))

    if chunks == 1 and readers == 1:
        check([read(0, 0)])
        h.update(span(0))
        return
    with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="marlin-pack-read") as pool:  # joined before fd closes
        ahead = [pool.submit(read, 0, part) for part in range(readers)]
        for k in range(chunks):
            check([f.result() for f in ahead])
            if k + 1 < chunks:  # into the other buffer, hashed last round
                ahead = [pool.submit(read, k + 1, part) for part in range(readers)]
            h.update(span(k))


def file_digest(path: Path, threads: int | None = None) -> str:
    """The BLAKE3 hex digest of a whole file (see :func:`hash_file`, which also says what was hashed)."""
    return hash_file(path, threads).digest


def hash_workers(n_files: int) -> int:
    """Threads for hashing ``n_files`` files: hashing releases the GIL, so files hash in parallel
    up to the cores (capped: past ~8 streams the disk or page cache, not the hash, is the limit)."""
    return max(1, min(n_files, os.cpu_count() or 1, 8))


def file_digests(paths: list[Path]) -> list[HashedFile | OSError]:
    """:func:`hash_file` of several files, in parallel; per file its result or the OSError hashing it raised."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: Path) -> HashedFile | OSError:
        try:
            return hash_file(path, threads=max(1, (os.cpu_count() or 1) // hash_workers(len(paths))))
        except OSError as e:
            return e

    if len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=hash_workers(len(paths)), thread_name_prefix="marlin-pack-hash") as pool:
        return list(pool.map(one, paths))
