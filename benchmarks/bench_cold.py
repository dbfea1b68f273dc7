"""Cold and first starts (issue 55): the disk's own rate beside every start that reads from it, in one sitting.

Runs on a GPU machine with vLLM 0.33.0 and marlin-pack installed, as root (to drop the page cache):

    python benchmarks/bench_cold.py --preset llama-70b --layers 40 --format awq --kernel machete --workdir /tmp/cold

The checkpoint and its bundle both live under ``--workdir`` (one disk: ``--layers`` keeps both on a 64 GiB
disk). In order, it prints:

* ``disk``: a plain ``O_DIRECT`` sequential read of the checkpoint's files, cold (``--streams`` readers of
  ``--block-mib`` blocks): the disk's rate, the bound of every cold row;
* ``convert``: ``--device cuda`` twice, around the page cache (``MARLIN_PACK_WRITE=direct``) and by the default
  rule (through it where memory holds the bundle); then the bundle's residency;
* ``first start after convert``, then ``warm`` (the page cache as the first start left it);
* ``prepacked cold``: page cache dropped, with the physical bound (bundle bytes / the disk's rate);
* ``ordinary cold`` and ``ordinary warm``: vLLM's default engine from the checkpoint;
* ``daemon fill cold``: ``marlin-pack daemon`` filled from the dropped bundle;
* ``verify cold``: ``marlin-pack verify`` of the dropped bundle (its BLAKE3 reads).

Every figure is vLLM's "Model loading took" (engines) or the daemon's fill line; the table at the end gives
the goals' ratios. Nothing is asserted: the figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_load import _daemon_rows, _engine  # this folder is on sys.path when run as a script


def drop_page_cache(paths: list[Path]) -> str:
    """Empty the page cache of ``paths``' files: the whole cache as root (``drop_caches``), else file by file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        from marlin_pack.io.residency import drop_cached

        for root in paths:
            for f in root.rglob("*"):
                if f.is_file():
                    drop_cached(f)
        return "fadvise DONTNEED per file (not root)"


def residency(root: Path) -> float:
    """The cached fraction of ``root``'s safetensors bytes."""
    from marlin_pack.io.residency import cached_fraction

    files = [f for f in root.rglob("*.safetensors")]
    total = sum(f.stat().st_size for f in files) or 1
    return sum((cached_fraction(f) or 0.0) * f.stat().st_size for f in files) / total


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


def _timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` around it: the finally blocks end the engines
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b")
    ap.add_argument("--layers", type=int, default=40, help="layers of the preset (40: ~24 GB each, both on a 64 GiB disk)")
    ap.add_argument("--format", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--kernel", default="machete", help="the bundle's layout (convert --kernel): what the GPU's vLLM picks")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cold"))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--block-mib", type=int, default=32)
    ap.add_argument("--attention-backend", default=os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN"))
    ap.add_argument("--skip", default="", help="rows to leave out (comma-separated): ordinary, daemon, verify")
    args = ap.parse_args()
    skip = set(args.skip.split(","))

    import dataclasses

    import torch

    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    shape = dataclasses.replace(PRESETS[args.preset], num_hidden_layers=args.layers)
    model, bundle = args.workdir / f"{args.preset}-{args.layers}-{args.format}", args.workdir / "bundle"
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    rows: dict[str, float | None] = {}
    try:
        t = time.perf_counter()
        (write_awq_checkpoint if args.format == "awq" else write_gptq_checkpoint)(
            model, shape, group_size=128, max_shard_bytes=5 << 30, device="cuda")
        torch.cuda.empty_cache()
        ckpt_gb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e9
        how = drop_page_cache([model])
        gbps, read_gb = direct_read_gbps(sorted(model.glob("*.safetensors")), args.streams, args.block_mib << 20, 16 << 30)
        rows["disk_gbps"] = gbps
        print(f"checkpoint {ckpt_gb:.1f} GB generated in {time.perf_counter() - t:.1f} s; page cache dropped ({how}); "
              f"O_DIRECT sequential read, {args.streams} x {args.block_mib} MiB: {gbps:.2f} GB/s ({read_gb:.1f} GB)", flush=True)

        convert = [sys.executable, "-m", "marlin_pack.cli", "convert", str(model), "-o", str(bundle), "--device", "cuda", "--tp", "1",
                   "--kernel", args.kernel, "--dtype", "float16", "--force"]
        rows["convert direct s"] = _timed(convert, {"MARLIN_PACK_WRITE": "direct"})
        print(f"convert around the page cache: {rows['convert direct s']:.1f} s; bundle {residency(bundle):.0%} cached", flush=True)
        rows["convert s"] = _timed(convert)
        bundle_gb = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e9
        cached = residency(bundle)
        print(f"convert (default): {rows['convert s']:.1f} s; bundle {bundle_gb:.1f} GB, {cached:.0%} cached", flush=True)

        extra = {"bundle": str(bundle)}
        attn = args.attention_backend
        rows["first start after convert"] = _engine(model, "prepacked", attn, extra)["model_loading_s"]
        rows["prepacked warm"] = _engine(model, "prepacked", attn, extra)["model_loading_s"]
        drop_page_cache([model, bundle])
        rows["prepacked cold"] = _engine(model, "prepacked", attn, extra)["model_loading_s"]
        if "ordinary" not in skip:
            drop_page_cache([model, bundle])
            rows["ordinary cold"] = _engine(model, "default", attn)["model_loading_s"]
            rows["ordinary warm"] = _engine(model, "default", attn)["model_loading_s"]
        if "daemon" not in skip:
            drop_page_cache([model, bundle])
            rows["daemon fill cold"] = _daemon_rows(model, bundle, attn, False, args.workdir, attach=False)["fill_s"]
        if "verify" not in skip:
            drop_page_cache([model, bundle])
            rows["verify cold s"] = _timed([sys.executable, "-m", "marlin_pack.cli", "verify", str(bundle), "--integrity-only"])
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    bound = bundle_gb / rows["disk_gbps"]
    print(f"\n{args.preset} ({args.layers} layers) {args.format} --kernel {args.kernel}, TP=1; checkpoint {ckpt_gb:.1f} GB and "
          f"bundle {bundle_gb:.1f} GB on one disk; O_DIRECT read {rows['disk_gbps']:.2f} GB/s; bound {bound:.2f} s")
    for key, value in rows.items():
        if key == "disk_gbps" or value is None:
            continue
        note = ""
        if key == "prepacked cold":
            note = f"  {value / bound:.2f} of the bound (goal <= 1.10 + 1 s: {1.1 * bound + 1:.2f} s)"
            if rows.get("ordinary cold"):
                note += f"; {value / rows['ordinary cold']:.2f} of ordinary cold"
        elif key == "first start after convert" and rows.get("prepacked warm"):
            note = f"  {value / rows['prepacked warm']:.2f} of warm (goal <= 1.5)"
        elif key == "daemon fill cold":
            note = f"  {value / bound:.2f} of the bound"
        print(f"  {key:28} {value:8.2f} s{note}")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
