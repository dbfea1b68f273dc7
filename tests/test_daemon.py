"""CPU tests of the weight-cache support (``vllm preload`` / ``--load-format ipc_cache``).

* the launcher (``marlin-pack daemon``): argument handling, no vLLM import for ``--help``,
  plugin installed before vLLM's CLI runs;
* the quant-method patch: ``supports_pre_processed_weights`` on real vLLM classes with fake
  kernels (Marlin fp16/bf16 accepted; Machete, Exllama, int8/fp8 activations refused, with
  vLLM's own ``check_ipc_quant_support`` message), the pre-processed post-processing path,
  composition with the prepacked patch, and an end-to-end daemon -> IPC round trip on real
  vLLM layers (vLLM's ``export_entries``, ``IpcModelLoader._apply_entries`` and
  ``process_weights_after_loading`` under ``weights_already_processed()``);
* Marlin forcing for weight-cache processes, and an unchanged ``WeightCacheKey``;
* spawned daemon processes: vLLM's real ``_run_daemon`` in a ``spawn`` child, started as
  ``vllm preload`` starts it, sees the loader and the patch (and, as a control, does not
  without marlin-pack's spawn target).

Run as a script (``python tests/test_daemon.py spawn-probe``) this file is the parent of
that spawn test.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from marlin_pack.errors import BundleError, MarlinPackError
from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def installed() -> Any:
    """marlin-pack registered in this process (as vLLM's plugin loading would do)."""
    from marlin_pack.vllm_plugin.prepacked import install_patches

    from marlin_pack.vllm_plugin import ipc, register

    register()
    install_patches()
    ipc.install()
    return ipc


# --- the launcher ---------------------------------------------------------------------------


def _bundle(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    (model / "marlin-pack").mkdir(parents=True)
    (model / "marlin-pack" / "manifest.json").write_text("{}")
    return model


def test_preload_argv_defaults_to_the_bundle(tmp_path: Path) -> None:
    from marlin_pack.daemon import preload_argv

    model = _bundle(tmp_path)
    assert preload_argv(model) == ["preload", "--model", str(model), "--load-format", "marlin_prepacked"]
    extra = ["--tensor-parallel-size", "2", "--weight-cache-socket-dir", "/s", "--dtype=float16"]
    assert preload_argv(model, extra) == [
        "preload",
        "--model",
        str(model),
        "--load-format",
        "marlin_prepacked",
        *extra,
    ]


@pytest.mark.parametrize(
    "extra",
    [
        ["--load-format", "auto", "--linear-backend", "marlin"],
        ["--load_format=auto"],
        ["--load-format=AUTO", "--enforce-eager"],
    ],
)
def test_preload_argv_keeps_an_explicit_load_format(tmp_path: Path, extra: list[str]) -> None:
    from marlin_pack.daemon import preload_argv

    model = tmp_path / "no-bundle"  # a checkpoint fill needs no bundle
    assert preload_argv(model, extra) == ["preload", "--model", str(model), *extra]


def test_preload_argv_bundle_options(tmp_path: Path) -> None:
    from marlin_pack.daemon import preload_argv

    model = tmp_path / "model"
    other = _bundle(tmp_path / "elsewhere") / "marlin-pack"
    for extra in (
        ["--model-loader-extra-config", json.dumps({"bundle": str(other)})],
        [f"--model-loader-extra-config={json.dumps({'fallback': True})}"],
        ["--model-loader-extra-config", "{not json"],  # vLLM reports it
    ):
        assert preload_argv(model, extra)[-len(extra) :] == extra


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ([], BundleError, r"no marlin-pack bundle at .*model/marlin-pack .*run `marlin-pack convert"),
        (
            ["--model-loader-extra-config", '{"bundle": "/nope"}'],
            BundleError,
            r"no marlin-pack bundle at /nope",
        ),
        (["--model", "x"], MarlinPackError, r"--model is MODEL_DIR"),
        (["--model=x"], MarlinPackError, r"--model is MODEL_DIR"),
        (["--load-format", "ipc_cache"], MarlinPackError, r"--load-format ipc_cache is for engines"),
        (["--load-format"], MarlinPackError, r"--load-format needs a value"),
    ],
)
def test_preload_argv_refuses(tmp_path: Path, extra: list[str], error: type, match: str) -> None:
    from marlin_pack.daemon import preload_argv

    with pytest.raises(error, match=match):
        preload_argv(tmp_path / "model", extra)


