"""``patches.post_processing``: the one wrapper of the AWQ/GPTQ quant methods'
``process_weights_after_loading`` and their ``supports_pre_processed_weights``, on real vLLM
classes with kernels built without a GPU (``plugin_fakes``).

Decisions in order: a prepacked mark (the loader filled the layer from a bundle) -> finish
only; weights pre-processed (the weight cache) -> check kernel and layout, finish; else vLLM's
own post-processing."""

from __future__ import annotations

from typing import Any

import plugin_fakes as fakes
import pytest
import torch
from torch import nn

from marlin_pack.vllm_plugin.patches import registry, scope
from marlin_pack.vllm_plugin.patches.post_processing import (
    QUANT_METHODS,
    is_patched,
    is_prepacked,
    mark_prepacked,
    supports_pre_processed,
    take_prepacked_mark,
)

GPTQ_PWAL = f"{QUANT_METHODS[1]}.process_weights_after_loading"


def p(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# --- the prepacked mark -----------------------------------------------------------------------


def test_mark_is_one_shot() -> None:
    layer = nn.Module()
    assert not is_prepacked(layer) and not take_prepacked_mark(layer)
    mark_prepacked(layer)
    assert is_prepacked(layer)
    assert take_prepacked_mark(layer) and not is_prepacked(layer) and not take_prepacked_mark(layer)


def test_marked_layers_skip_stock_post_processing_once(patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    first = AutoGPTQLinearMethod.process_weights_after_loading
    patched.install()  # idempotent: no double wrapping
    assert AutoGPTQLinearMethod.process_weights_after_loading is first

    # GPTQ: the loader leaves create_weights' checkpoint-shaped qzeros; finishing makes it
    # the empty int32[0] parameter MarlinLinearKernel uses (marlin_make_empty).
    layer, config = fakes.marlin_layer("uint4b8", 256, 512, 128, False)
    layer.qzeros = p(torch.zeros(2, 64, dtype=torch.int32))
    calls: list[nn.Module] = []
    method = fakes.marlin_method("gptq", config)
    method.kernel.process_weights_after_loading = calls.append
    mark_prepacked(layer)
    method.process_weights_after_loading(layer)
    assert calls == [] and not is_prepacked(layer)
    fakes.assert_empty_zero_points(layer, method)
    method.process_weights_after_loading(layer)  # the mark is one-shot
    assert calls == [layer]

    # AWQ: skipped before _convert_awq_to_standard_format; its Marlin zero points are kept.
    awq_layer, awq_config = fakes.marlin_layer("uint4", 256, 512, 128, False)
    awq_method = fakes.marlin_method("awq", awq_config)
    fakes.forbid_stock_post_processing(monkeypatch, awq_method)
    qzeros = awq_layer.qzeros
    mark_prepacked(awq_layer)
    awq_method.process_weights_after_loading(awq_layer)
    assert getattr(awq_layer, "input_global_scale", None) is None and awq_layer.qzeros is qzeros

    assert is_patched(AutoGPTQLinearMethod.__new__(AutoGPTQLinearMethod)) and is_patched(method)
    patched.uninstall_all()
    assert not is_patched(AutoGPTQLinearMethod.__new__(AutoGPTQLinearMethod))


# --- supports_pre_processed_weights -----------------------------------------------------------


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize(
    ("kind", "kernel", "weight", "act", "ok"),
    [
        ("awq", "Marlin", "uint4", torch.float16, True),
        ("awq", "Marlin", "uint4", torch.bfloat16, True),
        ("gptq", "Marlin", "uint4b8", torch.float16, True),
        ("gptq", "Marlin", "uint8b128", torch.bfloat16, True),
        ("gptq", "Marlin", "uint4b8", torch.int8, False),  # VLLM_MARLIN_INPUT_DTYPE=int8
        ("gptq", "Marlin", "uint4b8", torch.float8_e4m3fn, False),  # VLLM_MARLIN_INPUT_DTYPE=fp8
        ("awq", "Machete", "uint4", torch.float16, True),  # H200's default: shared too (issue 49)
        ("gptq", "Machete", "uint4b8", torch.bfloat16, True),
        ("gptq", "Machete", "uint4b8", torch.int8, False),
        ("gptq", "Exllama", "uint4b8", torch.float16, False),
        ("awq", "Conch", "uint4", torch.float16, False),
    ],
)
def test_supports_pre_processed_weights(patched: Any, kind: str, kernel: str, weight: str, act: torch.dtype, ok: bool) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError, check_ipc_quant_support

    method = fakes.quant_method(kind, fakes.fake_kernel(fakes.kernel_cls(kernel), fakes.mp_config(weight, act)))
    assert method.supports_pre_processed_weights is ok
    assert supports_pre_processed(method) is ok
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


@pytest.mark.usefixtures("weight_cache_scope")
def test_supports_needs_exactly_marlin(patched: Any) -> None:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    sub = type("MarlinSubclass", (fakes.kernel_cls("Marlin"),), {})
    assert not fakes.quant_method("gptq", fakes.fake_kernel(sub, fakes.mp_config("uint4b8"))).supports_pre_processed_weights
    assert not fakes.quant_method("gptq", None).supports_pre_processed_weights  # before create_weights
    assert QuantizeMethodBase.supports_pre_processed_weights is False  # other methods: unchanged


def test_stock_vllm_refuses_pre_processed_awq_gptq() -> None:
    """Without the patches (what they are for): vLLM refuses AWQ/GPTQ Marlin layers, up to the release that ships the
    opt-in itself (0.34.0: Marlin only, so Machete layers are still refused)."""
    upstream = "dense_pre_processed" in fakes.running_release().upstream
    method = fakes.marlin_method("gptq", fakes.mp_config("uint4b8"))
    assert method.supports_pre_processed_weights is upstream
    machete = fakes.quant_method("gptq", fakes.fake_kernel(fakes.kernel_cls("Machete"), fakes.mp_config("uint4b8")))
    assert machete.supports_pre_processed_weights is False


def test_vllm_post_processing_refuses_unsupported_layers(patched: Any) -> None:
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed

    root = nn.Module()
    root.layer = nn.Module()
    root.layer.quant_method = fakes.quant_method("awq", fakes.fake_kernel(fakes.kernel_cls("Conch"), fakes.mp_config()))
    cfg = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, dtype=torch.float16, quantization="auto_awq")
    with weights_already_processed(), pytest.raises(RuntimeError, match="does not support pre-processed weights"):
        process_weights_after_loading(root, cfg, torch.device("cpu"))


@pytest.mark.usefixtures("weight_cache_scope")
def test_wrapper_keeps_its_promise_if_called_directly(patched: Any) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer, _ = fakes.marlin_layer("uint4b8", 256, 512, 128, False)
    method = fakes.quant_method("gptq", fakes.fake_kernel(fakes.kernel_cls("Exllama"), fakes.mp_config("uint4b8")))
    with weights_already_processed(), pytest.raises(RuntimeError, match="ExllamaLinearKernel cannot use pre-processed weights"):
        method.process_weights_after_loading(layer)


# --- the pre-processed path -------------------------------------------------------------------


@pytest.mark.usefixtures("weight_cache_scope")
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
    patched: Any, monkeypatch: pytest.MonkeyPatch, kind: str, weight: str, k: int, n: int, g: int, bias: bool
) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer, config = fakes.marlin_layer(weight, k, n, g, bias)
    method = fakes.marlin_method(kind, config)
    fakes.forbid_stock_post_processing(monkeypatch, method)
    before = {name: (t, t.data_ptr()) for name, t in layer.named_parameters()}
    with weights_already_processed():
        method.process_weights_after_loading(layer)
    after = dict(layer.named_parameters())
    # (0.34.0: Marlin's empty w_zp, which a real cache also shares, is created where this fake one lacks it)
    added = {"w_zp"} if fakes.running_release().finish == "w_zp" and not config.zero_points else set()
    assert after.keys() == before.keys() | added
    for name, (t, ptr) in before.items():
        assert after[name] is t and t.data_ptr() == ptr, name  # the shared tensors, untouched
    assert getattr(layer, "input_global_scale", None) is None


