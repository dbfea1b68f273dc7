"""GPU acceptance of vLLM's weight cache (``vllm preload`` / ``--load-format ipc_cache``) with marlin-pack.

Three tiny checkpoints, each converted for TP 1 / float16:

=======  ==========================================  ======================================
name     checkpoint                                  covers
=======  ==========================================  ======================================
awq4     AWQ 4-bit, ``tiny``, g128                   zero points, aligned; Machete-capable
gptq4    GPTQ 4-bit, ``tiny-padded``, g32             padded qkv / gate_up, empty ``qzeros``
gptq8    GPTQ 8-bit, ``tiny-qwen2``, g128             qkv bias
=======  ==========================================  ======================================

plus ``qwen3moe-gptq4`` (GPTQ 4-bit Qwen3-MoE, ``tiny-qwen3moe``, g128: routed experts on Marlin
MoE, whose ``w13_qweight`` is the tensor poked through the shared mappings), ``qwen3moe-ct4-asym``
(the same with compressed-tensors W4A16_ASYM experts: ``w13_weight_packed`` poked), and the
compressed-tensors ``ct4`` / ``ct4-asym``, and ``awq4-machete``: the awq4 shape converted with
``--kernel machete`` (H100/H200 only), whose four starts all keep vLLM's own choice, Machete: the
ordinary one with vLLM's default kernel choice, the fallback and attached engines because the
model's bundle holds Machete layers (nothing is forced), the daemon filled from that bundle.

Per checkpoint, four engine starts (FP16, eager, ``MARLIN_PACK_TEST_ATTN`` or TRITON_ATTN):
ordinary loading with ``linear_backend="marlin"`` (vLLM's default for ``awq4-machete``); ``ipc_cache`` with no daemon (disk
fallback); and two ``ipc_cache`` engines attached to the daemon with ``fallback: false``.
Their greedy outputs and top-5 prompt/sample logprobs agree; the attached engines hold,
for the fused qkv_proj / gate_up_proj layers, the daemon's memory (not their own
allocator's; a write through one engine's mapping is seen by the other) with contents
bit-identical to ordinary loading. The daemons are filled from the bundles: two by
``marlin-pack daemon``, one (gptq8) by plain ``vllm preload --load-format
marlin_prepacked`` when the entry point is installed. A daemon whose layers vLLM serves with
Machete (``--linear-backend machete``) comes up (Machete layers are shared since issue 49); refused
with vLLM's ``UnsupportedQuantForIPCError``: ``VLLM_MARLIN_INPUT_DTYPE=int8`` in an engine (even
with fallback on).
Measured (printed as ``marlin-pack: timing`` lines, also in ``timings.json``): daemon fill
time from the bundle vs from the checkpoint, and engines' model-loading time.

The processes come from ``_harness.Cluster``. Daemons run in their own session (``setsid``),
each with its own short socket directory (readiness: its socket accepts a connection); their
process groups are killed at the end. Engines are subprocesses (``marlin_pack.testing.engine_harness`` run as a
script) with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and an explicit ``kv_cache_memory_bytes``,
so that all of them start concurrently on one GPU.
``MARLIN_PACK_TEST_BENCH_PRESET`` (e.g. ``llama-1gb``) times the fills on a larger AWQ model
(default: the awq4 checkpoint).

Run on the GPU machine::

    pip install -e .    # so the vllm.general_plugins entry point exists
    python -m pytest tests/on_gpu/test_daemon_gpu.py -m gpu -v -s
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import FUSED, Cluster, Proc, attach_config, check_logprobs_close, plugin_installed, wait_socket

BENCH_PRESET = os.environ.get("MARLIN_PACK_TEST_BENCH_PRESET")
XOR = 0x5A5A5A5A

pytestmark = [
    pytest.mark.gpu,
    # A string, evaluated lazily: see test_loader_gpu.py.
    pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU"),
]

ALL_MODELS = {  # name -> (format, preset, bits, group size)
    "awq4": ("awq", "tiny", 4, 128),
    "gptq4": ("gptq", "tiny-padded", 4, 32),
    "gptq8": ("gptq", "tiny-qwen2", 8, 128),
    "ct4": ("ct", "tiny", 4, 128),  # compressed-tensors W4A16, symmetric (empty weight_zero_point)
    "ct4-asym": ("ct-asym", "tiny", 4, 64),  # compressed-tensors W4A16_ASYM: zero points
    "qwen3moe-gptq4": ("moe-gptq", "tiny-qwen3moe", 4, 128),  # mixture of experts (marlin_pack.testing.synthetic_moe)
    "qwen3moe-ct4-asym": ("moe-ct-asym", "tiny-qwen3moe", 4, 128),  # compressed-tensors W4A16_ASYM experts
    "gptq4-vocab": ("gptq", "tiny-vocab", 4, 128),  # an embedding and a head large enough to copy beside the construction
    "awq4-machete": ("awq", "tiny", 4, 128),  # a --kernel machete bundle: Machete in every start (SM90 only)
    # served through vLLM's Transformers backend (0.33+): written by transformers' own Olmo2 class
    "olmo2-awq-backend": ("arch-awq:Olmo2ForCausalLM", None, 4, 128),
}
# The kernel each model's bundle is converted for (marlin unless named here) and the kernel its layers run on.
KERNEL = {"awq4-machete": "machete"}
KERNEL_CLASS = {"marlin": "MarlinLinearKernel", "machete": "MacheteLinearKernel"}
# The I/O plan a daemon's fill is forced to (MARLIN_PACK_IO) per model: the embedding and the head copied beside the
# construction whatever the plan would be on this machine.
DAEMON_IO = {"gptq4-vocab": {"MARLIN_PACK_IO": json.dumps({"common_during_build": True})}}
# The layers each engine reports (kernels, tensors); the first tensor of the second is poked through the mappings.
MOE_EXPERTS = "model.layers.0.mlp.experts.routed_experts"
LAYERS = {"qwen3moe-gptq4": ["model.layers.0.self_attn.qkv_proj", MOE_EXPERTS],
          "qwen3moe-ct4-asym": ["model.layers.0.self_attn.qkv_proj", MOE_EXPERTS]}
POKE = {"qwen3moe-gptq4": f"{MOE_EXPERTS}.w13_qweight", "qwen3moe-ct4-asym": f"{MOE_EXPERTS}.w13_weight_packed"}
# MARLIN_PACK_TEST_DAEMON_MODELS=ct4,ct4-asym runs a subset (the Machete and int8 refusals need
# awq4 and gptq4, plain `vllm preload` gptq8; their tests skip when those are left out).
_SELECTED = os.environ.get("MARLIN_PACK_TEST_DAEMON_MODELS")
MODELS = {n: v for n, v in ALL_MODELS.items() if not _SELECTED or n in _SELECTED.split(",")}
STARTS = ["ordinary", "fallback", "attach1", "attach2"]
# The models of the tests without a `name` parameter: the daemon filled by plain `vllm preload`, the checkpoint
# of the Machete daemon, the model the int8 engine attaches to.
PLAIN_PRELOAD, MACHETE_DAEMON, INT8 = "gptq8", "awq4", "gptq4"
READS = {  # test -> the model it reads
    "test_plain_vllm_preload_gets_the_plugin": PLAIN_PRELOAD,
    "test_machete_layers_are_shared": MACHETE_DAEMON,
    "test_int8_activations_are_refused": INT8,
}
TIMINGS = "test_fill_and_load_timings"  # times the first model started: awq4 when no other is


def models_to_start(selected: list[tuple[str, str | None]]) -> list[str]:
    """The models whose engines and daemon the selected tests read, in ``MODELS`` order.

    ``selected`` holds (test function, its ``name`` parameter or None) of each selected test. A ``-k``
    selection starts only these: every model is four engines and a daemon, and all nine at once, in each of
    several selections side by side, took a 128 GiB machine down (2026-12-06).
    """
    names = {param or READS.get(test) for test, param in selected} - {None}
    if not names and any(test == TIMINGS for test, _ in selected):
        names = {"awq4"}
    return [n for n in MODELS if n in names]


def _kernel(name: str) -> str:
    return KERNEL.get(name, "marlin")


def _ordinary_backend(name: str) -> dict[str, str]:
    """The ordinary start's kernel choice: Marlin forced, or vLLM's own for a Machete bundle's model."""
    return {} if _kernel(name) == "machete" else {"linear_backend": "marlin"}


