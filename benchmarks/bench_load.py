"""Engine model-loading time: ordinary loading (Marlin forced) vs ``--load-format marlin_prepacked``.

Runs on a GPU machine with vLLM 0.33.0 and marlin-pack installed:

    python benchmarks/bench_load.py --preset llama-70b --formats awq,gptq --workdir /tmp/bench

For each format it generates a synthetic checkpoint (random packed words are valid quantized
values), converts it (``--device cuda``), warms the page cache with both the checkpoint and the
bundle, then starts one engine per load format in its own subprocess, side by side, and reports
vLLM's "Model loading took" seconds, the ratio, the bundle read bandwidth the loader logged, and
the peak GPU memory allocated by torch during model loading.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
model, mode, attn, extra = sys.argv[1:5]
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
import marlin_pack.vllm_plugin as plugin
plugin.register()
from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader
peak = {}
def wrap(cls):
    orig = cls.load_model
    def load_model(self, *a, **k):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        t = time.perf_counter(); m = orig(self, *a, **k); torch.cuda.synchronize()
        peak['load_model_s'] = time.perf_counter() - t
        peak['peak_alloc_gb'] = torch.cuda.max_memory_allocated() / 1e9
        peak['weights_gb'] = (torch.cuda.memory_allocated() - base) / 1e9
        return m
    cls.load_model = load_model
wrap(BaseModelLoader); wrap(MarlinPrepackedLoader)
from vllm import LLM, SamplingParams
kw = dict(model=model, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.92,
          attention_backend=attn, dtype='float16', skip_tokenizer_init=True, seed=0)
if mode == 'ordinary':
    kw['linear_backend'] = 'marlin'
else:
    kw['load_format'] = 'marlin_prepacked'
    if json.loads(extra):
        kw['model_loader_extra_config'] = json.loads(extra)
t = time.perf_counter()
llm = LLM(**kw)
start_s = time.perf_counter() - t
out = llm.generate([{'prompt_token_ids': [1, 2, 3, 4]}], SamplingParams(max_tokens=4, temperature=0))
print('RESULT ' + json.dumps({'engine_start_s': start_s, 'tokens': list(out[0].outputs[0].token_ids), **peak}))
"""


def _engine(model: Path, mode: str, attn: str, extra: dict | None = None) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    p = subprocess.run([sys.executable, "-c", CHILD, str(model), mode, attn, json.dumps(extra or {})],
                       capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"{mode} engine failed (exit {p.returncode})")
    result = json.loads(line[len("RESULT "):])
    log = p.stdout + p.stderr  # vLLM logs to stdout/stderr; parse its own timing line
    m = re.search(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds", log)
    result["model_loading_s"] = float(m.group(2)) if m else None
    result["model_loading_gib"] = float(m.group(1)) if m else None
    result["marlin_pack_log"] = [x[x.index("marlin-pack: validate"):] for x in log.splitlines() if "marlin-pack: validate" in x]
    return result


def _warm(paths: list[Path]) -> float:
    n = 0
    for root in paths:
        for f in sorted(root.rglob("*.safetensors")):
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(64 << 20):
                    n += len(chunk)
    return n / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b")
    ap.add_argument("--formats", default="awq,gptq")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--attention-backend", default=os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN"))
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and bundles (disk!)")
    ap.add_argument("--tuned", default='{"io_threads": 8, "chunk_mb": 64}',
                    help="extra config of a third engine, marlin_prepacked with these loader options ('' to skip)")
    args = ap.parse_args()

    import torch

    from marlin_pack.conversion import convert
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    rows = []
    for fmt in args.formats.split(","):
        model = args.workdir / f"{args.preset}-{fmt}"
        t = time.perf_counter()
        writer = write_awq_checkpoint if fmt == "awq" else write_gptq_checkpoint
        writer(model, PRESETS[args.preset], group_size=128, max_shard_bytes=5 << 30, device="cuda")
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        manifest = convert(model, tp_sizes=(1,), dtype="float16", device="cuda", force=True)
        conv_s = time.perf_counter() - t
        rank_bytes = manifest.tensor_parallel[0].ranks[0].file.size
        torch.cuda.empty_cache()
        warm_gb = _warm([model])
        print(f"{fmt}: generated in {gen_s:.1f} s, converted in {conv_s:.1f} s (cuda), warmed {warm_gb:.1f} GB", flush=True)
        ordinary = _engine(model, "ordinary", args.attention_backend)
        prepacked = _engine(model, "prepacked", args.attention_backend)
        same = ordinary["tokens"] == prepacked["tokens"]
        rows.append((fmt, warm_gb, rank_bytes, conv_s, ordinary, prepacked, same))
        print(json.dumps({"format": fmt, "ordinary": ordinary, "prepacked": prepacked}, indent=1), flush=True)
        if args.tuned:
            tuned = _engine(model, "prepacked", args.attention_backend, json.loads(args.tuned))
            rows.append((f"{fmt}*", warm_gb, rank_bytes, conv_s, ordinary, tuned, ordinary["tokens"] == tuned["tokens"]))
            print(json.dumps({"format": fmt, "tuned": args.tuned, "prepacked": tuned}, indent=1), flush=True)
        if not args.keep:
            shutil.rmtree(model)
    print(f"\n{args.preset}, TP=1, page cache warm, one engine per load format (subprocess each)")
    print(f"{'format':6} {'ckpt+bundle GB':>14} {'ordinary s':>10} {'prepacked s':>11} {'ratio':>6} "
          f"{'peak GPU ord GB':>15} {'peak GPU pre GB':>15} {'same tokens':>11} {'load_model ord/pre s':>20}")
    if args.tuned:
        print(f"(rows marked * use --model-loader-extra-config {args.tuned})")
    for fmt, gb, _, _, o, p, same in rows:
        ratio = (p["model_loading_s"] or float("nan")) / (o["model_loading_s"] or float("nan"))
        print(f"{fmt:6} {gb:14.1f} {o['model_loading_s'] or -1:10.2f} {p['model_loading_s'] or -1:11.2f} {ratio:6.3f} "
              f"{o['peak_alloc_gb']:15.1f} {p['peak_alloc_gb']:15.1f} {str(same):>11} "
              f"{o['load_model_s']:9.2f}/{p['load_model_s']:.2f}")
        for line in p["marlin_pack_log"]:
            print(f"  {fmt} {line}")
        bw = re.search(r"\(([\d.]+) GB/s\)", " ".join(p["marlin_pack_log"]))
        if bw:
            print(f"  {fmt} bundle read bandwidth logged by the loader: {bw.group(1)} GB/s")


if __name__ == "__main__":
    main()
