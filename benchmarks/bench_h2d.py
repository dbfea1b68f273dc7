"""Host-to-GPU bandwidth of the loader's reader modes, side by side with the hardware limits.

    python benchmarks/bench_h2d.py --dir /tmp/h2d --gb 16

On a GPU machine: writes one file of ``--gb`` GB, then in one run prints

* the pinned host -> GPU copy bandwidth (the PCIe limit the loader is measured against) and a
  pageable one (what a plain ``param.copy_(cpu_tensor)`` gets);
* page cache warm: ``ParallelReader`` (the ``marlin_prepacked`` loader's reader) in each
  ``io_mode`` at several thread counts and window sizes, each as GB/s and as a fraction of
  the pinned bandwidth;
* with ``--beside``, each warm configuration again with a stand-in for vLLM building a model running
  in this process beside the copy (Python work, small allocations and kernels, two large
  allocations like the embedding and the head), and that construction's time alone and beside the
  copy: what a copy configuration costs the engine's own steps next to it, not just its rate;
* page cache cold (``posix_fadvise(DONTNEED)`` on the file, which drops its clean pages):
  a plain sequential read, a BLAKE3 file digest (what a first start without stamps does),
  and the reader, so each can be compared with the plain read.

The file's destination is one GPU tensor cut into 64 MB pieces, like a bundle rank file's tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from marlin_pack.io.hashing import file_digest
from marlin_pack.vllm_plugin.copy_helpers import HelperPool
from marlin_pack.vllm_plugin.gpu_reader import CopyItem, ParallelReader

PIECE = 64 << 20


def _write(path: Path, nbytes: int) -> None:
    if path.exists() and path.stat().st_size == nbytes:
        return
    block = torch.randint(0, 256, (PIECE,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for off in range(0, nbytes, PIECE):
            f.write(block[: min(PIECE, nbytes - off)])
        f.flush()
        os.fsync(f.fileno())


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: Path) -> float:
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(PIECE)
        while (k := f.readinto(buf)) > 0:
            n += k
    return n / (time.perf_counter() - t) / 1e9


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


def _reader(
    path: Path, dst: torch.Tensor, mode: str, threads: int, chunk_mb: int, beside: Callable[[], float] | None = None
) -> tuple[float, float | None]:
    """One configuration's GB/s. ``mode`` is an ``io_mode``, ``registered+p`` (madvise-populate each
    window before pinning it) or ``processes/P[s][c]`` (P helper processes of ``threads`` threads each,
    started before the clock starts, as the loader starts them while vLLM builds the model; this
    process copies a share beside them unless ``s`` (solo); ``c``: the helpers run with
    ``CUDA_DEVICE_MAX_CONNECTIONS=8``, the driver's default, instead of HelperPool's 1; ``d``: they
    unregister their windows after answering (``--defer-unregister``); ``+S``: S staging threads per
    helper beside the registered ones, e.g. ``processes/4sd+2``; with 0 ``threads`` they stage everything;
    ``w``: the clock starts before the helpers do, so the figure includes their start, as the loader's does).
    With ``beside``, it runs in this thread while the copy runs on another; returns (GB/s, its seconds)."""
    n = dst.numel()
    items = [CopyItem(off, min(PIECE, n - off), dst[off : off + PIECE]) for off in range(0, n, PIECE)]
    mode, _, procs = mode.partition("/")
    procs, _, staged = procs.partition("+")
    populate = mode.endswith("+p")
    count = int(procs.rstrip("scdw") or 4)
    t_start = time.perf_counter()
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"} if "c" in procs else None
    helpers = (
        HelperPool(count, torch.cuda.current_device(), env=env, staged=int(staged or 0), defer_unregister="d" in procs)
        if mode == "processes" else None
    )
    try:
        if helpers is not None and "w" not in procs:
            helpers.ready()
        torch.cuda.synchronize()
        t = t_start if "w" in procs else time.perf_counter()
        done: list[float] = []
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                torch.cuda.set_device(dst.device)
                with ParallelReader(threads, chunk_mb << 20, mode.removesuffix("+p"), populate=populate, helpers=helpers,  # type: ignore[arg-type]
                                    own_share="s" not in procs) as r:
                    r.copy(path, items)
                torch.cuda.synchronize()
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)
            done.append(time.perf_counter() - t)

        thread = threading.Thread(target=copy)
        thread.start()
        construction = beside() if beside is not None else None
        thread.join()
        if errors:
            raise errors[0]
        rate = n / done[0] / 1e9
    finally:
        if helpers is not None:
            helpers.close()
    if helpers is not None and helpers.failures:
        raise RuntimeError(f"helpers failed, this process read their windows: {helpers.failures}")
    return rate, construction


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h2d"))
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--configs", default="staged:8:64,staged:16:64,staged:16:128,registered:4:256,registered:8:256,"
                    "registered:16:256,registered:8:64,registered:16:1024,hybrid:16:128,hybrid:16:256,hybrid:24:256,"
                    "processes/4:4:256,processes/4:8:256,processes/8:4:256,processes/2:8:256")
    ap.add_argument("--cold", default="staged:16:64,registered:16:256,hybrid:16:256")
    ap.add_argument("--beside", type=int, default=0, metavar="ROUNDS",
                    help="also run each warm configuration beside a stand-in model construction, this many rounds")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "h2d.bin"
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    t = time.perf_counter()
    _write(path, nbytes)
    print(f"file {path}: {nbytes / 1e9:.1f} GB written in {time.perf_counter() - t:.1f} s", flush=True)
    pinned, pageable = h2d_gbps(True), h2d_gbps(False)
    print(f"pinned host->GPU {pinned:.1f} GB/s; pageable host->GPU {pageable:.1f} GB/s", flush=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    print(f"page cache warm: plain sequential read {_warm(path):.1f} GB/s (1 thread)", flush=True)
    want = None
    for cfg in args.configs.split(","):
        mode, threads, chunk = cfg.split(":")
        try:
            rate, _ = _reader(path, dst, mode, int(threads), int(chunk))
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            print(f"warm  {cfg}: failed: {e}", flush=True)
            continue
        check = int(dst[:: 1 << 20].sum())
        want = check if want is None else want
        print(f"warm  {mode:10} threads {threads:>2} window {chunk:>4} MiB: {rate:5.1f} GB/s = {rate / pinned:.2f} of pinned"
              f"{'' if check == want else '  (DIFFERENT BYTES)'}", flush=True)
        if args.beside:
            alone, beside, rates = [], [], []
            for _ in range(args.beside):  # alternating: the construction alone, then beside the copy
                alone.append(_construct())
                rate, seconds = _reader(path, dst, mode, int(threads), int(chunk), beside=_construct)
                rates.append(rate)
                beside.append(seconds)
            med = statistics.median
            print(f"      beside a construction (median of {args.beside}): copy {med(rates):5.1f} GB/s = "
                  f"{med(rates) / pinned:.2f} of pinned; construction {med(alone):.3f} s alone, {med(beside):.3f} s beside "
                  f"(+{med(beside) - med(alone):.3f} s)", flush=True)
    for cfg in ["plain", "blake3", *args.cold.split(",")] if args.cold else []:  # --cold '': warm only
        _drop(path)
        t = time.perf_counter()
        if cfg == "plain":
            rate = _warm(path)
            plain = rate
        elif cfg == "blake3":
            file_digest(path)
            rate = nbytes / (time.perf_counter() - t) / 1e9
        else:
            mode, threads, chunk = cfg.split(":")
            try:
                rate, _ = _reader(path, dst, mode, int(threads), int(chunk))
            except Exception as e:  # noqa: BLE001
                print(f"cold  {cfg}: failed: {e}", flush=True)
                continue
        print(f"cold  {cfg:28}: {rate:5.1f} GB/s = {nbytes / rate / 1e9:.2f} s, {plain / rate:.2f}x the plain read time",
              flush=True)
    _drop(path)


if __name__ == "__main__":
    main()
