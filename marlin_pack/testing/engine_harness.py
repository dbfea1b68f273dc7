"""The engine harness of the GPU tests and the benchmarks: engine and daemon subprocesses, their checks.

* Settings: ``ENGINE_SETTINGS`` (dtype, eager mode, model length: every test and benchmark engine,
  daemon and CPU stand-in), ``ENGINE_KWARGS`` (a test engine's ``vllm.LLM`` arguments) and
  ``DAEMON_FLAGS`` (a weight-cache daemon's).
* Constants: ``ROOT`` (the directory holding the ``marlin_pack`` package: the repository),
  ``ATTN`` (``MARLIN_PACK_TEST_ATTN``, default TRITON_ATTN), ``MLA_ENGINE_KWARGS`` (the attention
  backends of MLA models: DeepSeek), ``PROMPTS``, ``MAX_TOKENS``, ``TOP``.
* The engine subprocess: this module run as a script (``python -m marlin_pack.testing.engine_harness
  engine SPEC.json``) builds a ``vllm.LLM`` from the spec, generates, reports kernels, tensors,
  whose memory they live in and (with ``digests``) every parameter's sha256, per rank, as JSON;
  with ``serve`` it then answers poke/peek commands on stdin.
* Processes: :class:`Proc` (one subprocess and its log) and :class:`Cluster` (engines, weight-cache
  daemons or any command started side by side, each in its own session with its own rendezvous
  port, stopped together); :func:`attach_config` (an ``ipc_cache`` engine's extra config) and
  :func:`wait_socket` (a daemon's readiness).
* Checks: :func:`ordinary_and_prepacked`, :func:`assert_engines_identical` and
  :func:`check_logprobs_close` over the JSON results of that engine subprocess.

The GPU tests import it through ``tests/on_gpu/_harness.py`` (``from _harness import ...``),
``benchmarks/bench_load.py`` directly; ``benchmarks/cpu_engine.py`` loads this file by path for
``ENGINE_SETTINGS`` (its ``--baseline-tree`` children import an older marlin_pack). So importing it
runs the standard library only: no vLLM, no torch, no other marlin_pack module, and no GPU is
touched (engine subprocesses fork TP workers after importing it).
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROOT", "ATTN", "MLA_ENGINE_KWARGS", "PROMPTS", "MAX_TOKENS", "TOP", "START_TIMEOUT_S", "ENGINE_SETTINGS",
    "ENGINE_KWARGS", "DAEMON_FLAGS", "MOE_LEAVES", "FUSED", "plugin_installed", "Proc", "Cluster", "attach_config",
    "wait_socket", "process_env", "ordinary_and_prepacked", "assert_engines_identical", "check_logprobs_close",
]

ROOT = Path(__file__).resolve().parents[2]  # on PYTHONPATH (and the cwd) of every process started here
ATTN = os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN")
# MLA models (DeepSeek) need an MLA backend: TRITON_ATTN is refused for them. Decode: TRITON_MLA
# (Triton, any head size and GPU). Prefill: vLLM's pure-torch MLA prefill (named CPU; it computes on
# the tensors' device): on Hopper vLLM's only automatic choice is FLASH_ATTN, whose binaries the
# project's GPU machine does not carry. "auto" for either lets vLLM choose.
MLA_ATTN = os.environ.get("MARLIN_PACK_TEST_MLA_ATTN", "TRITON_MLA")
MLA_PREFILL = os.environ.get("MARLIN_PACK_TEST_MLA_PREFILL", "CPU")
MLA_ENGINE_KWARGS: dict[str, Any] = {
    "attention_backend": None if MLA_ATTN == "auto" else MLA_ATTN,
    **({} if MLA_PREFILL == "auto" else {"attention_config": {"mla_prefill_backend": MLA_PREFILL}}),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
MAX_TOKENS = 16
TOP = 5

ENGINE_MODULE = "marlin_pack.testing.engine_harness"  # the engine subprocess: python -m ENGINE_MODULE engine SPEC
START_TIMEOUT_S = 420

# What every engine and daemon of the tests and benchmarks shares (and the CPU stand-in of benchmarks/cpu_engine.py).
ENGINE_SETTINGS: dict[str, Any] = dict(dtype="float16", enforce_eager=True, max_model_len=512)
ENGINE_KWARGS: dict[str, Any] = dict(
    **ENGINE_SETTINGS,
    attention_backend=ATTN,
    gpu_memory_utilization=0.05,
    kv_cache_memory_bytes=256 << 20,  # no memory profiling: engines start side by side
    max_num_batched_tokens=512,
    max_num_seqs=4,
    seed=0,
    enable_flashinfer_autotune=False,
)
DAEMON_FLAGS = [
    "--dtype",
    ENGINE_SETTINGS["dtype"],
    "--enforce-eager",
    "--max-model-len",
    str(ENGINE_SETTINGS["max_model_len"]),
    "--gpu-memory-utilization",
    "0.05",
    "--kernel-config",
    '{"enable_flashinfer_autotune": false}',
]
# The tensors vLLM keeps for an AWQ/GPTQ (then compressed-tensors) routed-experts layer on Marlin MoE.
MOE_LEAVES = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros",
              "w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale", "w13_weight_zero_point",
              "w2_weight_zero_point", "w13_weight_shape", "w2_weight_shape")
FUSED = [
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.1.mlp.gate_up_proj",
]


def plugin_installed() -> bool:
    return any(e.name == "marlin_pack" for e in entry_points(group="vllm.general_plugins"))


# --- the engine subprocess ------------------------------------------------------------------


def _logprobs(positions: Any) -> list[Any]:
    if positions is None:
        return []
    return [None if p is None else {str(int(k)): float(v.logprob) for k, v in p.items()} for p in positions]


def _digest(t: torch.Tensor) -> str:
    import hashlib

    import torch

    return hashlib.sha256(
        t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    ).hexdigest()


def _layer_info(model: torch.nn.Module, names: list[str], digests: bool = False) -> dict[str, Any]:
    """Kernel, tensors (shape, dtype, pointer, sha256) and whose memory they live in; with
    ``digests``, also ``[dtype, shape, sha256]`` of every parameter (bitwise comparison)."""
    import torch

    segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]

    def own(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in segments)

    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))  # a shared expert also under its MoERunner (0.34)
    info: dict[str, Any] = {"kernels": {}, "tensors": {}, "model_class": type(model).__name__}
    for layer in names:
        qm = modules[layer].quant_method
        # AWQ/GPTQ keep the kernel on the method; compressed-tensors on the layer's scheme.
        kernel = getattr(qm, "kernel", None) or getattr(getattr(modules[layer], "scheme", None), "kernel", None)
        moe_kernel = getattr(qm, "moe_kernel", None)
        if kernel is None and moe_kernel is not None:  # routed experts: the fused-MoE experts class (MarlinExperts)
            experts = getattr(getattr(moe_kernel, "impl", None), "fused_experts", None)
            info["kernels"][layer] = {
                "method": type(qm).__name__,
                "kernel": type(experts).__name__,
                "moe_backend": str(getattr(getattr(qm, "wna16_moe_backend", None) or getattr(qm, "wna16_backend", None),
                                           "value", None)),
                "act_type": str(getattr(getattr(modules[layer], "moe_config", None), "in_dtype", None)),
                "input_global_scale": repr(getattr(modules[layer], "w13_input_global_scale", None)),
            }
        else:
            info["kernels"][layer] = {
                "method": type(qm).__name__,
                "kernel": type(kernel).__name__,
                "act_type": str(getattr(getattr(kernel, "config", None), "act_type", None)),
                "input_global_scale": repr(getattr(modules[layer], "input_global_scale", "<missing>")),
            }
        for leaf in ("qweight", "scales", "qzeros", "weight_packed", "weight_scale", "weight_zero_point", "bias",
                     *MOE_LEAVES):
            p = params.get(f"{layer}.{leaf}")
            if p is None:
                continue
            t = p.detach()
            info["tensors"][f"{layer}.{leaf}"] = {
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "ptr": t.data_ptr(),
                "sha256": _digest(t),
                "own_memory": own(t) if t.numel() else None,
            }
    nonempty = [(n, p) for n, p in params.items() if p.numel() and p.is_cuda]
    info["params_in_own_memory"] = sum(own(p) for _, p in nonempty)
    info["params"] = len(nonempty)
    if digests:
        info["digests"] = {n: [str(p.dtype), list(p.shape), _digest(p)] for n, p in model.named_parameters()}
    return info


def _poke(model: torch.nn.Module, name: str, xor: int) -> int:
    """Read the first int32 word of a parameter; with ``xor``, flip bits of it (in place)."""
    import torch

    flat = dict(model.named_parameters(remove_duplicate=False))[name].data.view(-1)
    old = int(flat[0].item())
    if xor:
        flat[0] = old ^ xor
        torch.cuda.synchronize()
    return old


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def _engine_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if not plugin_installed():
        from marlin_pack.vllm_plugin import register

        register()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["kwargs"])
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, prompt_logprobs=TOP, seed=0)
    outputs = []
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = out.outputs[0]
        outputs.append(
            {
                "token_ids": list(c.token_ids),
                "text": c.text,
                "logprobs": _logprobs(c.logprobs),
                "prompt_token_ids": list(out.prompt_token_ids or []),
                "prompt_logprobs": _logprobs(out.prompt_logprobs),
            }
        )
    # One result per tensor-parallel worker, in rank order.
    ranks = llm.apply_model(
        functools.partial(_layer_info, names=spec["layers"], digests=spec.get("digests", False))
    )
    from marlin_pack.vllm_plugin.patches.registry import installed  # no vLLM import of its own

    result = {"outputs": outputs, "layers": ranks[0], "ranks": ranks, "start_s": start_s, "patched": installed(),
              "model_class": ranks[0]["model_class"]}
    _write_json(Path(spec["out"]), result)
    print("MARLIN_PACK_ENGINE_READY", flush=True)
    if spec.get("serve"):  # answer poke/peek commands until told to exit
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            value = llm.apply_model(functools.partial(_poke, name=cmd["name"], xor=cmd["xor"]))[0]
            _write_json(Path(cmd["resp"]), {"value": value})
    sys.stdout.flush()
    os._exit(0)


# --- processes --------------------------------------------------------------------------------

# Rendezvous ports (VLLM_PORT) of processes started together: distinct across every Cluster of this
# process that is not given its own base port. Pytest runs side by side need bases far enough apart:
# `tests/on_gpu/device.sh --parallel` gives each its own MARLIN_PACK_TEST_PORT_BASE (two runs counting from the
# same base made two weight-cache daemons bind one port, EADDRINUSE, on 2026-12-06).
_PORTS = itertools.count(int(os.environ.get("MARLIN_PACK_TEST_PORT_BASE", "21040")), 40)


def process_env(port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine or daemon process: this tree's ``marlin_pack`` first on ``PYTHONPATH``,
    its own ``VLLM_PORT``, vLLM's engine core in-process, 16-bit Marlin activations unless ``extra`` says otherwise."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "VLLM_PORT": str(port),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    env.pop("VLLM_MARLIN_INPUT_DTYPE", None)
    env.update(extra or {})
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    out: Path | None = None
    started: float = field(default_factory=time.monotonic)
    stop_timeout_s: float = 20  # how long stop() waits after SIGTERM before SIGKILL
    _seq: int = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 6000) -> str:
        return f"--- {self.name} ({self.log_path}) ---\n{self.log()[-n:]}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.stdin is not None and self.alive:  # a serving engine: ask it to exit
            try:
                self.popen.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.popen.stdin.flush()
                self.popen.wait(20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        # Its own session (setsid): signal the whole process group, which also reaches the
        # daemon processes `vllm preload` spawned; SIGKILL whatever is left.
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                time.sleep(1)  # let spawned children finish their own SIGTERM handling

    def result(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.out is not None and self.out.exists():
                return json.loads(self.out.read_text())  # type: ignore[no-any-return]
            if not self.alive:
                return (
                    json.loads(self.out.read_text()) if self.out is not None and self.out.exists() else None
                )
            time.sleep(0.2)
        return None

    def command(self, name: str, xor: int, timeout: float = 60) -> int:
        assert self.popen.stdin is not None and self.out is not None
        self._seq += 1
        resp = self.out.with_name(f"resp-{self._seq}.json")
        self.popen.stdin.write(json.dumps({"op": "poke", "name": name, "xor": xor, "resp": str(resp)}) + "\n")
        self.popen.stdin.flush()
        deadline = time.monotonic() + timeout
        while not resp.exists():
            assert self.alive and time.monotonic() < deadline, self.tail()
            time.sleep(0.05)
        return int(json.loads(resp.read_text())["value"])

    def wait_exit(self, timeout: float | None = START_TIMEOUT_S) -> int | None:
        """The exit code, or None if it still runs after ``timeout`` seconds (None: wait as long as it runs)."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class Cluster:
    """Processes started side by side (each in its own session, with its own rendezvous port), stopped together.

    ``workdir``: where each process's ``NAME.log`` (stdout and stderr) and an engine's spec and results go.
    ``logs``: the folder under ``$OUT`` that :meth:`stop` copies the logs to (None: not copied). ``port``:
    the base of this cluster's ``VLLM_PORT`` values (None: the ports shared by every such cluster of this
    process). ``cwd``: the processes' working directory. ``stop_timeout_s``: SIGTERM to SIGKILL, per process.
    """

    def __init__(self, workdir: Path, logs: str | None = "daemon-gpu-logs", port: int | None = None, *,
                 cwd: Path = ROOT, stop_timeout_s: float = 20) -> None:
        self.workdir = workdir
        self.logs = logs  # where stop() copies the logs, under $OUT
        self.procs: list[Proc] = []
        self._ports = _PORTS if port is None else itertools.count(port + 40, 40)
        self.cwd = cwd
        self.stop_timeout_s = stop_timeout_s
        self.sockets: list[Path] = []

    def socket_dir(self) -> Path:
        """A fresh weight-cache socket directory, removed by :meth:`stop`."""
        # AF_UNIX paths are limited to ~107 bytes and vLLM's socket name takes 55: stay short.
        d = Path(tempfile.mkdtemp(prefix="mpd-", dir="/tmp"))
        self.sockets.append(d)
        return d

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """:func:`process_env` with the next port: distinct rendezvous ports for processes starting together."""
        return process_env(next(self._ports), extra)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdin: bool = False) -> Proc:
        """Start ``argv`` in its own session, stdout and stderr to ``workdir/NAME.log`` (``env``: :meth:`env`'s)."""
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                argv,
                cwd=self.cwd,
                env=self.env() if env is None else env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # setsid: its own process group, killed as a whole
            )
        proc = Proc(name, popen, log_path, stop_timeout_s=self.stop_timeout_s)
        self.procs.append(proc)
        return proc

    def daemon(self, name: str, model: Path, sdir: Path, *extra: str, vllm_cli: bool = False,
               env: dict[str, str] | None = None) -> Proc:
        """A weight-cache daemon of ``model`` listening in ``sdir`` (``marlin-pack daemon``, or ``vllm preload``)."""
        if vllm_cli:  # plain vLLM CLI (no console script on the GPU machine)
            argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "preload", "--model", str(model)]
            argv += ["--load-format", "marlin_prepacked"]
        else:
            argv = [sys.executable, "-m", "marlin_pack.cli", "daemon", str(model)]
        argv += [*DAEMON_FLAGS, "--weight-cache-socket-dir", str(sdir), *extra]
        return self.start(name, argv, self.env(env))

    def engine(
        self,
        name: str,
        model: Path,
        *,
        serve: bool = False,
        digests: bool = False,
        env: dict[str, str] | None = None,
        layers: list[str] | None = None,
        **kwargs: Any,
    ) -> Proc:
        """The engine subprocess (this module's ``engine`` command) of ``model``, ``ENGINE_KWARGS`` updated by ``kwargs``."""
        d = self.workdir / name
        d.mkdir(parents=True, exist_ok=True)
        spec = {
            "model": str(model),
            "kwargs": {**ENGINE_KWARGS, **kwargs},
            "layers": FUSED if layers is None else layers,
            "out": str(d / "out.json"),
            "serve": serve,
            "digests": digests,
        }
        (d / "spec.json").write_text(json.dumps(spec))
        proc = self.start(
            name, [sys.executable, "-m", ENGINE_MODULE, "engine", str(d / "spec.json")], self.env(env), serve
        )
        proc.out = d / "out.json"
        return proc

    def stop(self) -> None:
        # Engines first (their zero-copy mappings outlive the daemon anyway), then daemons.
        for proc in sorted(self.procs, key=lambda p: p.popen.stdin is None):
            proc.stop()
        for d in self.sockets:
            shutil.rmtree(d, ignore_errors=True)
        if self.logs and os.environ.get("OUT"):  # tests/on_gpu/device.sh collects $OUT
            dest = Path(os.environ["OUT"]) / self.logs
            dest.mkdir(parents=True, exist_ok=True)
            for proc in self.procs:
                shutil.copy(proc.log_path, dest / proc.log_path.name)


