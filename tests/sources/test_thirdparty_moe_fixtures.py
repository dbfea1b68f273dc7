"""Mixture-of-experts checkpoints written by the real quantizers (``tests/data/thirdparty``): converted and
compared bit for bit with what stock vLLM holds (``tests/oracles/vllm_moe_reference.py``: its own model
class, config read through transformers, ``load_weights`` with its ``hf_to_vllm_mapper``), or refused by
both, marlin-pack naming the reason.

* ``gptqmodel-qwen3moe-4bit-g128``: GPTQModel 7.7 with transformers 5.25, whose config stores the expert
  count as ``num_local_experts`` (``Qwen3MoeConfig.attribute_map`` maps ``num_experts`` to it).
* ``autoawq-mixtral-4bit-g128``: AutoAWQ 0.2.9 (transformers 4.51), ``block_sparse_moe.experts.N.{w1,w2,w3}``.
* ``gptqmodel-mixtral-4bit-g128``: GPTQModel 7.7 with transformers 5.25 writes Mixtral's experts under
  ``mlp.experts.N.{gate,up,down}_proj`` (router ``mlp.gate``): vLLM's ``MixtralForCausalLM`` has no
  ``mlp`` module and its mapper renames only the projections, so stock vLLM refuses it.
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
from test_thirdparty_fixtures import DATA, MOE_ACCEPTED, MOE_REFUSED  # noqa: E402


def _names(name: str) -> list[str]:
    with safe_open(DATA / name / "model.safetensors", "pt") as f:
        return list(f.keys())


def test_moe_fixtures_carry_the_quantizers_namings() -> None:
    q3 = json.loads((DATA / "gptqmodel-qwen3moe-4bit-g128" / "config.json").read_text())
    assert q3["num_local_experts"] == 4 and q3.get("num_experts") is None and q3["transformers_version"].startswith("5.")
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in _names("gptqmodel-qwen3moe-4bit-g128")
    awq = _names("autoawq-mixtral-4bit-g128")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.qweight" in awq and "model.layers.0.block_sparse_moe.gate.weight" in awq
    gm = _names("gptqmodel-mixtral-4bit-g128")
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in gm and "model.layers.0.mlp.gate.weight" in gm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(MOE_ACCEPTED))
def test_moe_fixture_bit_exact_with_vllm(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    tps = MOE_ACCEPTED[name]
    model, manifest = convert_copy(DATA, name, tmp_path, tps, dtype)
    compared = assert_moe_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    assert compared >= sum(tps) * (6 + 2 * 2)  # 6 expert tensors and 2 attention linears (qweight, scales) per rank
    assert all(len(s.moe_layers) == 1 and s.moe_layers[0].num_experts == 4 for s in manifest.tensor_parallel)
    assert verify(model / "marlin-pack").ok


@pytest.mark.parametrize("name", list(MOE_REFUSED))
def test_moe_fixture_vllm_refuses_is_refused_naming_why(name: str, tmp_path: Path) -> None:
    model = copy_fixture(DATA, name, tmp_path)
    with pytest.raises(VllmRefusedError, match="no module or parameter named"):
        reference_moe_rank_tensors(model, 1, 0, torch.float16)
    with pytest.raises(UnsupportedCheckpointError, match=MOE_REFUSED[name]) as e:
        convert(model, tp=(1,))
    assert "incomplete" not in str(e.value)
    assert not (model / "marlin-pack").exists()
