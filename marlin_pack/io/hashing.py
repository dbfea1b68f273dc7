"""Digests of files (BLAKE3) and bytes (SHA-256), and the local stamp cache.

Files are hashed with BLAKE3 (format version 3): a tree hash that uses every core on one
file (a TP=1 rank file of a 70B model is a single 38 GB file) and runs at several GB/s per
core, where SHA-256 runs one core at ~1.5 GB/s. Small byte strings (headers, canonical JSON)
keep SHA-256.

Hashing a 40 GB checkpoint at every engine start would still cost more than the start
itself, so a full hash is remembered as a *stamp*: the identity and state of a file
whose SHA-256 was checked, ``(size, mtime_ns, ctime_ns, inode, device)``. A later check
trusts a file whose stat still matches its stamp and hashes it again otherwise. The
change time cannot be set by users (``touch -r`` and ``utime`` update it), and a file
replaced by another (rename, copy, another checkpoint with equal mtimes) has another
inode, so what fools a ``(size, mtime)`` stamp does not fool this one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

from marlin_pack.io.files import open_regular, read_limited

__all__ = ["file_digest", "file_digests", "new_file_hasher", "hash_workers", "sha256_bytes", "file_identity", "StampCache"]

def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def new_file_hasher(threads: int = 1) -> Any:
    """An incremental BLAKE3 hasher, as used for file digests (``update(bytes)``, ``hexdigest()``).

    ``threads``: BLAKE3 threads per ``update`` (the digest is the same for any number).
    """
    import blake3

    return blake3.blake3(max_threads=threads) if threads > 1 else blake3.blake3()


def file_digest(path: Path, threads: int | None = None) -> str:
    """BLAKE3 of a whole file (regular files only), hashed from a read-only memory map.

    ``threads``: BLAKE3 threads for this file (default: every core); the tree hash splits one
    file across them, so a single large file hashes as fast as many small ones.
    """
    import blake3

    h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
    finally:
        os.close(fd)
    return h.hexdigest()


def hash_workers(n_files: int) -> int:
    """Threads for hashing ``n_files`` files: hashlib releases the GIL, so files hash in parallel
    up to the cores (capped: past ~8 streams the disk or page cache, not SHA-256, is the limit)."""
    return max(1, min(n_files, os.cpu_count() or 1, 8))


def file_digests(paths: list[Path]) -> list[str | OSError]:
    """:func:`file_digest` of several files, in parallel; per file its hex digest or the OSError reading it raised."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: Path) -> str | OSError:
        try:
            return file_digest(path, threads=max(1, (os.cpu_count() or 1) // hash_workers(len(paths))))
        except OSError as e:
            return e

    if len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=hash_workers(len(paths)), thread_name_prefix="marlin-pack-hash") as pool:
        return list(pool.map(one, paths))


_MAX_STAMPS_BYTES = 16 << 20


def file_identity(path: Path) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode, device]``: what a stamp binds (symlinks followed)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class StampCache:
    """``{key: [size, mtime_ns, ctime_ns, inode, device, digest]}`` in a JSON file; best effort only.

    The cache is an optimisation, never a source of truth: a stamp only lets a check
    skip hashing when the file's identity and stat are unchanged *and* the recorded hash
    equals the expected one. A missing, unreadable, oversized or malformed cache is
    ignored (as if empty), and unwritable locations are silently skipped.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamps: dict[str, list[object]] = {}
        try:
            raw = json.loads(read_limited(path, _MAX_STAMPS_BYTES))
        except (OSError, ValueError, RecursionError):
            raw = {}
        if isinstance(raw, dict):
            self._stamps = {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, list)}
        self._dirty = False

    def trusted(self, key: str, file: Path, expected_digest: str) -> bool:
        """Whether ``file`` is, unchanged, the file whose digest ``expected_digest`` was checked."""
        try:
            return self._stamps.get(key) == [*file_identity(file), expected_digest]
        except OSError:
            return False

    def record(self, key: str, file: Path, digest: str) -> None:
        """Remember that ``file``, as it is now, hashed to ``digest``."""
        try:
            self._stamps[key] = [*file_identity(file), digest]
        except OSError:
            return
        self._dirty = True

    def save(self) -> None:
        """Write the cache atomically; never raises, never leaves a temporary file behind."""
        if not self._dirty:
            return
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self._stamps, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
