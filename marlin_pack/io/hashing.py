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

import errno
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from marlin_pack.io.files import FileChangedError, identity_of, open_regular, pread_full

__all__ = [
    "FileChangedError", "HashedFile", "file_digest", "file_digests", "file_identity", "hash_file", "hash_workers",
    "identity_of", "new_file_hasher", "sha256_bytes",
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


def hash_file(path: Path, threads: int | None = None) -> HashedFile:
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
    try:
        named = file_identity(path)
    except OSError as e:
        raise FileChangedError(errno.ESTALE, f"changed while it was hashed (removed: {e.strerror})", str(path)) from e
    if after != before or named != before:
        what = "replaced" if named[3:] != before[3:] else "written"
        if what == "written" and after[0] < before[0]:
            what = f"truncated to {after[0]} of its {before[0]} bytes"
        raise FileChangedError(errno.ESTALE, f"changed while it was hashed ({what})", str(path))
    return HashedFile(path, h.hexdigest(), before, stampable=max(before[1], before[2]) < started - RACY_NS)


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
