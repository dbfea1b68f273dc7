"""Digests of files (BLAKE3) and bytes (SHA-256), each file's digest bound to the identity of the bytes hashed.

Files are hashed with BLAKE3 (format version 3): a tree hash that uses every core on one
file (a TP=1 rank file of a 70B model is a single 38 GB file) and runs at several GB/s per
core, where SHA-256 runs one core at ~1.5 GB/s. Small byte strings (headers, canonical JSON)
keep SHA-256.

:func:`hash_file` returns the digest together with the file's *identity*
``(size, mtime_ns, ctime_ns, inode, device)`` taken from the open descriptor before and
after hashing (and from the path after): a file written, truncated or replaced while it is
hashed is refused (:class:`FileChangedError`), never reported with a digest of bytes it no
longer holds. The per-user stamp store (:mod:`marlin_pack.io.stamps`) remembers such results.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from marlin_pack.io.files import open_regular

__all__ = [
    "FileChangedError", "HashedFile", "file_digest", "file_digests", "file_identity", "hash_file", "hash_workers",
    "identity_of", "new_file_hasher", "sha256_bytes",
]

# A file whose change time is this close to the start of its hash (or later) is hashed but not
# stamped: file-system clocks are coarse (a jiffy on ext4, the server's clock on NFS), so a write
# in the same tick as the last one would leave the identity unchanged (git's "racily clean" files).
RACY_NS = 1_000_000_000

def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def new_file_hasher(threads: int = 1) -> Any:
    """An incremental BLAKE3 hasher, as used for file digests (``update(bytes)``, ``hexdigest()``).

    ``threads``: BLAKE3 threads per ``update`` (the digest is the same for any number).
    """
    import blake3

    return blake3.blake3(max_threads=threads) if threads > 1 else blake3.blake3()


class FileChangedError(OSError):
    """A file's identity moved while it was hashed (written, truncated, replaced): no digest describes it."""


class HashedFile(NamedTuple):
    """A file's digest and the identity of the bytes hashed (the same before and after hashing).

    ``stampable``: the file had not changed within :data:`RACY_NS` before the hash began, so a
    later write cannot hide behind an unchanged identity; only such results are stamped.
    """

    path: Path
    digest: str
    identity: tuple[int, ...]
    stampable: bool


def identity_of(st: os.stat_result) -> tuple[int, ...]:
    """``(size, mtime_ns, ctime_ns, inode, device)``: what a stamp binds. The change time cannot be set
    by users (``touch -r`` and ``utime`` update it); a file replaced by another has another inode."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def file_identity(path: Path) -> tuple[int, ...]:
    """:func:`identity_of` the file at ``path`` (symlinks followed)."""
    return identity_of(path.stat())


def hash_file(path: Path, threads: int | None = None) -> HashedFile:
    """BLAKE3 of a whole regular file, hashed from a read-only memory map, with the identity of what was hashed.

    ``threads``: BLAKE3 threads for this file (default: every core); the tree hash splits one
    file across them, so a single large file hashes as fast as many small ones.

    Raises:
        FileChangedError: the file changed while it was hashed (identity before != after), or the
            path names another file afterwards.
        NotRegularFileError, OSError: as :func:`~marlin_pack.io.files.open_regular`.
    """
    import blake3

    h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    started = time.time_ns()
    fd = open_regular(path)
    try:
        before = identity_of(os.fstat(fd))
        if before[0]:
            with mmap.mmap(fd, before[0], access=mmap.ACCESS_READ) as mm:
                h.update(mm)
        after = identity_of(os.fstat(fd))
    finally:
        os.close(fd)
    try:
        named = file_identity(path)
    except OSError as e:
        raise FileChangedError(errno.ESTALE, f"was removed while it was hashed ({e.strerror})", str(path)) from e
    if after != before or named != before:
        what = "was replaced" if named[3:] != before[3:] else "was written"
        raise FileChangedError(errno.ESTALE, f"{what} while it was hashed", str(path))
    return HashedFile(path, h.hexdigest(), before, stampable=max(before[1], before[2]) < started - RACY_NS)


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
