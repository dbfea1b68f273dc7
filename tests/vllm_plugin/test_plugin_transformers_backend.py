"""Bundles of architectures vLLM serves through its Transformers backend, loaded by the plugin on the CPU.

The model is the one the running release builds (``TransformersForCausalLM`` / ``TransformersMoEForCausalLM``: the
backend's real ``recursive_replace``, fusers, tp_plan and weight mapper over the installed transformers; built as the
oracles build it: platform seen as SM90, CUDA repack ops as pure-torch stand-ins); the loader checks, places the bundle,
loads the common tensors through the backend's ``load_weights`` (its mapper: ``transformer.`` / ``gpt_neox.`` to
``model.``), and vLLM's post-processing finishes the layers: every quantized parameter then equals what stock vLLM
holds, as the oracles compute it. Skipped where the running release builds a class of its own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from marlin_pack import convert
from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked

vmr = pytest.importorskip("oracles.vllm_moe_reference")
from arch_checkpoints import write_arch_checkpoint  # noqa: E402
from oracles import vllm_reference as vr  # noqa: E402

# case -> (architecture, format, tp, rank, dtype)
CASES = {
    "olmo2-gptq-tp1": ("Olmo2ForCausalLM", "gptq", 1, 0, torch.bfloat16),
    "gptbigcode-awq-tp2-rank1": ("GPTBigCodeForCausalLM", "awq", 2, 1, torch.float16),  # replicated MLP, one KV head
    "gptneox-gptq-tp2-rank0": ("GPTNeoXForCausalLM", "gptq", 2, 0, torch.float16),  # gpt_neox. prefix, embed_out
    "olmoe-awq-tp2-rank1": ("OlmoeForCausalLM", "awq", 2, 1, torch.bfloat16),  # experts on Marlin MoE
    # a shared expert the 0.34 MoE fuser also hands to the experts' MoERunner (the module tree reaches it twice)
    "hunyuan-moe-gptq-tp2-rank1": ("HunYuanMoEV1ForCausalLM", "gptq", 2, 1, torch.float16),
    "mellum-awq-tp1": ("MellumForCausalLM", "awq", 1, 0, torch.bfloat16),  # a dense layer, then a sparse one
    # no registry entry: the registry's fallback to transformers' class (fc1 / fc2 MLP)
    "nanochat-awq-tp2-rank1": ("NanoChatForCausalLM", "awq", 2, 1, torch.float16),
}


def _bundle(tmp: Path, arch: str, fmt: str, dtype: torch.dtype) -> Path:
    from marlin_pack.marlin.architectures import ARCHITECTURES

    if ARCHITECTURES[arch].moe:
        from moe_checkpoints import write_moe_checkpoint

        model = write_moe_checkpoint(tmp / "m", arch, fmt, group_size=32, dtype=dtype)
    else:
        model = write_arch_checkpoint(tmp / "m", arch, fmt, group_size=32, dtype=dtype)
    convert(model, tp=(1, 2), dtype=str(dtype).removeprefix("torch."))
    return model


def _engine(model_dir: Path, quantization: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tp: int,
            rank: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A fake engine (what the loader reads) whose create_model builds the model the running vLLM builds."""
    from vllm.config.kernel import KernelConfig
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if tp > 1:
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(), speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, world_size_across_dp=tp),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9), device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model_config = SimpleNamespace(model=str(model_dir), dtype=dtype, quantization=quantization,
                                   word_embeddings_untied_by_checkpoint=False, enable_sleep_mode=False)

    def create_model(self: object, vllm_config: SimpleNamespace, model_config: object, prefix: str = "") -> nn.Module:
        v = vr._vllm()
        real = v.ModelConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), trust_remote_code=True,
                             skip_tokenizer_init=True, enforce_eager=True)
        config = v.VllmConfig(model_config=real, device_config=v.DeviceConfig("cpu"), load_config=v.LoadConfig(),
                              kernel_config=vllm_config.kernel_config)
        with torch.device("cpu"):
            model = v.initialize_model(config)
        model._real_model_config = real
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    return vllm_config, model_config


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_backend_model_loads_its_bundle_as_stock_vllm_holds_it(
    tmp_path: Path, patched: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.marlin.architectures import ARCHITECTURES
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.engine import quantized_layers
    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    arch, fmt, tp, rank, dtype = CASES[case]
    if releases.serving_path(vllm_version(), arch) != "transformers":
        pytest.skip(f"vLLM {vllm_version()} builds its own class for {arch}")
    model_dir = _bundle(tmp_path, arch, fmt, dtype)
    moe = ARCHITECTURES[arch].moe
    reference = (vmr.reference_moe_rank_tensors(model_dir, tp, rank, dtype) if moe
                 else vr.reference_rank_tensors(model_dir, tp, rank, dtype))
    vllm_config, model_config = _engine(model_dir, {"awq": "auto_awq", "gptq": "auto_gptq"}[fmt], dtype, monkeypatch, tp, rank)
    monkeypatch.setenv("MARLIN_PACK_IO", '{"threads": 2, "window_mib": 1}')
    loader = MarlinPrepackedLoader(vr._vllm().LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={}))
    context = vmr._moe_patched(tp, rank) if moe else vr._patched(tp, rank)
    with context as m, (m.base if moe else m).set_default_torch_dtype(dtype):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        assert type(model).__name__.startswith("Transformers")
        layers = quantized_layers(model)
        assert all(is_patched(mod.quant_method) for mod in layers.values())
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        assert all(is_prepacked(mod) for mod in layers.values())
        process_weights_after_loading(model, model._real_model_config, torch.device("cpu"))
    assert not any(is_prepacked(mod) for mod in model.modules())
    got = {n: p for n, p in model.named_parameters(remove_duplicate=False) if n in reference}
    for name, want in reference.items():
        if name not in got and want.numel() == 0:  # the kernel's empty zero points (GPTQ), on the kernel's own name
            continue
        t = got[name]
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.detach(), want), name
    # the common tensors went through the backend's mapper: the embeddings are the checkpoint's
    from safetensors.torch import load_file

    common = load_file(str(model_dir / "marlin-pack" / "common.safetensors"))
    embed = next(n for n in common if n.endswith(("embed_tokens.weight", "embed_in.weight", "wte.weight")))
    weight = next(p for n, p in model.named_parameters() if n.endswith(("embed_tokens.weight", "embed_in.weight", "wte.weight")))
    rows = weight.shape[0]  # this rank's share of the vocabulary (VocabParallelEmbedding)
    assert torch.equal(weight.detach(), common[embed][rank * rows:(rank + 1) * rows])