def test_cli_daemon_forwards_every_other_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import marlin_pack.daemon

    from marlin_pack.cli import app

    model = _bundle(tmp_path)
    calls: list[list[str]] = []
    monkeypatch.setattr(marlin_pack.daemon, "run", calls.append)
    args = ["--tensor-parallel-size", "2", "--weight-cache-socket-dir", "/s", "--enforce-eager"]
    r = runner.invoke(app, ["daemon", str(model), *args])
    assert r.exit_code == 0, r.output
    assert calls == [["preload", "--model", str(model.resolve()), "--load-format", "marlin_prepacked", *args]]
    assert "marlin-pack: vllm preload --model" in r.output
    r = runner.invoke(app, ["daemon", str(tmp_path)])  # no bundle: one-line error before vLLM starts
    assert r.exit_code != 0 and isinstance(r.exception, BundleError)


def test_cli_daemon_help_does_not_import_vllm() -> None:
    code = (
        "import sys\nfrom marlin_pack.cli import main\nsys.argv = ['marlin-pack', 'daemon', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import marlin_pack.daemon, marlin_pack.vllm_plugin.ipc\n"
        "print('VLLM', [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "VLLM []" in r.stdout, r.stderr
    assert "vllm preload" in r.stdout and "ipc_cache" in r.stdout


def test_run_installs_marlin_pack_before_vllm_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.entrypoints.cli.main as vllm_cli
    from marlin_pack.daemon import run

    from marlin_pack.vllm_plugin import ipc

    seen: dict[str, Any] = {}

    def fake_main() -> None:
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
        from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon

        seen.update(argv=list(sys.argv), spawn_target=_run_daemon, formats=set(_LOAD_FORMAT_TO_MODEL_LOADER))

    monkeypatch.setattr(vllm_cli, "main", fake_main)
    argv = ["preload", "--model", "/m", "--load-format", "marlin_prepacked"]
    before = list(sys.argv)
    run(argv)
    assert sys.argv == before
    assert seen["argv"] == ["vllm", *argv]
    assert seen["spawn_target"] is ipc.run_daemon  # what PreloadSubcommand.cmd hands to spawn
    assert "marlin_prepacked" in seen["formats"]


def test_run_reports_vllm_errors_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.entrypoints.cli.main as vllm_cli
    from marlin_pack.daemon import run

    def fake_main() -> None:
        raise ValueError("--weight-cache-master-port is required when the daemons span nodes")

    monkeypatch.setattr(vllm_cli, "main", fake_main)
    with pytest.raises(
        MarlinPackError, match=r"^vllm preload failed: ValueError: --weight-cache-master-port"
    ):
        run(["preload", "--model", "/m"])


# --- supports_pre_processed_weights on fake kernels ----------------------------------------


def _config(
    weight: str = "uint4", act: torch.dtype = torch.float16, k: int = 256, n: int = 512, g: int = 128
) -> Any:
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    return MPLinearLayerConfig(
        full_weight_shape=(k, n),
        partition_weight_shape=(k, n),
        weight_type=getattr(scalar_types, weight),
        act_type=act,
        group_size=g,
        zero_points=weight == "uint4",
    )


def _kernel(cls: type, config: Any) -> Any:
    kernel = object.__new__(cls)  # as the kernel's __init__ would leave it, without its checks
    kernel.config, kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name = config, "qweight", "scales", "qzeros"
    return kernel


def _method(kind: str, kernel: Any) -> Any:
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMarlinLinearMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    cls = AutoAWQMarlinLinearMethod if kind == "awq" else AutoGPTQLinearMethod
    method = cls.__new__(cls)
    method.kernel = kernel
    return method


def _kernel_cls(name: str) -> type:
    import importlib

    module = {"Marlin": "marlin", "Machete": "machete", "Exllama": "exllama", "Conch": "conch"}[name]
    mod = importlib.import_module(f"vllm.model_executor.kernels.linear.mixed_precision.{module}")
    return getattr(mod, f"{name}LinearKernel")  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kind", "kernel", "weight", "act", "ok"),
    [
        ("awq", "Marlin", "uint4", torch.float16, True),
        ("awq", "Marlin", "uint4", torch.bfloat16, True),
        ("gptq", "Marlin", "uint4b8", torch.float16, True),
        ("gptq", "Marlin", "uint8b128", torch.bfloat16, True),
        ("gptq", "Marlin", "uint4b8", torch.int8, False),  # VLLM_MARLIN_INPUT_DTYPE=int8
        ("gptq", "Marlin", "uint4b8", torch.float8_e4m3fn, False),  # VLLM_MARLIN_INPUT_DTYPE=fp8
        ("awq", "Machete", "uint4", torch.float16, False),  # H200's default without forcing
        ("gptq", "Machete", "uint4b8", torch.float16, False),
        ("gptq", "Exllama", "uint4b8", torch.float16, False),
        ("awq", "Conch", "uint4", torch.float16, False),
    ],
)
def test_supports_pre_processed_weights(
    installed: Any, kind: str, kernel: str, weight: str, act: torch.dtype, ok: bool
) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import (
        UnsupportedQuantForIPCError,
        check_ipc_quant_support,
    )

    method = _method(kind, _kernel(_kernel_cls(kernel), _config(weight, act)))
    assert method.supports_pre_processed_weights is ok
    root = nn.Module()
    root.model = nn.Module()
    root.model.qkv_proj = nn.Module()
    root.model.qkv_proj.quant_method = method
    if ok:
        check_ipc_quant_support(root)  # vLLM's own check, as the daemon and the IPC loader run it
    else:
        name = type(method).__name__
        with pytest.raises(
            UnsupportedQuantForIPCError,
            match=rf"^layer model\.qkv_proj: {name} does not support loading from pre-processed weights\.$",
        ):
            check_ipc_quant_support(root)


