"""Is a file in the page cache, and does its file system take direct reads: the facts of the cold path.

The I/O plan reads a bundle the way its pages are. Page-locking a map of a file that is not in the page
cache faults it in page by page: 1.2 GB/s for a 70B rank file on the H200's disk, the first start after a
``convert`` (whose writes bypass the page cache) taking 29.95 s. Large aligned ``O_DIRECT`` reads with a few
in flight go at the disk's speed instead, and so do ``pread`` calls through the page cache, which leave the file
cached for the next start. So the plan asks three plain questions of the rank file:

* :func:`cached_fraction`: how much of it is in the page cache (``mincore`` over a read-only map, a
  byte per page: milliseconds for 40 GB, nothing read);
* :func:`takes_direct_reads`: whether it can be opened with ``O_DIRECT`` and read at an aligned offset
  (not on a tmpfs before Linux 6.6, nor on some network file systems);
* :func:`room_for`: whether the host's available memory keeps it in the page cache with :data:`HEADROOM` to spare
  (then a cold file is read through the cache, else around it).

The other direction: a conversion writes its bundle through the page cache where the host's memory holds
it (:func:`write_through_cache`), so the first start after ``convert`` is a warm one; else around it
(:mod:`marlin_pack.io.direct_file`), and that first start reads at the disk's speed.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path

__all__ = [
    "DIRECT_ALIGN", "HEADROOM", "WRITE_ENV", "available_memory", "cached_fraction", "drop_cached", "room_for", "takes_direct_reads",
    "write_through_cache",
]

# Offset, length and buffer alignment of an O_DIRECT read that every block device here accepts
# (logical blocks of 512 B or 4 KiB).
DIRECT_ALIGN = 4096
_CHUNK = 1 << 30  # bytes mapped per mincore call (the vector stays 256 KiB)
_SAMPLED, _SAMPLES = 1 << 30, 64  # a file larger than 1 GiB: 64 ranges of 16 MiB looked at
# Memory left to the host beyond a bundle kept in (or brought into) the page cache: what the engine's own
# host allocations, pinned staging and the rest of the machine need.
HEADROOM = 8 << 30
WRITE_ENV = "MARLIN_PACK_WRITE"  # "direct" or "cached": force a conversion's write path (benchmarks)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each page's byte says resident


def _ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges looked at: the whole file up to :data:`_SAMPLED`, else :data:`_SAMPLES` page-aligned ranges
    spread evenly over it (``mincore`` costs ~12 ms per GiB: a whole 40 GB file would take half a second)."""
    if size <= _SAMPLED:
        return [(lo, min(_CHUNK, size - lo)) for lo in range(0, size, _CHUNK)]
    step, n = size // _SAMPLES, _SAMPLED // _SAMPLES
    starts = [(k * step) - (k * step) % mmap.ALLOCATIONGRANULARITY for k in range(_SAMPLES)]
    return [(lo, min(n, size - lo)) for lo in starts]


def cached_fraction(path: str | Path) -> float | None:
    """The fraction of ``path``'s pages in the page cache, in [0, 1] (sampled in a large file); None where it
    cannot be told.

    Nothing of the file is read: its pages are mapped (libc ``mmap``, read-only), never touched, and unmapped.
    """
    page = mmap.PAGESIZE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        libc = _libc()
        resident = pages = 0
        for lo, n in _ranges(size):
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
            if addr in (None, _MAP_FAILED):
                return None
            try:
                vec = (ctypes.c_ubyte * -(-n // page))()
                if libc.mincore(addr, n, vec) != 0:
                    return None
                resident += bytes(vec).translate(_LOW_BIT).count(1)  # C speed
                pages += len(vec)
            finally:
                libc.munmap(addr, n)
        return resident / pages
    except (OSError, AttributeError):  # AttributeError: a libc without mincore (not Linux)
        return None
    finally:
        os.close(fd)


def drop_cached(path: str | Path) -> None:
    """Drop ``path``'s pages from the page cache (written back first): a cold file, for benchmarks and tests.
    A tmpfs keeps them (they are its storage)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def takes_direct_reads(path: str | Path) -> bool:
    """Whether ``path`` opens with ``O_DIRECT`` and gives an aligned read of its first block."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    buf = mmap.mmap(-1, DIRECT_ALIGN)  # anonymous maps are page-aligned
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def room_for(nbytes: int, available: int | None, headroom: int = HEADROOM) -> bool:
    """Whether ``available`` bytes of host memory (``MemAvailable``; None: unknown) hold ``nbytes`` more of page cache
    and still leave ``headroom``."""
    return available is not None and available >= nbytes + headroom


def write_through_cache(bundle_bytes: int, available: int | None, forced: str | None = None) -> bool:
    """Whether a conversion writes its ``bundle_bytes`` through the page cache (True) or around it (``O_DIRECT``).

    Through it where memory holds the bundle: the first start after ``convert`` then finds the bundle in the
    page cache. A conversion is bound by the disk's write rate either way (every byte is made durable before
    the bundle is published), so the copy into the cache costs CPU, not time, on a host with cores to spare.
    Around it where memory is short: the cache keeps what the host serves, and the first start is a cold one.
    ``forced``: ``$MARLIN_PACK_WRITE`` (``direct`` or ``cached``), for benchmarks.

    Raises:
        ValueError: ``forced`` is neither.
    """
    if forced:
        if forced not in ("direct", "cached"):
            raise ValueError(f"{WRITE_ENV}={forced!r}: expected 'direct' or 'cached'; unset it for the default")
        return forced == "cached"
    return room_for(bundle_bytes, available)
