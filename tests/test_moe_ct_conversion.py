"""``convert`` of compressed-tensors (llm-compressor pack-quantized) mixture-of-experts checkpoints.

Every rank file of a converted tiny Qwen3-MoE / Mixtral (and one Qwen2-MoE, DeepSeek-V3) checkpoint,
W4A16 / W4A16_ASYM / W8A16 with several group sizes, TP 1/2/4, fp16/bf16, holds exactly what vLLM's
own model class holds after ``process_weights_after_loading`` (``vllm_moe_reference``: the dense
compressed-tensors Marlin linears and the experts of ``CompressedTensorsWNA16MoEMethod`` on the
Marlin MoE backend), nothing missing and nothing extra. What vLLM refuses or would not serve on
Marlin is refused in one line before anything is written; the experts' ignore/targets decision is
checked against vLLM's own ``CompressedTensorsConfig.get_scheme_dict``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify
from marlin_pack.errors import UnsupportedCheckpointError

pytest.importorskip("vllm")
from moe_checkpoints import CT_IGNORE, write_moe_checkpoint  # noqa: E402
from oracles.vllm_moe_reference import VllmRefusedError, reference_moe_rank_tensors  # noqa: E402
from test_moe_conversion import assert_moe_bundle_equals_vllm  # noqa: E402

from marlin_pack.marlin.moe import MOE_ARCHITECTURES  # noqa: E402
from marlin_pack.moe_conversion import ct_expert_names  # noqa: E402
from marlin_pack.sources import source_from_quant_config  # noqa: E402
from marlin_pack.testing.synthetic import compressed_tensors_config  # noqa: E402

CT = "compressed-tensors"
Q3, MIX = "Qwen3MoeForCausalLM", "MixtralForCausalLM"

# (architecture, bits, symmetric, group size, dtype, TP sizes, config overrides). Intermediate sizes other than
# the hidden size keep w13's and w2's weight_shape apart.
CASES = [
    (Q3, 4, True, 128, torch.bfloat16, (1, 2, 4), {}),
    (Q3, 4, False, 64, torch.float16, (1, 2, 4), {"moe_intermediate_size": 256}),
    (Q3, 8, True, 128, torch.bfloat16, (1, 2), {"moe_intermediate_size": 256}),
    (MIX, 4, True, 32, torch.float16, (1, 2, 4), {"intermediate_size": 256}),
    (MIX, 4, False, 128, torch.bfloat16, (1, 2, 4), {}),
    (MIX, 8, True, -1, torch.float16, (1, 4), {}),
    (Q3, 4, False, 32, torch.bfloat16, (2,), {"moe_intermediate_size": 192}),  # 96 per rank, padded to 128
    ("Qwen2MoeForCausalLM", 4, False, 128, torch.bfloat16, (2,), {}),  # shared expert: dense linears
    ("DeepseekV3ForCausalLM", 4, False, 64, torch.float16, (2,), {}),  # dense first layer, MLA, shared experts
]


def _id(c: tuple) -> str:
    arch, bits, sym, g, dtype, tps, _ = c
    return f"{arch[:7]}-w{bits}{'' if sym else 'asym'}-g{g}-{str(dtype)[6:]}-tp{''.join(map(str, tps))}"


@pytest.mark.slow
@pytest.mark.parametrize("arch,bits,sym,g,dtype,tps,kw", CASES, ids=[_id(c) for c in CASES])
def test_ct_moe_bundle_bit_exact(tmp_path: Path, arch: str, bits: int, sym: bool, g: int, dtype: torch.dtype,
                                 tps: tuple[int, ...], kw: dict) -> None:
    model = write_moe_checkpoint(tmp_path / "m", arch, CT, bits=bits, group_size=g, symmetric=sym, dtype=dtype, **kw)
    manifest = convert(model, tp=tps).manifest
    assert manifest.source.format.value == CT and manifest.quant.zero_points is (not sym)
    per_layer = 6 + (0 if sym else 2)  # weights, scales, two weight_shapes (+ zero points)
    n_sparse = len(manifest.tensor_parallel[0].moe_layers)
    assert n_sparse >= 2
    assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype) >= sum(tps) * n_sparse * per_layer
    assert verify(model / "marlin-pack").ok


def test_ct_experts_names_and_layout_match_vllm_method(tmp_path: Path) -> None:
    """The oracle's experts layers ran CompressedTensorsWNA16MoEMethod on Marlin with 16-bit activations, and a
    symmetric scheme keeps no zero points (what the loader's layer check and the daemon's opt-in rely on)."""
    model = write_moe_checkpoint(tmp_path / "m", Q3, CT, bits=4, group_size=128, moe_intermediate_size=256)
    info: dict = {}
    ref = reference_moe_rank_tensors(model, 1, 0, torch.float16, info=info)
    for name, layer in info["layers"].items():
        assert (layer["method"], layer["backend"], layer["input_dtype"]) == ("CompressedTensorsWNA16MoEMethod", "MARLIN", None)
        assert f"{name}.w13_weight_packed" in ref and f"{name}.w13_weight_zero_point" not in ref
        assert ref[f"{name}.w13_weight_shape"][0].tolist() == [256, 512]  # [N, K] of gate/up
        assert ref[f"{name}.w2_weight_shape"][0].tolist() == [512, 256]


def test_ct_group_split_refused_like_vllm(tmp_path: Path) -> None:
    model = write_moe_checkpoint(tmp_path / "m", Q3, CT, bits=4, group_size=64, moe_intermediate_size=384)
    with pytest.raises(VllmRefusedError, match="Marlin not supported for this layer"):  # --moe-backend marlin
        reference_moe_rank_tensors(model, 4, 0, torch.float16)
    with pytest.raises(VllmRefusedError, match="No WNA16 MoE backend|divisible by group_size"):  # auto: none serves it
        reference_moe_rank_tensors(model, 4, 0, torch.float16, moe_backend="auto")
    with pytest.raises(UnsupportedCheckpointError, match=r"^experts: 96 intermediate features per rank at --tp 4 split a "
                       r"quantization group of 64; vLLM's CompressedTensorsWNA16MoEMethod refuses it, choose a smaller --tp$"):
        convert(model, tp=(1, 4))
    assert not (model / "marlin-pack").exists()


def _edit_qc(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    qc = cfg["quantization_config"]
    for key, value in changes.items():
        if key in ("actorder", "dynamic", "type"):
            qc["config_groups"]["group_0"]["weights"][key] = value
        else:
            qc[key] = value
    (model / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    ({"ignore": [*CT_IGNORE[Q3], "re:.*experts.*"]},
     (r"^compressed-tensors ignore/targets leave the experts of decoder layer 0 unquantized "
      r"\(model\.layers\.0\.mlp\.experts\.0\.gate_proj\); vLLM serves them with UnquantizedFusedMoEMethod")),
    ({"ignore": [*CT_IGNORE[Q3], "re:.*experts.*gate_proj$"]},
     r"^compressed-tensors ignore/targets leave model\.layers\.0\.mlp\.experts\.0\.gate_proj unquantized but not its sibling"),
    ({"actorder": "group"}, r"actorder is 'group'"),
])
def test_ct_moe_refusals_before_writing(tmp_path: Path, changes: dict, match: str) -> None:
    model = write_moe_checkpoint(tmp_path / "m", Q3, CT, bits=4, group_size=128)
    _edit_qc(model, **changes)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(model)
    assert not (model / "marlin-pack").exists()
    assert not [p for p in model.iterdir() if p.name.startswith(".marlin-pack")]


def test_ct_moe_cli_refusal_one_line_exit_1(tmp_path: Path) -> None:
    model = write_moe_checkpoint(tmp_path / "m", MIX, CT, bits=4, group_size=128)
    _edit_qc(model, ignore=["lm_head", "re:.*block_sparse_moe.*"])  # router and experts: vLLM's unquantized MoE
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    r = subprocess.run([sys.executable, "-c", code, "convert", str(model)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: compressed-tensors ignore/targets leave the experts of decoder layer 0 unquantized "
                               "(model.layers.0.block_sparse_moe.experts.0.w1)"), r.stderr
    assert r.stderr.splitlines()[0].endswith("use a checkpoint whose experts are quantized")  # the whole error on one line
    assert not (model / "marlin-pack").exists()


# --- the experts' ignore/targets decision against vLLM's own CompressedTensorsConfig ----------------------------


def _vllm_quantizes_experts(qc: dict, names: tuple[str, ...]) -> bool | str:
    """vLLM's answer for one experts layer: get_scheme_dict of expert 0's names on a RoutedExperts module."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    config._add_fused_moe_to_target_scheme_map()
    layer = type("RoutedExperts", (torch.nn.Module,), {})()
    answers = {config.get_scheme_dict(layer, n) is not None for n in names}
    return "refused" if len(answers) > 1 else answers.pop()