def test_supports_needs_exactly_marlin(installed: Any) -> None:
    marlin = _kernel_cls("Marlin")
    sub = type("MarlinSubclass", (marlin,), {})
    assert not _method("gptq", _kernel(sub, _config("uint4b8"))).supports_pre_processed_weights
    assert not _method("gptq", None).supports_pre_processed_weights  # before create_weights
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    assert QuantizeMethodBase.supports_pre_processed_weights is False  # other methods: unchanged


def test_vllm_post_processing_refuses_unsupported_layers(installed: Any) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed

    root = nn.Module()
    root.layer = nn.Module()
    root.layer.quant_method = _method("awq", _kernel(_kernel_cls("Machete"), _config()))
    cfg = SimpleNamespace(
        word_embeddings_untied_by_checkpoint=False, dtype=torch.float16, quantization="auto_awq"
    )
    with (
        weights_already_processed(),
        pytest.raises(RuntimeError, match="does not support pre-processed weights"),
    ):
        process_weights_after_loading(root, cfg, torch.device("cpu"))


# --- the pre-processed path -----------------------------------------------------------------


def _marlin_layer(weight: str, k: int, n: int, g: int, bias: bool) -> tuple[nn.Module, Any]:
    """A layer holding tensors of the shapes MarlinLinearKernel leaves (contents arbitrary)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_padded_nk

    config = _config(weight, torch.float16, k, n, g)
    pn, pk = marlin_padded_nk(n, k, g)
    bits = config.weight_type.size_bits
    groups = 1 if g == -1 else pk // g
    layer = nn.Module()
    layer.prefix = "model.layers.0.mlp.gate_up_proj"
    p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer.qweight = p(torch.randint(-(2**31), 2**31 - 1, (pk // 16, pn * bits // 2), dtype=torch.int32))
    layer.scales = p(torch.randn(groups, pn, dtype=torch.float16))
    if config.zero_points:
        layer.qzeros = p(torch.randint(0, 2**31 - 1, (groups, pn * bits // 32), dtype=torch.int32))
    else:
        layer.qzeros = p(torch.empty(0, dtype=torch.int32))
    layer.bias = p(torch.randn(pn, dtype=torch.float16)) if bias else None
    return layer, config


def _forbid(monkeypatch: pytest.MonkeyPatch, method: Any) -> None:
    """Every transform of stock post-processing raises."""
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("stock post-processing ran in pre-processed mode")

    monkeypatch.setattr(auto_awq, "_convert_awq_to_standard_format", boom)
    monkeypatch.setattr(method.kernel, "process_weights_after_loading", boom, raising=False)


@pytest.mark.parametrize(
    ("kind", "weight", "k", "n", "g", "bias"),
    [
        ("awq", "uint4", 256, 1024, 128, False),
        ("awq", "uint4", 320, 960, 32, True),  # padded (tiny-padded gate_up)
        ("gptq", "uint4b8", 320, 448, 32, True),  # padded, qkv with bias
        ("gptq", "uint8b128", 256, 512, -1, False),
    ],
)
def test_pre_processed_mode_only_restores_state(
    installed: Any,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    weight: str,
    k: int,
    n: int,
    g: int,
    bias: bool,
) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer, config = _marlin_layer(weight, k, n, g, bias)
    method = _method(kind, _kernel(_kernel_cls("Marlin"), config))
    _forbid(monkeypatch, method)
    before = {name: (t, t.data_ptr()) for name, t in layer.named_parameters()}
    with weights_already_processed():
        method.process_weights_after_loading(layer)
    after = dict(layer.named_parameters())
    assert after.keys() == before.keys()
    for name, (t, ptr) in before.items():
        assert after[name] is t and t.data_ptr() == ptr, name  # the shared tensors, untouched
    assert layer.input_global_scale is None


def test_pre_processed_gptq_recreates_missing_empty_qzeros(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer, config = _marlin_layer("uint4b8", 256, 512, 128, False)
    layer.qzeros = nn.Parameter(torch.empty(2, 64, dtype=torch.int32, device="meta"), requires_grad=False)
    method = _method("gptq", _kernel(_kernel_cls("Marlin"), config))
    _forbid(monkeypatch, method)
    with weights_already_processed():
        method.process_weights_after_loading(layer)
    assert isinstance(layer.qzeros, nn.Parameter) and layer.qzeros.numel() == 0
    assert layer.qzeros.dtype == torch.int32 and layer.qzeros.device == layer.qweight.device


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("qweight-meta", r"did not provide qweight"),
        (
            "qweight-checkpoint-layout",
            r"pre-processed qweight has shape \[32, 512\], MarlinLinearKernel holds \[16, 1024\]",
        ),
        ("scales-unpadded", r"pre-processed scales has shape"),
        ("qzeros-meta", r"did not provide qzeros"),
        ("bias-unpadded", r"pre-processed bias has shape \[480\]"),
    ],
)
def test_pre_processed_mode_refuses_another_layout(
    installed: Any, monkeypatch: pytest.MonkeyPatch, damage: str, match: str
) -> None:
    from vllm.model_executor.utils import weights_already_processed

    shape = (256, 512, 128) if damage == "qweight-checkpoint-layout" else (320, 480, 32)
    layer, config = _marlin_layer("uint4", *shape, True)
    p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
    if damage == "qweight-meta":
        layer.qweight = p(torch.empty(layer.qweight.shape, dtype=torch.int32, device="meta"))
    elif damage == "qweight-checkpoint-layout":
        layer.qweight = p(torch.zeros(256 // 8, 512, dtype=torch.int32))  # GPTQ layout, not repacked
    elif damage == "scales-unpadded":
        layer.scales = p(torch.zeros(10, 480, dtype=torch.float16))
    elif damage == "qzeros-meta":
        layer.qzeros = p(torch.empty(10, 60, dtype=torch.int32, device="meta"))
    else:
        layer.bias = p(torch.zeros(480, dtype=torch.float16))
    method = _method("awq", _kernel(_kernel_cls("Marlin"), config))
    _forbid(monkeypatch, method)
    with weights_already_processed(), pytest.raises(RuntimeError, match=match):
        method.process_weights_after_loading(layer)


def test_normal_mode_runs_stock_post_processing(installed: Any) -> None:
    layer, config = _marlin_layer("uint4b8", 256, 512, 128, False)
    calls: list[nn.Module] = []
    method = _method("gptq", _kernel(_kernel_cls("Marlin"), config))
    method.kernel.process_weights_after_loading = calls.append
    method.process_weights_after_loading(layer)
    assert calls == [layer]


@pytest.mark.parametrize("order", ["prepacked-first", "ipc-first"])
def test_composes_with_the_prepacked_patch(installed: Any, order: str) -> None:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod
    from vllm.model_executor.utils import weights_already_processed

    from marlin_pack.vllm_plugin import prepacked

    prepacked.uninstall_patches()  # restores vLLM's method (the wrappers' original), both layers gone
    assert not installed.is_ours(AutoGPTQLinearMethod.process_weights_after_loading)
    first, second = (
        (prepacked.install_patches, installed.install)
        if order == "prepacked-first"
        else (installed.install, prepacked.install_patches)
    )
    first()
    second()
    top = AutoGPTQLinearMethod.process_weights_after_loading
    installed.install()
    prepacked.install_patches()
    assert AutoGPTQLinearMethod.process_weights_after_loading is top  # idempotent, no double wrapping
    assert installed.is_ours(top) and prepacked.is_patched(AutoGPTQLinearMethod.__new__(AutoGPTQLinearMethod))

    layer, config = _marlin_layer("uint4b8", 256, 512, 128, False)
    calls: list[nn.Module] = []
    method = _method("gptq", _kernel(_kernel_cls("Marlin"), config))
    method.kernel.process_weights_after_loading = calls.append
    prepacked.mark_prepacked(layer)  # the daemon filled from a bundle: normal mode, marked
    method.process_weights_after_loading(layer)
    with weights_already_processed():  # an ipc_cache engine
        method.process_weights_after_loading(layer)
    assert calls == []
    method.process_weights_after_loading(layer)  # a later ordinary reload
    assert calls == [layer]


# --- a daemon -> IPC round trip on real vLLM layers ------------------------------------------

ROUND_TRIPS = {
    "awq4": lambda d: write_awq_checkpoint(d, PRESETS["tiny"], tokenizer=False),
    "gptq4-padded": lambda d: write_gptq_checkpoint(
        d, PRESETS["tiny-padded"], group_size=32, tokenizer=False
    ),
    "gptq8-bias": lambda d: write_gptq_checkpoint(d, PRESETS["tiny-qwen2"], bits=8, tokenizer=False),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_daemon_to_engine_round_trip_on_real_layers(installed: Any, tmp_path: Path, case: str) -> None:
    """Stock post-processing (the daemon), vLLM's export, then a meta-built model filled by vLLM's
    IPC loader code and post-processed in pre-processed mode: the engine holds the daemon's
    very tensors (CPU stand-ins for the IPC mappings), equal to stock vLLM's."""
    vr = pytest.importorskip("vllm_reference")
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.daemon import export_entries
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
    from vllm.model_executor.model_loader.weight_cache.protocol import (
        WeightCacheState,
        check_ipc_quant_support,
    )
    from vllm.model_executor.utils import weights_already_processed

    ckpt = ROUND_TRIPS[case](tmp_path / "ckpt")
    reference = vr.reference_rank_tensors(ckpt, 1, 0, torch.float16)
    cfg = json.loads((ckpt / "config.json").read_text())
    biases = {n.rsplit(".", 1)[0] for n in reference if n.endswith(".bias")}
    v = vr._vllm()
    model_cls = v.model_classes.get(cfg["architectures"][0], v.default_model_class)
    with vr._patched(1, 0), v.set_default_torch_dtype(torch.float16):
        qc = vr._quant_config(v, ckpt, cfg["quantization_config"], model_cls)
        facts = vr._model_facts(cfg)
        # The daemon's layers, post-processed the stock way, with reference contents.
        daemon = vr._build_layers(v, facts, qc, biases, 1)
        for name, tensor in reference.items():
            module, leaf = name.rsplit(".", 1)
            setattr(daemon.get_submodule(module), leaf, nn.Parameter(tensor.clone(), requires_grad=False))
        for module in daemon.modules():
            if hasattr(module, "quant_method"):
                module.input_global_scale = None
        entries, aliases = export_entries(daemon)
        # The engine: built on meta, checked, filled and post-processed as IpcModelLoader does.
        with torch.device("meta"):
            engine = vr._build_layers(v, facts, qc, biases, 1)
        check_ipc_quant_support(engine)
        loader = SimpleNamespace(mode="zero_copy")
        IpcModelLoader._apply_entries(loader, engine, WeightCacheState(entries, aliases, {}), 0)  # type: ignore[arg-type]
        model_config = SimpleNamespace(
            word_embeddings_untied_by_checkpoint=False, dtype=torch.float16, quantization=qc.get_name()
        )
        with weights_already_processed():
            process_weights_after_loading(engine, model_config, torch.device("cpu"))
    got = dict(engine.named_parameters())
    shared = dict(daemon.named_parameters())
    assert got.keys() == shared.keys() == reference.keys()
    for name, want in reference.items():
        assert not got[name].is_meta, name
        assert got[name].data_ptr() == shared[name].data_ptr(), name  # the same memory, not a copy
        assert got[name].dtype == want.dtype and torch.equal(got[name].detach(), want), name
    for module in engine.modules():
        if hasattr(module, "quant_method"):
            assert module.input_global_scale is None


