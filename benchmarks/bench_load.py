"""Every start path of a quantized model, side by side in one sitting, with vLLM's own timings.

Runs on a GPU machine with vLLM 0.33.0 and marlin-pack installed:

    python benchmarks/bench_load.py --preset llama-70b --formats gptq,awq --workdir /tmp/bench \\
        --bundle-root /dev/shm/bench --daemon gptq

For each format it generates a synthetic checkpoint on the GPU (random packed words are valid
quantized values) under ``--workdir``, converts it (``--device cuda``, timed, beside a plain
durable write of as many bytes to the same disk: the bound of a conversion) into a bundle under
``--bundle-root``, warms the page cache with both, then starts, one engine per process:

* ``ordinary``: vLLM's own loading of the checkpoint, Marlin forced (``--ordinary default`` adds vLLM's
  default kernel choice, Machete on SM90: what a user runs without marlin-pack);
* ``--kernel marlin,machete``: a bundle per kernel layout (``convert --kernel``), each started below;
* ``prepacked``: ``--load-format marlin_prepacked``, once per ``--io`` configuration: a JSON object whose loader
  keys (``bundle``, ``fallback``, ``verify``, ``preload``) go to ``--model-loader-extra-config`` and whose other
  keys (I/O plan fields: ``mode``, ``threads``, ``window_mib``, ``helpers``, ...) to ``MARLIN_PACK_IO``;
* with ``--daemon FMT``: ``marlin-pack daemon`` filled from the bundle, then engines with
  ``--load-format ipc_cache`` attaching to it, one after the other (``--attaches N``, 2 by default); with
  ``--ablate construct,cache_key`` each is followed by one without those patch modules of
  ``marlin_pack.vllm_plugin.patches`` (before/after side by side in one sitting). Each attach prints the
  steps of its ``load_model`` (the daemon's answer, construction, mapping, post-processing).

``--serve`` times the same serving workloads after every start (prefill 16 x 1024 tokens, decode 64 and 256
sequences x 64 tokens; the engines in vLLM's default execution, torch.compile and CUDA graphs, unless ``--eager``;
each run once untimed, then the best of three) and prints them beside the
default ordinary engine's, with the kernels vLLM logged. The Machete sitting of issue 49:

    python benchmarks/bench_load.py --formats awq,gptq --ordinary default,marlin --kernel marlin,machete --serve \\
        --daemon gptq --workdir /dev/shm/bench

It prints vLLM's "Model loading took" seconds for each engine, the ratios to ordinary, the
loader's own phase line, the daemon's fill time, the peak GPU memory torch allocated during
loading, and, measured in the same run, the pinned host-to-GPU bandwidth that the loader's
read+copy rate is compared with. ``--profile`` adds the top of a cProfile of the loader's
``load_model`` for the prepacked and attach engines. ``--py-spy DIR`` samples every
engine and daemon process (and its children) with ``py-spy record`` (the binary from ``PY_SPY`` or
``PATH``; it is a static one, so it can be carried to the GPU machine), keeps the collapsed stacks in
``DIR`` and prints where the stacks under the loader spent their samples: for the daemon's fill,
which ``--profile`` does not reach.

The daemon's line also says how long after its run began the fill started (what vLLM's daemon
initialisation took), and how long after launch the daemon listened. Start-up figures move by
0.1-0.3 s from one engine to the next on that machine: ``--rounds N`` runs every prepacked and
daemon configuration N times, interleaved, and prints each one's median and best. ``--keep`` then
``--reuse`` (same machine) skip the generation and the conversion, and leave what they reuse in place; ``--io none`` starts no
prepacked engine.

``--preset qwen3-30b-a3b`` is a mixture-of-experts model shaped like Qwen3-30B-A3B (48 layers of
128 experts, 8 active; about 17 GB at 4 bits; ``marlin_pack.testing.synthetic_moe``), e.g.

    python benchmarks/bench_load.py --preset qwen3-30b-a3b --formats gptq --daemon gptq --workdir /tmp/bench

(``--formats ct,ct-asym`` there: compressed-tensors W4A16 / W4A16_ASYM experts, as llm-compressor writes them.)

A 70B checkpoint (40 GB) and its bundle (38 GB) do not both fit a 64 GiB disk. The loader's
reader behaves differently on tmpfs (the I/O plan stages there and pins page-cache pages in
place elsewhere), so to measure what a server with the bundle on disk gets, put the
checkpoint on tmpfs and the bundle on disk: ``--workdir /dev/shm/bench --bundle-root /tmp/bench``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sitting_guard
from sitting_guard import BUNDLE_RATIO, check_room, checkpoint_bytes

# The engine harness of the GPU tests: processes in their own sessions, rendezvous ports, daemon flags, readiness.
from marlin_pack.testing.engine_harness import Cluster, Proc, attach_config, wait_socket

CHILD = r"""
import cProfile, io, json, os, pstats, sys, time
import torch
model, mode, attn, extra, profile, ablate = sys.argv[1:7]
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
import marlin_pack.vllm_plugin as plugin
plugin.register()
if ablate:  # an engine without these patch modules (nothing reinstalls them in an ipc_cache engine)
    import importlib
    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.patches import registry
    skip = {p.target for m in ablate.split(',') for p in importlib.import_module(f'{patches.__name__}.{m}').PATCHES}
    patches.uninstall_all()
    from marlin_pack._constants import TARGET_VLLM_VERSION as V
    registry.install_all([p for p in patches.PATCHES if p.target not in skip], running=V, targeted=V)
