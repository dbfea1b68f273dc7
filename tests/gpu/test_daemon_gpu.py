"""GPU acceptance of vLLM's weight cache (``vllm preload`` / ``--load-format ipc_cache``) with marlin-pack.

Three tiny checkpoints, each converted for TP 1 / float16:

=======  ==========================================  ======================================
name     checkpoint                                  covers
=======  ==========================================  ======================================
awq4     AWQ 4-bit, ``tiny``, g128                   zero points, aligned; Machete-capable
gptq4    GPTQ 4-bit, ``tiny-padded``, g32             padded qkv / gate_up, empty ``qzeros``
gptq8    GPTQ 8-bit, ``tiny-qwen2``, g128             qkv bias
=======  ==========================================  ======================================

Per checkpoint, four engine starts (FP16, eager, ``MARLIN_PACK_TEST_ATTN`` or TRITON_ATTN):
ordinary loading with ``linear_backend="marlin"``; ``ipc_cache`` with no daemon (disk
fallback); and two ``ipc_cache`` engines attached to the daemon with ``fallback: false``.
Their greedy outputs and top-5 prompt/sample logprobs agree; the attached engines hold,
for the fused qkv_proj / gate_up_proj layers, the daemon's memory (not their own
allocator's; a write through one engine's mapping is seen by the other) with contents
bit-identical to ordinary loading. The daemons are filled from the bundles: two by
``marlin-pack daemon``, one (gptq8) by plain ``vllm preload --load-format
marlin_prepacked`` when the entry point is installed. Refused with vLLM's
``UnsupportedQuantForIPCError``: a Machete-served layer (``--linear-backend machete``) in a
daemon, and ``VLLM_MARLIN_INPUT_DTYPE=int8`` in an engine (even with fallback on).
Measured (printed as ``marlin-pack: timing`` lines, also in ``timings.json``): daemon fill
time from the bundle vs from the checkpoint, and engines' model-loading time.

Daemons run in their own session (``setsid``), each with its own short socket directory
(readiness: its socket accepts a connection); their process groups are killed at the end.
Engines are subprocesses (this file run as a script) with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and an explicit ``kv_cache_memory_bytes``, so that all of them start concurrently on one GPU.
``MARLIN_PACK_TEST_BENCH_PRESET`` (e.g. ``llama-1gb``) times the fills on a larger AWQ model
(default: the awq4 checkpoint).

Run on the GPU machine::

    pip install -e .    # so the vllm.general_plugins entry point exists
    python -m pytest tests/gpu/test_daemon_gpu.py -m gpu -v -s
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from test_loader_gpu import ATTN, MAX_TOKENS, PROMPTS, ROOT, TOP

THIS = Path(__file__).resolve()
BENCH_PRESET = os.environ.get("MARLIN_PACK_TEST_BENCH_PRESET")
START_TIMEOUT_S = 420
XOR = 0x5A5A5A5A

pytestmark = [
    pytest.mark.gpu,
    # A string, evaluated lazily: see test_loader_gpu.py.
    pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU"),
]

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
MODELS = {  # name -> (format, preset, bits, group size)
    "awq4": ("awq", "tiny", 4, 128),
    "gptq4": ("gptq", "tiny-padded", 4, 32),
    "gptq8": ("gptq", "tiny-qwen2", 8, 128),
}
FUSED = [
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.1.mlp.gate_up_proj",
]
STARTS = ["ordinary", "fallback", "attach1", "attach2"]


def _plugin_installed() -> bool:
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
        kernel = getattr(qm, "kernel", None)
        info["kernels"][layer] = {
            "method": type(qm).__name__,
            "kernel": type(kernel).__name__,
            "act_type": str(getattr(getattr(kernel, "config", None), "act_type", None)),
            "input_global_scale": repr(getattr(modules[layer], "input_global_scale", "<missing>")),
        }
        for leaf in ("qweight", "scales", "qzeros", "bias"):
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
    flat = dict(model.named_parameters())[name].data.view(-1)
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
    if not _plugin_installed():
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
        **kwargs: Any,
    ) -> Proc:
        d = self.workdir / name
        d.mkdir(parents=True, exist_ok=True)
        spec = {
            "model": str(model),
            "kwargs": {**ENGINE_KWARGS, **kwargs},
            "layers": FUSED,
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
        if os.environ.get("OUT"):  # tests/gpu/device.sh collects $OUT
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


def _seconds(pattern: str, log: str) -> float | None:
    m = re.search(pattern, log)
    return float(m.group(1)) if m else None


FILL_RE = r"filled its model in ([0-9.]+) s"
LOAD_RE = r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds"


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


# --- the module's processes -------------------------------------------------------------------


def _write(name: str, out: Path, preset: str | None = None) -> Path:
    import marlin_pack
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    fmt, default_preset, bits, group = MODELS.get(name, ("awq", preset, 4, 128))
    shape = PRESETS[preset or default_preset]
    device = "cuda" if preset else "cpu"
    if fmt == "awq":
        d = write_awq_checkpoint(out, shape, group_size=group, device=device)
    else:
        d = write_gptq_checkpoint(out, shape, bits=bits, group_size=group, device=device)
    marlin_pack.convert(d, tp_sizes=(1,), dtype="float16", device=device)
    return d


@dataclass
class Results:
    workdir: Path
    cluster: Cluster
    models: dict[str, Path]
    daemons: dict[str, Proc]
    engines: dict[tuple[str, str], Proc]
    results: dict[tuple[str, str], dict[str, Any]]
    machete: Proc | None
    int8: Proc
    vllm_cli_daemon: bool
    timings: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    workdir = tmp_path_factory.mktemp("daemon-gpu")
    models = {name: _write(name, workdir / name) for name in MODELS}
    cluster = Cluster(workdir)
    try:
        empty = cluster.socket_dir()  # no daemon there: the disk-fallback engines
        sdirs = {name: cluster.socket_dir() for name in MODELS}
        vllm_cli = _plugin_installed()
        daemons = {
            name: cluster.daemon(
                f"daemon-{name}", models[name], sdirs[name], vllm_cli=vllm_cli and name == "gptq8"
            )
            for name in MODELS
        }
        # Machete exists on SM90 only (H100/H200); elsewhere this daemon is not started.
        hopper = torch.cuda.get_device_capability() == (9, 0)
        machete = (
            None
            if not hopper
            else cluster.daemon(
                "daemon-machete",
                models["awq4"],
                cluster.socket_dir(),
                "--load-format",
                "auto",
                "--linear-backend",
                "machete",
            )
        )
        engines: dict[tuple[str, str], Proc] = {}
        for name, model in models.items():
            engines[name, "ordinary"] = cluster.engine(f"{name}-ordinary", model, linear_backend="marlin")
            engines[name, "fallback"] = cluster.engine(
                f"{name}-fallback",
                model,
                load_format="ipc_cache",
                model_loader_extra_config={"socket_dir": str(empty), "fallback": True},
            )
            for start in ("attach1", "attach2"):  # wait for their daemon (fallback off)
                engines[name, start] = cluster.engine(
                    f"{name}-{start}",
                    model,
                    serve=True,
                    load_format="ipc_cache",
                    model_loader_extra_config=attach_config(sdirs[name]),
                )
        ready = {name: wait_socket(daemons[name], sdirs[name]) for name in MODELS}
        assert all(ready.values()), "\n".join(daemons[n].tail() for n, ok in ready.items() if not ok)
        # int8 activations attach to a ready daemon with fallback on: refused all the same.
        int8 = cluster.engine(
            "gptq4-int8",
            models["gptq4"],
            env={"VLLM_MARLIN_INPUT_DTYPE": "int8"},
            load_format="ipc_cache",
            model_loader_extra_config={"socket_dir": str(sdirs["gptq4"]), "fallback": True},
        )
        results: dict[tuple[str, str], dict[str, Any]] = {}
        for key, proc in engines.items():
            res = proc.result()
            assert res is not None, proc.tail()
            results[key] = res
        yield Results(workdir, cluster, models, daemons, engines, results, machete, int8, vllm_cli)
    finally:
        cluster.stop()


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_four_starts_agree(run: Results, name: str) -> None:
    ref = run.results[name, "ordinary"]["outputs"]
    for start in STARTS[1:]:
        check_logprobs_close(ref, run.results[name, start]["outputs"], "ordinary", start)
    for start in STARTS:
        log = run.engines[name, start].log()
        assert "Using MarlinLinearKernel for mixed-precision linear" in log, run.engines[name, start].tail()
        for layer, k in run.results[name, start]["layers"]["kernels"].items():
            assert k["kernel"] == "MarlinLinearKernel" and k["act_type"] == "torch.float16", (start, layer, k)
            assert k["input_global_scale"] == "None", (start, layer, k)
    exact = all(run.results[name, s]["outputs"] == ref for s in STARTS)
    print(f"{name}: outputs of the four starts bit-identical: {exact}")


@pytest.mark.parametrize("name", list(MODELS))
def test_engines_loaded_as_intended(run: Results, name: str) -> None:
    fb, a1, a2 = (run.engines[name, s].log() for s in ("fallback", "attach1", "attach2"))
    assert "falling back to disk loading" in fb, run.engines[name, "fallback"].tail()
    assert "ipc_cache engine: AWQ/GPTQ linear layers use MarlinLinearKernel" in fb
    for log, proc in ((a1, run.engines[name, "attach1"]), (a2, run.engines[name, "attach2"])):
        assert "Mapped" in log and "from the weight cache daemon (zero_copy mode)" in log, proc.tail()
        assert "falling back" not in log and "marlin-pack: ipc_cache engine" in log, proc.tail()
    own = {s: run.results[name, s]["layers"] for s in STARTS}
    assert own["ordinary"]["params_in_own_memory"] == own["ordinary"]["params"] > 0
    assert own["fallback"]["params_in_own_memory"] == own["fallback"]["params"] > 0
    for s in ("attach1", "attach2"):  # every weight is mapped from the daemon, none allocated here
        assert own[s]["params_in_own_memory"] == 0 and own[s]["params"] > 0, own[s]


@pytest.mark.parametrize("name", list(MODELS))
def test_attachments_share_the_daemon_tensors(run: Results, name: str) -> None:
    ref = run.results[name, "ordinary"]["layers"]["tensors"]
    a1 = run.results[name, "attach1"]["layers"]["tensors"]
    a2 = run.results[name, "attach2"]["layers"]["tensors"]
    assert a1.keys() == a2.keys() == ref.keys()
    leaves = {n.rsplit(".", 1)[1] for n in ref}
    assert {"qweight", "scales", "qzeros"} <= leaves
    if name == "gptq8":
        assert "model.layers.0.self_attn.qkv_proj.bias" in ref
    for tensor, want in ref.items():
        for got in (a1[tensor], a2[tensor]):
            assert (got["shape"], got["dtype"], got["sha256"]) == (
                want["shape"],
                want["dtype"],
                want["sha256"],
            ), tensor
            assert got["device"].startswith("cuda")
            assert got["own_memory"] in (False, None), tensor  # None: GPTQ's empty qzeros
    same_ptr = all(a1[t]["ptr"] == a2[t]["ptr"] for t in a1)
    print(f"{name}: attachments' data_ptr equal in both processes: {same_ptr}")
    # The same physical memory: a write through attach1's mapping is read back by attach2.
    e1, e2 = run.engines[name, "attach1"], run.engines[name, "attach2"]
    target = f"{FUSED[1]}.qweight"
    old = e1.command(target, XOR)
    try:
        assert e2.command(target, 0) == old ^ XOR, "attach2 does not see attach1's write"
    finally:
        assert e1.command(target, XOR) == old ^ XOR  # restore
    assert e2.command(target, 0) == old


@pytest.mark.parametrize("name", list(MODELS))
def test_daemons_filled_from_the_bundle(run: Results, name: str) -> None:
    proc = run.daemons[name]
    log = proc.log()
    assert "plugin active in weight-cache daemon process" in log, proc.tail()
    assert "quantized layers use MarlinLinearKernel" in log, proc.tail()  # the bundle's checks passed
    assert "not using the bundle" not in log
    assert re.search(
        r"weight-cache target daemon rank 0 filled its model in [0-9.]+ s \(load format marlin_prepacked\)",
        log,
    )
    if name == "gptq8" and run.vllm_cli_daemon:
        assert "marlin-pack: vllm preload" not in log  # plain `vllm preload`, not the launcher
    if name != "gptq8":
        assert "marlin-pack: vllm preload --model" in log


def test_plain_vllm_preload_gets_the_plugin(run: Results) -> None:
    if not run.vllm_cli_daemon:
        pytest.skip("marlin-pack's vllm.general_plugins entry point is not installed (pip install -e .)")
    log = run.daemons["gptq8"].log()
    assert "plugin active in weight-cache daemon process" in log, run.daemons["gptq8"].tail()


def test_machete_layer_is_refused(run: Results) -> None:
    if run.machete is None:
        pytest.skip("Machete needs compute capability 9.0 (H100/H200)")
    code = run.machete.wait_exit()
    log = run.machete.log()
    assert code not in (None, 0), run.machete.tail()
    assert "Using MacheteLinearKernel" in log, run.machete.tail()
    assert "UnsupportedQuantForIPCError" in log, run.machete.tail()
    assert "AutoAWQMarlinLinearMethod does not support loading from pre-processed weights" in log


def test_int8_activations_are_refused(run: Results) -> None:
    code = run.int8.wait_exit()
    log = run.int8.log()
    assert code not in (None, 0), run.int8.tail()
    assert "UnsupportedQuantForIPCError" in log, run.int8.tail()
    assert "AutoGPTQLinearMethod does not support loading from pre-processed weights" in log
    assert "MARLIN_PACK_ENGINE_READY" not in log


def test_fill_and_load_timings(run: Results) -> None:
    """Last: stops everything else, then times a bundle fill against a checkpoint fill
    (``--load-format auto --linear-backend marlin``) and an engine's IPC model loading."""
    for key, proc in run.engines.items():
        run.timings[f"engine {key[0]} {key[1]} model loading s"] = _seconds(LOAD_RE, proc.log())
    for name, proc in run.daemons.items():
        run.timings[f"daemon {name} fill (bundle, concurrent start) s"] = _seconds(FILL_RE, proc.log())
    run.cluster.stop()
    cluster = Cluster(run.workdir / "bench")
    (run.workdir / "bench").mkdir(exist_ok=True)
    try:
        model = (
            _write("bench", run.workdir / "bench-model", BENCH_PRESET) if BENCH_PRESET else run.models["awq4"]
        )
        s_bundle, s_ckpt = cluster.socket_dir(), cluster.socket_dir()
        bundle = cluster.daemon("bench-daemon-bundle", model, s_bundle)
        assert wait_socket(bundle, s_bundle), bundle.tail()
        ckpt = cluster.daemon(
            "bench-daemon-checkpoint", model, s_ckpt, "--load-format", "auto", "--linear-backend", "marlin"
        )
        engine = cluster.engine(
            "bench-engine-ipc",
            model,
            load_format="ipc_cache",
            model_loader_extra_config={"socket_dir": str(s_bundle), "fallback": False},
        )
        assert engine.result() is not None, engine.tail()
        assert wait_socket(ckpt, s_ckpt), ckpt.tail()
        run.timings.update(
            {
                "bench model": BENCH_PRESET or "awq4 (tiny)",
                "daemon fill from the bundle s": _seconds(FILL_RE, bundle.log()),
                "daemon fill from the checkpoint (auto + marlin) s": _seconds(FILL_RE, ckpt.log()),
                "engine model loading through IPC s": _seconds(LOAD_RE, engine.log()),
            }
        )
    finally:
        cluster.stop()
        (run.workdir / "timings.json").write_text(json.dumps(run.timings, indent=2))
        for k, v in run.timings.items():
            print(f"marlin-pack: timing {k}: {v}")
    assert run.timings["daemon fill from the bundle s"] is not None
    assert run.timings["daemon fill from the checkpoint (auto + marlin) s"] is not None
    assert run.timings["engine model loading through IPC s"] is not None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        _engine_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} engine SPEC.json")
