"""``modules_to_not_convert`` as vLLM's AutoAWQ reads it, checked against vLLM's own code."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.sources import Checkpoint
from marlin_pack.sources.awq import AwqGemmSource
from marlin_pack.sources.awq_skips import float_only_modules, skipping_entry

quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LAYERS = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
          "model.layers.1.mlp.down_proj", "model.layers.10.mlp.down_proj", "model.layers.0.mlp.shared_expert.gate_up_proj",
          "model.layers.0.mlp.experts"]
ENTRIES = ["gate", "q_proj", "k_proj", "mlp", "self_attn", "model.layers.1.", "model.layers.1", "layers.0.mlp.gate_proj",
           "gate_up_proj", "visual", "experts"]


def _parts(name: str) -> tuple[str, ...]:
    head, proj = name.rsplit(".", 1)
    return tuple(f"{head}.{p}" for p in PACKED.get(proj, ()))


@pytest.mark.parametrize("entries", [list(c) for n in (0, 1, 2) for c in itertools.combinations(ENTRIES, n)])
def test_skipping_entry_agrees_with_vllm(entries: list[str]) -> None:
    for name in LAYERS:
        try:
            expected = quant_utils.is_layer_skipped(name, entries, PACKED, match_mode="substring")
        except ValueError:  # some but not all shards of a fused layer
            with pytest.raises(UnsupportedCheckpointError, match="fuses into"):
                skipping_entry(name, _parts(name), entries)
            continue
        hit = skipping_entry(name, _parts(name), entries)
        assert (hit is not None) == expected, (name, entries)
        assert hit is None or hit in entries


def test_float_only_modules_is_what_vllm_derives(tmp_path: Path) -> None:
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    tensors = {
        "model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.float16),
        "model.layers.0.mlp.gate.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate_proj.qweight": torch.zeros(4, 1, dtype=torch.int32),
        "model.layers.0.mlp.gate_proj.scales": torch.zeros(1, 8, dtype=torch.float16),
        "model.layers.0.input_layernorm.weight": torch.zeros(4, dtype=torch.float32),
        "lm_head.weight": torch.zeros(4, 4, dtype=torch.float16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    vllm_config = AutoAWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True})
    vllm_config.maybe_update_config(str(tmp_path))
    ckpt = Checkpoint(tmp_path)
    try:
        assert sorted(float_only_modules(ckpt)) == sorted(vllm_config.modules_to_not_convert)
    finally:
        ckpt.close()


def test_check_layer_both_ways() -> None:
    src = AwqGemmSource(128, ("mlp.down_proj",))
    src.check_layer("model.layers.0.mlp.down_proj", False, modules=("model.layers.0.mlp.down_proj",))
    src.check_layer("model.layers.0.self_attn.o_proj", True)
    with pytest.raises(UnsupportedCheckpointError, match="entry 'mlp.down_proj' is a substring of model.layers.0.mlp.down_proj"):
        src.check_layer("model.layers.0.mlp.down_proj", True)
    with pytest.raises(UnsupportedCheckpointError, match="stored unquantized, but no AWQ modules_to_not_convert entry"):
        src.check_layer("model.layers.0.self_attn.o_proj", False, modules=("model.layers.0.self_attn.o_proj",))
    # An entry in the checkpoint's naming (as a multimodal checkpoint may write it) still counts.
    AwqGemmSource(128, ("model.language_model.layers.0.mlp",)).check_layer(
        "language_model.model.layers.0.mlp.down_proj", False, modules=("model.language_model.layers.0.mlp.down_proj",))