from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader
from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
peak = {}
def wrap(cls):
    orig = cls.load_model
    def load_model(self, *a, **k):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        prof = cProfile.Profile() if profile == '1' else None
        t = time.perf_counter()
        if prof: prof.enable()
        m = orig(self, *a, **k); torch.cuda.synchronize()
        if prof:
            prof.disable(); s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats('cumulative').print_stats(45)
            pstats.Stats(prof, stream=s).sort_stats('tottime').print_stats(30)
            print('PROFILE-BEGIN\n' + s.getvalue() + 'PROFILE-END', flush=True)
        peak['load_model_s'] = time.perf_counter() - t
        if os.environ.get('MARLIN_PACK_BENCH_DISK_OF'):  # the disk's bytes read by the load's end (bench_cold's rows)
            st = os.stat(os.environ['MARLIN_PACK_BENCH_DISK_OF']).st_dev
            for f in (x.split() for x in open('/proc/diskstats').read().splitlines()):
                if len(f) > 5 and (int(f[0]), int(f[1])) == (os.major(st), os.minor(st)):
                    peak['disk_read_bytes_at_load_end'] = int(f[5]) * 512
        peak['peak_alloc_gb'] = torch.cuda.max_memory_allocated() / 1e9
        peak['weights_gb'] = (torch.cuda.memory_allocated() - base) / 1e9
        return m
    cls.load_model = load_model
wrap(BaseModelLoader); wrap(MarlinPrepackedLoader); wrap(IpcModelLoader)
phases = {}  # an attach's steps inside load_model, seconds (where a first attach's time goes)
if mode == 'ipc':
    import vllm.model_executor.model_loader.weight_cache.ipc_loader as ipc
    def timed(owner, name, label):
        orig = getattr(owner, name)
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, run)
    for owner, name, label in ((IpcModelLoader, '_fetch_entries', 'fetch'), (ipc, 'initialize_model', 'construct'),
                               (ipc, 'check_ipc_quant_support', 'quant_check'), (IpcModelLoader, '_apply_entries', 'map'),
                               (ipc, 'process_weights_after_loading', 'post_process'),
                               (ipc, '_materialize_remaining_meta_tensors', 'materialize'),
                               (IpcModelLoader, '_watch_daemon', 'watch')):
        timed(owner, name, label)
from vllm import LLM, SamplingParams
serve = os.environ.get('MARLIN_PACK_BENCH_SERVE') == '1'
# Serving is timed as a user runs vLLM: its default execution (torch.compile and CUDA graphs); eager decode of a 70B is
# bound by the host's kernel launches and varied 0.59-1.32x between two engines with the same kernels (2026-12-07).
eager = not serve or os.environ.get('MARLIN_PACK_BENCH_EAGER') == '1'
kw = dict(model=model, enforce_eager=eager, max_model_len=2048 if serve else 512, attention_backend=attn, dtype='float16',
          skip_tokenizer_init=True, seed=0)
extra = json.loads(extra)
if mode == 'ordinary':  # Marlin forced for linears and (MoE models) experts: the layouts a bundle holds
    kw.update(linear_backend='marlin', moe_backend='marlin', gpu_memory_utilization=0.92)
elif mode == 'default':  # vLLM's own kernel choice (Machete on SM90): what a user runs without marlin-pack
    kw.update(gpu_memory_utilization=0.92)
elif mode == 'prepacked':
    kw.update(load_format='marlin_prepacked', gpu_memory_utilization=0.92, model_loader_extra_config=extra)
