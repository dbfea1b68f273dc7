"""Opening files that may be hostile: regular files only, read with a hard byte limit.

A FIFO at ``config.json`` would block a reader forever, a symlink to ``/dev/zero`` reports
size 0 and never ends: every file marlin-pack reads goes through :func:`open_regular`,
which opens without blocking and refuses anything but a regular file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = [
    "MEMORY_FILESYSTEMS", "NotRegularFileError", "FileTooLargeError", "filesystem_type", "in_base_memory_pages",
    "open_regular", "read_limited", "rename_no_replace",
]

# Filesystems whose pages are memory (shmem): no device behind the page cache. The bundle writer
# writes such files through the page cache rather than O_DIRECT (which there is one more copy, not
# one less); the loader stages those held in 4 KiB pages rather than pinning them in place
# (in_base_memory_pages: measured faster).
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "shm"})


class NotRegularFileError(OSError):
    """The path exists but is a FIFO, device, socket or directory, not a regular file."""


class FileTooLargeError(OSError):
    """A file holds more bytes than its kind ever needs."""


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


def rename_no_replace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst`` (not even an empty directory).

    Uses Linux's ``renameat2(RENAME_NOREPLACE)``, so the check and the rename are one step;
    where the call or the file system lacks it, falls back to check-then-rename.

    Raises:
        FileExistsError: something is at ``dst``.
    """
    import ctypes

    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        at_fdcwd, rename_noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise (FileExistsError if err == errno.EEXIST else OSError)(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


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
