"""Host-to-GPU bandwidth of the loader's reader per I/O plan, side by side with the hardware limits, in one run.

    python benchmarks/bench_h2d.py --dir /tmp/h2d --gb 16
    python benchmarks/bench_h2d.py --gb 16 --beside 3 --configs 'registered:16:256,helpers/4:4:256,helpers/4+preload:4:256'
    python benchmarks/bench_h2d.py --configs '' --cold '' --pin /tmp,/dev/shm,/mnt/hp   # the page-locking section only
    mount -t tmpfs -o huge=always,size=48g tmpfs /mnt/hp   # as root: a tmpfs of 2 MiB pages, for --pin

Needs a CUDA GPU. Writes one file of ``--gb`` GB in ``--dir`` (kept for later runs), then prints

* ``limits``: the pinned host -> GPU copy bandwidth (what the loader is measured against) and a pageable
  one (what a plain ``param.copy_(cpu_tensor)`` gets);
* ``warm``, page cache warm: a plain sequential read, then :class:`marlin_pack.gpu.reader.ParallelReader`
  for each ``--configs`` entry (an :class:`marlin_pack.gpu.plan.IoPlan`), as GB/s and as a fraction of the
  pinned bandwidth. The file's destination is one GPU tensor cut into 64 MB pieces, like a rank file's
  tensors. A ``helpers`` configuration starts its :class:`marlin_pack.gpu.helpers.HelperPool` and waits for
  it before the clock starts (the loader starts it while vLLM builds the model); its row also says when the
  helpers were ready and how long ending them took (what the loader waits for after the copy);
* with ``--beside ROUNDS``, each warm configuration again beside a stand-in for vLLM building a model in
  this process (Python work, small allocations and kernels, two large allocations like the embedding and
  the head): the copy's rate then, and the construction's time alone and beside the copy;
* ``cold``, page cache cold (``posix_fadvise(DONTNEED)`` drops the file's clean pages): ``O_DIRECT``
  sequential reads with a few streams and request sizes (the disk's own rate), a plain sequential read, a
  BLAKE3 file digest (what a first start without stamps does) and the reader per ``--cold`` entry (``direct``
  is the plan's cold path), each against the disk's best read;
* with ``--pin DIRS``, ``pin``: what page-locking a mapped file costs per file system (tmpfs without
  ``huge=`` holds a file in 4 KiB pages, ext4 (Linux 6.16 and later) and XFS in large folios, a
  ``huge=always`` tmpfs in 2 MiB pages). Per directory, a file of ``--pin-gb`` GiB in the page cache, on one
  thread, best of ``--pin-repeats``: ``MADV_POPULATE_READ`` of a fresh map (the reader's step before
  pinning), ``mlock`` + ``munlock`` (the CPU side of pinning) and ``cudaHostRegister`` (read-only) +
  ``cudaHostUnregister`` of ``--pin-window-mib`` windows; GB/s and each directory's ratio to the first.

A configuration is ``MODE[/HELPERS][+FLAG...]:THREADS:WINDOW_MIB``: ``MODE`` is ``staged``, ``registered`` or
``helpers``; ``HELPERS`` the helper processes (helpers only, default 4) with ``THREADS`` threads each. Flags:
``nopopulate`` (registered: pin without ``MADV_POPULATE_READ`` first), ``defer`` (helpers: keep windows
page-locked until the job is answered, as a weight-cache daemon's fill does), ``preload`` (helpers:
``HelperPool.retain`` page-locks the whole file before the clock, as the loader's preload does while vLLM
sets up, so the copy itself does not page-lock), ``start`` (helpers: the clock starts before the pool does,
so the figure includes the helpers' start).

H200 host, 16 cores (docs/performance.md): pinned 55 GB/s; registered 22-26 GB/s; helpers 4 x 4 threads 35-37 GB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from marlin_pack.gpu.helpers import DEFAULT_PROCESSES, HelperPool
from marlin_pack.gpu.host_map import FileMap
from marlin_pack.gpu.plan import MODES, IoPlan
from marlin_pack.gpu.reader import CopyItem, ParallelReader, populate_read
from marlin_pack.io.hashing import file_digest
from marlin_pack.io.residency import drop_cached

PIECE = 64 << 20
_MIB = 1 << 20
_SAMPLE = 1 << 20  # one byte per MiB compared with the file after each copy
# cudaHostRegister flags, as the reader registers the bundle map: portable | read-only.
_REGISTER_FLAGS = 0x01 | 0x08
_FLAGS = {"staged": set(), "registered": {"nopopulate"}, "helpers": {"defer", "preload", "start"}, "direct": set()}

DEFAULT_CONFIGS = (
    "staged:8:64,staged:16:64,staged:16:128,"
    "registered:8:256,registered:16:256,registered:16:64,registered:16:1024,registered+nopopulate:16:256,"
    "helpers/4:4:256,helpers/4:8:256,helpers/2:8:256,helpers/8:4:256,"
    "helpers/4+defer:4:256,helpers/4+start:4:256,helpers/4+preload:4:256"
)
DEFAULT_COLD = "direct:8:32,direct:16:32,direct:8:64,direct:4:128,staged:8:64,registered:16:256,helpers/4:4:256"
# O_DIRECT sequential reads of the cold file, (streams, MiB per read): the disk's own rate, the bound of the cold rows.
DISK_READS = ((1, 32), (4, 32), (8, 32), (16, 32), (4, 128))


@dataclass(frozen=True)
class Config:
    """One ``--configs`` entry: the plan the reader obeys, and how the benchmark drives it."""

    text: str
    plan: IoPlan
    populate: bool = True  # ParallelReader(populate=...)
    start: bool = False  # helpers: the clock includes the pool's start


def parse_config(text: str) -> Config:
    """``MODE[/HELPERS][+FLAG...]:THREADS:WINDOW_MIB`` as a :class:`Config` (see the module docstring)."""
    try:
        head, threads_s, window_s = text.split(":")
        threads, window_mib = int(threads_s), int(window_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODE[/HELPERS][+FLAG...]:THREADS:WINDOW_MIB") from None
    mode, *flags = head.split("+")
    mode, slash, count_s = mode.partition("/")
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: mode {mode!r}, expected one of {', '.join(MODES)}")
    unknown = set(flags) - _FLAGS[mode]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: flag(s) {', '.join(sorted(unknown))} not for {mode} (its flags: {', '.join(sorted(_FLAGS[mode])) or 'none'})")
    if slash and mode != "helpers":
        raise argparse.ArgumentTypeError(f"{text!r}: /HELPERS is for helpers configurations only")
    if not (1 <= threads <= 64 and 1 <= window_mib <= 1024):
        raise argparse.ArgumentTypeError(f"{text!r}: threads must be 1..64 and the window 1..1024 MiB")
    if "preload" in flags and "start" in flags:
        raise argparse.ArgumentTypeError(f"{text!r}: preload page-locks before the clock, start puts the start on it: pick one")
    try:
        count = int(count_s) if count_s else DEFAULT_PROCESSES
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: helpers {count_s!r} is not a number") from None
    plan = IoPlan(
        mode, threads, window_mib * _MIB, helpers=count if mode == "helpers" else 0,  # type: ignore[arg-type]
        defer_unregister="defer" in flags, preload="preload" in flags, why=f"bench_h2d {text}",
    )
    return Config(text, plan, populate="nopopulate" not in flags, start="start" in flags)


def direct_read_gbps(files: list[Path], streams: int, block: int, limit: int) -> tuple[float, float]:
    """``O_DIRECT`` sequential reads of ``files`` (front to back, ``streams`` threads taking the next block of the
    next file; at most ``limit`` bytes): (GB/s, GB read). ``os.preadv`` releases the GIL."""
    jobs = []
    for f in files:
        size = f.stat().st_size
        jobs += [(f, lo, min(block, size - lo)) for lo in range(0, size, block)]
    jobs, taken, lock = jobs[: max(1, limit // block)], [0], threading.Lock()
    done = [0]

    def run() -> None:
        buf = mmap.mmap(-1, block)
        fds: dict[Path, int] = {}
        try:
            while True:
                with lock:
                    if taken[0] >= len(jobs):
                        return
                    f, lo, n = jobs[taken[0]]
                    taken[0] += 1
                fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY | os.O_DIRECT))
                aligned = -(-n // 4096) * 4096
                got = os.preadv(fd, [memoryview(buf)[:aligned]], lo)
                with lock:
                    done[0] += min(got, n)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    t = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    return done[0] / seconds / 1e9, done[0] / 1e9


def parse_configs(text: str) -> list[Config]:
    return [parse_config(t.strip()) for t in text.split(",") if t.strip()]


def _write(path: Path, nbytes: int) -> bool:
    """Write ``nbytes`` of random 64 MB blocks to ``path`` unless a file of that size is there; whether it wrote."""
    if path.exists() and path.stat().st_size == nbytes:
        return False
    block = torch.randint(0, 256, (PIECE,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for off in range(0, nbytes, PIECE):
            f.write(block[: min(PIECE, nbytes - off)])
        f.flush()
        os.fsync(f.fileno())
    return True


def _plain_read(path: Path) -> float:
    """GB/s of one thread reading the whole file."""
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(PIECE)
        while (k := f.readinto(buf)) > 0:
            n += k
    return n / (time.perf_counter() - t) / 1e9


def _file_sample(path: Path) -> int:
    """The sum of one byte per MiB of the file, to compare with the GPU copy's."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        return sum(mm[i] for i in range(0, len(mm), _SAMPLE))


