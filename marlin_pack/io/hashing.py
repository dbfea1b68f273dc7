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
such results. :class:`CopyHash` (the loader's copy) and :class:`ReadHash` (``verify``'s comparisons) take the digest from
the bytes another reader reads anyway, bound the same way.

Files are read with ``pread`` into two buffers of :data:`CHUNK` bytes, never through a memory map: the
next chunk is read (by up to :data:`MAX_READERS` threads) while BLAKE3 hashes the current one on every
core (both release the GIL). A file truncated while it is hashed then reads short and is refused in one
line, where a mapped page past the new end killed the process with SIGBUS (:mod:`marlin_pack.io.preads`).
The price is a copy out of the page cache: on 16 cores a warm file hashes at about half the map's speed
(figures at :data:`CHUNK`); one BLAKE3 thread (a conversion's source files) hashes faster than through
the map.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from marlin_pack.io.files import FileChangedError, identity_of, open_regular, pread_full, writable_by_others

__all__ = [
    "CopyHash", "FileChangedError", "HashedFile", "HeldBytes", "ReadHash", "file_digest", "file_digests", "file_identity",
    "hash_file", "hash_workers", "identity_of", "new_file_hasher", "remembered", "sha256_bytes",
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
    remembered (the rule stamps follow, :func:`~marlin_pack.io.files.writable_by_others`).
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


class _FileDigest:
    """BLAKE3 of one open file, bound to the identity of its descriptor when hashing began and after it ended, and to
    the path's afterwards (:func:`_result`): the part :class:`CopyHash` and :class:`ReadHash` share."""

    def __init__(self, path: Path, fd: int, threads: int | None) -> None:
        import blake3

        self.path = Path(path)
        self._fd = fd
        self._started = time.time_ns()
        self._before = identity_of(os.fstat(fd))
        self.size = self._before[0]
        self._h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)

    def _digest(self) -> HashedFile:
        """The digest of the bytes hashed, bound to the descriptor's identity now (:func:`_result`)."""
        return _result(self.path, self._h.hexdigest(), self._before, identity_of(os.fstat(self._fd)), self._started)


class CopyHash(_FileDigest):
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
        super().__init__(path, fd, threads)
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
        if self._next != self.size and os.fstat(self._fd).st_size == self.size:
            raise RuntimeError(f"internal error: the copy of {self.path} handed {self._next} of its {self.size} bytes to its hash")
        return self._digest()


# Bytes ReadHash keeps at most, over all the files sharing a HeldBytes (one verify): copies of ranges read before the
# bytes ahead of them in their file. A checkpoint written by safetensors puts every int32 tensor of a file before every
# float16 one, and names in text order (layer 10 before layer 2): verify's round trip, in layer order, reads scales, and
# layers 2 to 9, ahead of the codes still to come. benchmarks/bench_verify.py (Llama-70B AWQ, 40 GB, scaled down): in
# 5 GB files 2.07 GB kept at most, nothing read twice; in 10 GB files or one file 1.9 GB of it read twice (1.05x; none
# with 4 GiB).
HELD = 2 << 30


class HeldBytes:
    """What :class:`ReadHash` objects keep, together: at most ``limit`` bytes (default :data:`HELD`). Where a range does not
    fit, the ranges kept farthest past their front (reached last) give way to one nearer its own, each read again when its
    front reaches it. The objects sharing it share its lock (:attr:`lock`): one thread hashes at a time."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = HELD if limit is None else limit
        self.held = 0
        self.lock = threading.RLock()
        self._owners: list[ReadHash] = []

    def _room(self, n: int, distance: int) -> bool:
        """(lock held) Reserve ``n`` bytes for a range ``distance`` bytes past its front, making room by giving up ranges
        kept farther past theirs; False (nothing given up or reserved) where even that would not make room."""
        if self.held + n > self.limit:
            farther = sorted(
                ((start - o.front, i, start) for i, o in enumerate(self._owners) for start in o._kept if start - o.front > distance),
                reverse=True,
            )
            if self.held - sum(len(self._owners[i]._kept[start]) for _, i, start in farther) + n > self.limit:
                return False
            for _, i, start in farther:
                if self.held + n <= self.limit:
                    break
                self._owners[i]._give_up(start)
        self.held += n
        return True


class ReadHash(_FileDigest):
    """BLAKE3 of a whole file from the bytes a reader reads anyway, in the reader's order: one read of each byte serves
    the reader and the digest (``verify``: the comparison's reads of the bundle and of the checkpoint).

    The reader hands over each range it read (:meth:`seen`); BLAKE3 takes the file in order: a range at the front (the
    end of the bytes hashed) is hashed at once, in the reader's thread, before the reader goes on with it; a range past
    the front is copied and kept until the front reaches it, within the limit of :class:`HeldBytes` ``held`` shared by
    every file read (a range that does not fit is read again when the front reaches it). ``expected``: the
    ``(start, end)`` ranges the reader is expected to read; every other byte (the header, padding, tensors no one reads)
    is read here as soon as the front reaches it, and whatever is still missing by :meth:`finish`, in file order.

    The digest is bound to the identity ``(size, mtime_ns, ctime_ns, inode, device)`` of the descriptor when this object
    was made and after the last byte, and to the path's afterwards, as :func:`hash_file` binds its own: a file written,
    truncated or replaced meanwhile is refused (:class:`FileChangedError`, "changed while it was hashed").

    Args:
        path: the file, as its stamp and messages name it.
        fd: the reader's descriptor of it (read-only; the caller closes it after :meth:`finish` or :meth:`abort`).
        expected: the ranges the reader will read (any order, may overlap).
        held: the limit shared with the other files read (default: :data:`HELD` for this file alone).
        threads: BLAKE3 threads (default: every core).

    Raises:
        FileChangedError, OSError: reading the bytes before the first range the reader will read.
    """

    def __init__(
        self, path: Path, fd: int, expected: Iterable[tuple[int, int]] = (), held: HeldBytes | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(path, fd, threads)
        self._threads = threads or os.cpu_count() or 1
        self._held = held if held is not None else HeldBytes()
        self._lock = self._held.lock
        self._expected = _merged((max(0, a), min(b, self.size)) for a, b in expected if min(b, self.size) > max(0, a))
        self._kept: dict[int, bytes] = {}  # start -> a copy of the bytes there, past the front
        self._kept_starts: list[int] = []  # sorted
        self.front = 0  # bytes [0, front) are hashed
        self.read_here = 0  # bytes this object read itself (what the reader was not expected to read, or gave up)
        self.given_up = 0  # bytes of the reader's not kept (past the limit): read again when the front reaches them
        with self._lock:
            self._held._owners.append(self)
            try:
                self._advance()  # the bytes before the first range the reader will read (the header)
            except BaseException:
                self._held._owners.remove(self)
                raise

    def seen(self, offset: int, data: memoryview) -> None:
        """The reader read ``data`` at ``offset``: hash it now if it is at the front (then anything now in reach), else
        keep a copy of it within the limit; bytes hashed already are ignored (a second read of the same range).

        Raises:
            FileChangedError, OSError: reading what lies between the front and the next range the reader will read.
        """
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        with self._lock:
            end = offset + len(data)
            if end <= self.front or offset in self._kept:
                return
            if offset < self.front:  # (a range across the front: its part past it)
                data, offset = data[self.front - offset :], self.front
            if offset == self.front:
                self._h.update(data)
                self.front = end
                self._advance()
            elif self._held._room(len(data), offset - self.front):
                self._kept[offset] = bytes(data)
                bisect.insort(self._kept_starts, offset)
            else:
                self._not_kept(offset, end)

    def _not_kept(self, start: int, end: int) -> None:
        """(lock held) Bytes of the reader's not kept: read here when the front reaches them."""
        self.given_up += sum(min(b, end) - max(a, start) for a, b in self._expected if a < end and b > start)
        self._expected = _without(self._expected, start, end)

    def _give_up(self, start: int) -> None:
        """(lock held) Drop the copy kept at ``start`` (:class:`HeldBytes` makes room)."""
        data = self._kept.pop(start)
        self._kept_starts.remove(start)
        self._held.held -= len(data)
        self._not_kept(start, start + len(data))

    def _advance(self, everything: bool = False) -> None:
        """(lock held) Move the front over the copies kept there and over bytes the reader is not expected to read (read
        here); with ``everything``, to the end of the file."""
        while self.front < self.size:
            while self._kept_starts and self._kept_starts[0] < self.front:  # behind the front (overlapping ranges)
                start = self._kept_starts.pop(0)
                data = self._kept.pop(start)
                self._held.held -= len(data)
                if start + len(data) > self.front:
                    self._h.update(memoryview(data)[self.front - start :])
                    self.front = start + len(data)
            if self._kept_starts and self._kept_starts[0] == self.front:
                data = self._kept.pop(self._kept_starts.pop(0))
                self._h.update(data)
                self._held.held -= len(data)
                self.front += len(data)
                continue
            i = bisect.bisect_right(self._expected, (self.front, self.size + 1)) - 1
            if not everything and i >= 0 and self._expected[i][1] > self.front:
                return  # the reader will bring these bytes
            stop = self.size if i + 1 >= len(self._expected) or everything else self._expected[i + 1][0]
            if self._kept_starts:
                stop = min(stop, self._kept_starts[0])
            n = stop - self.front
            readers = max(1, min(MAX_READERS, self._threads // 4)) if n > CHUNK else 1
            _hash_bytes(self._fd, self.size, self._h, self.path, readers, self.front, stop)
            self.read_here += n
            self.front = stop

    def finish(self) -> HashedFile:
        """The digest, once the reader is done: every byte not hashed yet is read and hashed now, in file order.

        Raises:
            FileChangedError: the file changed since this object was made (its identity moved, it ends early, or the path
                names another file now).
            OSError: a read failed.
        """
        try:
            with self._lock:
                self._advance(everything=True)
            return self._digest()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the copies kept (their bytes go back to the limit); idempotent."""
        with self._lock:
            self._held.held -= sum(len(d) for d in self._kept.values())
            self._kept.clear()
            self._kept_starts.clear()
            if self in self._held._owners:
                self._held._owners.remove(self)


def _without(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Sorted, disjoint ``ranges`` less ``[start, end)``."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= start or a >= end:
            out.append((a, b))
            continue
        if a < start:
            out.append((a, start))
        if b > end:
            out.append((end, b))
    return out


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` ranges sorted, overlapping and adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _hash_bytes(fd: int, size: int, h: Any, path: Path, readers: int = 1, start: int = 0, end: int | None = None) -> None:
    """``h.update`` with bytes ``[start, end)`` of ``fd`` (default: ``[0, size)``, ``size`` the file's), :data:`CHUNK` at a
    time: chunk ``k + 1`` is read (in ``readers`` parts, one thread each) while chunk ``k`` is hashed.

    Raises:
        FileChangedError: the file ends before ``end`` (truncated while it is hashed).
        OSError: a read failed.
    """
    n_bytes = (size if end is None else end) - start
    chunks = -(-n_bytes // CHUNK)
    if chunks <= 0:
        return
    bufs = [memoryview(bytearray(min(n_bytes, CHUNK))) for _ in range(min(chunks, 2))]

    def span(k: int) -> memoryview:
        return bufs[k % 2][: min(CHUNK, n_bytes - k * CHUNK)]

    def read(k: int, part: int) -> bool:
        """Part ``part`` of chunk ``k`` (page-aligned cuts) into its buffer; whether all of it was there."""
        n = len(span(k))
        lo, hi = (n * part // readers) & ~4095, n if part == readers - 1 else (n * (part + 1) // readers) & ~4095
        return pread_full(fd, span(k)[lo:hi], start + k * CHUNK + lo) == hi - lo

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