# --- Marlin for weight-cache processes ------------------------------------------------------


def _configs(quantization: str = "auto_awq", **kernel: Any) -> tuple[Any, Any]:
    from vllm.config.kernel import KernelConfig

    return SimpleNamespace(kernel_config=KernelConfig(**kernel)), SimpleNamespace(quantization=quantization)


@pytest.mark.parametrize(
    ("quantization", "kernel", "forced"),
    [
        ("auto_awq", {}, True),
        ("auto_gptq", {"linear_backend_per_quant": {"fp8": "cutlass"}}, True),
        ("auto_gptq", {"linear_backend_per_quant": {"mixed_precision": "auto"}}, True),
        ("auto_gptq", {"linear_backend": "marlin"}, False),  # already Marlin
        ("auto_awq", {"linear_backend": "machete"}, False),  # explicit: kept (and refused later)
        ("auto_gptq", {"linear_backend_per_quant": {"mixed_precision": "exllama"}}, False),
        ("fp8", {}, False),  # not AWQ/GPTQ
        (None, {}, False),
    ],
)
def test_force_marlin_for_cache(installed: Any, quantization: Any, kernel: dict, forced: bool) -> None:
    vllm_config, model_config = _configs(quantization, **kernel)
    before = dict(vllm_config.kernel_config.linear_backend_per_quant or {})
    assert installed.force_marlin_for_cache(vllm_config, model_config) is forced
    after = dict(vllm_config.kernel_config.linear_backend_per_quant or {})
    assert after == ({**before, "mixed_precision": "marlin"} if forced else before)