def h2d_gbps(pinned: bool = True, gb: float = 4.0, reps: int = 3) -> float:
    """Host-to-GPU copy bandwidth from one ``gb`` GB host buffer (pinned or pageable), in GB/s."""
    n = int(gb * 1e9)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    rate = n * reps / (time.perf_counter() - t) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return rate


def _construct(modules: int = 640, large_gb: float = 2.1) -> float:
    """A stand-in for vLLM building a 70B-shaped model on the GPU (its quantized placeholders are memory-less
    stubs then): per module some Python work, a small allocation and now and then a small kernel, plus two
    large allocations (the embedding and the head). Returns its seconds."""
    t = time.perf_counter()
    kept = [torch.empty(int(large_gb * 1e9), dtype=torch.uint8, device="cuda") for _ in range(2)]
    for i in range(modules):
        kept.append(torch.empty(8192, dtype=torch.float16, device="cuda"))
        sum(range(5000))  # vLLM's per-module Python work, roughly
        if i % 8 == 0:
            kept.append(torch.ones(4096, device="cuda").mul_(2))  # e.g. the rotary cache, a norm's init
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    del kept
    torch.cuda.empty_cache()
    return seconds


@dataclass
class Run:
    rate: float  # GB/s
    construction: float | None  # seconds of the construction beside the copy (with beside)
    notes: list[str]
    sample: int  # _file_sample of the destination


