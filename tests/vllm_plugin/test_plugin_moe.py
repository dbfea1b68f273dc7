"""Mixture-of-experts bundles in the vLLM plugin, on the CPU, with vLLM's real MoE model classes.

The model is vLLM's own (Mixtral, Qwen3-MoE, Qwen2-MoE built by ``initialize_model`` as the MoE
oracle builds it: platform seen as SM90, CUDA repack ops as pure-torch stand-ins); the loader
places a bundle into it and vLLM's ``process_weights_after_loading`` runs with marlin-pack's
patches. Experts and dense layers must then hold what stock vLLM holds (``vllm_moe_reference``),
with the Marlin MoE kernel built. The weight cache's round trip runs vLLM's ``export_entries``,
``IpcModelLoader._apply_entries`` and the pre-processed post-processing on a meta-built engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from marlin_pack.errors import LoadRefusedError
from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked

vmr = pytest.importorskip("oracles.vllm_moe_reference")
from moe_checkpoints import MOE_CONFIGS  # noqa: E402

CASES = {
    "mixtral-awq-tp1": ("MixtralForCausalLM", "awq", 1, 0, torch.float16),
    "qwen3moe-gptq-tp2-rank1": ("Qwen3MoeForCausalLM", "gptq", 2, 1, torch.bfloat16),
    "qwen2moe-gptq-tp1": ("Qwen2MoeForCausalLM", "gptq", 1, 0, torch.float16),
    # MLA attention (replicated kv_a_proj_with_mqa / fused_qkv_a_proj), a dense first layer, shared experts.
    "deepseekv2-awq-tp2-rank1": ("DeepseekV2ForCausalLM", "awq", 2, 1, torch.bfloat16),
    "deepseekv3-gptq-tp1": ("DeepseekV3ForCausalLM", "gptq", 1, 0, torch.float16),
    # compressed-tensors (CompressedTensorsWNA16MoEMethod): symmetric (no zero points) and W4A16_ASYM.
    "mixtral-ct-tp1": ("MixtralForCausalLM", "ct", 1, 0, torch.float16),
    "qwen3moe-ct-asym-tp2-rank1": ("Qwen3MoeForCausalLM", "ct-asym", 2, 1, torch.bfloat16),
}
# The experts' quantized weights per format: vLLM aliases w13_weight / w2_weight to them.
_W13 = {"awq": "w13_qweight", "gptq": "w13_qweight", "ct": "w13_weight_packed", "ct-asym": "w13_weight_packed"}


def _build(model_dir: Path, dtype: torch.dtype, kernel_config: Any, device: str = "cpu") -> tuple[nn.Module, Any]:
    """vLLM's model class for ``model_dir`` with ``kernel_config``, as the MoE oracle builds it (inside ``_moe_patched``)."""
    v = vmr._moe_vllm().base
    model_config = v.ModelConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), trust_remote_code=True,
                                 skip_tokenizer_init=True, enforce_eager=True)
    vllm_config = v.VllmConfig(model_config=model_config, device_config=v.DeviceConfig("cpu"), load_config=v.LoadConfig(),
                               kernel_config=kernel_config)
    with torch.device(device):
        model = v.initialize_model(vllm_config)
    return model, model_config


def _engine(model_dir: Path, quantization: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tp: int, rank: int,
            **kernel: Any) -> tuple[SimpleNamespace, SimpleNamespace, list[str]]:
    """A fake engine (what the loader reads) whose create_model builds vLLM's real model; returns the moe_backends seen."""
    from vllm.config.kernel import KernelConfig
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if tp > 1:
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(**kernel),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, world_size_across_dp=tp),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model_config = SimpleNamespace(model=str(model_dir), dtype=dtype, quantization=quantization,
                                   word_embeddings_untied_by_checkpoint=False)
    seen: list[str] = []

    def create_model(self: object, vllm_config: SimpleNamespace, model_config: object, prefix: str = "") -> nn.Module:
        seen.append(str(vllm_config.kernel_config.moe_backend))
        model, real_config = _build(model_dir, dtype, vllm_config.kernel_config)
        model._real_model_config = real_config
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    return vllm_config, model_config, seen


