"""Helpers shared by the GPU test modules (no tests here; pytest does not collect this file).

* Constants: ``ROOT`` (the repository), ``ATTN`` (``MARLIN_PACK_TEST_ATTN``, default
  TRITON_ATTN), ``MLA_ENGINE_KWARGS`` (the attention backends of MLA models: DeepSeek),
  ``PROMPTS``, ``MAX_TOKENS``, ``TOP``.
* The engine subprocess: this file run as a script (``python _harness.py engine SPEC.json``)
  builds a ``vllm.LLM`` from the spec, generates, reports kernels, tensors, whose memory they
  live in and (with ``digests``) every parameter's sha256, per rank, as JSON; with ``serve``
  it then answers poke/peek commands on stdin.
* Processes: :class:`Proc` (one subprocess and its log) and :class:`Cluster` (engines and
  weight-cache daemons started side by side, each in its own session, stopped together);
  :func:`attach_config` (an ``ipc_cache`` engine's extra config) and :func:`wait_socket`
  (a daemon's readiness).
* :func:`check_logprobs_close` over the JSON results of that engine subprocess.

The test modules import it as ``from _harness import ...``: tests/on_gpu has no ``__init__.py``,
so pytest puts this folder on ``sys.path`` (and so does running a file here as a script).
Importing it touches no GPU (engine subprocesses fork TP workers after importing it).
"""

from __future__ import annotations

import functools
import glob
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
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

THIS = Path(__file__).resolve()  # the engine subprocess's script
START_TIMEOUT_S = 420

ENGINE_KWARGS: dict[str, Any] = dict(
    dtype="float16",
    enforce_eager=True,
    attention_backend=ATTN,
    gpu_memory_utilization=0.05,
    kv_cache_memory_bytes=256 << 20,  # no memory profiling: engines start side by side
    max_model_len=512,
    max_num_batched_tokens=512,
    max_num_seqs=4,
    seed=0,
    enable_flashinfer_autotune=False,
)
DAEMON_FLAGS = [
    "--dtype",
    "float16",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--gpu-memory-utilization",
    "0.05",
    "--kernel-config",
    '{"enable_flashinfer_autotune": false}',
]
# The tensors vLLM keeps for an AWQ/GPTQ routed-experts layer on Marlin MoE.
MOE_LEAVES = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros")
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

    return hashlib.sha256(
        t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    ).hexdigest()


def _layer_info(model: torch.nn.Module, names: list[str], digests: bool = False) -> dict[str, Any]:
    """Kernel, tensors (shape, dtype, pointer, sha256) and whose memory they live in; with
    ``digests``, also ``[dtype, shape, sha256]`` of every parameter (bitwise comparison)."""

    segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]

    def own(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in segments)

    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    info: dict[str, Any] = {"kernels": {}, "tensors": {}}
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
                "moe_backend": str(getattr(getattr(qm, "wna16_moe_backend", None), "value", None)),
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
    result = {"outputs": outputs, "layers": ranks[0], "ranks": ranks, "start_s": start_s}
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


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    out: Path | None = None
    started: float = field(default_factory=time.monotonic)
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
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
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

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class Cluster:
    """Every process of this module: started side by side, stopped at the end."""

    def __init__(self, workdir: Path, logs: str = "daemon-gpu-logs", port: int = 21000) -> None:
        self.workdir = workdir
        self.logs = logs  # where stop() copies the logs, under $OUT
        self.procs: list[Proc] = []
        self._port = port
        self.sockets: list[Path] = []

    def socket_dir(self) -> Path:
        # AF_UNIX paths are limited to ~107 bytes and vLLM's socket name takes 55: stay short.
        d = Path(tempfile.mkdtemp(prefix="mpd-", dir="/tmp"))
        self.sockets.append(d)
        return d

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        self._port += 40  # distinct rendezvous ports for processes starting together
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "VLLM_PORT": str(self._port),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        env.pop("VLLM_MARLIN_INPUT_DTYPE", None)
        env.update(extra or {})
        return env

    def _start(self, name: str, argv: list[str], env: dict[str, str], stdin: bool = False) -> Proc:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # setsid: its own process group, killed as a whole
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def daemon(self, name: str, model: Path, sdir: Path, *extra: str, vllm_cli: bool = False) -> Proc:
        if vllm_cli:  # plain vLLM CLI (no console script on the GPU machine)
            argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "preload", "--model", str(model)]
            argv += ["--load-format", "marlin_prepacked"]
        else:
            argv = [sys.executable, "-m", "marlin_pack.cli", "daemon", str(model)]
        argv += [*DAEMON_FLAGS, "--weight-cache-socket-dir", str(sdir), *extra]
        return self._start(name, argv, self._env())

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
        proc = self._start(
            name, [sys.executable, str(THIS), "engine", str(d / "spec.json")], self._env(env), serve
        )
        proc.out = d / "out.json"
        return proc

    def stop(self) -> None:
        # Engines first (their zero-copy mappings outlive the daemon anyway), then daemons.
        for proc in sorted(self.procs, key=lambda p: p.popen.stdin is None):
            proc.stop()
        for d in self.sockets:
            shutil.rmtree(d, ignore_errors=True)
        if os.environ.get("OUT"):  # tests/on_gpu/device.sh collects $OUT
            dest = Path(os.environ["OUT"]) / self.logs
            dest.mkdir(parents=True, exist_ok=True)
            for proc in self.procs:
                shutil.copy(proc.log_path, dest / proc.log_path.name)


def attach_config(sdir: Path) -> dict[str, Any]:
    """``model_loader_extra_config`` of an ``ipc_cache`` engine that waits for its daemon (no fallback)."""
    return {"socket_dir": str(sdir), "fallback": False, "state_timeout_s": 600}


def wait_socket(proc: Proc, sdir: Path, timeout: float = START_TIMEOUT_S) -> bool:
    """A daemon is ready once its socket accepts a connection (it binds only when loaded)."""
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
        time.sleep(0.2)
    return False


# --- ordinary vs prepacked ---------------------------------------------------------------------


def ordinary_and_prepacked(workdir: Path, case: str, model: Path, layer: str, *, extra_layers: tuple[str, ...] = (),
                           ordinary: dict[str, Any] | None = None, **kwargs: Any) -> tuple[dict, dict]:
    """Engine (a): ``model`` loaded the ordinary way with Marlin forced; engine (b): from its bundle.

    Both report every parameter's digest and the kernels of ``layer`` and ``extra_layers``; (b) must
    log the loader's timing line. ``ordinary``: more engine arguments for (a) only (e.g.
    ``moe_backend="marlin"``). Returns their results.
    """
    cluster = Cluster(workdir / f"{case}-engines", logs=f"gpu-logs-{case}")
    try:
        kw: dict[str, Any] = dict(digests=True, layers=[layer, *extra_layers], **kwargs)
        a_proc = cluster.engine(f"{case}-ordinary", model, linear_backend="marlin", **(ordinary or {}), **kw)
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


def assert_engines_identical(a: dict, b: dict, layer: str) -> int:
    """Both engines ran ``layer`` on Marlin, hold bit-identical parameters (every digest), and
    generated the same tokens with exactly the same logprobs. Returns the number of parameters."""
    assert a["layers"]["kernels"][layer]["kernel"] == b["layers"]["kernels"][layer]["kernel"] == "MarlinLinearKernel"
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
