"""When each copy helper is ready, measured from its start, in a fresh process per round.

    python benchmarks/bench_helpers_ready.py --rounds 3 --variants '4;2;8;4:staged=4,stage_mib=16'

The loader starts its helpers (:class:`marlin_pack.vllm_plugin.copy_helpers.HelperPool`) once the
process's own CUDA context exists (it asks for the free GPU memory first), then waits for *all* of
them before handing out the windows. This prints, per variant and order, the seconds from the
pool's start until the first, the median and the last helper said it was ready, and how long the
process's own CUDA context took to come up: ``ctx-first`` (the loader's order today) or
``together`` (the context created while the helpers start). If the first helper is ready well
before the last, handing windows out as each helper becomes ready would start the copy sooner.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time


def _one(order: str, count: int, staged: int, stage_mib: int) -> dict:
    import torch

    from marlin_pack.vllm_plugin.copy_helpers import HelperPool

    ctx = 0.0
    if order == "ctx-first":
        t = time.perf_counter()
        torch.cuda.mem_get_info()
        ctx = time.perf_counter() - t
    start = time.perf_counter()
    pool = HelperPool(count, 0, staged=staged, stage_mib=stage_mib)
    if order == "together":
        t = time.perf_counter()
        torch.cuda.mem_get_info()
        ctx = time.perf_counter() - t
    pool._spawner.join()  # noqa: SLF001 - a benchmark looks at each helper's answer itself
    spawned = time.perf_counter() - start
    pending = {p.stdout: p for p in pool._procs}  # noqa: SLF001
    ready = []
    while pending:
        got, _, _ = select.select(list(pending), [], [], 30)
        if not got:
            break
        now = time.perf_counter() - start
        for f in got:
            line = f.readline()
            ready.append(now if '"ready"' in line else float("nan"))
            del pending[f]
    pool._ready = [True] * len(pool._procs)  # noqa: SLF001 - answered above
    pool.close(wait=True)
    return {"ctx": ctx, "spawned": spawned, "ready": sorted(ready)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="4;2;8")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        order, count, staged, mib = args.one.split(",")
        print(json.dumps(_one(order, int(count), int(staged), int(mib))))
        return 0
    variants = []
    for spec in args.variants.split(";"):
        count, _, rest = spec.partition(":")
        kw = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        variants.append((spec, int(count), int(kw.get("staged", 0)), int(kw.get("stage_mib", 64))))
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for spec, count, staged, mib in variants:
            for order in ("ctx-first", "together"):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{order},{count},{staged},{mib}"],
                    capture_output=True, text=True, env=os.environ, check=False,
                )
                if out.returncode != 0:
                    print(f"{spec} {order}: failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                results.setdefault((spec, order), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'helpers':<28} {'order':<10} {'ctx':>6} {'spawned':>8} {'first':>6} {'median':>7} {'last':>6}  (medians of rounds, s)")
    for (spec, order), rows in results.items():
        def med(f, rows=rows):  # noqa: ANN001, ANN202
            return statistics.median(f(r) for r in rows)
        print(
            f"{spec:<28} {order:<10} {med(lambda r: r['ctx']):6.3f} {med(lambda r: r['spawned']):8.3f} "
            f"{med(lambda r: r['ready'][0]):6.3f} {med(lambda r: statistics.median(r['ready'])):7.3f} "
            f"{med(lambda r: r['ready'][-1]):6.3f}  all: {[[round(x, 3) for x in r['ready']] for r in rows]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