else:  # an ipc_cache engine beside its daemon: no memory profiling
    kw.update(load_format='ipc_cache', kv_cache_memory_bytes=1 << 30, model_loader_extra_config=extra)
t = time.perf_counter()
llm = LLM(**kw)
start_s = time.perf_counter() - t
out = llm.generate([{'prompt_token_ids': [1, 2, 3, 4]}], SamplingParams(max_tokens=4, temperature=0))
serving = {}
if serve:  # the same workloads for every engine: prefill 16 x 1024 tokens; decode 64 and 256 sequences x 64 tokens
    import random
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    def prompts(n, length):
        return [{'prompt_token_ids': [rng.randrange(10, vocab - 1) for _ in range(length)]} for _ in range(n)]
    def timed_generate(batch, params):
        torch.cuda.synchronize(); t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize(); return round(time.perf_counter() - t, 4)
    # Each workload runs once untimed first (the attention kernels compile for its shapes on first use: the
    # 2026-12-04 sitting saw one engine's first 64-sequence decode 1.27x its twin's), then the best of three runs.
    first = SamplingParams(max_tokens=1, temperature=0)
    decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    workloads = {'prefill_16x1024_s': (16, 1024, first), 'decode_64x64_s': (64, 16, decode), 'decode_256x64_s': (256, 16, decode)}
    for key, (n, length, params) in workloads.items():
        timed_generate(prompts(n, length), params)
        serving[key] = min(timed_generate(prompts(n, length), params) for _ in range(3))
print('RESULT ' + json.dumps({'engine_start_s': start_s, 'tokens': list(out[0].outputs[0].token_ids), **peak,
                              'phases': {k: round(v, 4) for k, v in phases.items()}, 'serving': serving}))
"""

LOAD_RE = r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds"
FILL_RE = r"filled its model in ([\d.]+) s"
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # on top of the harness's process environment
_RUNS = itertools.count(1)  # numbers the engines' log files


def _cluster(log_dir: Path) -> Cluster:
    """The harness's processes for one engine or one daemon and its engines: logs in ``log_dir``, this cwd (relative
    paths given to the bench hold), 60 s from SIGTERM to SIGKILL (a daemon frees its ~40 GB)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return Cluster(log_dir, logs=None, cwd=Path.cwd(), stop_timeout_s=60)


_MARLIN_KEYS = ("marlin-pack: validate", "marlin-pack: placed", "filled its model", "daemon warm-up", "copy helpers")


def _marlin_lines(log: str) -> list[str]:
    return [x[x.index("marlin-pack:"):] for x in log.splitlines() if any(k in x for k in _MARLIN_KEYS)]


SPY_DIR: list[Path] = []  # --py-spy DIR
MADE: list[Path] = []  # the checkpoints and bundles this run draws: removed when it ends or is stopped, unless --keep


class _Spy:
    """``py-spy record`` of a process and its children (``--py-spy``), from now until it exits or :meth:`stop`.

    The samples are written to ``DIR/<name>.raw`` (py-spy's collapsed stacks, one frame per thread
    first); :meth:`stop` prints where they went (:func:`spy_summary`).
    """

    def __init__(self, pid: int, name: str, under: str | None = "marlin_pack/vllm_plugin/loader.py") -> None:
        self.out, self.under = SPY_DIR[0] / f"{name}.raw", under
        exe = os.environ.get("PY_SPY") or shutil.which("py-spy") or "py-spy"
        self.proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
                                      "--rate", "250", "--format", "raw", "--output", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self, wait_only: bool = False) -> None:
        if not wait_only and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file and exits
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.exists():
            print(f"  py-spy wrote nothing ({err.strip()[-300:]})", flush=True)
            return
        print(spy_summary(self.out.read_text(), self.under), flush=True)


def spy_summary(raw: str, under: str | None, top: int = 25) -> str:
    """Where py-spy's samples (collapsed stacks recorded with ``--threads``) went, most first.

    ``under``: a source file. The stacks through one of its functions count, by that innermost
    function and the stack's innermost frame. None (or no stack through it): every stack with a
    ``marlin_pack`` frame counts, by its thread and its innermost ``marlin_pack`` frame (a conversion's
    main, reader, writer and hashing threads).
    """
    counts: dict[tuple[str, str], int] = {}
    fallback: dict[tuple[str, str], int] = {}
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        ours = [f for f in frames if under and under in f and not f.startswith("<module>")]
        if ours:
            key = (ours[-1].split(" (")[0], frames[-1][:110])
            counts[key] = counts.get(key, 0) + int(n)
        pack = [f for f in frames if "marlin_pack/" in f and not f.startswith("<module>")]
        if pack:
            thread = next((f.split(": ", 1)[-1] for f in frames if f.startswith("thread ")), "?")
            key = (thread[:28], pack[-1][:110])
            fallback[key] = fallback.get(key, 0) + int(n)
    table, how = (counts, "function") if counts else (fallback, "thread / innermost marlin_pack frame")
    rows = sorted(table.items(), key=lambda kv: -kv[1])[:top]
    lines = [f"  py-spy: {sum(table.values())} samples (250 Hz) under {under if counts else 'marlin_pack'}; by {how}:"]
    lines += [f"    {n:6d}  {a:28s} {b}" for (a, b), n in rows]
    return "\n".join(lines)


