"""What the ``processes`` io mode's helpers cost around the copy, beside a stand-in for vLLM building a model.

    python benchmarks/bench_helpers_start.py --gb 35 --tensors 640

The loader starts the helpers (:class:`marlin_pack.vllm_plugin.copy_helpers.HelperPool`) just before
vLLM builds the model and ends them after the copies. In alternating rounds this prints: the stand-in
construction (``--tensors`` GPU allocations totalling ``--gb`` GB, a little Python work per tensor)
alone and while four helpers start; how much longer the helpers needed to be ready; and ending
them with ``close(wait=True)`` (waiting for their CUDA contexts to go) vs ``close(wait=False)`` (the
loader's way).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from marlin_pack.vllm_plugin.copy_helpers import HelperPool


def _construct(n: int, each: int) -> float:
    t = time.perf_counter()
    tensors = []
    for _ in range(n):
        tensors.append(torch.empty(each, dtype=torch.uint8, device="cuda"))
        sum(range(5000))  # vLLM's per-module Python work, roughly
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    torch.cuda.empty_cache()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=35.0)
    ap.add_argument("--tensors", type=int, default=640)
    ap.add_argument("--helpers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    each = int(args.gb * 1e9 / args.tensors)
    _construct(args.tensors, each)  # warm the allocator and the driver
    alone, beside, ready, waited, not_waited = [], [], [], [], []
    for _ in range(args.rounds):
        alone.append(_construct(args.tensors, each))
        pool = HelperPool(args.helpers, torch.cuda.current_device())
        beside.append(_construct(args.tensors, each))
        t = time.perf_counter()
        n = pool.ready()
        ready.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.close(wait=True)
        waited.append(time.perf_counter() - t)
        pool = HelperPool(args.helpers, torch.cuda.current_device())
        pool.ready()
        t = time.perf_counter()
        pool.close(wait=False)
        not_waited.append(time.perf_counter() - t)
        time.sleep(1.0)  # let the reaper finish before the next round
    med = statistics.median
    print(f"{args.tensors} tensors, {args.gb:.0f} GB, {args.helpers} helpers ({n} ready), median of {args.rounds} rounds:")
    print(f"  construction alone {med(alone):.3f} s; while the helpers start {med(beside):.3f} s "
          f"(+{med(beside) - med(alone):.3f} s); helpers ready {med(ready):.3f} s after it")
    print(f"  close(wait=True) {med(waited):.3f} s; close(wait=False) {med(not_waited):.4f} s")


if __name__ == "__main__":
    main()