@pytest.mark.usefixtures("weight_cache_scope")
def test_pre_processed_gptq_recreates_missing_empty_qzeros(patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer, config = fakes.marlin_layer("uint4b8", 256, 512, 128, False)
    layer.qzeros = p(torch.empty(2, 64, dtype=torch.int32, device="meta"))
    method = fakes.marlin_method("gptq", config)
    fakes.forbid_stock_post_processing(monkeypatch, method)
    with weights_already_processed():
        method.process_weights_after_loading(layer)
    fakes.assert_empty_zero_points(layer, method)


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("qweight-meta", r"did not provide qweight"),
        ("qweight-checkpoint-layout", r"pre-processed qweight has shape \[32, 512\], MarlinLinearKernel holds \[16, 1024\]"),
        ("scales-unpadded", r"pre-processed scales has shape"),
        ("qzeros-meta", r"did not provide qzeros"),
        ("bias-unpadded", r"pre-processed bias has shape \[480\]"),
    ],
)
def test_pre_processed_mode_refuses_another_layout(patched: Any, monkeypatch: pytest.MonkeyPatch, damage: str, match: str) -> None:
    from vllm.model_executor.utils import weights_already_processed

    shape = (256, 512, 128) if damage == "qweight-checkpoint-layout" else (320, 480, 32)
    layer, config = fakes.marlin_layer("uint4", *shape, True)
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
    method = fakes.marlin_method("awq", config)
    fakes.forbid_stock_post_processing(monkeypatch, method)
    with weights_already_processed(), pytest.raises(RuntimeError, match=match):
        method.process_weights_after_loading(layer)