def _run(path: Path, dst: torch.Tensor, cfg: Config, beside: Callable[[], float] | None = None) -> Run:
    """Copy the whole file into ``dst`` as ``cfg`` says; with ``beside``, that runs in this thread meanwhile."""
    n = dst.numel()
    items = [CopyItem(off, min(PIECE, n - off), dst[off : off + PIECE]) for off in range(0, n, PIECE)]
    plan, notes = cfg.plan, []
    dst.zero_()
    torch.cuda.synchronize()
    pool: HelperPool | None = None
    try:
        t_start = time.perf_counter()
        if plan.mode == "helpers":
            pool = HelperPool(plan.helpers, dst.device.index, defer_unregister=plan.defer_unregister)
            if not cfg.start:
                pool.ready()
                if plan.preload:  # as the loader's preload: the whole file page-locked in the helpers ahead
                    t = time.perf_counter()
                    got = pool.retain([path], plan.window)
                    dt = time.perf_counter() - t
                    notes.append(f"retained {got / 1e9:.1f} GB in {dt:.2f} s ({got / dt / 1e9:.1f} GB/s) before")
        t0 = t_start if cfg.start else time.perf_counter()
        done: list[float] = []
        errors: list[BaseException] = []
        modes: set[str] = set()

        def copy() -> None:
            try:
                torch.cuda.set_device(dst.device)
                with ParallelReader(plan, pool, populate=cfg.populate) as r:
                    r.copy(path, items)
                    torch.cuda.synchronize()
                    done.append(time.perf_counter() - t0)
                    modes.update(r.modes_used)
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

        thread = threading.Thread(target=copy)
        thread.start()
        construction = beside() if beside is not None else None
        thread.join()
        if errors:
            raise errors[0]
        if pool is not None:
            t = time.perf_counter()
            if plan.preload:  # the loader with preload: the helpers let go of our memory and pages (they exit later)
                pool.let_go()
            else:  # the loader's own pool: their CUDA contexts must be gone before vLLM measures the memory
                pool.close(wait=False)
                pool.join()
            ended = time.perf_counter() - t
            ready = f"ready {pool.ready_after:.2f} s after their start, " if pool.ready_after is not None else ""
            notes.insert(0, f"helpers {ready}{'let go' if plan.preload else 'exited'} {ended:.2f} s after")
            if pool.failures:
                notes.append(f"{len(pool.failures)} helper failure(s), this process read what they left: {pool.failures[-1]}")
        if modes != {plan.mode}:
            notes.append(f"modes used: {'/'.join(sorted(modes)) or '-'}")
    finally:
        if pool is not None:
            pool.close()
    return Run(n / done[0] / 1e9, construction, notes, int(dst[::_SAMPLE].sum()))