@pytest.mark.parametrize("arch", [Q3, MIX, "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("ignore,targets", [
    (None, ["Linear"]),
    (["lm_head", "re:.*experts.*"], ["Linear"]),
    (["lm_head", "re:.*mlp[.]experts[.].*[.]down_proj$", "re:.*[.]w2$"], ["Linear"]),
    (["lm_head"], ["re:.*self_attn.*"]),  # only attention targeted: the experts stay unquantized
    (["lm_head"], ["re:.*self_attn.*", "re:.*experts.*"]),
    (["lm_head"], ["RoutedExperts"]),
    (["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj",
      "model.layers.0.mlp.experts.0.down_proj"], ["Linear"]),
])
def test_experts_decision_equals_vllm(arch: str, ignore: list[str] | None, targets: list[str]) -> None:
    qc = compressed_tensors_config(4, 128, True, ignore=ignore)
    qc["config_groups"]["group_0"]["targets"] = targets
    source = source_from_quant_config(qc)
    for layer in (0, 1):
        names = ct_expert_names(MOE_ARCHITECTURES[arch], "model.layers", layer)
        want = _vllm_quantizes_experts(qc, names)
        if want == "refused":
            with pytest.raises(UnsupportedCheckpointError, match="one scheme for all MoE projections"):
                source.vllm_quantizes_experts(names)
        else:
            assert source.vllm_quantizes_experts(names) is want, (names, want)


@pytest.mark.parametrize("arch", [Q3, MIX, "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_expert_names_are_the_ones_vllm_looks_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """ct_expert_names equals what vLLM's get_moe_method builds ({layer_name}.0.{ckpt name}) for every experts layer."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe as ct_moe,
    )

    seen: list[tuple[str, ...]] = []
    real = ct_moe.CompressedTensorsMoEMethod.get_moe_method

    def spy(quant_config, layer, layer_name):  # noqa: ANN001, ANN202
        seen.append(tuple(f"{layer_name}.0.{p}" for p in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                                                          layer.ckpt_down_proj_name)))
        return real(quant_config, layer, layer_name)

    monkeypatch.setattr(ct_moe.CompressedTensorsMoEMethod, "get_moe_method", staticmethod(spy))
    model = write_moe_checkpoint(tmp_path / "m", arch, CT, bits=4, group_size=128)
    info: dict = {}
    reference_moe_rank_tensors(model, 1, 0, torch.float16, info=info)
    layers = sorted(int(name.split(".")[2]) for name in info["layers"])
    assert seen and seen == [ct_expert_names(MOE_ARCHITECTURES[arch], "model.layers", i) for i in layers]
