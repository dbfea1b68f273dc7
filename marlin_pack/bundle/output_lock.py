"""The lock of a conversion's output: one conversion writes an output at a time, the others wait for it.

``.NAME.lock`` beside the output (in it where a volume is mounted there), made 0600, new and never through a symlink,
held by a write lock (``F_OFD_SETLK``, else ``lockf``), which a user who may only read the file cannot take; one of
another user is refused (anyone could hold it). A waiting conversion says whose the lock is and waits a bounded time
(:func:`lock_wait_s`); the holder removes the file at the end.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from marlin_pack.bundle.in_place import open_output, open_parent
from marlin_pack.errors import MarlinPackError
from marlin_pack.io.files import owner_text, same_file

__all__ = ["LOCK_WAIT_ENV", "lock_wait_s", "output_lock"]

# How long a conversion waits for another one's lock of its output before it gives up (exit 1), unless set.
LOCK_WAIT_ENV = "MARLIN_PACK_LOCK_WAIT_S"
_DEFAULT_LOCK_WAIT_S = 600.0
_WAIT_NOTICE_S = 30.0  # how often a waiting conversion says it is still waiting


def lock_wait_s() -> float:
    """How long to wait for another conversion's lock: ``$MARLIN_PACK_LOCK_WAIT_S`` seconds (``inf``: without end), default 600.

    Raises:
        MarlinPackError: the variable is not a non-negative number.
    """
    raw = os.environ.get(LOCK_WAIT_ENV, "").strip()
    if not raw:
        return _DEFAULT_LOCK_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN too
        raise MarlinPackError(f"{LOCK_WAIT_ENV}={raw!r} is not a number of seconds; expected e.g. 1800, or inf to wait without end")
    return value


def _try_lock(fd: int) -> bool:
    """Take a write lock of the whole file ``fd`` without waiting; False if another open file holds a lock on it.

    An open-file-description lock (``F_OFD_SETLK``: it also excludes another open of the file in this process),
    else a POSIX ``lockf``: both need a descriptor open for writing, which only this user and root have (0600).
    """
    import fcntl

    cmd = getattr(fcntl, "F_OFD_SETLK", None)
    if cmd is not None and struct.calcsize("P") == 8:
        try:  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for an OFD lock), padding
            fcntl.fcntl(fd, cmd, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if e.errno != errno.EINVAL:  # EINVAL: a kernel before 3.15
                raise
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _lock_holder(fd: int, out: Path) -> str:
    """Who holds the lock, from the pid its holder wrote into the file (only this user or root can write it)."""
    pid = 0
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        pid = int(text) if text.isdigit() else 0
    if not pid:
        return f"a process that did not write its pid (not a marlin-pack conversion) holds the lock of {out}"
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"another marlin-pack conversion (pid {pid}) is writing {out}"
    if uid == os.geteuid():
        return f"another marlin-pack conversion (pid {pid}) is writing {out}"
    return f"pid {pid} of {owner_text(uid)}, not a conversion of this user, holds the lock of {out}"


def _open_lock(name: str, parent_fd: int, path: Path, out: Path) -> int | None:
    """The lock file, made 0600 if missing; None where it vanished meanwhile (try again).

    Raises:
        MarlinPackError: not a regular file (a symlink too), or another user's (named), or not openable.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as e:
        raise MarlinPackError(f"cannot make the lock file {path} ({e.strerror or e}); choose a writable location (`output=DIR`)") from e
    remove = f"remove it if no conversion of {out} is running (it is only a lock), or choose another `output=DIR`"
    try:
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise MarlinPackError(f"cannot make the lock file {path}: a symlink is there, expected a lock file; {remove}") from e
        if not stat.S_ISREG(st.st_mode):
            raise MarlinPackError(f"{path} is not a regular file; {remove}") from e
        raise MarlinPackError(
            f"cannot open the lock file {path} of {owner_text(st.st_uid)} ({e.strerror or e}); a conversion of {out} by that user "
            f"is running or was killed: wait for it, or have that user or root remove the file"
        ) from e
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"{path} is not a regular file; {remove}"
    elif st.st_uid not in (os.geteuid(), 0):
        why = f"the lock file {path} belongs to {owner_text(st.st_uid)}, not to this user or root (anyone could hold it); {remove}"
    if why is not None:
        os.close(fd)
        raise MarlinPackError(why)
    os.set_blocking(fd, True)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o600:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)  # a lock file of an older version (0644): no one else opens it from now on
    return fd


