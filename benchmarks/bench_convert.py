"""Conversion speed and memory, side by side with a plain safetensors read+write of the same checkpoint.

    python benchmarks/bench_convert.py                     # ~1 GB Llama-shaped AWQ + GPTQ, 3 rounds
    python benchmarks/bench_convert.py --preset llama-8b --formats awq --rounds 1 --device cuda
    python benchmarks/bench_convert.py --formats gptq8 --workdir /dev/shm/bc   # 8-bit GPTQ, bundle on tmpfs

Each measurement runs in a fresh subprocess (so peak memory is its own), alternating
baseline and conversion in an order that rotates each round (use a multiple of 3 rounds),
page cache warm. The baseline's write stays in the page cache; a bundle
is written durably (O_DIRECT and fsync), so a second baseline, ``read+write+fsync``, also syncs
its files: on a slow disk the sync, not the conversion, sets the convert time. Peak memory is the process's anonymous RSS
(heap), sampled every 10 ms; memory-mapped checkpoint pages are page cache, not heap,
and are reported separately as peak RSS.

A small VM's wall times vary from one process to the next (the same plain read+write was measured
at 0.6 and 1.4 s in one run), so besides the medians the script prints every round, the ratio of the
best rounds, and the CPU time each side used (user + system of the whole process, counted after importing torch).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, threading, time, resource
from pathlib import Path
peak = [0]
def sample():
    while True:
        for line in open('/proc/self/status'):
            if line.startswith('RssAnon:'):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
mode, src, dst, device = sys.argv[1:5]
import torch
start = resource.getrusage(resource.RUSAGE_SELF)  # CPU time from here: importing torch is not the work
t0 = time.perf_counter()
if mode in ('baseline', 'durable'):
    import os
    from safetensors.torch import load_file, save_file
    Path(dst).mkdir(parents=True)
    for f in sorted(Path(src).glob('*.safetensors')):
        save_file(load_file(f), Path(dst) / f.name, metadata={'format': 'pt'})
        if mode == 'durable':  # on disk before returning, as a bundle is written
            fd = os.open(Path(dst) / f.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
else:
    from marlin_pack import convert
    imported = time.perf_counter() - t0
    convert(src, dst, tp=(1,), device=device)
    if device.startswith('cuda'):
        torch.cuda.synchronize()
dt = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({'seconds': dt, 'import_s': imported if mode == 'convert' else 0.0, 'peak_anon': peak[0],
                  'maxrss': usage.ru_maxrss * 1024, 'cpu_s': usage.ru_utime + usage.ru_stime - start.ru_utime - start.ru_stime}))
"""


def _run(mode: str, src: Path, dst: Path, device: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(dst), device], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr}")
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _checkpoint(root: Path, fmt: str, preset: str, device: str) -> Path:
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    d = root / f"{preset}-{fmt}"
    if not (d / "config.json").exists():
        print(f"generating {d} ...", flush=True)
        kw = dict(max_shard_bytes=2 << 30, device=device, tokenizer=False)
        if fmt == "awq":
            write_awq_checkpoint(d, PRESETS[preset], **kw)
        else:
            write_gptq_checkpoint(d, PRESETS[preset], bits=8 if fmt == "gptq8" else 4, **kw)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-1gb")
    ap.add_argument("--formats", default="awq,gptq", help="comma-separated: awq, gptq (4-bit), gptq8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = ap.parse_args()
    args.workdir.mkdir(exist_ok=True)
    rows = []
    per_round: dict[str, dict[str, list[dict]]] = {}
    for fmt in args.formats.split(","):
        src = _checkpoint(args.workdir, fmt, args.preset, args.device)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        for f in src.glob("*.safetensors"):  # warm the page cache for both sides alike
            f.read_bytes()
        runs: dict[str, list[dict]] = {"baseline": [], "durable": [], "convert": []}
        modes = list(runs)
        for r in range(args.rounds):
            # The order rotates each round: on a VM, whatever runs right after a process that touched a lot
            # of memory (the conversion) was measured up to 3x slower (1.1-1.8 vs 0.5 s for a plain
            # read+write), so a fixed order would slow one side only.
            for mode in modes[r % 3 :] + modes[: r % 3]:
                device = args.device if mode == "convert" else "cpu"
                runs[mode].append(_run(mode, src, args.workdir / f"out-{mode}", device))
        base, durable, conv = runs["baseline"], runs["durable"], runs["convert"]
        b = statistics.median(r["seconds"] for r in base)
        d = statistics.median(r["seconds"] for r in durable)
        c = statistics.median(r["seconds"] for r in conv)
        imp = statistics.median(r["import_s"] for r in conv)
        rows.append((fmt, size, b, d, c, max(r["peak_anon"] for r in base), max(r["peak_anon"] for r in conv),
                     max(r["maxrss"] for r in conv), imp))
        per_round[fmt] = runs
    print(f"\npreset {args.preset}, {args.rounds} round(s), median seconds, convert on {args.device}")
    print(f"{'format':6} {'size GB':>8} {'read+write s':>13} {'+fsync s':>9} {'convert s':>10} {'ratio':>6} {'ratio fsync':>12} "
          f"{'heap r+w GB':>12} {'heap conv GB':>13} {'rss conv GB':>12}")
    for fmt, size, b, d, c, pb, pc, rc, _ in rows:
        print(f"{fmt:6} {size / 1e9:8.2f} {b:13.2f} {d:9.2f} {c:10.2f} {c / b:6.2f} {c / d:12.2f} "
              f"{pb / 1e9:12.2f} {pc / 1e9:13.2f} {rc / 1e9:12.2f}")
    # The convert column includes importing marlin_pack (pydantic schemas and all, ~0.1 s), as the CLI does.
    for fmt, _, b, d, c, _, _, _, imp in rows:
        print(f"{fmt:6} convert without importing marlin_pack: {c - imp:.2f} s (ratio {(c - imp) / b:.2f}, "
              f"fsync {(c - imp) / d:.2f}; import {imp:.2f} s)")
    print("every round (wall s), best of each side, and CPU time (user + system, median s):")
    for fmt, runs in per_round.items():
        best = {mode: min(r["seconds"] for r in rs) for mode, rs in runs.items()}
        cpu = {mode: statistics.median(r["cpu_s"] for r in rs) for mode, rs in runs.items()}
        for mode, rs in runs.items():
            print(f"{fmt:6} {mode:9} " + " ".join(f"{r['seconds']:.2f}" for r in rs) + f"   best {best[mode]:.2f}   cpu {cpu[mode]:.2f}")
        print(f"{fmt:6} best convert / best read+write {best['convert'] / best['baseline']:.2f}, "
              f"/ best read+write+fsync {best['convert'] / best['durable']:.2f}; "
              f"CPU time convert / read+write {cpu['convert'] / cpu['baseline']:.2f}")


if __name__ == "__main__":
    main()