def test_forcing_makes_vllm_choose_marlin_and_keeps_the_cache_key(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.config as vllm_config_mod
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS, _resolve_backend_kernels
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey
    from vllm.platforms import PlatformEnum

    vllm_config, model_config = _configs("auto_awq")
    kc = vllm_config.kernel_config
    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: vllm_config)

    def candidates() -> list[str]:
        kernels = _POSSIBLE_KERNELS[PlatformEnum.CUDA]
        return [
            k.__name__
            for k in _resolve_backend_kernels(
                list(kernels), "mp", quantization="mixed_precision", compute_capability=90
            )
        ]

    assert candidates()[0] != "MarlinLinearKernel"  # H200: Machete (or Humming) first
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "awq"})
    text = SimpleNamespace(rope_parameters={"rope_theta": 1e4}, max_position_embeddings=4096)
    mc = SimpleNamespace(
        hf_config=hf,
        hf_text_config=text,
        model="/not/a/dir",
        dtype=torch.float16,
        quantization="auto_awq",
        quantization_config=None,
        revision=None,
    )
    cache = SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[])

    def key(kernel_config: Any) -> Any:
        return WeightCacheKey.from_model_config(mc, 1, 0, cache_config=cache, kernel_config=kernel_config)

    daemon_key = key(KernelConfig())  # computed before loading, as WeightCacheDaemon.__init__ does
    assert installed.force_marlin_for_cache(vllm_config, model_config)
    assert candidates() == ["MarlinLinearKernel"]
    assert key(kc) == daemon_key  # the engine's key (and a later reload's) still matches
    assert kc.linear_backend_per_quant == {"mixed_precision": "marlin"}  # hashed for compile caches
    forced_elsewhere = KernelConfig(linear_backend_per_quant={"mixed_precision": "marlin"})
    assert key(forced_elsewhere) != daemon_key  # a user's explicit setting is part of the key


