"""The stamp store: a per-user cache of "this file identity hashed to this digest", kept outside every bundle.

Hashing a 40 GB checkpoint at every engine start would cost more than the start itself, so
the result of a full hash is remembered as a *stamp*: the identity of the file whose bytes
were hashed, ``(size, mtime_ns, ctime_ns, inode, device)`` (see :mod:`marlin_pack.io.hashing`),
and their BLAKE3 digest. ``verify: auto`` then skips hashing a file whose identity has a stamp
with the digest the manifest expects.

An identity proves nothing about bytes that someone else can still change without moving it:
a user who may write a file can keep a page of a shared writable mapping dirty while it is
hashed and write through it afterwards (no new mtime or ctime). So a file is stamped, and a
stamp trusted, only while no one but the effective user and root may change it
(:func:`~marlin_pack.io.files.writable_by_others`): owned by one of them, no group or other write bit, in a directory
(as named, and where its symlinks lead) owned by one of them with no group or other write bit.
Every other file is hashed at every start, and the report says why. Write access the mode
bits do not show (NFSv4 or other non-POSIX ACLs, ``CAP_DAC_OVERRIDE`` holders) is not seen;
POSIX ACLs are, as their mask is the group bits.

Trust rests on who can write the store, so it lives in one directory of the user running the
check, never in the bundle or the checkpoint (which other users may write):

* ``$MARLIN_PACK_STAMPS``, else ``$XDG_STATE_HOME/marlin-pack/stamps``, else
  ``~/.cache/marlin-pack/stamps``; created 0700 when missing. A directory that is a symlink, is
  not owned by the effective user, or (when this call did not create it) that other users may
  read or write (any group or other bit: ``/tmp``, a shared directory) is not used and never
  chmod-ed: every check then hashes, and says why and what to do.
* Every operation goes through the directory's descriptor: stamp files are read with
  ``O_NOFOLLOW`` (regular, ours, small) and written to a fresh ``O_CREAT|O_EXCL|O_NOFOLLOW``
  temporary file renamed over the stamp, so nothing is ever written through a planted path.
* A stamp is recorded only from a :class:`~marlin_pack.io.hashing.HashedFile` (an identity the
  same before and after hashing, not changed just before, still the file's afterwards), or for a
  file this process wrote and hashed itself (:meth:`StampStore.record_written`); in both cases
  only for a file no one else may write. Each record says why it stamped nothing
  (:class:`NotStamped`): a file that changed, one others may write, or a store that cannot be
  written (read-only, full).

One file per stamped identity (``DEV-INODE.json``), so engines of several ranks checking at once
never lose each other's stamps. The store is an optimisation only: anything wrong with it
(missing, unwritable, a stamp that does not parse) means hashing, never trusting.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from marlin_pack.io.files import writable_by_others
from marlin_pack.io.hashing import HashedFile, identity_of
from marlin_pack.io.home import HomeDirectoryError, expand_user, home_dir

__all__ = ["STAMPS_ENV", "NotStamped", "stamps_dir", "StampStore"]

STAMPS_ENV = "MARLIN_PACK_STAMPS"
_STAMP_MAX_BYTES = 4096  # one stamp is ~200 bytes of JSON
_FORMAT = 1


class NotStamped(NamedTuple):
    """Why a hashed file was not stamped.

    ``kind``: ``changed`` (it changed just before, while or since it was hashed: the next start
    hashes it again and may stamp it), ``writable`` (others may write it: hashed at every start
    while that holds), ``store`` (the store cannot be written or kept: every start hashes until
    it is fixed). ``why``: one phrase, e.g. ``owned by uid 1000``.
    """

    kind: Literal["changed", "writable", "store"]
    why: str


def stamps_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where this user's stamps live (see the module docstring), or None when no location is known (no home directory:
    ``HOME`` unset or relative and no passwd entry, as for an arbitrary UID in a container).

    Raises:
        HomeDirectoryError: ``MARLIN_PACK_STAMPS`` starts with a ``~`` that names no home directory.
    """
    env = os.environ if environ is None else environ
    if env.get(STAMPS_ENV):
        return expand_user(env[STAMPS_ENV], STAMPS_ENV, env)
    state = env.get("XDG_STATE_HOME", "")
    if state and os.path.isabs(state):
        return Path(state) / "marlin-pack" / "stamps"
    try:
        return home_dir("the stamp store", STAMPS_ENV, env) / ".cache" / "marlin-pack" / "stamps"
    except HomeDirectoryError:
        return None


class _NotPrivate(PermissionError):
    """A stamp directory that is not this user's private directory; ``advice``: what to do."""

    def __init__(self, path: Path, why: str, advice: str) -> None:
        super().__init__(0, why, str(path))
        self.advice = advice


_ADVICE = f"set {STAMPS_ENV} to a directory of this user"


