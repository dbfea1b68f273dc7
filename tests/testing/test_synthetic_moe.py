"""``marlin_pack.testing.synthetic_moe``: random Qwen3-MoE checkpoints vLLM loads, convert bit-exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify
from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

pytest.importorskip("vllm")
from test_moe_conversion import assert_moe_bundle_equals_vllm  # noqa: E402


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("awq", 4), ("gptq", 8)])
def test_tiny_preset_sharded_converts_bit_exact(tmp_path: Path, fmt: str, bits: int) -> None:
    model = write_moe_checkpoint(tmp_path / "m", MOE_PRESETS["tiny-qwen3moe"], fmt, bits=bits, max_shard_bytes=1 << 20,
                                 tokenizer=True)
    assert (model / "model.safetensors.index.json").exists() and (model / "tokenizer.json").exists()
    convert(model, tp=(1, 2))
    assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.float16)
    assert verify(model / "marlin-pack").ok


@pytest.mark.parametrize("bits,symmetric,dtype", [(4, True, torch.bfloat16), (4, False, torch.float16), (8, True, torch.bfloat16)])
def test_tiny_preset_compressed_tensors_converts_bit_exact(tmp_path: Path, bits: int, symmetric: bool, dtype: torch.dtype) -> None:
    """llm-compressor's layout and config (W4A16, W4A16_ASYM, W8A16): vLLM serves the experts with
    CompressedTensorsWNA16MoEMethod, the router stays 16-bit (ignored), and the bundle equals what vLLM holds."""
    model = write_moe_checkpoint(tmp_path / "m", MOE_PRESETS["tiny-qwen3moe"], "compressed-tensors", bits=bits,
                                 symmetric=symmetric, dtype=dtype, max_shard_bytes=1 << 20)
    qc = json.loads((model / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*mlp[.]gate$"] and qc["format"] == "pack-quantized"
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.gate.weight" in index and "model.layers.0.mlp.experts.7.down_proj.weight_shape" in index
    assert ("model.layers.0.mlp.experts.0.up_proj.weight_zero_point" in index) is (not symmetric)
    manifest = convert(model, tp=(1, 2)).manifest
    assert manifest.source.format.value == "compressed-tensors" and manifest.quant.zero_points is (not symmetric)
    assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype) > 0
    assert verify(model / "marlin-pack").ok


def test_compressed_tensors_asymmetric_8bit_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="asymmetric compressed-tensors experts are 4-bit"):
        write_moe_checkpoint(tmp_path / "m", MOE_PRESETS["tiny-qwen3moe"], "compressed-tensors", bits=8, symmetric=False)


def test_qwen3_30b_a3b_preset_shapes(tmp_path: Path) -> None:
    """One layer of the benchmark preset (the full one is 48 layers, ~17 GB): Qwen3-30B-A3B's widths."""
    shape = dataclasses.replace(MOE_PRESETS["qwen3-30b-a3b"], num_hidden_layers=1, vocab_size=1024)
    model = write_moe_checkpoint(tmp_path / "m", shape, "gptq")
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (2048, 128, 8, 768)
    manifest = convert(model).manifest
    (entry,) = manifest.tensor_parallel[0].moe_layers
    assert (entry.num_experts, entry.hidden_size, entry.intermediate_size, entry.padded_intermediate) == (128, 2048, 768, 768)
    full = MOE_PRESETS["qwen3-30b-a3b"]
    per_layer = sum(f.stat().st_size for f in model.glob("*.safetensors")) - 2 * 1024 * 2048 * 2
    assert 15e9 < per_layer * full.num_hidden_layers + 2 * full.vocab_size * 2048 * 2 < 19e9  # ~17 GB at 4 bits
