"""marlin_pack.marlin.deepseek: DeepSeek's per-layer linears, MLA sizes and skipped layers, from config.json alone.

The layouts themselves are checked bit-exact against vLLM in tests/test_deepseek_conversion.py;
these pin the config rules that fixtures built by transformers cannot reach (moe_layer_freq,
an absent q_lora_rank taking transformers' default, MTP prefixes).
"""

from __future__ import annotations

import pytest

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin import deepseek
from marlin_pack.marlin.architectures import ARCHITECTURES
from marlin_pack.marlin.sharding import layer_specs, model_dims
from marlin_pack.schemas import LayerKind

V2, V3 = ARCHITECTURES["DeepseekV2ForCausalLM"], ARCHITECTURES["DeepseekV3ForCausalLM"]


def _config(**kw: object) -> dict:
    base = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=512, intermediate_size=768,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=256,
                n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return {**base, **kw}


def _names(config: dict, layer: int) -> list[str]:
    return [s.name.split(".", 3)[3] for s in layer_specs(model_dims(config), layer)]


def test_sparse_layers_follow_vllms_is_moe_layer() -> None:
    assert deepseek.sparse_layers(_config(), V2, 4) == [1, 2, 3]
    assert deepseek.sparse_layers(_config(moe_layer_freq=2), V2, 4) == [2]
    assert deepseek.sparse_layers(_config(first_k_dense_replace=0), V2, 4) == [0, 1, 2, 3]
    assert deepseek.sparse_layers({}, V3, 5) == [3, 4]  # transformers' DeepseekV3Config default: 3 dense layers


def test_layers_by_config() -> None:
    dense = ["self_attn.kv_a_proj_with_mqa", "self_attn.q_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
             "mlp.gate_up_proj", "mlp.down_proj"]
    assert _names(_config(), 0) == dense
    assert _names(_config(), 1) == [*dense[:4], "mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"]
    assert _names(_config(moe_layer_freq=2), 1) == dense
    q_lora = _names(_config(q_lora_rank=384), 1)
    assert q_lora[:2] == ["self_attn.fused_qkv_a_proj", "self_attn.q_b_proj"]
    # An absent q_lora_rank is transformers' default (1536), not null: vLLM then fuses q_a_proj too.
    config = _config()
    del config["q_lora_rank"]
    assert _names(config, 1)[0] == "self_attn.fused_qkv_a_proj"


def test_mla_shapes_and_kinds() -> None:
    specs = {s.name.split(".", 3)[3]: s for s in layer_specs(model_dims(_config(q_lora_rank=384)), 1)}
    fused = specs["self_attn.fused_qkv_a_proj"]
    assert fused.kind is LayerKind.replicated
    assert [(p.name, p.size_k, p.size_n) for p in fused.parts] == [("q_a_proj", 512, 384), ("kv_a_proj_with_mqa", 512, 576)]
    assert (specs["self_attn.q_b_proj"].kind, specs["self_attn.q_b_proj"].parts[0].size_k) == (LayerKind.column, 384)
    kv_b = specs["self_attn.kv_b_proj"].parts[0]
    assert (kv_b.size_k, kv_b.size_n) == (512, 4 * (128 + 128))
    o = specs["self_attn.o_proj"].parts[0]
    assert (specs["self_attn.o_proj"].kind, o.size_k, o.size_n) == (LayerKind.row, 4 * 128, 512)
    shared = specs["mlp.shared_experts.gate_up_proj"]
    assert [p.size_n for p in shared.parts] == [2 * 256, 2 * 256]


def test_mtp_layers_are_skipped_prefixes() -> None:
    d = model_dims(_config(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_nextn_predict_layers=2))
    assert d.skipped_prefixes == ("model.layers.4.", "model.layers.5.")
    assert model_dims(_config()).skipped_prefixes == ()


@pytest.mark.parametrize("change,match", [
    ({"qk_nope_head_dim": 0, "qk_rope_head_dim": 0}, r"uses vLLM's multi-head attention path"),
    ({"kv_lora_rank": None},
     r"^config\.json kv_lora_rank is None, expected an integer >= 1 \(DeepseekV2ForCausalLM\); restore the checkpoint's config\.json$"),
    ({"n_routed_experts": None}, r"without n_routed_experts has no routed experts"),
])
def test_config_refusals(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=match):
        model_dims(_config(**change))


@pytest.mark.parametrize("key", ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "first_k_dense_replace",
                                 "moe_layer_freq", "q_lora_rank", "n_shared_experts", "num_nextn_predict_layers"])
@pytest.mark.parametrize("value", [[2], {}, float("inf"), float("nan"), "2", True, 2.0, {"a": 1}, 10**30])
def test_config_values_of_another_json_type_are_refused_naming_them(key: str, value: object) -> None:
    """Every integer DeepSeek's layout is read from: a list, an object, inf/NaN, a string, a bool (an int to Python), a
    float such as 2.0, or an absurd size is one line naming the key, never an internal error (issue 68, item 10)."""
    config = _config(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **{key: value})
    with pytest.raises(UnsupportedCheckpointError, match=rf"^config\.json {key} is .*; (the config is corrupt, )?restore the checkpoint"):
        model_dims(config)


def test_mtp_layer_count_is_bounded_and_may_be_null() -> None:
    v3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    assert model_dims(_config(**v3, num_nextn_predict_layers=None)).skipped_prefixes == ()
    assert model_dims(_config(**v3, num_nextn_predict_layers=0)).skipped_prefixes == ()
    with pytest.raises(UnsupportedCheckpointError, match=r"num_nextn_predict_layers is 1000000, expected at most 64"):
        model_dims(_config(**v3, num_nextn_predict_layers=10**6))
