"""vLLM's model construction and the other CPU-runnable steps of an ``ipc_cache`` attach, timed on the CPU.

An ``ipc_cache`` engine (and the ``marlin_prepacked`` loader's "create" phase) spends most of its
"Model loading took" building the model on ``meta``. This reproduces that on a machine without a
GPU, for the shapes of ``bench_load.py``'s presets: it runs vLLM's real ``IpcModelLoader._build_model``
(marlin-pack's patches installed, as in an engine) on a daemon state standing in for the IPC
handles, and times its steps, the cache key that precedes it and the per-layer facts the
``marlin_prepacked`` create phase reads:

    python benchmarks/bench_construct.py --presets llama-70b,qwen3-30b-a3b --repeats 3 --rounds 2 [--profile 40]

Each preset gets a *sparse* checkpoint (every safetensors header, no data:
``write_*_checkpoint(device="meta")``), because vLLM reads the headers (GPTQ's
``modules_in_block_to_quantize`` lists every quantized module; the cache key hashes them).
Variants run in their own processes, alternating ``--rounds`` times: ``before`` without the patch
modules ``construct`` and ``cache_key`` of :mod:`marlin_pack.vllm_plugin.patches`, ``after`` with
them; with ``--baseline-tree DIR`` (e.g. ``git archive <commit> marlin_pack | tar -x -C DIR``)
``before`` imports that tree's marlin-pack instead (add ``--baseline-patches`` to keep all of that
tree's patches installed: two trees compared as engines run them). Per phase it prints the best first build of a
process (cold, like an engine's only build), the best build overall, and before:after.

CPU stand-ins (this benchmark only): the quantization and kernel-selection modules see an SM90
CUDA platform (Marlin's capability checks refuse a CPU), attention layers get vLLM's CPU
attention backend, the load device is ``cpu:0``, a one-rank gloo group stands for NCCL. The
daemon state is what a ``marlin_prepacked`` daemon exports: a meta-built model whose quantized
layers get the bundle's shapes (marlin-pack's conversion plan of the headers), post-processed and
exported by vLLM's ``export_entries``, with stride-0 CPU tensors (no memory) for the IPC handles.
Not reproduced: the socket exchange, opening IPC handles, anything on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_engine import configs, daemon_state, setup, write_checkpoint  # this folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
# build_model (IpcModelLoader._build_model) = construct + check_ipc_quant_support + apply_entries + post_process
# + materialize; cache_key precedes it in an attach, layer_facts follows construction in marlin_prepacked's create.
PHASES = ("cache_key", "construct", "check_ipc_quant_support", "apply_entries", "post_process", "materialize", "build_model",
          "layer_facts")


class _Phases:
    """Wall time of each step of ``IpcModelLoader._build_model``, taken by wrapping the names it calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: object, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)