@contextlib.contextmanager
def output_lock(
    out: Path, on_wait: Callable[[str], None] | None = None, poll_s: float = 0.2, wait_s: float | None = None
) -> Iterator[None]:
    """Hold the lock of ``out`` (``.NAME.lock`` beside it): one conversion writes ``out`` at a time.

    A second conversion of the same output **waits** for the first (pods whose init containers start
    together), saying so through ``on_wait`` at once and every 30 s (and whose the lock is, where its
    holder is not this user's conversion), and then decides again with the first one's result in place
    (usually: up to date). It waits ``wait_s`` at most (default :func:`lock_wait_s`: ``$MARLIN_PACK_LOCK_WAIT_S``,
    else 600 s), then gives up. The lock file is made 0600 (new, never through a symlink); one of another
    user is refused (anyone could hold it); the lock is a write lock, which needs a descriptor open for
    writing, so a user who may only read the file cannot hold it. A holder that dies releases it. Removed at the
    end: a waiter that then holds a lock on the removed file tries again, so two conversions never both
    believe they hold it. The folder of ``out`` is made if missing (never through another user's symlink).

    Raises:
        MarlinPackError: the lock file cannot be made (an unwritable folder), is not a regular file or is
            another user's; the lock was still held after ``wait_s``.
    """
    limit = lock_wait_s() if wait_s is None else wait_s
    name = f".{out.name}.lock"
    # Beside the output, except where a volume is mounted at it: then in it, where every pod that mounts it finds it.
    inside = os.path.ismount(out)
    path = (out if inside else out.parent) / name
    parent_fd = open_output(out) if inside else open_parent(out)
    began = time.monotonic()
    noticed = -_WAIT_NOTICE_S
    try:
        while True:
            fd = _open_lock(name, parent_fd, path, out)
            if fd is None:
                continue
            try:
                try:
                    locked = _try_lock(fd)
                except OSError as e:  # ENOLCK: a file system without locks
                    raise MarlinPackError(f"cannot lock {path} ({e.strerror or e}); choose another location (`output=DIR`)") from e
                if not locked:
                    waited = time.monotonic() - began
                    if waited >= limit:
                        raise MarlinPackError(
                            f"{path} is still locked after {waited:.0f} s: {_lock_holder(fd, out)}; expected it to finish: wait "
                            f"for it or stop it, or set {LOCK_WAIT_ENV} to wait longer (seconds, or inf)"
                        )
                    if on_wait is not None and waited - noticed >= _WAIT_NOTICE_S:
                        noticed = waited
                        bound = f"at most {limit:.0f} s" if math.isfinite(limit) else "without end"
                        on_wait(f"{_lock_holder(fd, out)}; waiting for it ({waited:.0f} s so far, {bound}: {LOCK_WAIT_ENV})")
                    os.close(fd)
                    fd = -1
                    time.sleep(min(poll_s, max(0.0, limit - waited)))
                    continue
                try:
                    same = same_file(os.fstat(fd), os.lstat(name, dir_fd=parent_fd))
                except FileNotFoundError:
                    same = False
                if not same:  # the holder removed the file as we took the lock: take the new one
                    continue
                if os.fstat(fd).st_uid == os.geteuid():  # ours: say who holds it (never write into another user's file)
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError):
                        if same_file(os.fstat(fd), os.lstat(name, dir_fd=parent_fd)):
                            os.unlink(name, dir_fd=parent_fd)
                return
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        os.close(parent_fd)
