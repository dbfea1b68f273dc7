"""SHA-256 of files and bytes, and the local stamp cache.

Hashing a 40 GB checkpoint at every engine start would cost more than the start
itself, so a full hash is remembered as a *stamp*: ``(size, mtime_ns)`` of a file
whose SHA-256 was checked. A later check trusts a file whose stat still matches its
stamp and hashes it again otherwise (an edited or copied file gets a new mtime).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["sha256_file", "sha256_bytes", "StampCache"]

_CHUNK = 8 << 20


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Full SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class StampCache:
    """``{file name: [size, mtime_ns, sha256]}`` kept in a JSON file; best effort only.

    The cache is an optimisation, never a source of truth: a stamp only lets a check
    skip hashing when the file's stat is unchanged *and* the recorded hash equals the
    expected one. Unwritable locations are silently ignored.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            raw = json.loads(path.read_text())
            self._stamps: dict[str, list[object]] = raw if isinstance(raw, dict) else {}
        except (OSError, ValueError):
            self._stamps = {}
        self._dirty = False

    def trusted(self, key: str, file: Path, expected_sha256: str) -> bool:
        st = file.stat()
        return self._stamps.get(key) == [st.st_size, st.st_mtime_ns, expected_sha256]

    def record(self, key: str, file: Path, sha256: str) -> None:
        st = file.stat()
        self._stamps[key] = [st.st_size, st.st_mtime_ns, sha256]
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        try:
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._stamps, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            pass
