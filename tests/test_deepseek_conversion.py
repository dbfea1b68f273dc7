"""``convert`` of DeepSeek-V2 / V3 (multi-head latent attention, shared and routed experts) against vLLM 0.33.0.

Every rank file of a converted tiny DeepSeek checkpoint (``moe_checkpoints``: transformers' own
model classes for names and unquantized tensors) holds exactly what vLLM's ``DeepseekV2ForCausalLM``
/ ``DeepseekV3ForCausalLM`` hold after ``process_weights_after_loading`` (``vllm_moe_reference``):
the MLA projections (``kv_a_proj_with_mqa`` or ``fused_qkv_a_proj`` replicated, ``q_proj`` /
``q_b_proj`` and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel), the dense MLP of the
first layers, the shared experts and the Marlin MoE routed experts; nothing missing, nothing extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from marlin_pack import convert, verify
from marlin_pack.cli import app
from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.architectures import ARCHITECTURES
from marlin_pack.schemas import LayerKind

pytest.importorskip("vllm")
from moe_checkpoints import write_moe_checkpoint  # noqa: E402
from oracles.oracle_compare import assert_rank_file_equals  # noqa: E402
from oracles.vllm_moe_reference import reference_moe_rank_tensors  # noqa: E402

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"

# (architecture, format, bits, dtype, tp sizes, checkpoint options)
CASES = {
    # DeepSeek-V2-Lite's layout: q_proj (no q_lora_rank), a dense first layer, 2 shared experts.
    "v2lite-awq-bf16": (V2, "awq", 4, torch.bfloat16, (1, 2), {}),
    # Group 64: every projection and the experts keep whole groups on 4 ranks (1 head per rank).
    "v2lite-gptq4-g64-fp16": (V2, "gptq", 4, torch.float16, (1, 2, 4), {"group_size": 64}),
    # q_lora_rank set (fused_qkv_a_proj), one shared expert, every layer sparse, 8-bit.
    "v2-qlora-gptq8-bf16": (V2, "gptq", 8, torch.bfloat16, (2,),
                            {"q_lora_rank": 384, "n_shared_experts": 1, "first_k_dense_replace": 0}),
    # V3 routing (sigmoid, e_score_correction_bias, grouped top-k) and a multi-token-prediction layer.
    "v3-awq-fp16-mtp": (V3, "awq", 4, torch.float16, (1, 2), {"mtp_layers": 1}),
    "v3-gptq4-bf16": (V3, "gptq", 4, torch.bfloat16, (2,), {}),
}


def _compare(model: Path, tps: tuple[int, ...], dtype: torch.dtype) -> tuple[int, dict]:
    compared, info = 0, {}
    for tp in tps:
        for rank in range(tp):
            info = {}
            want = reference_moe_rank_tensors(model, tp, rank, dtype, info=info)
            compared += assert_rank_file_equals(model / "marlin-pack", tp, rank, want)
    return compared, info


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_bundle_bit_exact(tmp_path: Path, case: str) -> None:
    arch, fmt, bits, dtype, tps, options = CASES[case]
    model = write_moe_checkpoint(tmp_path / "m", arch, fmt, bits=bits, dtype=dtype, **options)
    manifest = convert(model, tp=tps).manifest
    n, info = _compare(model, tps, dtype)
    assert info["model_class"] == ARCHITECTURES[arch].vllm_class.split(".")[1]  # vLLM's own class for it
    config = json.loads((model / "config.json").read_text())
    sparse = list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))
    for s in manifest.tensor_parallel:
        assert [int(e.name.split(".")[2]) for e in s.moe_layers] == sparse
        kinds = {e.name.split(".", 3)[3]: e.kind for e in s.layers}
        assert kinds["self_attn.kv_b_proj"] is LayerKind.column and kinds["self_attn.o_proj"] is LayerKind.row
        a_proj = "self_attn.fused_qkv_a_proj" if config["q_lora_rank"] else "self_attn.kv_a_proj_with_mqa"
        assert kinds[a_proj] is LayerKind.replicated
        a_entry = next(e for e in s.layers if e.name.endswith(a_proj))
        assert a_entry.size_n == (config["q_lora_rank"] or 0) + config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert n >= sum(tps) * len(sparse) * 6
    # vLLM's MLA post-processing (W_UK/W_UV from kv_b_proj) ran after the quant methods: on Marlin tensors.
    assert [name for name, _ in info["mla_post_processing"]] == [f"model.layers.{i}.self_attn.attn"
                                                                  for i in range(config["num_hidden_layers"])]
    kv_b = next(e for e in manifest.tensor_parallel[-1].layers if e.name.endswith("self_attn.kv_b_proj"))
    assert {shape for _, shape in info["mla_post_processing"]} == {(kv_b.padded_k // 16, kv_b.padded_n * bits // 2)}
    if options.get("mtp_layers"):  # vLLM's model skips the MTP layer: the bundle neither converts nor keeps it
        from safetensors import safe_open

        assert not [e.name for s in manifest.tensor_parallel for e in [*s.layers, *s.moe_layers] if ".layers.3." in e.name]
        with safe_open(str(model / "marlin-pack" / "common.safetensors"), "pt") as f:
            assert not [k for k in f.keys() if k.startswith("model.layers.3.")]  # noqa: SIM118
            assert "model.layers.1.mlp.gate.e_score_correction_bias" in f.keys()  # noqa: SIM118
    assert verify(model / "marlin-pack").ok


def test_deepseek_experts_get_marlin_moe_with_auto_backend(tmp_path: Path) -> None:
    """Without --moe-backend, vLLM on SM90 (no humming package) runs DeepSeek's AWQ/GPTQ experts on Marlin MoE:
    grouped top-k, sigmoid scoring and the correction bias are the router's business, not the experts kernel's."""
    model = write_moe_checkpoint(tmp_path / "m", V3, "gptq")
    info: dict = {}
    reference_moe_rank_tensors(model, 1, 0, torch.bfloat16, info=info, moe_backend="auto")
    assert {(v["method"], v["backend"], v["experts_class"]) for v in info["layers"].values()} == {
        ("AutoGPTQMoEMethod", "MARLIN", "MarlinExperts")}
    assert info["aliases"]["model.layers.1.mlp.experts.routed_experts.e_score_correction_bias"] == (
        "model.layers.1.mlp.gate.e_score_correction_bias")


@pytest.mark.parametrize("config,tp,group,match", [
    ({"index_topk": 64}, 1, 128, r"^DeepseekV2ForCausalLM with index_topk is DeepSeek-V3\.2 \(sparse attention"),
    ({"is_causal": False}, 1, 128, r"with is_causal false uses vLLM's non-MLA attention"),
    # group 32: every other shard stays whole at --tp 8, only the heads do not split
    ({}, 8, 32, r"^DeepseekV2ForCausalLM: num_attention_heads \(4\) is not divisible by --tp 8; vLLM's MLA attention"),
    # 256 / 4 = 64 intermediate features per rank split a group of 128: vLLM would use MoeWNA16, not Marlin.
    ({}, 4, 128, r"experts: 64 intermediate features per rank at --tp 4 split a quantization group of 128"),
    ({"architectures": ["DeepseekForCausalLM"]}, 1, 128,
     (r"^DeepseekForCausalLM is a mixture-of-experts model marlin-pack does not convert; its mixture-of-experts "
      r"architectures are MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, "
      r"DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, FlexOlmoForCausalLM, HunYuanMoEV1ForCausalLM, "
      r"Kolibri1ForCausalLM, MellumForCausalLM$")),
])
def test_unsupported_deepseek_refused_before_writing(tmp_path: Path, config: dict, tp: int, group: int, match: str) -> None:
    model = write_moe_checkpoint(tmp_path / "m", V2, "awq", group_size=group)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(config)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(model, tp=(tp,))
    assert not (model / "marlin-pack").exists()


def test_quantized_mtp_layer_without_config_refused(tmp_path: Path) -> None:
    """A multi-token-prediction layer the config does not announce is not vLLM's to skip: its experts are stray.

    (``num_nextn_predict_layers: 0``: a V3 config without the key gets DeepseekV3Config's default 1, and vLLM skips it.)"""
    model = write_moe_checkpoint(tmp_path / "m", V3, "awq", mtp_layers=1)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=r"^model\.layers\.3\.mlp\.experts\.0\.down_proj\.qweight is an MoE expert"):
        convert(model)


def test_cli_convert_inspect_verify_deepseek(tmp_path: Path) -> None:
    runner = CliRunner()
    model = write_moe_checkpoint(tmp_path / "m", V2, "gptq")
    r = runner.invoke(app, ["convert", str(model), "--tp", "1,2", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [len(s["moe_layers"]) for s in data["manifest"]["tensor_parallel"]] == [2, 2]
    assert data["manifest"]["source"]["architecture"] == V2
    r = runner.invoke(app, ["inspect", str(model / "marlin-pack")])
    assert r.exit_code == 0 and "2 Marlin MoE layers x 4 experts" in r.stdout, r.stdout
    r = runner.invoke(app, ["verify", str(model / "marlin-pack"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True, r.output
