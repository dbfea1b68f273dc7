"""Mixture-of-experts checkpoints written by llm-compressor (``tests/data/llmcompressor``, ``make_moe_fixtures.py``):
converted and compared bit for bit with what stock vLLM holds (``tests/oracles/vllm_moe_reference.py``:
its own model class, ``CompressedTensorsWNA16MoEMethod`` on the Marlin MoE backend for the experts, the
compressed-tensors Marlin linears for attention), verified, and refused by both where a group would be split.

* ``qwen3moe-gptq-w4a16``: ``GPTQModifier(scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])``.
* ``mixtral-rtn-w4a16-asym``: ``QuantizationModifier(scheme="W4A16_ASYM")``; llm-compressor 0.14 with
  transformers 5 names Mixtral's experts ``block_sparse_moe.experts.N.{gate,up,down}_proj`` (vLLM's mapper
  renames them to ``w1``/``w3``/``w2``).

Both write ``ignore`` as the routers' module names (``model.layers.0.mlp.gate`` ...), not the regexes given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from marlin_pack import UnsupportedCheckpointError, convert, verify

pytest.importorskip("vllm")
from committed_fixtures import convert_copy, copy_fixture  # noqa: E402
from oracles.vllm_moe_reference import VllmRefusedError, assert_moe_bundle_equals_vllm, reference_moe_rank_tensors  # noqa: E402
from test_llmcompressor_fixtures import DATA, MOE_ACCEPTED  # noqa: E402


def test_moe_fixtures_are_what_llm_compressor_writes() -> None:
    q3 = json.loads((DATA / "qwen3moe-gptq-w4a16" / "config.json").read_text())["quantization_config"]
    assert q3["ignore"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]
    assert q3["config_groups"]["group_0"]["weights"]["actorder"] == "static"
    with safe_open(DATA / "mixtral-rtn-w4a16-asym" / "model.safetensors", "pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "model.layers.1.block_sparse_moe.experts.3.up_proj.weight_zero_point" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(MOE_ACCEPTED))
def test_moe_fixture_bit_exact_with_vllm(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    tps = MOE_ACCEPTED[name]
    model, manifest = convert_copy(DATA, name, tmp_path, tps, dtype)
    assert manifest.source.format.value == "compressed-tensors"
    assert all(len(s.moe_layers) == 2 for s in manifest.tensor_parallel)
    compared = assert_moe_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    assert compared >= sum(tps) * 2 * 6
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure


@pytest.mark.parametrize("name", list(MOE_ACCEPTED))
def test_moe_fixture_tp4_refused_by_both(name: str, tmp_path: Path) -> None:
    """256 intermediate features are 64 per rank at TP 4: a group of 128 would straddle ranks."""
    model = copy_fixture(DATA, name, tmp_path)
    with pytest.raises(VllmRefusedError):
        reference_moe_rank_tensors(model, 4, 0, torch.bfloat16)
    with pytest.raises(UnsupportedCheckpointError, match="split a quantization group of 128"):
        convert(model, tp=(4,))
    assert not (model / "marlin-pack").exists()