def _open_private_dir(path: Path) -> int:
    """A descriptor of ``path`` if it is a private directory of the effective user; created 0700 if missing.

    Only a directory this call created is ever chmod-ed (to 0700, should the file system have
    made it looser); an existing one that other users may read or write (``/tmp``, a shared
    directory) is refused as it is, never tightened: other users may rely on it.

    Raises:
        OSError: cannot be created or opened, is a symlink (``O_NOFOLLOW``), belongs to another
            user, or is open to others and was not created here (its message says which; ``_NotPrivate``
            carries what to do).
    """
    created = False
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
            created = True
    if os.path.islink(path):
        raise _NotPrivate(path, "it is a symlink", f"{_ADVICE} (a real directory, not a link)")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _NotPrivate(path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})", _ADVICE)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077 and not created:
            raise _NotPrivate(
                path, f"mode {mode:04o}: other users may read or write it, and marlin-pack did not create it",
                f"set {STAMPS_ENV} to a path of its own (marlin-pack creates it 0700), or `chmod 700` it if only this user uses it",
            )
        if mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_failure(where: Path | None, e: OSError) -> str:
    """``/x/stamps is read-only (Read-only file system)``: why a stamp could not be written, in one phrase."""
    what = {
        errno.EROFS: "is read-only", errno.EACCES: "is not writable by this user", errno.EPERM: "is not writable by this user",
        errno.ENOSPC: "is full", errno.EDQUOT: "is over its quota",
    }.get(e.errno or 0, "cannot be written")
    return f"{where} {what} ({e.strerror or e})"


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
        try:
            where = stamps_dir(environ)
        except HomeDirectoryError as e:
            return cls(None, None, str(e))
        if where is None:
            return cls(None, None, f"no home directory to keep stamps in; {_ADVICE}")
        try:
            return cls(where, _open_private_dir(where), None)
        except OSError as e:
            why = e.strerror or str(e)
            advice = e.advice if isinstance(e, _NotPrivate) else _ADVICE
            return cls(where, None, f"stamps cannot be kept in {where} ({why}); {advice}")

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
        """Whether this user hashed the file now at ``path``, unchanged since, to ``expected_digest``, and no one
        else may write it now (a stamp kept from before its mode, owner or directory changed is not trusted)."""
        if self._fd is None:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        identity = identity_of(st)
        stamp = self._read(self._name(identity))
        if stamp is None or stamp.get("identity") != list(identity) or stamp.get("blake3") != expected_digest:
            return False
        return writable_by_others(path, st) is None

    def record(self, hashed: HashedFile) -> NotStamped | None:
        """Remember a hash result; None if stamped, else why not.

        Stamped only where its identity held still while hashed (see HashedFile), is still the
        file's now, and no one but this user and root may write the file or its directory.
        """
        if self._fd is None:
            return NotStamped("store", self.unavailable or "no stamp store")
        if not hashed.stampable:
            return NotStamped("changed", "changed less than a second before it was hashed")
        try:
            st = os.stat(hashed.path)
        except OSError as e:
            return NotStamped("changed", f"cannot be examined after it was hashed ({e.strerror or e})")
        if identity_of(st) != hashed.identity:  # an owner or mode change moves the ctime: st is what was hashed
            return NotStamped("changed", "changed after it was hashed")
        if (why := writable_by_others(hashed.path, st)) is not None:
            return NotStamped("writable", why)
        return self._write(hashed.identity, hashed.digest)

    def record_written(self, path: Path, digest: str) -> NotStamped | None:
        """Remember the digest of a file this process has just written and hashed while writing; None if stamped.

        Only for a regular file (not a symlink) no one but this user and root may write, in a
        directory no one else may write (:func:`~marlin_pack.io.files.writable_by_others`): its bytes are then exactly
        the ones hashed.
        """
        if self._fd is None:
            return NotStamped("store", self.unavailable or "no stamp store")
        try:
            st = os.lstat(path)
        except OSError as e:
            return NotStamped("changed", f"cannot be examined ({e.strerror or e})")
        if not stat.S_ISREG(st.st_mode):
            return NotStamped("changed", "is not a regular file")
        if (why := writable_by_others(path, st)) is not None:
            return NotStamped("writable", why)
        return self._write(identity_of(st), digest)

    def _write(self, identity: tuple[int, ...], digest: str) -> NotStamped | None:
        """Write one stamp atomically: a fresh exclusive temporary file, renamed over the stamp; never raises.

        None when written; else why not (``store``: read-only, full, ...), no temporary file left.
        """
        if self._fd is None:
            return NotStamped("store", self.unavailable or "no stamp store")
        tmp = f".{secrets.token_hex(8)}.tmp"
        data = json.dumps({"format": _FORMAT, "identity": list(identity), "blake3": digest}).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=self._fd)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            finally:
                os.close(fd)
            os.rename(tmp, self._name(identity), src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)
            return NotStamped("store", _write_failure(self.where, e))
        return None
