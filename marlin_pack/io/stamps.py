"""The stamp store: a per-user cache of "this file identity hashed to this digest", kept outside every bundle.

Hashing a 40 GB checkpoint at every engine start would cost more than the start itself, so
the result of a full hash is remembered as a *stamp*: the identity of the file whose bytes
were hashed, ``(size, mtime_ns, ctime_ns, inode, device)`` (see :mod:`marlin_pack.io.hashing`),
and their BLAKE3 digest. ``verify: auto`` then skips hashing a file whose identity has a stamp
with the digest the manifest expects.

Trust rests on who can write the store, so it lives in one directory of the user running the
check, never in the bundle or the checkpoint (which other users may write):

* ``$MARLIN_PACK_STAMPS``, else ``$XDG_STATE_HOME/marlin-pack/stamps``, else
  ``~/.cache/marlin-pack/stamps``; created 0700. A directory that is a symlink, or is not owned
  by the effective user, is not used (every check then hashes, and says why); one of ours with a
  looser mode is tightened to 0700.
* Every operation goes through the directory's descriptor: stamp files are read with
  ``O_NOFOLLOW`` (regular, ours, small) and written to a fresh ``O_CREAT|O_EXCL|O_NOFOLLOW``
  temporary file renamed over the stamp, so nothing is ever written through a planted path.
* A stamp is recorded only from a :class:`~marlin_pack.io.hashing.HashedFile` (an identity the
  same before and after hashing, not changed just before), or for a file this process wrote and
  hashed itself that no other user could write (:meth:`StampStore.record_written`).

One file per stamped identity (``DEV-INODE.json``), so engines of several ranks checking at once
never lose each other's stamps. The store is an optimisation only: anything wrong with it
(missing, unwritable, a stamp that does not parse) means hashing, never trusting.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from marlin_pack.io.hashing import HashedFile, file_identity, identity_of

__all__ = ["STAMPS_ENV", "stamps_dir", "StampStore"]

STAMPS_ENV = "MARLIN_PACK_STAMPS"
_STAMP_MAX_BYTES = 4096  # one stamp is ~200 bytes of JSON
_FORMAT = 1


def stamps_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where this user's stamps live (see the module docstring), or None when no location is known."""
    env = os.environ if environ is None else environ
    if env.get(STAMPS_ENV):
        return Path(env[STAMPS_ENV]).expanduser()
    state = env.get("XDG_STATE_HOME", "")
    if state and os.path.isabs(state):
        return Path(state) / "marlin-pack" / "stamps"
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".cache" / "marlin-pack" / "stamps" if os.path.isabs(home) else None


def _open_private_dir(path: Path) -> int:
    """A descriptor of ``path``, created 0700 if missing, if it is a directory of the effective user.

    Raises:
        OSError: cannot be created or opened, is a symlink (``O_NOFOLLOW``), or belongs to another
            user (its message says which).
    """
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
    if os.path.islink(path):
        raise PermissionError(0, "it is a symlink; a stamp directory must be a real directory of this user", str(path))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(0, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})", str(path))
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


class StampStore:
    """This user's stamps; open with :meth:`open` (never raises), use as a context manager or :meth:`close`.

    ``where``: the directory; ``unavailable``: why stamps are not kept (then nothing is trusted
    and nothing recorded: every ``auto`` check hashes).
    """

    def __init__(self, where: Path | None, dir_fd: int | None, unavailable: str | None) -> None:
        self.where = where
        self.unavailable = unavailable
        self._fd = dir_fd

    @classmethod
    def open(cls, environ: Mapping[str, str] | None = None) -> StampStore:
        where = stamps_dir(environ)
        if where is None:
            return cls(None, None, f"no home directory to keep stamps in; set {STAMPS_ENV} to a directory of this user")
        try:
            return cls(where, _open_private_dir(where), None)
        except OSError as e:
            why = e.strerror or str(e)
            return cls(where, None, f"stamps cannot be kept in {where} ({why}); set {STAMPS_ENV} to a directory of this user")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StampStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _name(identity: tuple[int, ...]) -> str:
        return f"{identity[4]}-{identity[3]}.json"

    def _read(self, name: str) -> dict | None:
        """The stamp file ``name`` if it is a small regular file of this user that parses; else None."""
        assert self._fd is not None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=self._fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _STAMP_MAX_BYTES:
                return None
            raw = json.loads(os.read(fd, _STAMP_MAX_BYTES + 1))
        except (OSError, ValueError, RecursionError):
            return None
        finally:
            os.close(fd)
        return raw if isinstance(raw, dict) and raw.get("format") == _FORMAT else None

    def trusted(self, path: Path, expected_digest: str) -> bool:
        """Whether this user hashed the file now at ``path``, unchanged since, to ``expected_digest``."""
        if self._fd is None:
            return False
        try:
            identity = file_identity(path)
        except OSError:
            return False
        stamp = self._read(self._name(identity))
        return stamp is not None and stamp.get("identity") == list(identity) and stamp.get("blake3") == expected_digest

    def record(self, hashed: HashedFile) -> None:
        """Remember a hash result (only one whose identity held still while hashed and since, see HashedFile)."""
        if hashed.stampable:
            self._write(hashed.identity, hashed.digest)

    def record_written(self, path: Path, digest: str) -> None:
        """Remember the digest of a file this process has just written and hashed while writing.

        Only for a regular file (not a symlink) of this user that no one else may write, in a
        directory no one else may write: its bytes are then exactly the ones hashed.
        """
        try:
            st = os.lstat(path)
            parent = os.lstat(path.parent)
        except OSError:
            return
        mine = st.st_uid == parent.st_uid == os.geteuid()
        if stat.S_ISREG(st.st_mode) and mine and not (stat.S_IMODE(st.st_mode) | stat.S_IMODE(parent.st_mode)) & 0o022:
            self._write(identity_of(st), digest)

    def _write(self, identity: tuple[int, ...], digest: str) -> None:
        """Write one stamp atomically: a fresh exclusive temporary file, renamed over the stamp; never raises."""
        if self._fd is None:
            return
        tmp = f".{secrets.token_hex(8)}.tmp"
        data = json.dumps({"format": _FORMAT, "identity": list(identity), "blake3": digest}).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=self._fd)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, self._name(identity), src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)
