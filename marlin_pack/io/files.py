"""Opening files that may be hostile: regular files only, read with a hard byte limit; files written only where made.

A FIFO at ``config.json`` would block a reader forever, a symlink to ``/dev/zero`` reports
size 0 and never ends: every file marlin-pack reads goes through :func:`open_regular`,
which opens without blocking and refuses anything but a regular file.

Writing is the other direction: a directory another user may write (her model directory, a shared
model tree) can have its entries renamed and replaced by symlinks at any moment, so a path checked
once says nothing about what a later open by that path reaches. What marlin-pack writes there is
made relative to a descriptor of a directory it made and still holds (:func:`open_dirs`,
:func:`open_dir`, :func:`create_file`, :func:`remove_contents`), never through a symlink that
appeared, and a symlink is followed only when its owner is this user or root (:func:`trusted_link`,
the kernel's ``protected_symlinks`` rule).

A file's *identity* (:func:`identity_of`) and whole reads with ``pread`` (:func:`pread_full`) live here too: a
file that reads short or whose identity moves while it is read is :class:`FileChangedError`, never SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = [
    "MEMORY_FILESYSTEMS", "NotRegularFileError", "FileTooLargeError", "UntrustedSymlinkError", "filesystem_type",
    "in_base_memory_pages", "open_regular", "read_limited", "rename_no_replace", "owner_text", "trusted_link", "same_file",
    "open_dir", "open_dirs", "create_file", "remove_contents", "FileChangedError", "identity_of", "pread_full",
    "writable_by_others",
]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC

# Filesystems whose pages are memory (shmem): no device behind the page cache. The bundle writer
# writes such files through the page cache rather than O_DIRECT (which there is one more copy, not
# one less); the loader stages those held in 4 KiB pages rather than pinning them in place
# (in_base_memory_pages: measured faster).
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "shm"})


class NotRegularFileError(OSError):
    """The path exists but is a FIFO, device, socket or directory, not a regular file."""


class FileTooLargeError(OSError):
    """A file holds more bytes than its kind ever needs."""


class UntrustedSymlinkError(OSError):
    """A symlink owned by another user (neither this one nor root): never followed."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` (symlinks followed) if it is a regular file.

    Raises:
        NotRegularFileError: a FIFO, device, socket or directory (opening never blocks).
        OSError: missing, unreadable, ...
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"is a {_kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_limited(path: Path, limit: int) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes.

    Raises:
        FileTooLargeError: more than ``limit`` bytes (counted while reading, not from stat).
        NotRegularFileError, OSError: as :func:`open_regular`.
    """
    fd = open_regular(path)
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise FileTooLargeError(errno.EFBIG, f"holds more than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def rename_no_replace(src: str | Path, dst: str | Path, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst`` (not even an empty directory).

    Uses Linux's ``renameat2(RENAME_NOREPLACE)``, so the check and the rename are one step;
    where the call or the file system lacks it, falls back to check-then-rename. ``src_dir_fd`` /
    ``dst_dir_fd``: the names are relative to these directories (as :func:`os.rename` takes them).

    Raises:
        FileExistsError: something is at ``dst``.
    """
    import ctypes

    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        at_fdcwd, rename_noreplace = -100, 1
        src_at = at_fdcwd if src_dir_fd is None else src_dir_fd
        dst_at = at_fdcwd if dst_dir_fd is None else dst_dir_fd
        if fn(src_at, os.fsencode(src), dst_at, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise (FileExistsError if err == errno.EEXIST else OSError)(err, os.strerror(err), str(dst))
    try:
        os.lstat(dst, dir_fd=dst_dir_fd)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))


def owner_text(uid: int) -> str:
    """``alice (uid 1001)``, or ``uid 1001`` where the user database has no name for it."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def trusted_link(st: os.stat_result) -> bool:
    """Whether a symlink (its ``lstat``) may be followed: its owner is this user or root.

    The kernel's ``protected_symlinks`` rule: anyone else's link may be swapped for one pointing
    anywhere (into a 0700 directory of root's too) between a check and the write through it.
    """
    return st.st_uid in (os.geteuid(), 0)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two stats are of one file (device and inode)."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), following a final symlink only if :func:`trusted_link`.

    Raises:
        UntrustedSymlinkError: ``name`` is another user's symlink.
        OSError: missing, not a directory, ...
    """
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.lstat(name, dir_fd=dir_fd)
        if not stat.S_ISLNK(st.st_mode):
            raise
        if not trusted_link(st):
            raise UntrustedSymlinkError(
                errno.ELOOP, f"is a symlink owned by {owner_text(st.st_uid)}, not by this user or root", str(name)
            ) from None
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def open_dirs(path: Path, mode: int = 0o777) -> int:
    """A descriptor of the directory ``path``, making the missing ones (``mkdir -p``) without following another user's symlink.

    The part of ``path`` that exists is the caller's choice and opened as it is; each missing
    directory is made and opened relative to the one above it, so a symlink put in its place
    meanwhile is followed only if :func:`trusted_link` (a plain ``mkdir(parents=True)`` would go
    wherever it points).

    Raises:
        UntrustedSymlinkError: a missing directory appeared meanwhile as another user's symlink.
        OSError: a component is not a directory, not writable, ...
    """
    missing: list[str] = []
    top = Path(path)
    while not os.path.lexists(top) and top != top.parent:
        missing.append(top.name)
        top = top.parent
    fd = os.open(top, _DIR_FLAGS)
    try:
        for name in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made meanwhile (another conversion): opened as any existing entry
                os.mkdir(name, mode, dir_fd=fd)
            below = open_dir(name, fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(name: str, dir_fd: int, mode: int = 0o666, flags: int = os.O_WRONLY) -> int:
    """A new file ``name`` in the held directory ``dir_fd``: never an existing one, never through a symlink.

    Raises:
        FileExistsError: something (a planted symlink too) is already at ``name``.
    """
    return os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)


def remove_contents(dir_fd: int) -> None:
    """Remove everything inside the held directory ``dir_fd`` (which stays), never following a symlink.

    Each subdirectory is opened without following a symlink and emptied through its descriptor,
    so nothing outside the directory is reached whatever is renamed meanwhile. Errors are ignored:
    what cannot be removed stays.
    """
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                if same_file(os.fstat(sub), st):
                    remove_contents(sub)
            finally:
                os.close(sub)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=dir_fd)
        else:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)