def attach_config(sdir: Path) -> dict[str, Any]:
    """``model_loader_extra_config`` of an ``ipc_cache`` engine that waits for its daemon (no fallback)."""
    return {"socket_dir": str(sdir), "fallback": False, "state_timeout_s": 600}


def wait_socket(proc: Proc, sdir: Path, timeout: float = START_TIMEOUT_S, poll_s: float = 0.2) -> bool:
    """A daemon is ready once its socket accepts a connection (it binds only when loaded); False if it exited
    or ``timeout`` passed first. ``poll_s``: how often to look (a benchmark timing the readiness looks often)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in glob.glob(str(sdir / "*.sock")):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return True
            except OSError:
                pass
            finally:
                s.close()
        if not proc.alive:
            return False
        time.sleep(poll_s)
    return False


# --- ordinary vs prepacked ---------------------------------------------------------------------


def ordinary_and_prepacked(workdir: Path, case: str, model: Path, layer: str, *, extra_layers: tuple[str, ...] = (),
                           ordinary: dict[str, Any] | None = None, vllm_default: bool = False,
                           **kwargs: Any) -> tuple[dict, dict]:
    """Engine (a): ``model`` loaded the ordinary way with Marlin forced (``vllm_default``: with vLLM's own kernel
    choice, Machete on SM90, for ``--kernel machete`` bundles); engine (b): from its bundle.

    Both report every parameter's digest and the kernels of ``layer`` and ``extra_layers``; (b) must
    log the loader's timing line. ``ordinary``: more engine arguments for (a) only (e.g.
    ``moe_backend="marlin"``). Returns their results.
    """
    cluster = Cluster(workdir / f"{case}-engines", logs=f"gpu-logs-{case}")
    try:
        kw: dict[str, Any] = dict(digests=True, layers=[layer, *extra_layers], **kwargs)
        forced = {} if vllm_default else {"linear_backend": "marlin"}
        a_proc = cluster.engine(f"{case}-ordinary", model, **forced, **(ordinary or {}), **kw)
        a = a_proc.result()
        assert a is not None, a_proc.tail()
        b_proc = cluster.engine(f"{case}-prepacked", model, load_format="marlin_prepacked", **kw)
        b = b_proc.result()
        assert b is not None, b_proc.tail()
        log = b_proc.log()
    finally:
        cluster.stop()
    assert "marlin-pack: validate" in log and "prepacked layers" in log, log[-4000:]
    return a, b


def assert_engines_identical(a: dict, b: dict, layer: str, kernel: str = "MarlinLinearKernel") -> int:
    """Both engines ran ``layer`` on ``kernel``, hold bit-identical parameters (every digest), and
    generated the same tokens with exactly the same logprobs. Returns the number of parameters."""
    assert a["layers"]["kernels"][layer]["kernel"] == b["layers"]["kernels"][layer]["kernel"] == kernel
    da, db = a["layers"]["digests"], b["layers"]["digests"]
    assert da.keys() == db.keys()
    differ = [n for n in da if da[n] != db[n]]
    assert not differ, f"{len(differ)} parameters differ, e.g. {differ[:3]}"
    for oa, ob in zip(a["outputs"], b["outputs"], strict=True):
        assert oa["token_ids"] == ob["token_ids"] and oa["prompt_token_ids"] == ob["prompt_token_ids"]
        assert oa["logprobs"] == ob["logprobs"] and oa["prompt_logprobs"] == ob["prompt_logprobs"]
    return len(da)


# --- comparisons -----------------------------------------------------------------------------


def check_logprobs_close(o0: list[dict], o1: list[dict], n0: str, n1: str) -> None:
    """Greedy tokens agree until the first difference, where each is in the other's top-5;
    the prompt's top-1 tokens are in each other's top-5."""
    assert len(o0) == len(o1) == len(PROMPTS)
    for i, (a, b) in enumerate(zip(o0, o1, strict=True)):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        for idx, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"], strict=False)):
            if ta != tb:
                msg = f"prompt {i} token {idx}: {n0} {a['text']!r} vs {n1} {b['text']!r}"
                assert str(ta) in b["logprobs"][idx] and str(tb) in a["logprobs"][idx], msg
                break
        for pos, (pa, pb) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"], strict=True)):
            if pa is None or pb is None:
                assert pa is None and pb is None
                continue
            assert max(pa, key=pa.get) in pb and max(pb, key=pb.get) in pa, f"prompt {i} position {pos}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        _engine_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} engine SPEC.json")
