"""``marlin_pack.testing.synthetic_deepseek``: random DeepSeek-V2 checkpoints in transformers' layout, converting bit-exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from marlin_pack import convert, verify
from marlin_pack.testing.synthetic_deepseek import DEEPSEEK_PRESETS, write_deepseek_checkpoint

pytest.importorskip("vllm")
from moe_checkpoints import write_moe_checkpoint  # noqa: E402
from test_deepseek_conversion import _compare  # noqa: E402


def _tensors(model: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():  # noqa: SIM118
                t = h.get_slice(name)
                out[name] = (t.get_dtype(), tuple(t.get_shape()))
    return out


@pytest.mark.parametrize("q_lora_rank", [None, 384])
def test_tiny_preset_is_transformers_layout(tmp_path: Path, q_lora_rank: int | None) -> None:
    """Same tensor names, dtypes and shapes, and the same config values, as transformers' DeepseekV2ForCausalLM
    saves for these dimensions (``moe_checkpoints`` quantizes that checkpoint the same way)."""
    shape = dataclasses.replace(DEEPSEEK_PRESETS["tiny-deepseek-v2"], q_lora_rank=q_lora_rank)
    ours = write_deepseek_checkpoint(tmp_path / "ours", shape, "awq")
    theirs = write_moe_checkpoint(tmp_path / "hf", "DeepseekV2ForCausalLM", "awq", q_lora_rank=q_lora_rank)
    assert _tensors(ours) == _tensors(theirs)
    a, b = (json.loads((m / "config.json").read_text()) for m in (ours, theirs))
    differ = {k for k in a.keys() & b.keys() if a[k] != b[k]} - {"quantization_config", "max_position_embeddings"}
    assert not differ, {k: (a[k], b[k]) for k in differ}
    qa, qb = a["quantization_config"], b["quantization_config"]
    assert {k: qa[k] for k in qa.keys() & qb.keys()} == {k: qb[k] for k in qa.keys() & qb.keys()}


def test_tiny_preset_converts_bit_exact(tmp_path: Path) -> None:
    model = write_deepseek_checkpoint(tmp_path / "m", DEEPSEEK_PRESETS["tiny-deepseek-v2"], "gptq", max_shard_bytes=1 << 20,
                                      dtype=torch.bfloat16, tokenizer=True)
    assert (model / "model.safetensors.index.json").exists() and (model / "tokenizer.json").exists()
    convert(model, tp=(2,))
    assert _compare(model, (2,), torch.bfloat16)[0] > 0
    assert verify(model / "marlin-pack").ok


def test_deepseek_v2_lite_preset_shapes(tmp_path: Path) -> None:
    """Two layers of the DeepSeek-V2-Lite preset (a dense one and a sparse one); g128 is refused by name."""
    shape = dataclasses.replace(DEEPSEEK_PRESETS["deepseek-v2-lite"], num_hidden_layers=2, vocab_size=1024, n_routed_experts=8)
    with pytest.raises(ValueError, match=r"group_size 128 does not divide the 10944 in_features of model\.layers\.0\.mlp\.down_proj"):
        write_deepseek_checkpoint(tmp_path / "m", shape, "awq")
    model = write_deepseek_checkpoint(tmp_path / "m", shape, "awq", group_size=64)
    manifest = convert(model, tp=(1,)).manifest
    (entry,) = manifest.tensor_parallel[0].moe_layers
    assert (entry.name, entry.num_experts, entry.hidden_size, entry.intermediate_size) == (
        "model.layers.1.mlp.experts.routed_experts", 8, 2048, 1408)
    sizes = {e.name.split(".", 3)[3]: (e.size_k, e.size_n) for e in manifest.tensor_parallel[0].layers}
    assert sizes["self_attn.kv_a_proj_with_mqa"] == (2048, 576) and sizes["self_attn.q_proj"] == (2048, 16 * 192)
    assert sizes["self_attn.kv_b_proj"] == (512, 16 * 256) and sizes["mlp.down_proj"] == (10944, 2048)
    assert sizes["mlp.shared_experts.down_proj"] == (2816, 2048)