class FileChangedError(OSError):
    """A file's identity moved while it was hashed or read (written, truncated, replaced): no digest or tensor describes it.

    ``strerror`` says what happened, starting "changed while it was hashed" or "changed while it was read";
    ``filename`` is the path.
    """


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Read ``len(buf)`` bytes of ``fd`` at ``offset`` into ``buf`` (the GIL released); the bytes read, fewer only
    where the file ends first.

    Raises:
        OSError: a read failed (``EIO``, ...).
    """
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def identity_of(st: os.stat_result) -> tuple[int, ...]:
    """``(size, mtime_ns, ctime_ns, inode, device)``: what a stamp binds. The change time cannot be set
    by users (``touch -r`` and ``utime`` update it); a file replaced by another has another inode."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _mount_of(path: str | Path, mounts: str | Path) -> tuple[str, frozenset[str]] | None:
    """The type and options of the filesystem ``path`` is on (the longest mount point above it)."""
    try:
        target = os.path.realpath(path)
        best, found = "", None
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, found = mount, (fields[2], frozenset(fields[3].split(",")))
        return found
    except OSError:
        return None


def filesystem_type(path: str | Path, mounts: str | Path = "/proc/self/mounts") -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it), or None if unknown.

    ``path`` need not exist (a file about to be created: its directory decides).
    """
    found = _mount_of(path, mounts)
    return None if found is None else found[0]


# tmpfs mount options under which a large file is held in 2 MiB pages (``advise`` only with madvise).
_HUGE_TMPFS_OPTIONS = frozenset({"huge=always", "huge=within_size"})


def in_base_memory_pages(
    path: str | Path,
    mounts: str | Path = "/proc/self/mounts",
    shmem_policy: str | Path = "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
) -> bool:
    """Whether ``path`` is on a memory filesystem that holds files in base (4 KiB) pages.

    Such files are slow to page-lock in place: pinning walks every page (``benchmarks/bench_h2d.py --pin``
    on an H200 host: ``cuMemHostRegister`` 16.1 GB/s on a default tmpfs against 37.2 GB/s on a
    ``huge=always`` tmpfs and 37.1 GB/s on ext4). True for ramfs and for tmpfs unless mounted
    ``huge=always`` or ``huge=within_size`` or the kernel forces huge pages on every tmpfs
    (``shmem_enabled`` ``[force]``; ``[deny]`` turns them off everywhere).
    """
    found = _mount_of(path, mounts)
    if found is None or found[0] not in MEMORY_FILESYSTEMS:
        return False
    fstype, options = found
    if fstype != "tmpfs":
        return True
    try:
        policy = Path(shmem_policy).read_text()
    except OSError:
        policy = ""
    if "[deny]" in policy:
        return True
    return not ("[force]" in policy or options & _HUGE_TMPFS_OPTIONS)


def _others_may_write(st: os.stat_result) -> str | None:
    """Why users other than the effective one and root may write the file or directory ``st`` is of; None if none may."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS_WRITE:
        return f"mode {mode:04o}: group or others may write it"
    return None


def writable_by_others(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why someone other than the effective user and root may change the file at ``path``, or None.

    The file (``st``: its stat, default ``os.stat(path)``) must be owned by the effective user or
    root with no group or other write bit, and so must the directory it is named in and the
    directory it really is in (symlinks resolved). A user who may write the file can change its
    bytes through a shared writable mapping without moving its identity; one who may write its
    directory can replace or rename it. A directory that cannot be examined counts as writable.
    """
    try:
        st = os.stat(path) if st is None else st
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if (why := _others_may_write(st)) is not None:
        return why
    for folder in dict.fromkeys((path.parent, Path(os.path.realpath(path)).parent)):
        try:
            why = _others_may_write(os.stat(folder))
        except OSError as e:
            why = f"cannot be examined ({e.strerror or e})"
        if why is not None:
            return f"its directory {folder} is {why}" if why.startswith("owned") else f"its directory {folder}: {why}"
    return None
