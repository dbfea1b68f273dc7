"""What page-locking a mapped bundle file costs, per file system, side by side in one run.

    python benchmarks/bench_pin.py --dirs /tmp,/dev/shm --gb 2
    mount -t tmpfs -o huge=always,size=48g tmpfs /mnt/hp   # as root: a tmpfs of 2 MiB pages
    python benchmarks/bench_pin.py --dirs /tmp,/dev/shm,/mnt/hp --gb 8

The ``registered`` and ``processes`` reader modes page-lock windows of the mapped bundle file
(``cuMemHostRegister``); their speed is set by that pinning, which walks the file's pages. How
many pages there are depends on the file system: tmpfs without ``huge=`` holds a file in 4 KiB
pages, ext4 (Linux 6.16 and later) and XFS in large folios, a ``huge=always`` tmpfs in 2 MiB pages.
For each directory this writes a file of ``--gb`` GB (kept for later runs), reads it into the
page cache, and times on one thread: populating the page-table entries of a fresh map
(``MADV_POPULATE_READ``, which the reader does before pinning), ``mlock`` + ``munlock`` (the
CPU side of pinning, measurable without a GPU) and, where ``libcuda.so.1`` loads and a GPU is
there, ``cuMemHostRegister`` (read-only) + ``cuMemHostUnregister`` of ``--window-mib`` windows.
Prints GB/s per step and each directory's ratio to the first. Standard library only (and the copy
helpers' own ctypes bindings).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

# The copy helpers' own driver and libc bindings (standard library only), so this measures what they do.
from marlin_pack.vllm_plugin.copy_helper_main import _MADV_POPULATE_READ, _REGISTER_FLAGS, _Driver, _libc


def _locking_libc() -> ctypes.CDLL:
    libc = _libc()
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _cuda() -> _Driver | None:
    """The CUDA driver with device 0's primary context current, or None without a GPU."""
    try:
        cu = _Driver()
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        cu("cuInit", 0)
        cu("cuDeviceGet", ctypes.byref(dev), 0)
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        cu("cuCtxSetCurrent", ctx)
    except (OSError, RuntimeError):
        return None
    return cu


def _file(directory: Path, size: int) -> Path:
    path = directory / f"bench-pin-{size >> 20}m.bin"
    if not path.exists() or path.stat().st_size != size:
        block = os.urandom(1 << 20) * 64
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    return path


def _timed(libc: ctypes.CDLL, path: Path, size: int, step: Callable[[int], None]) -> float:
    """GB/s of ``step(address)`` on a fresh read-only shared map of the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            t0 = time.perf_counter()
            step(address)
            return size / (time.perf_counter() - t0) / 1e9
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", default="/tmp,/dev/shm", help="comma-separated directories (file systems) to compare")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--window-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many per step")
    args = ap.parse_args()
    size = (int(args.gb * (1 << 30)) // (64 << 20)) * (64 << 20)
    window = args.window_mib << 20
    libc, cuda = _locking_libc(), _cuda()

    def populate(a: int) -> None:
        if libc.madvise(a, size, _MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")

    def lock(a: int) -> None:
        if libc.mlock(a, size) != 0:
            raise OSError(ctypes.get_errno(), "mlock (raise the memlock limit: ulimit -l unlimited)")
        libc.munlock(a, size)

    def register(a: int) -> None:
        assert cuda is not None
        for lo in range(0, size, window):
            n = min(window, size - lo)
            cuda("cuMemHostRegister", ctypes.c_void_p(a + lo), ctypes.c_size_t(n), ctypes.c_uint(_REGISTER_FLAGS))
            cuda("cuMemHostUnregister", ctypes.c_void_p(a + lo))

    steps: dict[str, Callable[[int], None]] = {"populate": populate, "mlock+munlock": lock}
    if cuda is not None:
        steps["register+unregister"] = register
    rows: dict[str, dict[str, float]] = {}
    for d in args.dirs.split(","):
        path = _file(Path(d), size)
        rows[d] = {name: max(_timed(libc, path, size, fn) for _ in range(args.repeats)) for name, fn in steps.items()}
        print(f"{d}: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rows[d].items()), flush=True)
    first = next(iter(rows.values()))
    print(f"\n{size / 1e9:.2f} GB file, one thread, best of {args.repeats}; GB/s (ratio to {args.dirs.split(',')[0]})")
    print(f"{'directory':24}" + "".join(f"{k:>28}" for k in steps))
    for d, r in rows.items():
        print(f"{d:24}" + "".join(f"{r[k]:>16.1f} ({r[k] / first[k]:7.2f}x)" for k in steps))


if __name__ == "__main__":
    main()
