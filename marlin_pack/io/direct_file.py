"""A file written front to back that bypasses the page cache (``O_DIRECT``) where the file system allows it.

Why. A conversion writes its bundle once and fsyncs it before publishing, so every byte goes to
the disk before ``convert`` returns either way. Through the page cache each byte is first copied
into freshly allocated cache pages: on the 2-core CI-class VM that copy cost 0.3-2.3 s of CPU
per GB (fresh pages are dear on a VM that hands freed memory back to its host), as much as the
whole Marlin repack, and the fsync after it waited another 0.35-0.5 s. Written with ``O_DIRECT``
from an aligned staging buffer, the same GB took 0.63-0.74 s of wall time and ~0.05 s of CPU,
with nothing left to fsync. The cost: the bundle is not in the page cache afterwards (a first
load reads it from the disk).

``O_DIRECT`` needs the buffer address, the file offset and the length aligned to the device's
logical block; data is gathered into a page-aligned staging buffer and written in whole chunks,
the last chunk padded and the file truncated to its real size at the end. Where the file system
refuses ``O_DIRECT`` (tmpfs, some FUSE and network file systems: ``EINVAL`` on open or on the
first write), or a write comes back short, the file simply continues through the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from pathlib import Path

import numpy as np

__all__ = ["SequentialFile"]

_ALIGN = 4096  # covers 512-byte and 4K logical blocks
_CHUNK = 8 << 20  # measured: 8 and 32 MiB write at the same speed; smaller keeps many rank files cheap


class SequentialFile:
    """Write ``path`` (created or truncated) from front to back; :meth:`close` makes it durable.

    Args:
        path: the file.
        direct: try ``O_DIRECT`` (see the module docstring); False: through the page cache.

    Not thread-safe: one writer thread at a time.
    """

    def __init__(self, path: Path, direct: bool = True) -> None:
        self.path = path
        self.size = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        fd = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT
                    raise
        self._fd: int = os.open(path, flags, 0o666) if fd is None else fd
        self._closed = False
        # Anonymous mappings are page-aligned, which O_DIRECT needs of the memory it writes from.
        self._stage = mmap.mmap(-1, _CHUNK) if self.direct else None
        # The staging map as a numpy array: numpy copies into it without the GIL (a memoryview slice assignment holds it).
        self._stage_array = np.frombuffer(self._stage, dtype=np.uint8) if self._stage is not None else None
        self._fill = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        if not self.direct:
            self._write_all(mv)
            return
        assert self._stage_array is not None
        source = np.frombuffer(mv, dtype=np.uint8)
        pos = 0
        while pos < len(mv):
            n = min(len(mv) - pos, _CHUNK - self._fill)
            np.copyto(self._stage_array[self._fill : self._fill + n], source[pos : pos + n])
            self._fill += n
            pos += n
            if self._fill == _CHUNK:
                self._flush_stage()
            if not self.direct:  # fell back to the page cache while flushing: write the rest directly
                self._write_all(mv[pos:])
                return

    def _flush_stage(self, final: bool = False) -> None:
        """Write the staged bytes (whole chunks; at the end, padded to the alignment)."""
        assert self._stage_array is not None
        n = self._fill
        if final and self.direct and n % _ALIGN:
            padded = n + (-n % _ALIGN)
            self._stage_array[n:padded] = 0
            n = padded
        self._fill = 0
        self._write_all(memoryview(self._stage_array[:n]))

    def _write_all(self, mv: memoryview) -> None:
        while len(mv):
            try:
                n = os.write(self._fd, mv)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._stop_direct()  # the file system opened with O_DIRECT but refuses its writes
                continue
            mv = mv[n:]
            if len(mv) and self.direct:
                self._stop_direct()  # a short write leaves the offset unaligned: go on through the page cache

    def _stop_direct(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write what is staged, cut the padding off, fsync and close."""
        if self._stage_array is not None:
            if self._fill:
                self._flush_stage(final=True)
            os.ftruncate(self._fd, self.size)  # the last chunk's padding (a no-op when there was none)
        os.fsync(self._fd)
        self._release()

    def abort(self) -> None:
        """Close without writing what is staged (the caller removes the file)."""
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._stage_array = None  # its export of the staging map must go before the map closes
        if self._stage is not None:
            self._stage.close()