def test_ipc_loader_and_daemon_are_wrapped(installed: Any, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.model_executor.model_loader.weight_cache import daemon as daemon_mod
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError

    assert installed.is_ours(IpcModelLoader._build_model) and installed.is_ours(IpcModelLoader._fallback_load)
    assert installed.is_ours(daemon_mod.WeightCacheDaemon.get_model)
    assert daemon_mod._run_daemon is installed.run_daemon

    seen: list[Any] = []
    wrapped = installed._with_marlin_for_cache(
        lambda self, vllm_config, model_config, prefix: seen.append(
            dict(vllm_config.kernel_config.linear_backend_per_quant or {})
        )
    )
    vllm_config, model_config = _configs("auto_gptq")
    wrapped(None, vllm_config, model_config, "")
    assert seen == [{"mixed_precision": "marlin"}]  # forced before vLLM builds the model

    def refuse(self: Any) -> Any:
        raise UnsupportedQuantForIPCError("layer x: AutoGPTQLinearMethod does not support ...")

    fake = SimpleNamespace(
        role="target",
        global_rank=0,
        vllm_config=_configs()[0],
        model_config=SimpleNamespace(quantization="auto_gptq"),
    )
    fake.vllm_config.load_config = SimpleNamespace(load_format="marlin_prepacked")
    with caplog.at_level(logging.INFO, logger="vllm.marlin_pack"):
        assert installed._wrap_get_model(lambda self: "model")(fake) == "model"
        with pytest.raises(UnsupportedQuantForIPCError):
            installed._wrap_get_model(refuse)(fake)
    text = caplog.text
    assert "weight-cache target daemon rank 0 filled its model in" in text and "marlin_prepacked" in text
    assert "only when vLLM serves them with MarlinLinearKernel and 16-bit activations" in text


# --- spawned daemon processes ---------------------------------------------------------------


class Probe:
    """Stands in for the VllmConfig vLLM's ``_run_daemon`` receives: when ``WeightCacheDaemon``
    reads ``parallel_config`` (its first step), report the process's state and stop."""

    def __init__(self, queue: Any, tag: str) -> None:
        from vllm.config.logging import LoggingConfig

        self.queue, self.tag = queue, tag
        self.logging_config = LoggingConfig()  # _run_daemon configures logging from it first

    @property
    def parallel_config(self) -> Any:
        import vllm.plugins
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

        self.queue.put(
            {
                "tag": self.tag,
                "pid": os.getpid(),
                "registered": "marlin_prepacked" in _LOAD_FORMAT_TO_MODEL_LOADER,
                "quant_patch": isinstance(
                    AutoGPTQLinearMethod.__dict__.get("supports_pre_processed_weights"), property
                ),
                "general_plugins_loaded": vllm.plugins.plugins_loaded,
            }
        )
        raise SystemExit(0)


def _stock_spawn_target(*args: Any) -> None:
    """The control: vLLM's own ``_run_daemon``, as a plain ``vllm preload`` child runs it."""
    from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon

    _run_daemon(*args)


def _spawn_probe_main() -> None:
    """As ``vllm preload``: plugins load in the parent (the CLI's parser does it), then
    ``PreloadSubcommand.cmd`` imports ``_run_daemon`` and spawns it."""
    from vllm.plugins import load_general_plugins

    installed_ep = any(e.name == "marlin_pack" for e in entry_points(group="vllm.general_plugins"))
    if installed_ep:
        load_general_plugins()  # what `vllm preload`'s argument parser runs (arg_utils.py L3256)
    else:
        from marlin_pack.vllm_plugin import register

        register()
    import marlin_pack.vllm_plugin.ipc as ipc
    from vllm.model_executor.model_loader.weight_cache import daemon as daemon_mod
    from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon  # as preload.py L214

    ctx = multiprocessing.get_context("spawn")  # as preload.py
    queue = ctx.Queue()
    assert daemon_mod._marlin_pack_original_run_daemon is not _run_daemon
    targets = {"marlin-pack": _run_daemon, "vllm": _stock_spawn_target}
    procs = [
        ctx.Process(target=target, args=(0, 0, Probe(queue, tag), "tcp://127.0.0.1:9", None, queue))
        for tag, target in targets.items()
    ]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        r = queue.get(timeout=300)
        reports[r["tag"]] = r
    for p in procs:
        p.join(60)
    print(
        "SPAWN_PROBE "
        + json.dumps(
            {
                "entry_point": installed_ep,
                "parent_target_is_ours": _run_daemon is ipc.run_daemon,
                "reports": reports,
                "exitcodes": [p.exitcode for p in procs],
            }
        ),
        flush=True,
    )


def test_spawned_daemons_register_marlin_pack() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "spawn-probe"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("SPAWN_PROBE ")), None)
    assert line is not None, (r.stdout + r.stderr)[-4000:]
    out = json.loads(line.removeprefix("SPAWN_PROBE "))
    assert out["parent_target_is_ours"]
    ours, stock = out["reports"]["marlin-pack"], out["reports"]["vllm"]
    # A spawned daemon never runs load_general_plugins(): without marlin-pack's target it
    # lacks the loader and the patch; with it, vLLM's own _run_daemon runs with both.
    assert stock == {**stock, "registered": False, "quant_patch": False, "general_plugins_loaded": False}
    assert ours == {**ours, "registered": True, "quant_patch": True, "general_plugins_loaded": False}
    assert "plugin active in weight-cache daemon process" in r.stdout + r.stderr
    assert out["exitcodes"] == [0, 0]


if __name__ == "__main__":
    if sys.argv[1:] == ["spawn-probe"]:
        _spawn_probe_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} spawn-probe")
