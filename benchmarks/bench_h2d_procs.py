"""Does the registered reader scale past one process? (issue 12: read+copy at 40 GB/s)

    python benchmarks/bench_h2d_procs.py --dir /tmp/h2d --gb 16

One process's ``registered`` reader plateaus at 23-27 GB/s whatever its thread count. If the limit
is per process (the CUDA driver's locks around ``cudaHostRegister``, the process's page-table
lock), P processes each registering and copying 1/P of the file into the same GPU allocation
(opened through CUDA IPC) go faster together; if it is the machine's (IOMMU, memory), they do not.
Prints, in one run: the pinned host->GPU bandwidth, then for each ``P x T`` (processes x threads each)
the aggregate GB/s from the moment all processes are ready to the last one's end, and how long a
process took to become ready (torch import, CUDA context, IPC open), plus the start-up time of a
bare ``ctypes`` CUDA driver context (what a torch-free helper would cost).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_h2d import PIECE, _warm, _write, h2d_gbps  # noqa: E402

from marlin_pack.vllm_plugin.gpu_reader import CopyItem, ParallelReader  # noqa: E402


def _child(path: str, dst: torch.Tensor, lo: int, hi: int, threads: int, chunk_mb: int, populate: bool,
           ready, go, out) -> None:  # noqa: ANN001 - multiprocessing primitives
    t0 = time.monotonic()
    torch.cuda.synchronize()
    items = [CopyItem(off, min(PIECE, hi - off), dst[off : min(off + PIECE, hi)]) for off in range(lo, hi, PIECE)]
    out.put(("ready", time.monotonic() - t0))
    ready.set()
    go.wait()
    with ParallelReader(threads, chunk_mb << 20, "registered", populate=populate) as r:
        r.copy(path, items)
    torch.cuda.synchronize()
    out.put(("end", time.monotonic()))


def _run(path: Path, dst: torch.Tensor, procs: int, threads: int, chunk_mb: int, populate: bool) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    n = dst.numel()
    step = -(-n // procs // (chunk_mb << 20)) * (chunk_mb << 20)  # whole windows per process
    out = ctx.Queue()
    go = ctx.Event()
    readies, ps = [], []
    t_spawn = time.monotonic()
    for i in range(procs):
        lo, hi = i * step, min(n, (i + 1) * step)
        ev = ctx.Event()
        p = ctx.Process(target=_child, args=(str(path), dst, lo, hi, threads, chunk_mb, populate, ev, go, out))
        p.start()
        readies.append(ev)
        ps.append(p)
    for ev in readies:
        ev.wait()
    ready_s = time.monotonic() - t_spawn
    t0 = time.monotonic()
    go.set()
    ends = []
    while len(ends) < procs:
        kind, v = out.get()
        if kind == "end":
            ends.append(v)
    for p in ps:
        p.join()
    return n / (max(ends) - t0) / 1e9, ready_s


def _bare_driver_context_s() -> float:
    code = ("import ctypes; c = ctypes.CDLL('libcuda.so.1'); assert c.cuInit(0) == 0; d = ctypes.c_int(); "
            "assert c.cuDeviceGet(ctypes.byref(d), 0) == 0; x = ctypes.c_void_p(); "
            "assert c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d) == 0; assert c.cuCtxSetCurrent(x) == 0")
    t = time.monotonic()
    subprocess.run([sys.executable, "-S", "-c", code], check=True)
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h2d"))
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--configs", default="1x16,1x16p,2x8,2x8p,2x16p,4x4p,4x8p,8x4p")
    ap.add_argument("--chunk-mb", type=int, default=256)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "h2d.bin"
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    _write(path, nbytes)
    _warm(path)
    pinned = h2d_gbps(True)
    print(f"file {nbytes / 1e9:.1f} GB, page cache warm; pinned host->GPU {pinned:.1f} GB/s", flush=True)
    print(f"bare CUDA driver context in a fresh python -S: {_bare_driver_context_s():.2f} s", flush=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    want = None
    for cfg in args.configs.split(","):
        populate = cfg.endswith("p")
        procs, threads = (int(x) for x in cfg.removesuffix("p").split("x"))
        dst.zero_()
        torch.cuda.synchronize()
        rate, ready = _run(path, dst, procs, threads, args.chunk_mb, populate)
        check = int(dst[:: 1 << 20].sum())
        want = check if want is None else want
        print(f"registered {procs} processes x {threads:>2} threads{' +populate' if populate else '':10}: {rate:5.1f} GB/s"
              f" = {rate / pinned:.2f} of pinned; processes ready after {ready:.2f} s"
              f"{'' if check == want else '  (DIFFERENT BYTES)'}", flush=True)


if __name__ == "__main__":
    main()