def _split(io: str) -> tuple[dict, dict[str, str]]:
    """One ``--io`` object: (its loader options, the environment carrying the rest as ``MARLIN_PACK_IO``)."""
    from marlin_pack.vllm_plugin.options import OPTION_KEYS

    given = json.loads(io)
    env = {k[len("env:"):]: str(v) for k, v in given.items() if k.startswith("env:")}  # {"env:NAME": value}: an A/B
    plan = {k: v for k, v in given.items() if k not in OPTION_KEYS and not k.startswith("env:")}
    return {k: v for k, v in given.items() if k in OPTION_KEYS}, ({"MARLIN_PACK_IO": json.dumps(plan)} if plan else {}) | env


def _engine(model: Path, mode: str, attn: str, extra: dict | None = None, profile: bool = False, ablate: str = "",
            env: dict[str, str] | None = None) -> dict:
    argv = [sys.executable, "-c", CHILD, str(model), mode, attn, json.dumps(extra or {}), str(int(profile)), ablate]
    procs = _cluster(model.parent)
    proc = procs.start(f"engine-{next(_RUNS)}-{mode}-{model.name}", argv, procs.env({**ENV, **(env or {})}))
    spy = _Spy(proc.popen.pid, f"{mode}-{len(list(SPY_DIR[0].glob('*.raw')))}") if SPY_DIR else None
    try:
        code = proc.wait_exit(None)
    finally:
        procs.stop()  # its process group: nothing it started outlives it
    if spy is not None:
        spy.stop(wait_only=True)  # it ends with the engine's process
    log = proc.log()  # vLLM logs to stdout/stderr, both in the log; parse its own timing line
    line = next((x for x in log.splitlines() if x.startswith("RESULT ")), None)
    if code or line is None:
        sys.stderr.write(proc.tail(9000))
        raise SystemExit(f"{mode} engine failed (exit {code})")
    result = json.loads(line[len("RESULT "):])
    m = re.search(LOAD_RE, log)
    result["model_loading_s"] = float(m.group(2)) if m else None
    kv = re.search(r"Available KV cache memory: ([0-9.]+) GiB", log)  # sized from vLLM's memory snapshot and profile run
    result["kv_cache_gib"] = float(kv.group(1)) if kv else None
    result["marlin_pack_log"] = _marlin_lines(log)
    result["kernels"] = sorted(set(re.findall(r"Using (\w+) for mixed-precision linear", log)))
    prof = re.search(r"PROFILE-BEGIN\n(.*?)PROFILE-END", log, re.S)
    result["profile"] = prof.group(1) if prof else ""
    # One line per engine as it ends, so a sitting cut short still shows the rows it finished.
    print(f"  {mode} engine: Model loading took {result['model_loading_s']} s, engine start {result['engine_start_s']:.2f} s; "
          f"KV cache {result['kv_cache_gib']} GiB; {' | '.join(result['marlin_pack_log'][-1:])}", flush=True)
    if result.get("serving"):
        print("    serving: " + ", ".join(f"{k} {v:.2f}" for k, v in result["serving"].items())
              + f"; kernels {', '.join(result['kernels']) or '?'}", flush=True)
    if result.get("phases"):
        print(f"    load_model {result.get('load_model_s', 0):.3f} s: "
              + ", ".join(f"{k} {v:.3f}" for k, v in result["phases"].items()), flush=True)
    for x in result["marlin_pack_log"][:-1]:  # the copy's line, the helpers' exit and the engine's page-locking ahead
        if any(k in x for k in ("placed", "copy helpers to", "page-locked in", "I/O plan")):
            print(f"    {x}", flush=True)
    return result