def _row(kind: str, what: str, rate: float, tail: str) -> str:
    return f"{kind:6}{what:36} {rate:6.2f} GB/s{tail}"


# -- the --pin section ------------------------------------------------------------------------------------------


def _fs_of(directory: Path) -> str:
    """The file system holding ``directory``, as ``/proc/self/mounts`` names it (tmpfs with its ``huge=``)."""
    real, best = os.path.realpath(directory), ("", "?", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _, point, fstype, options, *_ = line.split()
                point = point.replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype, options)
    except OSError:
        return "?"
    huge = [o for o in best[2].split(",") if o.startswith("huge=")]
    return best[1] + (f" {huge[0]}" if best[1] == "tmpfs" and huge else "")


def _pin_file(directory: Path, size: int) -> Path:
    path = directory / f"bench-pin-{size >> 20}m.bin"
    if not path.exists() or path.stat().st_size != size:
        block = os.urandom(_MIB) * 64
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
    with open(path, "rb") as f:  # into the page cache
        while f.read(PIECE):
            pass
    return path


def _pin_section(dirs: list[str], size: int, window: int, repeats: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    cudart = torch.cuda.cudart()

    def populate(a: int) -> None:
        populate_read(a, size)

    def lock(a: int) -> None:
        if libc.mlock(a, size) != 0:
            raise OSError(ctypes.get_errno(), "mlock (raise the memlock limit: ulimit -l unlimited)")
        libc.munlock(a, size)

    def register(a: int) -> None:
        for lo in range(0, size, window):
            err = cudart.cudaHostRegister(a + lo, min(window, size - lo), _REGISTER_FLAGS)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            cudart.cudaHostUnregister(a + lo)

    steps: dict[str, Callable[[int], None]] = {"populate": populate, "mlock+munlock": lock, "register+unregister": register}

    def timed(path: Path, step: Callable[[int], None]) -> float:
        """GB/s of ``step(address)`` on a fresh read-only shared map of the file."""
        fd = os.open(path, os.O_RDONLY)
        try:
            mapping = FileMap(fd, size)
        finally:
            os.close(fd)
        try:
            t = time.perf_counter()
            step(mapping.base)
            return size / (time.perf_counter() - t) / 1e9
        finally:
            mapping.close()

    rows: dict[str, dict[str, float]] = {}
    for d in dirs:
        try:
            path = _pin_file(Path(d), size)
            rows[d] = {name: max(timed(path, fn) for _ in range(repeats)) for name, fn in steps.items()}
        except (OSError, RuntimeError) as e:
            print(f"pin   {d} ({_fs_of(Path(d))}): failed: {e}", flush=True)
            continue
        print(f"pin   {d} ({_fs_of(Path(d))}): " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rows[d].items()), flush=True)
    if not rows:
        return
    first_dir, first = next(iter(rows.items()))
    print(f"pin   {size / 1e9:.2f} GB file, {window >> 20} MiB windows, one thread, best of {repeats}; GB/s (ratio to {first_dir})")
    print(f"pin   {'directory':34}" + "".join(f"{k:>28}" for k in steps))
    for d, r in rows.items():
        print(f"pin   {d + ' (' + _fs_of(Path(d)) + ')':34}" + "".join(f"{r[k]:>16.1f} ({r[k] / first[k]:7.2f}x)" for k in steps))