def _loader(**extra: object) -> Any:
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    return MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=dict(extra)))


def _quantization(fmt: str) -> str:
    return {"awq": "auto_awq", "gptq": "auto_gptq"}.get(fmt, "compressed-tensors")


def _params(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if n in names}


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_moe_model_equals_stock_vllm(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """create_model (Marlin MoE forced, layers checked), load_weights (placement, marks, common tensors through
    vLLM's load_weights), vLLM's post-processing (patched: the prepacked experts only finish): every quantized
    parameter equals stock vLLM's, the Marlin MoE kernel is built, no expert tensor was repacked."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers
    from marlin_pack.vllm_plugin.moe_engine import is_moe_layer

    arch, fmt, tp, rank, dtype = CASES[case]
    model_dir = moe_bundle(arch, fmt, dtype)
    reference = vmr.reference_moe_rank_tensors(model_dir, tp, rank, dtype)
    vllm_config, model_config, seen = _engine(model_dir, _quantization(fmt), dtype, monkeypatch, tp, rank)
    monkeypatch.setenv("MARLIN_PACK_IO", '{"threads": 2, "window_mib": 1}')
    loader = _loader()
    with vmr._moe_patched(tp, rank) as m, m.base.set_default_torch_dtype(dtype):
        # Any repack of the experts would call these: prepacked experts must not.
        monkeypatch.setattr(m.int_wna16, "convert_to_wna16_moe_kernel_format",
                            lambda *a, **k: pytest.fail("stock MoE post-processing ran"), raising=True)
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        experts = {n: mod for n, mod in layers.items() if is_moe_layer(mod)}
        assert sorted(experts) == sorted({n.rsplit(".", 1)[0] for n in reference if ".experts." in n})
        assert all(is_patched(mod.quant_method) for mod in layers.values())
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        assert all(is_prepacked(mod) for mod in layers.values())
        process_weights_after_loading(model, model._real_model_config, torch.device("cpu"))
    assert seen == ["marlin"] and vllm_config.kernel_config.moe_backend == "marlin"
    assert not any(is_prepacked(mod) for mod in model.modules())
    got = _params(model, set(reference))
    assert got.keys() == {n for n, t in reference.items() if not (n.endswith(".qzeros") and t.numel() == 0)} | (
        got.keys() & {n for n, t in reference.items() if n.endswith(".qzeros") and t.numel() == 0})
    for name, want in reference.items():
        t = got[name]
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.detach(), want), name
    for name, layer in experts.items():
        method = layer.quant_method
        assert type(method.moe_kernel.impl.fused_experts).__name__ == "MarlinExperts", name
        assert layer.w13_weight is getattr(layer, _W13[fmt]) and layer.w2_weight is getattr(layer, _W13[fmt].replace("13", "2"))
        assert getattr(layer, "w13_bias", None) is None and getattr(layer, "w2_bias", None) is None


def _fact_hook(monkeypatch: pytest.MonkeyPatch, **override: Any) -> None:
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.vllm_plugin.moe_engine import moe_layer_facts

    def facts(module: nn.Module, skips_when_marked: bool) -> Any:
        return dataclasses.replace(moe_layer_facts(module, skips_when_marked), **override)

    monkeypatch.setattr(loader_mod, "moe_layer_facts", facts)


@pytest.mark.parametrize("override,match", [
    ({"backend": "HUMMING"}, r"\[kernel\] vLLM chose the HUMMING MoE backend for experts layer model\.layers\.0\.block_sparse_moe"),
    ({"method": "MoeWNA16Method"}, r"\[kernel\] experts layer .* uses MoeWNA16Method, the bundle holds AutoAWQMoEMethod experts"),
    ({"num_experts": 2}, r"\[layers\] experts layer .*: the engine's local experts is 2, the bundle's is 4"),
    ({"padded_intermediate": 512}, r"\[layout\] experts layer .* Marlin MoE padded intermediate size is 512, the bundle's is 256"),
    ({"act_dtype": "float8_e4m3fn"}, r"\[activation_dtype\] experts layer"),
])
def test_moe_layer_mismatch_refuses_or_falls_back(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch,
                                                  override: dict, match: str) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_dir = moe_bundle("MixtralForCausalLM", "awq", torch.float16)
    _fact_hook(monkeypatch, **override)
    vllm_config, model_config, _ = _engine(model_dir, "auto_awq", torch.float16, monkeypatch, 2, 0)
    with vmr._moe_patched(2, 0) as m, m.base.set_default_torch_dtype(torch.float16):
        with pytest.raises(LoadRefusedError, match=match):
            _loader().create_model(vllm_config, model_config)  # type: ignore[arg-type]
        calls: list = []
        monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, mdl, c: calls.append(mdl))
        fallback = _loader(fallback=True)
        model = fallback.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        fallback.load_weights(model, model_config)  # type: ignore[arg-type]
    assert calls == [model]
    assert not any(is_prepacked(mod) for mod in model.modules())


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2)])
def test_data_parallel_replicas_of_a_moe_model_take_the_experts_of_tp_times_dp(
    moe_bundle: Any, monkeypatch: pytest.MonkeyPatch, tp: int, dp: int,
) -> None:
    """vLLM's own Mixtral with a stand-in data-parallel group shards its experts over tp x dp ranks (1/(tp*dp) of the
    intermediate size each): the decision takes them from the bundle's tp<tp*dp> rank file (expert_share.py; loaded
    and compared in test_plugin_expert_share.py), and refuses in one line, naming the convert to run, a bundle
    without it (fallback: the ordinary way); DP=1 loads the rank's own file."""
    from marlin_pack.vllm_plugin.decision import EngineFacts, decide
    from marlin_pack.vllm_plugin.options import LoaderOptions

    model_dir = moe_bundle("MixtralForCausalLM", "awq", torch.float16)  # tp 1 and 2
    intermediate = MOE_CONFIGS["MixtralForCausalLM"]["intermediate_size"]
    for dp_rank in range(dp):
        with vmr.vr._LOCK, vmr._moe_patched(tp, tp - 1, dp=(dp, dp_rank)) as m, m.base.set_default_torch_dtype(torch.float16):
            model, _ = vmr._build(model_dir, tp, torch.float16, m, "marlin")
        experts = vmr.moe_layers(model)
        assert {e.intermediate_size_per_partition for e in experts.values()} == {intermediate // (tp * dp)}
    facts = EngineFacts(model=str(model_dir), vllm_version="0.33.0", quantization="auto_awq", tp_size=tp, dp_size=dp,
                        dp_rank=dp - 1, tp_rank=tp - 1)
    if tp * dp in (1, 2):
        sel = decide(LoaderOptions(), facts).bundle
        assert sel is not None and sel.experts is not None
        assert sel.experts.rank_file.parts[-2:] == (f"tp{tp * dp}", f"rank-{tp * dp - 1}.safetensors")
        return
    with pytest.raises(LoadRefusedError, match=rf"\[dp_size\] --data-parallel-size {dp}: vLLM shards each experts "
                                               rf"layer over the {tp} x {dp} tensor x data parallel ranks, which the tp{tp * dp} "
                                               r"rank files hold; the bundle has tp 1,2: run `marlin-pack convert .* --tp 1,2,4`") as e:
        decide(LoaderOptions(), facts)
    assert "\n" not in str(e.value)
    assert decide(LoaderOptions(fallback=True), facts).field == "dp_size"
    assert decide(LoaderOptions(), EngineFacts(model=str(model_dir), vllm_version="0.33.0", quantization="auto_awq",
                                               tp_size=tp)).bundle is not None


@pytest.mark.parametrize("override,match", [
    ({"method": "AutoGPTQMoEMethod"},
     r"\[kernel\] experts layer .* uses AutoGPTQMoEMethod, the bundle holds CompressedTensorsWNA16MoEMethod experts"),
    ({"zero_points": False}, r"\[zero_points\] experts layer .*: the engine's zero points is False, the bundle's is True"),
    ({"weight_type": "uint4b8"}, r"\[weight_type\] experts layer .*: the engine's weight type is uint4b8, the bundle's is uint4"),
    ({"group_size": 64}, r"\[group_size\] experts layer .*: the engine's group size is 64, the bundle's is 128"),
    ({"backend": "TRITON"}, r"\[kernel\] vLLM chose the TRITON MoE backend for experts layer model\.layers\.0\.mlp"),
])
def test_ct_moe_layer_mismatch_refused(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, override: dict,
                                       match: str) -> None:
    """The layer check for compressed-tensors experts: the facts of a real CompressedTensorsWNA16MoEMethod layer pass
    (test_prepacked_moe_model_equals_stock_vllm); each one changed is refused naming its field."""
    model_dir = moe_bundle("Qwen3MoeForCausalLM", "ct-asym", torch.bfloat16)
    _fact_hook(monkeypatch, **override)
    vllm_config, model_config, _ = _engine(model_dir, "compressed-tensors", torch.bfloat16, monkeypatch, 2, 0)
    with vmr._moe_patched(2, 0) as m, m.base.set_default_torch_dtype(torch.bfloat16), \
            pytest.raises(LoadRefusedError, match=match):
        _loader().create_model(vllm_config, model_config)  # type: ignore[arg-type]


def test_ct_moe_layer_facts_read_the_method(moe_bundle: Any, patched: Any) -> None:
    from vllm.config.kernel import KernelConfig

    from marlin_pack.vllm_plugin.moe_engine import is_marlin_moe_16bit, is_moe_layer, moe_layer_facts

    for fmt, weight_type, zero_points in (("ct", "uint4b8", False), ("ct-asym", "uint4", True)):
        model_dir = moe_bundle("MixtralForCausalLM", fmt, torch.float16)
        with vmr._moe_patched(1, 0) as m, m.base.set_default_torch_dtype(torch.float16):
            model, _ = _build(model_dir, torch.float16, KernelConfig(moe_backend="marlin"), device="meta")
        layer = next(mod for mod in model.modules() if is_moe_layer(mod))
        f = moe_layer_facts(layer, skips_when_marked=True)
        assert (f.method, f.backend, f.weight_type, f.group_size, f.zero_points, f.act_dtype) == (
            "CompressedTensorsWNA16MoEMethod", "MARLIN", weight_type, 128, zero_points, "float16")
        assert (f.num_experts, f.hidden_size, f.intermediate_size, f.padded_intermediate) == (4, 512, 512, 512)
        assert is_marlin_moe_16bit(layer.quant_method)
        layer.quant_method.input_dtype = torch.float8_e4m3fn  # fp8 activations (VLLM_MARLIN_INPUT_DTYPE): not shared
        assert not is_marlin_moe_16bit(layer.quant_method)


def test_explicit_non_marlin_moe_backend_is_kept_and_refused(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """--moe-backend triton is the user's choice: not overridden (vLLM itself refuses TRITON for AWQ/GPTQ experts
    that may carry a bias; a backend it accepted would be refused by the layer check, see the HUMMING case above)."""
    model_dir = moe_bundle("Qwen3MoeForCausalLM", "gptq", torch.bfloat16)
    vllm_config, model_config, seen = _engine(model_dir, "auto_gptq", torch.bfloat16, monkeypatch, 1, 0, moe_backend="triton")
    with vmr._moe_patched(1, 0) as m, m.base.set_default_torch_dtype(torch.bfloat16), \
            pytest.raises(ValueError, match=r"WNA16 MoE backend 'TRITON' does not support"):
        _loader().create_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert seen == ["triton"]


def test_force_marlin_moe_only_resolves_auto() -> None:
    from vllm.config.kernel import KernelConfig

    from marlin_pack.vllm_plugin.moe_engine import force_marlin_moe

    auto, explicit, marlin = KernelConfig(), KernelConfig(moe_backend="triton"), KernelConfig(moe_backend="marlin")
    assert force_marlin_moe(auto) and auto.moe_backend == "marlin"
    assert not force_marlin_moe(explicit) and explicit.moe_backend == "triton"
    assert not force_marlin_moe(marlin) and marlin.moe_backend == "marlin"


# --- the weight cache ---------------------------------------------------------------------------


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize("arch,fmt,dtype", [("MixtralForCausalLM", "awq", torch.float16), ("Qwen3MoeForCausalLM", "gptq", torch.bfloat16),
                                            ("DeepseekV2ForCausalLM", "gptq", torch.float16),
                                            ("MixtralForCausalLM", "ct-asym", torch.float16),
                                            ("Qwen3MoeForCausalLM", "ct", torch.bfloat16)])
def test_daemon_to_engine_round_trip_moe(moe_bundle: Any, patched: Any, arch: str, fmt: str, dtype: torch.dtype) -> None:
    """Daemon: stock vLLM load and post-processing (Marlin MoE). Engine: built on meta, vLLM's IPC checks and
    _apply_entries, then post-processing in pre-processed mode: the same tensors, the Marlin MoE kernel built,
    GPTQ's never-provided bias placeholders dropped (not materialized)."""
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.daemon import export_entries
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheState, check_ipc_quant_support
    from vllm.model_executor.utils import weights_already_processed

    from marlin_pack.vllm_plugin.moe_engine import is_moe_layer
    from marlin_pack.vllm_plugin.patches import scope

    model_dir = moe_bundle(arch, fmt, dtype)
    reference = vmr.reference_moe_rank_tensors(model_dir, 1, 0, dtype)
    vr = vmr.vr
    with vmr._moe_patched(1, 0) as m, m.base.set_default_torch_dtype(dtype):
        daemon, model_config = _build(model_dir, dtype, KernelConfig(moe_backend="marlin"))
        daemon.load_weights(vr._all_tensors(model_dir))
        process_weights_after_loading(daemon, model_config, torch.device("cpu"))
        entries, aliases = export_entries(daemon)
        with scope.in_use():  # as IpcModelLoader's patched build: compressed-tensors linear methods record their layer
            engine, _ = _build(model_dir, dtype, KernelConfig(moe_backend="marlin"), device="meta")
        check_ipc_quant_support(engine)  # AWQ/GPTQ/compressed-tensors MoE methods on Marlin now declare support
        IpcModelLoader._apply_entries(SimpleNamespace(mode="zero_copy"), engine, WeightCacheState(entries, aliases, {}), 0)
        with weights_already_processed():
            process_weights_after_loading(engine, model_config, torch.device("cpu"))
    got = dict(engine.named_parameters(remove_duplicate=False))
    shared = dict(daemon.named_parameters(remove_duplicate=False))
    for name, want in reference.items():
        if name.endswith(".qzeros") and want.numel() == 0:
            continue
        assert not got[name].is_meta, name
        assert got[name].data_ptr() == shared[name].data_ptr(), name
        assert torch.equal(got[name].detach(), want), name
    leftover = [n for n, p in engine.named_parameters(remove_duplicate=False) if p.is_meta]
    assert not leftover, f"the daemon provided no tensor for {leftover[:3]} (vLLM would materialize them uninitialized)"
    experts = [mod for mod in engine.modules() if is_moe_layer(mod)]
    assert experts
    for layer in experts:
        assert type(layer.quant_method.moe_kernel.impl.fused_experts).__name__ == "MarlinExperts"
        assert getattr(layer, "w13_bias", None) is None and getattr(layer, "w2_bias", None) is None
        assert layer.w13_weight is getattr(layer, _W13[fmt])


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize("fmt,method", [("awq", "AutoAWQMoEMethod"), ("ct", "CompressedTensorsWNA16MoEMethod")])
@pytest.mark.parametrize("change", ["backend", "input_dtype", "unpatched"])
def test_ipc_still_refuses_moe_methods_off_marlin(moe_bundle: Any, stock_vllm: None, registered: None, change: str,
                                                  fmt: str, method: str) -> None:
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError, check_ipc_quant_support

    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.moe_engine import is_moe_layer

    if change != "unpatched":
        assert patches.install()
    model_dir = moe_bundle("MixtralForCausalLM", fmt, torch.float16)
    with vmr._moe_patched(1, 0) as m, m.base.set_default_torch_dtype(torch.float16):
        engine, _ = _build(model_dir, torch.float16, KernelConfig(moe_backend="marlin"), device="meta")
    layer = next(mod for mod in engine.modules() if is_moe_layer(mod))
    assert type(layer.quant_method).__name__ == method
    if change == "backend":
        setattr(layer.quant_method, "wna16_backend" if fmt == "ct" else "wna16_moe_backend", WNA16MoEBackend.BATCHED_MARLIN)
    elif change == "input_dtype":
        layer.quant_method.input_dtype = torch.float8_e4m3fn
    if change != "unpatched":
        check_ipc_quant_support(next(mod for mod in engine.modules() if is_moe_layer(mod) and mod is not layer))
    with pytest.raises(UnsupportedQuantForIPCError, match=rf"{method} does not support loading from pre-processed weights"):
        check_ipc_quant_support(layer)  # stock vLLM (unpatched) refuses every AWQ/GPTQ/compressed-tensors MoE method


def test_weight_cache_resolves_auto_moe_backend_to_marlin_and_keeps_the_key() -> None:
    """Daemon and ipc_cache engine: AWQ/GPTQ models get Marlin MoE for ``auto``; WeightCacheKey sees what was configured."""
    from vllm.config.kernel import KernelConfig

    from marlin_pack.vllm_plugin.patches.weight_cache import _as_configured, force_marlin_for_cache

    def run(quantization: str, **kernel: Any) -> Any:
        vllm_config = SimpleNamespace(kernel_config=KernelConfig(**kernel))
        force_marlin_for_cache(vllm_config, SimpleNamespace(quantization=quantization))
        return vllm_config.kernel_config

    kc = run("auto_gptq")
    assert kc.moe_backend == "marlin" and _as_configured(kc).moe_backend == "auto"
    assert run("auto_awq", moe_backend="triton").moe_backend == "triton"  # explicit: kept (then refused by the cache)
    assert run("fp8").moe_backend == "auto"


def test_weight_cache_forces_marlin_moe_for_compressed_tensors_wna16_only() -> None:
    """compressed-tensors: Marlin MoE is forced only where every config group is pack-quantized weight-only int
    (its experts get CompressedTensorsWNA16MoEMethod); an FP8 or activation-quantized MoE keeps vLLM's choice."""
    from vllm.config.kernel import KernelConfig

    from marlin_pack.testing.synthetic import compressed_tensors_config
    from marlin_pack.vllm_plugin.patches.weight_cache import force_marlin_for_cache

    def run(qc: Any) -> str:
        vllm_config = SimpleNamespace(kernel_config=KernelConfig())
        model_config = SimpleNamespace(quantization="compressed-tensors", hf_config=SimpleNamespace(quantization_config=qc))
        force_marlin_for_cache(vllm_config, model_config)
        return str(vllm_config.kernel_config.moe_backend)

    assert run(compressed_tensors_config(4, 128, False)) == "marlin"
    assert run(compressed_tensors_config(8, -1, True)) == "marlin"
    fp8 = compressed_tensors_config(8, 128, True)
    fp8["config_groups"]["group_0"]["weights"]["type"] = "float"
    assert run(fp8) == "auto"
    w4a8 = compressed_tensors_config(4, 128, True)
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}
    assert run(w4a8) == "auto"
    assert run(None) == "auto"