def _skip_without_machete(name: str) -> None:
    if _kernel(name) == "machete" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Machete needs compute capability 9.0 (H100/H200)")


def _layers(name: str) -> list[str]:
    return LAYERS.get(name, FUSED)


def _moe(name: str) -> dict[str, str]:
    """Engine arguments: Marlin MoE for the ordinary start of an MoE model (as the weight cache forces for its starts)."""
    return {"moe_backend": "marlin"} if ALL_MODELS[name][0].startswith("moe-") else {}


def _leaves(name: str) -> tuple[str, str, str]:
    """The (weight, scales, zero points) parameter names vLLM keeps for this model's Marlin layers."""
    if ALL_MODELS[name][0].removeprefix("moe-").startswith("ct"):
        return ("weight_packed", "weight_scale", "weight_zero_point")
    return ("qweight", "scales", "qzeros")


def _seconds(pattern: str, log: str) -> float | None:
    m = re.search(pattern, log)
    return float(m.group(1)) if m else None


FILL_RE = r"filled its model in ([0-9.]+) s"
LOAD_RE = r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds"


# --- the module's processes -------------------------------------------------------------------


def _write(name: str, out: Path, preset: str | None = None) -> Path:
    import marlin_pack
    from marlin_pack.testing.synthetic import (
        PRESETS,
        write_awq_checkpoint,
        write_compressed_tensors_checkpoint,
        write_gptq_checkpoint,
    )

    fmt, default_preset, bits, group = MODELS.get(name, ("awq", preset, 4, 128))
    device = "cuda" if preset else "cpu"
    if fmt.startswith("arch-"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for arch_checkpoints
        from arch_checkpoints import write_arch_checkpoint

        arch_fmt, arch = fmt.removeprefix("arch-").split(":")
        d = write_arch_checkpoint(out, arch, arch_fmt, bits=bits, group_size=group, dtype=torch.float16, tokenizer=True)
        marlin_pack.convert(d, tp=(1,), dtype="float16", kernel="marlin")
        return d
    if fmt.startswith("moe-"):
        from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

        moe_fmt = fmt.removeprefix("moe-")
        ct = {"fmt": "compressed-tensors", "symmetric": moe_fmt == "ct"} if moe_fmt.startswith("ct") else {"fmt": moe_fmt}
        d = write_moe_checkpoint(out, MOE_PRESETS[default_preset], bits=bits, group_size=group, dtype=torch.float16,
                                 device=device, tokenizer=True, **ct)
        marlin_pack.convert(d, tp=(1,), dtype="float16", device=device, kernel="marlin")
        return d
    kernel = KERNEL.get(name, "marlin")
    shape = PRESETS[preset or default_preset]
    if fmt.startswith("ct"):
        d = write_compressed_tensors_checkpoint(out, shape, bits=bits, group_size=group, symmetric=fmt == "ct",
                                                dtype=torch.float16, device=device)
    elif fmt == "awq":
        d = write_awq_checkpoint(out, shape, group_size=group, device=device)
    else:
        d = write_gptq_checkpoint(out, shape, bits=bits, group_size=group, device=device)
    marlin_pack.convert(d, tp=(1,), dtype="float16", device=device, kernel=kernel)
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
    machete_sdir: Path | None
    int8: Proc | None
    vllm_cli_daemon: bool
    timings: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    workdir = tmp_path_factory.mktemp("daemon-gpu")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    selected = [
        (item.originalname, getattr(item, "callspec", None) and item.callspec.params.get("name"))
        for item in request.session.items
        if item.module.__name__ == __name__
    ]
    wanted, tests = models_to_start(selected), {test for test, _ in selected}
    print(f"marlin-pack: starting the models the selected tests read: {', '.join(wanted)}")
    models = {name: _write(name, workdir / name) for name in wanted if hopper or _kernel(name) != "machete"}
    cluster = Cluster(workdir)
    try:
        empty = cluster.socket_dir()  # no daemon there: the disk-fallback engines
        sdirs = {name: cluster.socket_dir() for name in models}
        vllm_cli = plugin_installed()
        daemons = {
            name: cluster.daemon(
                f"daemon-{name}", models[name], sdirs[name], vllm_cli=vllm_cli and name == PLAIN_PRELOAD, env=DAEMON_IO.get(name)
            )
            for name in models
        }
        # Machete exists on SM90 only (H100/H200); elsewhere this daemon is not started.
        machete_sdir = (cluster.socket_dir() if hopper and "test_machete_layers_are_shared" in tests
                        and MACHETE_DAEMON in models else None)
        machete = (
            None
            if machete_sdir is None
            else cluster.daemon(
                "daemon-machete",
                models[MACHETE_DAEMON],
                machete_sdir,
                "--load-format",
                "auto",
                "--linear-backend",
                "machete",
            )
        )
        engines: dict[tuple[str, str], Proc] = {}
        for name, model in models.items():
            digests = name in DAEMON_IO  # every parameter compared (the embedding and the head too)
            engines[name, "ordinary"] = cluster.engine(
                f"{name}-ordinary", model, **_ordinary_backend(name), layers=_layers(name), digests=digests, **_moe(name)
            )
            engines[name, "fallback"] = cluster.engine(
                f"{name}-fallback",
                model,
                layers=_layers(name),
                load_format="ipc_cache",
                model_loader_extra_config={"socket_dir": str(empty), "fallback": True},
            )
            for start in ("attach1", "attach2"):  # wait for their daemon (fallback off)
                engines[name, start] = cluster.engine(
                    f"{name}-{start}",
                    model,
                    layers=_layers(name),
                    digests=digests,
                    serve=True,
                    load_format="ipc_cache",
                    model_loader_extra_config=attach_config(sdirs[name]),
                )
        ready = {name: wait_socket(daemons[name], sdirs[name]) for name in models}
        assert all(ready.values()), "\n".join(daemons[n].tail() for n, ok in ready.items() if not ok)
        # int8 activations attach to a ready daemon with fallback on: refused all the same.
        int8 = None if "test_int8_activations_are_refused" not in tests or INT8 not in models else cluster.engine(
            "gptq4-int8",
            models[INT8],
            env={"VLLM_MARLIN_INPUT_DTYPE": "int8"},
            load_format="ipc_cache",
            model_loader_extra_config={"socket_dir": str(sdirs[INT8]), "fallback": True},
        )
        results: dict[tuple[str, str], dict[str, Any]] = {}
        for key, proc in engines.items():
            res = proc.result()
            assert res is not None, proc.tail()
            results[key] = res
        yield Results(workdir, cluster, models, daemons, engines, results, machete, machete_sdir, int8, vllm_cli)
    finally:
        cluster.stop()


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_four_starts_agree(run: Results, name: str) -> None:
    _skip_without_machete(name)
    ref = run.results[name, "ordinary"]["outputs"]
    for start in STARTS[1:]:
        check_logprobs_close(ref, run.results[name, start]["outputs"], "ordinary", start)
    kernel = KERNEL_CLASS[_kernel(name)]
    for start in STARTS:
        log = run.engines[name, start].log()
        assert f"Using {kernel} for mixed-precision linear" in log, run.engines[name, start].tail()
        for layer, k in run.results[name, start]["layers"]["kernels"].items():
            if layer == MOE_EXPERTS:  # the routed experts: Marlin MoE in every start
                assert (k["kernel"], k["moe_backend"]) == ("MarlinExperts", "MARLIN"), (start, layer, k)
            else:
                assert k["kernel"] == kernel, (start, layer, k)
            assert k["act_type"] == "torch.float16", (start, layer, k)
            # 16-bit activations: Marlin's layers hold input_global_scale = None up to 0.33 (none from 0.34: finish
            # "w_zp"), Machete's have no such attribute
            dense = k["kernel"] in ("MarlinLinearKernel", "MacheteLinearKernel")  # experts: w13_input_global_scale
            marlin_sets_it = _running_release().finish != "w_zp" and k["kernel"] != "MacheteLinearKernel"
            want_scale = "None" if marlin_sets_it or not dense else "'<missing>'"
            assert k["input_global_scale"] == want_scale, (start, layer, k)
    exact = all(run.results[name, s]["outputs"] == ref for s in STARTS)
    print(f"{name}: outputs of the four starts bit-identical: {exact}")


@pytest.mark.parametrize("name", list(MODELS))
def test_engines_loaded_as_intended(run: Results, name: str) -> None:
    _skip_without_machete(name)
    fb, a1, a2 = (run.engines[name, s].log() for s in ("fallback", "attach1", "attach2"))
    assert "falling back to disk loading" in fb, run.engines[name, "fallback"].tail()
    if _kernel(name) == "machete":
        assert "ipc_cache engine: the model's bundle holds vLLM's SM90 choice (Machete layers): nothing is forced" in fb
    else:
        assert "ipc_cache engine: AWQ/GPTQ/compressed-tensors linear layers use MarlinLinearKernel" in fb
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
    _skip_without_machete(name)
    ref = run.results[name, "ordinary"]["layers"]["tensors"]
    a1 = run.results[name, "attach1"]["layers"]["tensors"]
    a2 = run.results[name, "attach2"]["layers"]["tensors"]
    assert a1.keys() == a2.keys() == ref.keys()
    leaves = {n.rsplit(".", 1)[1] for n in ref}
    assert set(_leaves(name)) <= leaves
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
            assert got["own_memory"] in (False, None), tensor  # None: the empty zero points of symmetric schemes
    same_ptr = all(a1[t]["ptr"] == a2[t]["ptr"] for t in a1)
    print(f"{name}: attachments' data_ptr equal in both processes: {same_ptr}")
    # The same physical memory: a write through attach1's mapping is read back by attach2.
    e1, e2 = run.engines[name, "attach1"], run.engines[name, "attach2"]
    target = POKE.get(name, f"{FUSED[1]}.{_leaves(name)[0]}")
    old = e1.command(target, XOR)
    try:
        assert e2.command(target, 0) == old ^ XOR, "attach2 does not see attach1's write"
    finally:
        assert e1.command(target, XOR) == old ^ XOR  # restore
    assert e2.command(target, 0) == old


@pytest.mark.parametrize("name", list(MODELS))
def test_daemons_filled_from_the_bundle(run: Results, name: str) -> None:
    _skip_without_machete(name)
    proc = run.daemons[name]
    log = proc.log()
    assert "plugin active in weight-cache daemon process" in log, proc.tail()
    if _kernel(name) == "machete":  # the bundle's checks passed, vLLM's own choice kept
        assert re.search(r"quantized layers use vLLM's own choice, as the bundle holds: .*MacheteLinearKernel", log), proc.tail()
    else:
        assert "quantized layers use MarlinLinearKernel" in log, proc.tail()
    assert "not using the bundle" not in log
    assert re.search(
        r"weight-cache target daemon rank 0 filled its model in [0-9.]+ s \(load format marlin_prepacked\)",
        log,
    )
    if "I/O plan helpers" in log and not name.startswith("qwen3moe"):
        # The fill copied with helpers: those the daemon started as its process began (preload), with the
        # bundle page-locked in them by then, so its copy registered nothing. The loader's line says so (the
        # preload's own line is logged before vLLM configures logging in the daemon, so it is not asserted).
        assert re.search(r"helpers ready after [0-9.]+ s, [0-9.]+ [GM]B page-locked ahead", log), proc.tail()
        assert "exit in the background" in log, proc.tail()
    if name in DAEMON_IO:  # common_during_build: the embedding and the head copied beside the construction
        assert "(2 of its names copied beside the construction)" in log, proc.tail()
    if name == PLAIN_PRELOAD and run.vllm_cli_daemon:
        assert "marlin-pack: vllm preload" not in log  # plain `vllm preload`, not the launcher
    if name != PLAIN_PRELOAD:
        assert "marlin-pack: vllm preload --model" in log


@pytest.mark.parametrize("name", [n for n in MODELS if n in DAEMON_IO])
def test_daemon_options_keep_every_parameter(run: Results, name: str) -> None:
    """A daemon filled with another I/O plan (``common_during_build``: the embedding and the head copied
    beside the construction) serves every parameter bit for bit as ordinary loading holds it."""
    ref = run.results[name, "ordinary"]["layers"]["digests"]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= ref.keys()
    for start in ("attach1", "attach2"):
        got = run.results[name, start]["layers"]["digests"]
        assert got.keys() == ref.keys(), (start, sorted(got.keys() ^ ref.keys())[:5])
        assert [n for n in ref if got[n] != ref[n]] == [], start


def test_plain_vllm_preload_gets_the_plugin(run: Results) -> None:
    if not run.vllm_cli_daemon or PLAIN_PRELOAD not in run.daemons:
        pytest.skip("marlin-pack's entry point is not installed (pip install -e .), or gptq8 is not selected")
    daemon = run.daemons[PLAIN_PRELOAD]
    assert "plugin active in weight-cache daemon process" in daemon.log(), daemon.tail()


def test_machete_layers_are_shared(run: Results) -> None:
    """A daemon whose AWQ layers vLLM serves with Machete (``--linear-backend machete``, plain loading) comes up:
    Machete with 16-bit activations is shared too since issue 49 (it was refused before)."""
    if run.machete is None or run.machete_sdir is None:
        pytest.skip(f"Machete needs compute capability 9.0 (H100/H200), and {MACHETE_DAEMON} among the models")
    assert wait_socket(run.machete, run.machete_sdir), run.machete.tail()
    log = run.machete.log()
    assert "Using MacheteLinearKernel" in log, run.machete.tail()
    assert "UnsupportedQuantForIPCError" not in log, run.machete.tail()


def test_int8_activations_are_refused(run: Results) -> None:
    if run.int8 is None:
        pytest.skip("gptq4 is not among MARLIN_PACK_TEST_DAEMON_MODELS")
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
            _write("bench", run.workdir / "bench-model", BENCH_PRESET) if BENCH_PRESET else next(iter(run.models.values()))
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
                "bench model": BENCH_PRESET or f"{next(iter(run.models))} (tiny)",
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


def _running_release():  # type: ignore[no-untyped-def]
    """The running vLLM release's entry in marlin-pack's table (what its finished layers hold)."""
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    entry = releases.release(vllm_version())
    assert entry is not None, vllm_version()
    return entry