# -- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h2d"), help="where the test file h2d.bin is written (default: %(default)s)")
    ap.add_argument("--gb", type=float, default=16.0, help="the test file's size in GB (default: %(default)s)")
    ap.add_argument("--configs", type=parse_configs, default=DEFAULT_CONFIGS, metavar="CONFIG,...",
                    help="page cache warm reader configurations, MODE[/HELPERS][+FLAG...]:THREADS:WINDOW_MIB; '' for none "
                    "(default: %(default)s)")
    ap.add_argument("--cold", type=parse_configs, default=DEFAULT_COLD, metavar="CONFIG,...",
                    help="page cache cold reader configurations (after a plain read and a BLAKE3 digest); '' for no cold "
                    "rows (default: %(default)s)")
    ap.add_argument("--beside", type=int, default=0, metavar="ROUNDS",
                    help="also run each warm configuration beside a stand-in model construction, this many rounds")
    ap.add_argument("--pin", type=lambda s: [d for d in s.split(",") if d], default=[], metavar="DIR,...",
                    help="also measure page-locking a mapped file in each directory (file system), e.g. /tmp,/dev/shm")
    ap.add_argument("--pin-gb", type=float, default=2.0, help="--pin: the file's size in GiB (default: %(default)s)")
    ap.add_argument("--pin-window-mib", type=int, default=256, help="--pin: bytes per cudaHostRegister (default: %(default)s)")
    ap.add_argument("--pin-repeats", type=int, default=3, help="--pin: best of this many per step (default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_h2d.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured")

    pinned, pageable = h2d_gbps(True), h2d_gbps(False)
    print(f"limits pinned host->GPU {pinned:.1f} GB/s; pageable host->GPU {pageable:.1f} GB/s", flush=True)
    if args.configs or args.cold:
        args.dir.mkdir(parents=True, exist_ok=True)
        path = args.dir / "h2d.bin"
        nbytes = int(args.gb * 1e9) // 4096 * 4096
        t = time.perf_counter()
        wrote = _write(path, nbytes)
        print(f"file  {path} ({_fs_of(args.dir)}): {nbytes / 1e9:.1f} GB "
              f"{f'written in {time.perf_counter() - t:.1f} s' if wrote else 'already there'}", flush=True)
        print(_row("warm", "plain sequential read, 1 thread", _plain_read(path), ""), flush=True)
        want = _file_sample(path)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def one(kind: str, cfg: Config, plain: float | None = None) -> bool:
            """One row: ``cfg``'s rate against the pinned bandwidth (cold: also its seconds against the ``plain`` read)."""
            try:
                run = _run(path, dst, cfg)
            except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
                print(f"{kind:6}{cfg.text:36} failed: {type(e).__name__}: {e}", flush=True)
                return False
            cold = [] if plain is None else [f"{nbytes / run.rate / 1e9:.2f} s, {plain / run.rate:.2f}x the disk's best read time"]
            notes = [*cold, *run.notes, *([] if run.sample == want else ["DIFFERENT BYTES"])]
            print(_row(kind, cfg.text, run.rate, f" = {run.rate / pinned:.2f} of pinned" + "".join(f"; {x}" for x in notes)), flush=True)
            return True

        for cfg in args.configs:
            if not one("warm", cfg) or not args.beside:
                continue
            alone: list[float] = []
            beside: list[float] = []
            rates: list[float] = []
            try:
                for _ in range(args.beside):  # alternating: the construction alone, then beside the copy
                    alone.append(_construct())
                    run = _run(path, dst, cfg, beside=_construct)
                    rates.append(run.rate)
                    beside.append(run.construction or 0.0)
            except Exception as e:  # noqa: BLE001
                print(f"      beside a construction: failed: {type(e).__name__}: {e}", flush=True)
                continue
            med = statistics.median
            print(f"      beside a construction (median of {args.beside}): copy {med(rates):5.1f} GB/s = "
                  f"{med(rates) / pinned:.2f} of pinned; construction {med(alone):.3f} s alone, {med(beside):.3f} s beside "
                  f"(+{med(beside) - med(alone):.3f} s)", flush=True)
        if args.cold:
            disk = 0.0
            for streams, mib in DISK_READS:
                drop_cached(path)
                rate, _ = direct_read_gbps([path], streams, mib << 20, nbytes)
                disk = max(disk, rate)
                print(_row("cold", f"O_DIRECT read, {streams} x {mib} MiB", rate, f" = {nbytes / rate / 1e9:.2f} s"), flush=True)
            drop_cached(path)
            plain = _plain_read(path)
            print(_row("cold", "plain sequential read, 1 thread", plain, f" = {nbytes / plain / 1e9:.2f} s"), flush=True)
            plain = max(plain, disk)  # the cold rows are measured against the disk's best read
            drop_cached(path)
            t = time.perf_counter()
            file_digest(path)
            rate = nbytes / (time.perf_counter() - t) / 1e9
            tail = f" = {nbytes / rate / 1e9:.2f} s, {plain / rate:.2f}x the disk's best read time"
            print(_row("cold", "BLAKE3 file digest", rate, tail),
                  flush=True)
            for cfg in args.cold:
                drop_cached(path)
                one("cold", cfg, plain)
            drop_cached(path)
        del dst
        torch.cuda.empty_cache()
    if args.pin:
        size = (int(args.pin_gb * (1 << 30)) // PIECE) * PIECE
        _pin_section(args.pin, size, args.pin_window_mib << 20, args.pin_repeats)


if __name__ == "__main__":
    main()
