"""What the ``processes`` io mode's helpers cost around the copy, beside a stand-in for vLLM building a model.

    python benchmarks/bench_helpers_start.py --gb 35 --tensors 640 --variants '4;4:CUDA_DEVICE_MAX_CONNECTIONS=8;2'

The loader starts the helpers (:class:`marlin_pack.vllm_plugin.copy_helpers.HelperPool`) just before
vLLM builds the model and ends them after the copies. In alternating rounds this prints: the stand-in
construction (``--tensors`` GPU allocations totalling ``--gb`` GB, a little Python work per tensor)
alone and while four helpers start; how much longer the helpers needed to be ready; and ending
them with ``close(wait=True)`` (waiting for their CUDA contexts to go) vs ``close(wait=False)`` (the
loader's way). Each ``--variants`` entry is a helper count, optionally with environment settings for
the helpers only (``N:KEY=VALUE,KEY=VALUE``).
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


def _variant(spec: str) -> tuple[int, dict[str, str]]:
    count, _, env = spec.partition(":")
    return int(count), dict(kv.split("=", 1) for kv in env.split(",") if kv)


def _measure(count: int, env: dict[str, str], tensors: int, each: int, rounds: int) -> str:
    alone, beside, ready, waited, not_waited = [], [], [], [], []
    n = 0
    for _ in range(rounds):
        alone.append(_construct(tensors, each))
        pool = HelperPool(count, torch.cuda.current_device(), env=env)
        beside.append(_construct(tensors, each))
        t = time.perf_counter()
        n = pool.ready()
        ready.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.close(wait=True)
        waited.append(time.perf_counter() - t)
        pool = HelperPool(count, torch.cuda.current_device(), env=env)
        pool.ready()
        t = time.perf_counter()
        pool.close(wait=False)
        not_waited.append(time.perf_counter() - t)
        pool.join()
    med = statistics.median
    return (f"{count} helpers ({n} ready){' ' + str(env) if env else ''}: construction alone {med(alone):.3f} s, "
            f"while the helpers start {med(beside):.3f} s (+{med(beside) - med(alone):.3f} s), helpers ready "
            f"{med(ready):.3f} s after it; close(wait=True) {med(waited):.3f} s, close(wait=False) {med(not_waited):.4f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=35.0)
    ap.add_argument("--tensors", type=int, default=640)
    ap.add_argument("--variants", default="4", help="';'-separated helper counts, each optionally N:KEY=VALUE,...")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    each = int(args.gb * 1e9 / args.tensors)
    _construct(args.tensors, each)  # warm the allocator and the driver
    print(f"{args.tensors} tensors, {args.gb:.0f} GB, median of {args.rounds} rounds:", flush=True)
    for spec in args.variants.split(";"):
        count, env = _variant(spec)
        print("  " + _measure(count, env, args.tensors, each, args.rounds), flush=True)


if __name__ == "__main__":
    main()