def test_normal_mode_runs_stock_post_processing(patched: Any) -> None:
    layer, config = fakes.marlin_layer("uint4b8", 256, 512, 128, False)
    calls: list[nn.Module] = []
    method = fakes.marlin_method("gptq", config)
    method.kernel.process_weights_after_loading = calls.append
    method.process_weights_after_loading(layer)
    assert calls == [layer]


@pytest.mark.usefixtures("weight_cache_scope")
def test_one_wrapper_takes_the_decisions_in_order(patched: Any) -> None:
    """The mark (a daemon filled from a bundle), then pre-processed mode (an ipc_cache engine),
    then a later ordinary reload: one wrapper, directly around vLLM's method, handles all three."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod
    from vllm.model_executor.utils import weights_already_processed

    wrapper = vars(AutoGPTQLinearMethod)["process_weights_after_loading"]
    assert registry.is_replacement(wrapper) and wrapper.__wrapped__ is registry.original(GPTQ_PWAL)
    assert not registry.is_replacement(wrapper.__wrapped__)

    layer, config = fakes.marlin_layer("uint4b8", 256, 512, 128, False)
    calls: list[nn.Module] = []
    method = fakes.marlin_method("gptq", config)
    method.kernel.process_weights_after_loading = calls.append
    mark_prepacked(layer)  # normal mode, marked
    method.process_weights_after_loading(layer)
    with weights_already_processed():
        method.process_weights_after_loading(layer)
    assert calls == []
    method.process_weights_after_loading(layer)
    assert calls == [layer]


# --- compressed-tensors WNA16 (kernel on layer.scheme) ----------------------------------------


def _ct_layers(make_checkpoint: Any, fmt: str, in_scope: bool = True) -> dict[str, torch.nn.Module]:
    """Real vLLM linear layers with CompressedTensorsLinearMethod + CompressedTensorsWNA16 on Marlin, built inside
    marlin-pack's scope (``in_scope``: as a weight-cache daemon's fill or an ipc_cache engine's build runs)."""
    import contextlib
    import json

    from oracles import vllm_reference as vr

    model = make_checkpoint(fmt, "tiny", group_size=64)
    cfg = json.loads((model / "config.json").read_text())
    v = vr._vllm()
    with vr._patched(1, 0), v.set_default_torch_dtype(torch.float16), (scope.in_use() if in_scope else contextlib.nullcontext()):
        qc = vr._quant_config(v, model, cfg["quantization_config"], v.default_model_class)
        root = vr._build_layers(v, vr._model_facts(cfg), qc, set(), 1)
    return {n: m for n, m in root.named_modules() if hasattr(m, "scheme")}


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize("fmt", ["ct", "ct-asym"])
def test_compressed_tensors_wna16_opts_in_to_the_weight_cache(patched: Any, make_checkpoint: Any, fmt: str) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import check_ipc_quant_support

    from marlin_pack.vllm_plugin.engine import layer_facts, marlin_kernel

    layers = _ct_layers(make_checkpoint, fmt)
    assert layers
    root = torch.nn.Module()
    for i, m in enumerate(layers.values()):
        assert type(m.quant_method).__name__ == "CompressedTensorsLinearMethod"
        assert type(marlin_kernel(m.quant_method, m)).__name__ == "MarlinLinearKernel"
        assert m.quant_method.supports_pre_processed_weights is True
        assert supports_pre_processed(m.quant_method, m)
        assert layer_facts(m, True).method == "CompressedTensorsLinearMethod:CompressedTensorsWNA16"
        root.add_module(f"l{i}", m)
    check_ipc_quant_support(root)  # vLLM's own check passes: every layer declares the opt-in
    # Another scheme on the same method: no opt-in.
    m = next(iter(layers.values()))
    m.scheme = type("CompressedTensorsW8A8Int8", (), {"kernel": None})()
    assert m.quant_method.supports_pre_processed_weights is False


def test_compressed_tensors_built_outside_the_scope_is_not_bound(patched: Any, make_checkpoint: Any) -> None:
    """Outside marlin-pack's scope (an ordinary engine) create_weights records nothing: the method is vLLM's."""
    from marlin_pack.vllm_plugin.patches.post_processing import LAYER_REF

    layers = _ct_layers(make_checkpoint, "ct", in_scope=False)
    assert layers and all(LAYER_REF not in vars(m.quant_method) for m in layers.values())
    assert all(supports_pre_processed(m.quant_method, m) for m in layers.values())  # given the layer, it would


def test_compressed_tensors_not_bound_to_a_layer_does_not_opt_in(patched: Any) -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod,
    )

    assert CompressedTensorsLinearMethod(None).supports_pre_processed_weights is False  # type: ignore[arg-type]