def _daemon_rows(
    model: Path, bundle: Path, attn: str, profile: bool, log_dir: Path, ablate: str = "", io: str = "{}", attach: bool = True,
    attaches: int = 2,
) -> dict:
    """Fill a daemon from the bundle, then (``attach``) attach ``attaches`` ipc_cache engines one after the other
    (with ``ablate``, each followed by one without those marlin-pack patch modules: pairs side by side)."""
    procs = _cluster(log_dir)
    sdir = procs.socket_dir()
    options, plan_env = _split(io)
    config = json.dumps({**options, "bundle": str(bundle)})
    launched = time.perf_counter()
    daemon: Proc = procs.daemon(f"daemon-{model.name}", model, sdir, "--model-loader-extra-config", config, env={**ENV, **plan_env})
    spy = _Spy(daemon.popen.pid, f"daemon-{len(list(SPY_DIR[0].glob('*.raw')))}") if SPY_DIR else None
    try:
        up = wait_socket(daemon, sdir, timeout=600, poll_s=0.02)
        ready_s = time.perf_counter() - launched  # the whole daemon start: CLI, spawn, vLLM's init, fill, warm-up
        if spy is not None:
            spy.stop()  # the fill is over once the daemon listens
        if not up:
            sys.stderr.write(daemon.tail(6000))
            raise SystemExit("the daemon did not come up")
        text = daemon.log()
        m = re.search(FILL_RE, text)
        rows = {"fill_s": float(m.group(1)) if m else None, "ready_s": ready_s, "daemon_log": _marlin_lines(text)}
        print(f"  daemon ({io}) filled from the bundle in {rows['fill_s']} s; listening {ready_s:.2f} s after launch", flush=True)
        for line in rows["daemon_log"]:
            print(f"    {line}", flush=True)
        if not attach:
            return rows
        extra = attach_config(sdir)
        for k in range(1, attaches + 1):
            # No serving workloads on an attach (its 1 GiB KV cache would preempt them; the kernel is the daemon's).
            quiet = {"MARLIN_PACK_BENCH_SERVE": "0"}
            rows[f"attach{k}"] = _engine(model, "ipc", attn, extra, profile=profile and k == 2, env=quiet)
            if ablate:
                rows[f"attach{k} without {ablate}"] = _engine(model, "ipc", attn, extra, ablate=ablate, env=quiet)
        return rows
    finally:
        procs.stop()  # the daemon's process group (SIGTERM, SIGKILL after 60 s) and its socket directory