def _attach(model_dir: str, state: object, phases: _Phases) -> dict[str, float]:
    """One ``ipc_cache`` engine build: vLLM's ``_build_model`` (marlin-pack's wrapper included), then the
    marlin_prepacked create phase's own per-layer reads (``layer_facts``) on the built model."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    from marlin_pack.vllm_plugin.engine import layer_facts, quantized_layers
    from marlin_pack.vllm_plugin.moe_engine import is_moe_layer, moe_layer_facts

    vc, mc = configs(model_dir, "ipc_cache")
    loader = IpcModelLoader.__new__(IpcModelLoader)
    loader.load_config, loader.mode = vc.load_config, "zero_copy"
    loader._watch_daemon = lambda: None  # no daemon socket here
    phases.seconds = {}
    with set_current_vllm_config(vc):  # as the GPU worker's load_model
        t0 = time.perf_counter()  # the key _fetch_entries sends (it hashes the checkpoint's headers)
        WeightCacheKey.from_model_config(mc, 1, 0, cache_config=vc.cache_config, kernel_config=vc.kernel_config)
        t1 = time.perf_counter()
        model = IpcModelLoader._build_model(loader, vc, mc, "", state)
        t2 = time.perf_counter()
    phases.seconds["cache_key"], phases.seconds["build_model"] = t1 - t0, t2 - t1
    t0 = time.perf_counter()
    for m in quantized_layers(model).values():
        (moe_layer_facts if is_moe_layer(m) else layer_facts)(m, skips_when_marked=True)
    phases.seconds["layer_facts"] = time.perf_counter() - t0
    return dict(phases.seconds)


def child(role: str, model_dir: str, variant: str, repeats: int, profile: int, state_path: str) -> dict[str, object]:
    """One process: ``daemon`` saves the daemon state to ``state_path``; ``engine`` loads it and times ``repeats``
    engine builds (the first one cold, as an engine's only build), then optionally profiles one more."""
    import torch

    setup(model_dir, variant)
    if role == "daemon":
        torch.save(daemon_state(model_dir), state_path)
        return {}
    from vllm.model_executor.model_loader.weight_cache import ipc_loader

    from marlin_pack.vllm_plugin import patches

    phases = _Phases()
    for attr, phase in (("initialize_model", "construct"), ("check_ipc_quant_support", "check_ipc_quant_support"),
                        ("process_weights_after_loading", "post_process"), ("_materialize_remaining_meta_tensors", "materialize")):
        phases.wrap(ipc_loader, attr, phase)
    phases.wrap(ipc_loader.IpcModelLoader, "_apply_entries", "apply_entries")
    state = torch.load(state_path, weights_only=False)
    runs = [_attach(model_dir, state, phases) for _ in range(repeats)]
    out: dict[str, object] = {"runs": runs, "entries": len(state.entries), "installed": patches.installed()}
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        _attach(model_dir, state, phases)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(profile)
        out["profile"] = text.getvalue()
    return out


# ----------------------------------------------------------------------------------------------- parent


def _run_child(role: str, model_dir: Path, variant: str, repeats: int, profile: int, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    state = model_dir / "daemon-state.pt"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", role, str(model_dir), variant, str(repeats), str(profile),
            str(state)]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"{variant} child failed for {model_dir.name} (exit {p.returncode})")
    return json.loads(line[len("RESULT "):])


def _row(name: str, before: float | None, after: float | None) -> str:
    ratio = f"{before / after:6.1f}x" if before and after else "      -"
    b, a = ("-" if v is None else f"{v:.3f}" for v in (before, after))
    return f"  {name:24} {b:>9} {a:>9} {ratio}"


def _report(preset: str, fmt: str, results: dict[str, list[dict]]) -> None:
    """Per phase: the best cold (first-in-process) build over the rounds, and the best build of all."""
    entries = results["after"][0]["entries"]
    print(f"\n{preset} {fmt}: {entries} daemon entries; seconds, before / after / before:after")
    for label, cold in (("first build in a process (cold), best of the rounds", True), ("best build", False)):
        print(f" {label}")
        for phase in PHASES:
            vals = [min(run.get(phase, 0.0) for r in results[v] for run in (r["runs"][:1] if cold else r["runs"]))
                    for v in ("before", "after")]
            print(_row(phase, *vals))
    for variant, rs in results.items():
        for r in rs:
            if r.get("profile"):
                print(f"\n--- profile {preset} {variant} ---\n{r['profile']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama-70b,qwen3-30b-a3b")
    ap.add_argument("--format", default="gptq", choices=("gptq", "awq"))
    ap.add_argument("--repeats", type=int, default=2, help="engine builds per process (the first is cold)")
    ap.add_argument("--rounds", type=int, default=1, help="before/after process pairs, alternating (the best counts)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N cumulative cProfile entries of one more build")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="marlin-pack checkout to run as 'before'")
    ap.add_argument("--baseline-patches", action="store_true",
                    help="with --baseline-tree: 'before' keeps every patch of its tree (compares two trees)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the sparse checkpoints go (default: a temp dir)")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        role, model_dir, variant, repeats, profile, state = args.child
        print("RESULT " + json.dumps(child(role, model_dir, variant, int(repeats), int(profile), state)), flush=True)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-construct-"))
    trees = {"before": args.baseline_tree or ROOT, "after": ROOT}
    for preset in args.presets.split(","):
        model_dir = write_checkpoint(workdir, preset, args.format)
        _run_child("daemon", model_dir, "after", 0, 0, ROOT)
        results: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(args.rounds):  # alternating, so that a busy spell of the machine hits both variants
            for variant, tree in trees.items():
                profile = args.profile if i == args.rounds - 1 else 0
                # cpu_engine.setup leaves out the construction patches for "before" only
                as_variant = "after" if variant == "before" and args.baseline_patches else variant
                results[variant].append(_run_child("engine", model_dir, as_variant, args.repeats, profile, tree))
        _report(preset, args.format, results)


if __name__ == "__main__":
    main()