def _disk_write_gbps(directory: Path, nbytes: int = 8 << 30) -> float:
    """A plain durable sequential write of ``nbytes`` into ``directory`` (the way a bundle is written:
    ``SequentialFile``, O_DIRECT where the file system allows it, fsync), in GB/s; the file is removed."""
    from marlin_pack.io.direct_file import SequentialFile

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk-write-probe.bin"
    block = memoryview(os.urandom(64 << 20))
    t = time.perf_counter()
    f = SequentialFile(path)
    for _ in range(nbytes // len(block)):
        f.write(block)
    f.close()
    seconds = time.perf_counter() - t
    path.unlink()
    return nbytes / seconds / 1e9


def _warm(paths: list[Path]) -> float:
    n = 0
    for root in paths:
        for f in sorted(root.rglob("*.safetensors")):
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(64 << 20):
                    n += len(chunk)
    return n / 1e9


def _repeat(ios: list[str], i: int) -> str:
    """`` (n)`` for the n-th time (n > 1) a configuration appears in one round's list, so that each keeps its row."""
    n = ios[: i + 1].count(ios[i])
    return f" ({n})" if n > 1 else ""


def _per_config(rows: dict) -> dict[str, list[float]]:
    """Each configuration's figures over the rounds ("prepacked {io} #k" -> "prepacked {io}"): engines'
    Model loading took, daemons' fill."""
    out: dict[str, list[float]] = {}
    for key, value in rows.items():
        base = re.sub(r"( \(\d+\))?( #\d+)?$", "", key)  # a configuration's repeats and rounds together
        if isinstance(value, dict) and value.get("model_loading_s") is not None and base.startswith("prepacked"):
            out.setdefault(base, []).append(value["model_loading_s"])
        elif key.startswith("fill_s ") and value is not None:
            out.setdefault("daemon fill " + base[len("fill_s "):], []).append(value)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def main() -> None:
    # Run by sitting_guard.run: a `timeout`'s SIGTERM (or ^C) exits through the finally blocks, which end the engines and
    # daemons (a daemon left behind holds its ~40 GB and starves every later engine on that GPU) and remove what this
    # run drew (a checkpoint and bundles left behind fill the disk for the next call).
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b", help="a marlin_pack.testing.synthetic preset, or qwen3-30b-a3b (MoE)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--formats", default="gptq,awq", help="gptq, awq; with a MoE preset also ct, ct-asym (compressed-tensors)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--bundle-root", type=Path, default=None, help="where bundles go (default: in the checkpoint)")
    ap.add_argument("--attention-backend", default=os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN"))
    ap.add_argument("--io", default="{}", help="';'-separated JSON objects of loader options, I/O plan fields "
                    "(MARLIN_PACK_IO) and environment variables (\"env:NAME\"), one prepacked engine each (none: no engine)")
    ap.add_argument("--daemon-io", default="{}", help="';'-separated objects as --io: each fills a daemon, "
                    "the last one's gets the attaches")
    ap.add_argument("--daemon", default="", help="formats (comma-separated) that also get the daemon rows")
    ap.add_argument("--no-ordinary", action="store_true", help="skip the ordinary engines")
    ap.add_argument("--ordinary", default="marlin", help="ordinary engines (comma-separated): marlin (--linear-backend "
                    "marlin, the layout a Marlin bundle holds) and/or default (vLLM's own choice: Machete on SM90)")
    ap.add_argument("--kernel", default="marlin", help="bundles to convert and start from (comma-separated): marlin, "
                    "machete (convert --kernel); daemon rows use the last one")
    ap.add_argument("--serve", action="store_true", help="after each start, time the serving workloads: prefill 16 x "
                    "1024 tokens, decode 64 and 256 sequences x 64 tokens (vLLM's default execution: torch.compile and "
                    "CUDA graphs, unless --eager; max_model_len 2048)")
    ap.add_argument("--eager", action="store_true", help="with --serve: engines eager, as every engine runs without it")
    ap.add_argument("--profile", action="store_true", help="cProfile the prepacked and 2nd attach load_model")
    ap.add_argument("--ablate", default="", help="patch modules (e.g. construct,cache_key) that an attach engine "
                    "after each attach runs without")
    ap.add_argument("--attaches", type=int, default=2, help="ipc_cache engines attached to the daemon, one after the other")
    ap.add_argument("--rounds", type=int, default=1, help="run every prepacked and daemon configuration this many times, "
                    "interleaved, and print each one's median and best")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and bundles (disk!)")
    ap.add_argument("--reuse", action="store_true", help="use a checkpoint and bundle an earlier --keep run left (no convert row)")
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                    help="sample every engine and daemon with py-spy (PY_SPY or PATH) into DIR/*.raw and print where the "
                         "loader's time went")
    args = ap.parse_args()
    try:
        _sitting(args)
    finally:
        if not args.keep:
            for path in MADE:
                shutil.rmtree(path, ignore_errors=True)


def _sitting(args: argparse.Namespace) -> None:
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
        SPY_DIR.append(args.py_spy)

    import dataclasses

    import torch

    from marlin_pack.conversion import convert
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint
    from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

    moe = args.preset in MOE_PRESETS
    shape = MOE_PRESETS[args.preset] if moe else PRESETS[args.preset]
    if args.layers:
        shape = dataclasses.replace(shape, num_hidden_layers=args.layers)
    if not args.reuse:  # one format's checkpoint and bundles at a time (--keep: all of them), and the disk-write probe
        ckpt, formats, n = checkpoint_bytes(shape), len(args.formats.split(",")) if args.keep else 1, len(args.kernel.split(","))
        check_room("bench_load", [(args.workdir, formats * ckpt, f"{formats} checkpoint(s)"),
                                  (args.bundle_root or args.workdir, formats * n * BUNDLE_RATIO * ckpt, f"{formats * n} bundle(s)"),
                                  (args.bundle_root or args.workdir, 8 << 30, "the disk-write probe")],
                   "fewer --layers or --formats, another --workdir or --bundle-root")
    from bench_h2d import h2d_gbps  # this folder is on sys.path when run as a script

    pinned = h2d_gbps(pinned=True)
    print(f"pinned host->GPU bandwidth: {pinned:.1f} GB/s", flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = []
    kernels = [k for k in args.kernel.split(",") if k]
    if os.environ.get("MARLIN_PACK_BENCH_SERVE") is None and args.serve:
        ENV["MARLIN_PACK_BENCH_SERVE"] = "1"
    if args.eager:
        ENV["MARLIN_PACK_BENCH_EAGER"] = "1"
    for fmt in args.formats.split(","):
        model = args.workdir / f"{args.preset}-{fmt}"
        last = (args.bundle_root / model.name) if args.bundle_root else model / "marlin-pack"
        # The last kernel's bundle at the usual place (a daemon's ipc_cache engines find a Machete bundle there).
        bundles = {k: last if k == kernels[-1] else last.with_name(f"{last.name}-{k}") for k in kernels}
        # The daemon and its ipc_cache engines look for a Machete bundle at its default place (MODEL/marlin-pack):
        # with --bundle-root, a link there to the bundle (a 70B checkpoint on tmpfs, its bundle on disk).
        link = model / "marlin-pack" if "machete" in kernels[-1:] and fmt in args.daemon.split(",") and args.bundle_root else None
        reused = args.reuse and all((b / "manifest.json").is_file() for b in bundles.values()) and model.is_dir()
        if args.reuse and not reused:
            print(f"{fmt}: --reuse found no kept checkpoint {model} with bundles {list(bundles.values())}: generating", flush=True)
        conv_s: dict[str, float | None] = {}
        if reused:  # a kept checkpoint and bundle of an earlier run (--keep): no generation, no convert row
            from marlin_pack.bundle.reader import read_manifest

            manifest = read_manifest(bundles[kernels[-1]])
            gen_s = None
        else:
            MADE.extend([model, *bundles.values()])
            t = time.perf_counter()
            if moe:  # random words drawn on the GPU, streamed shard by shard (seconds for 17 GB)
                # ct / ct-asym: llm-compressor's W4A16 / W4A16_ASYM (compressed-tensors pack-quantized)
                ct = {"fmt": "compressed-tensors", "symmetric": fmt == "ct"} if fmt in ("ct", "ct-asym") else {"fmt": fmt}
                write_moe_checkpoint(model, shape, group_size=128, max_shard_bytes=5 << 30, device="cuda", **ct)
            else:
                writer = write_awq_checkpoint if fmt == "awq" else write_gptq_checkpoint
                writer(model, shape, group_size=128, max_shard_bytes=5 << 30, device="cuda")
            gen_s = time.perf_counter() - t
            for kernel, bundle in bundles.items():
                spy = _Spy(os.getpid(), f"convert-{fmt}-{kernel}", under=None) if SPY_DIR else None
                t = time.perf_counter()
                manifest = convert(model, bundle, tp=(1,), dtype="float16", device="cuda", force=True, kernel=kernel).manifest
                conv_s[kernel] = time.perf_counter() - t
                if spy is not None:
                    spy.stop()
                torch.cuda.empty_cache()
        bundle = bundles[kernels[-1]]
        if link is not None and not link.exists():
            link.symlink_to(bundle, target_is_directory=True)
        bundle_gb = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e9
        disk = _disk_write_gbps(bundle.parent) if not reused else float("nan")
        warm_gb = _warm([model, *bundles.values()])
        rank_gb = manifest.tensor_parallel[0].ranks[0].file.size / 1e9
        converts = ", ".join(f"convert --kernel {k} --device cuda {v:.1f} s" for k, v in conv_s.items())
        print(f"{fmt}: {'reused' if reused else f'generated in {gen_s:.1f} s; {converts}'}; "
              f"rank file {rank_gb:.1f} GB; bundle {bundle_gb:.1f} GB, a plain durable write of it at this disk's "
              f"{disk:.2f} GB/s: {bundle_gb / disk:.1f} s; warmed {warm_gb:.1f} GB", flush=True)
        rows: dict = {"convert_s": conv_s or None, "disk_write_s": bundle_gb / disk}
        if not args.no_ordinary:
            for kind in args.ordinary.split(","):
                name = "ordinary" if kind == "marlin" else f"ordinary {kind}"
                rows[name] = _engine(model, "ordinary" if kind == "marlin" else "default", args.attention_backend)
        engine_ios = args.io.split(";") if args.io != "none" else []
        daemon_ios = args.daemon_io.split(";") if fmt in args.daemon.split(",") else []
        # Rounds interleave the configurations (A B A B ...), so that a drift of the machine is spread
        # over all of them; the summary below gives each one's median and best.
        for k in range(args.rounds):
            tag = f" #{k + 1}" if args.rounds > 1 else ""
            for i, io in enumerate(engine_ios):
                options, plan_env = _split(io)
                for kernel, kernel_bundle in bundles.items():
                    extra = {**options, "bundle": str(kernel_bundle)}
                    label = f"prepacked {kernel} {io}" if len(bundles) > 1 else f"prepacked {io}"
                    try:
                        rows[f"{label}{_repeat(engine_ios, i)}{tag}"] = _engine(
                            model, "prepacked", args.attention_backend, extra, profile=args.profile and i == 0 and k == 0, env=plan_env
                        )
                    except SystemExit as e:  # one loader configuration failing should not end the sitting
                        print(f"{label}: {e}", flush=True)
            for j, io in enumerate(daemon_ios):
                attach = k == args.rounds - 1 and j == len(daemon_ios) - 1  # the attaches: the very last daemon
                r = _daemon_rows(model, bundle, args.attention_backend, args.profile and attach, args.workdir,
                                 args.ablate if attach else "", io=io, attach=attach, attaches=args.attaches)
                rows[f"fill_s {io}{_repeat(daemon_ios, j)}{tag}"] = r.pop("fill_s")
                rows[f"ready_s {io}{_repeat(daemon_ios, j)}{tag}"] = r.pop("ready_s")
                rows.setdefault("daemon_log", []).extend(r.pop("daemon_log"))
                rows.update(r)
        report.append((fmt, rows))
        print(json.dumps({"format": fmt, **{k: v for k, v in rows.items()}}, indent=1, default=str)[:20000], flush=True)
        if not (args.keep or reused):  # what an earlier --keep run left stays for the next --reuse
            shutil.rmtree(model)
            for b in bundles.values():
                shutil.rmtree(b, ignore_errors=True)

    print(f"\n{args.preset}{f' ({args.layers} layers)' if args.layers else ''}, TP=1, page cache warm, "
          f"one engine per process; pinned host->GPU {pinned:.1f} GB/s")
    print(f"{'format':6} {'start':40} {'Model loading took s':>20} {'/ ordinary':>10} {'peak GPU GB':>11} {'tokens':>8}")
    for fmt, rows in report:
        base = rows.get("ordinary", {}).get("model_loading_s")
        # Tokens are compared with ordinary's, or without an ordinary row with the first engine's.
        engines = [r for r in rows.values() if isinstance(r, dict) and "tokens" in r]
        tokens = rows.get("ordinary", engines[0] if engines else {}).get("tokens")
        for kernel, seconds in (rows["convert_s"] or {}).items():
            print(f"{fmt:6} {f'convert --kernel {kernel} --device cuda':40} {seconds:20.2f}")
        if rows["convert_s"]:
            print(f"{fmt:6} {'  the bundle written plainly (disk bound)':40} {rows['disk_write_s']:20.2f}")
        for key, value in rows.items():
            if key.startswith("fill_s ") and value is not None:
                io = key[len("fill_s "):]
                print(f"{fmt:6} {'daemon fill ' + io:40} {value:20.2f}   (listening {rows[f'ready_s {io}']:.2f} s after launch)")
        for key, r in rows.items():
            if not isinstance(r, dict) or "model_loading_s" not in r:
                continue
            same = "same" if tokens is None or r["tokens"] == tokens else "DIFFER"
            print(f"{fmt:6} {key:40} {r['model_loading_s'] or -1:20.2f} {_ratio(r['model_loading_s'], base):>10} "
                  f"{r['peak_alloc_gb']:11.1f} {same:>8}")
            if r.get("serving"):
                ref = rows.get("ordinary default", {}).get("serving") or {}
                print("         serving: " + ", ".join(
                    f"{k} {v:.2f} s ({_ratio(v, ref.get(k))} of default)" for k, v in r["serving"].items()
                ) + f"; kernels {', '.join(r.get('kernels') or []) or '?'}")
            for line in r["marlin_pack_log"]:
                bw = re.search(r"\(([\d.]+) GB, ([\d.]+) GB/s\)", line)
                share = f"  [{float(bw.group(2)) / pinned:.2f} of pinned H2D]" if bw else ""
                print(f"         {line}{share}")
        for line in rows.get("daemon_log", []):
            print(f"  daemon {line}")
        per_config = _per_config(rows)
        if any(len(values) > 1 for values in per_config.values()):  # rounds, or a configuration given twice
            for label, values in per_config.items():
                print(f"{fmt:6} {label:40} median {statistics.median(values):.2f} s, best {min(values):.2f} s "
                      f"of {len(values)}: {' '.join(f'{v:.2f}' for v in values)}")
    if args.profile:
        for fmt, rows in report:
            for key, r in rows.items():
                if isinstance(r, dict) and r.get("profile"):
                    print(f"\n--- profile {fmt} {key} ---\n{r['profile']}")


if __name__ == "__main__":
    sitting_guard.run(main, "bench_load")
