"""Checkpoints written by the real quantizers (GPTQModel, AutoAWQ, optimum), committed under
``tests/data/thirdparty/`` (see its README.md and make_fixtures.py): converted, compared bit for
bit with what stock vLLM holds (``tests/oracles/vllm_reference.py``), verified, and refused exactly
where vLLM refuses.

Each fixture's accepted TP sizes are written down here, not derived from the oracle, so a
refusal on either side fails a test; every other candidate TP size must be refused by both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from marlin_pack import UnsupportedCheckpointError, convert, verify

pytest.importorskip("vllm")
from committed_fixtures import copy_fixture  # noqa: E402
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402
from oracles.vllm_reference import VllmRefusedError, _OracleBug, reference_rank_tensors  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data" / "thirdparty"
CANDIDATE_TPS = (1, 2, 4, 8)

# fixture -> the TP sizes vLLM serves with Marlin (hidden 256, 8 heads, 2 KV heads).
ACCEPTED: dict[str, tuple[int, ...]] = {
    # g128: o_proj has 256 input features, 64 per rank at TP 4 split a group.
    "gptqmodel-llama-4bit-g128": (1, 2),
    "gptqmodel-llama-4bit-gch-descact": (1, 2, 4, 8),
    "gptqmodel-llama-8bit-g32": (1, 2, 4, 8),
    # TP 4: 172 input features per rank for down_proj, 43 packed 8-bit rows. At TP 8 (86 per
    # rank, 21.5 packed rows) vLLM's repack op fails.
    "gptqmodel-llama-8bit-gch-688": (1, 2, 4),
    "gptqmodel-qwen2-4bit-g64": (1, 2, 4),
    "gptqmodel-llama-4bit-g64-bf16": (1, 2, 4),
    "gptqmodel-awq-llama-4bit-g128": (1, 2),
    "autoawq-llama-4bit-g128": (1, 2),
    # intermediate 640: down_proj has 160 input features per rank at TP 4, which split a group of 64.
    "autoawq-llama-4bit-g64": (1, 2),
    # intermediate 576: 144 input features per rank at TP 4 split a group of 32.
    "optimum-llama-4bit-g32": (1, 2),
    "autoawq-qwen2-4bit-g64": (1, 2, 4),
}
# TP sizes vLLM serves that marlin-pack refuses (a refusal, never wrong bytes): strict xfails.
GAPS: dict[str, tuple[tuple[int, ...], str]] = {
    "gptqmodel-llama-4bit-g128-lmhead": (
        (1, 2),
        (
            "GPTQModel's lm_head=True writes lm_head: true and dynamic {lm_head: 8-bit g32}; vLLM serves the decoder "
            "layers (and a Marlin lm_head), marlin-pack refuses the whole checkpoint (decoder-layer linears only)"
        ),
    ),
}
# Checkpoints vLLM refuses outright: marlin-pack must refuse them too, naming the cause.
REFUSED: dict[str, str] = {
    "gptqmodel-llama-4bit-g128-descact": "desc_act",
    "gptqmodel-llama-4bit-g128-asym": "sym is False",
    "gptqmodel-awq-llama-4bit-g128-nozp": "zero_point is False",
    # GPTQModel writes Phi-3 with a fused qkv_proj but separate gate_proj / up_proj: vLLM's
    # Phi3ForCausalLM expects gate_up_proj (its packed_modules_mapping) and fails to load it.
    "gptqmodel-phi3-4bit-g64": "mlp.gate_up_proj is not in the checkpoint, which has down_proj, gate_proj, up_proj",
    # GPTQModel saves the tied lm_head; vLLM's Gemma2ForCausalLM has none and refuses the tensor.
    "gptqmodel-gemma2-4bit-g64": "stores lm_head.weight, but vLLM's Gemma2ForCausalLM has no lm_head",
}
# Mixture-of-experts fixtures (1 decoder layer, 4 experts of 256; tests/sources/test_thirdparty_moe_fixtures.py).
MOE_ACCEPTED: dict[str, tuple[int, ...]] = {
    "gptqmodel-qwen3moe-4bit-g128": (1, 2),  # transformers-5 config: num_local_experts
    "autoawq-mixtral-4bit-g128": (1, 2),  # block_sparse_moe.experts.N.{w1,w2,w3}
}
MOE_REFUSED: dict[str, str] = {
    # transformers 5's mlp.experts.N.{gate,up,down}_proj: vLLM's MixtralForCausalLM has no mlp module
    "gptqmodel-mixtral-4bit-g128": "stores its experts as mlp.experts.N",
}


def _fixture_dirs() -> list[str]:
    return sorted(p.parent.name for p in DATA.glob("*/config.json"))


def test_every_fixture_is_listed_and_small() -> None:
    found = _fixture_dirs()
    assert found, f"no fixtures under {DATA}"
    assert sorted(found) == sorted({*ACCEPTED, *REFUSED, *GAPS, *MOE_ACCEPTED, *MOE_REFUSED})
    total = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    assert total < 14_000_000, f"third-party fixtures take {total} bytes"
    assert {p.name for p in DATA.iterdir() if p.name != "__pycache__"} == {*found, "README.md", "make_fixtures.py"}
    kept = {"config.json", "generation_config.json", "quantize_config.json", "model.safetensors.index.json"}
    for name in found:
        files = {p.name for p in (DATA / name).iterdir()}
        assert any(f.endswith(".safetensors") for f in files), name
        assert all(f in kept or (f.startswith("model") and f.endswith(".safetensors")) for f in files), (name, files)


def test_fixtures_carry_the_quantizers_quirks() -> None:
    """What the fixtures are for: if a regeneration loses one of these, the tests below no longer cover it."""
    cfg = {n: json.loads((DATA / n / "config.json").read_text()) for n in _fixture_dirs()}
    qc = {n: c["quantization_config"] for n, c in cfg.items()}
    gm = qc["gptqmodel-llama-4bit-g128"]
    assert gm["checkpoint_format"] == "gptq" and gm["meta"]["quantizer"][0].startswith("gptqmodel:")
    assert (DATA / "gptqmodel-llama-4bit-g128" / "quantize_config.json").exists()
    assert qc["gptqmodel-llama-4bit-gch-descact"]["desc_act"] is True
    assert qc["gptqmodel-llama-4bit-gch-descact"]["group_size"] == -1
    assert cfg["gptqmodel-llama-8bit-g32"]["tie_word_embeddings"] is True
    assert qc["gptqmodel-llama-8bit-gch-688"]["bits"] == 8 and cfg["gptqmodel-llama-8bit-gch-688"]["intermediate_size"] == 688
    assert qc["autoawq-llama-4bit-g64"]["quant_method"] == "awq" and qc["autoawq-llama-4bit-g64"]["version"] == "gemm"
    assert isinstance(qc["optimum-llama-4bit-g32"].get("dataset"), list)
    assert qc["optimum-llama-4bit-g32"]["checkpoint_format"] == "gptq_v2"  # qzeros hold 8, not 8 - 1
    assert len(list((DATA / "gptqmodel-qwen2-4bit-g64").glob("model-*-of-*.safetensors"))) > 1
    assert len(list((DATA / "autoawq-llama-4bit-g64").glob("model-*-of-*.safetensors"))) > 1
    g_idx = load_file(DATA / "gptqmodel-llama-4bit-g128-descact" / "model.safetensors")["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // 128)  # act-order: what vLLM refuses
    assert cfg["gptqmodel-qwen2-4bit-g64"]["model_type"] == "qwen2"
    assert qc["gptqmodel-llama-4bit-g128-lmhead"]["dynamic"]["lm_head"]["bits"] == 8
    assert qc["gptqmodel-awq-llama-4bit-g128"]["checkpoint_format"] == "gemm" and "meta" in qc["gptqmodel-awq-llama-4bit-g128"]
    # bf16 model, fp16 scales: what GPTQModel writes for a bf16 model
    bf16 = load_file(DATA / "gptqmodel-llama-4bit-g64-bf16" / "model.safetensors")
    assert cfg["gptqmodel-llama-4bit-g64-bf16"]["dtype"] == "bfloat16"
    assert bf16["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert bf16["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_convert_is_bit_exact_with_vllm(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    tps = ACCEPTED[name]
    model = copy_fixture(DATA, name, tmp_path)
    convert(model, tp=tps, dtype=str(dtype).removeprefix("torch."))
    n = assert_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert n >= 2 * 4 * layers * sum(tps), n  # qweight, scales (+ AWQ zeros, biases) of 4 fused layers per decoder layer
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_other_tp_sizes_refused_by_both(name: str, tmp_path: Path) -> None:
    accepted = ACCEPTED[name]
    refused = [tp for tp in CANDIDATE_TPS if tp not in accepted and tp not in GAPS.get(name, ((), ""))[0]]
    model = copy_fixture(DATA, name, tmp_path)
    for tp in refused:
        # _OracleBug: vLLM hands gptq_marlin_repack a shape the CUDA op rejects (a load failure in vLLM).
        with pytest.raises((VllmRefusedError, _OracleBug)):
            reference_rank_tensors(model, tp, 0, torch.float16)
        with pytest.raises(UnsupportedCheckpointError):
            convert(model, tp=(tp,), dtype="float16")
        assert not (model / "marlin-pack").exists()


def _gap(name: str, tps: tuple[int, ...], why: str) -> object:
    return pytest.param(name, tps, marks=pytest.mark.xfail(strict=True, raises=UnsupportedCheckpointError, reason=why))


@pytest.mark.parametrize("name,tps", [_gap(n, tps, why) for n, (tps, why) in GAPS.items()])
def test_what_vllm_serves_but_marlin_pack_refuses(name: str, tps: tuple[int, ...], tmp_path: Path) -> None:
    model = copy_fixture(DATA, name, tmp_path)
    for tp in tps:
        assert reference_rank_tensors(model, tp, 0, torch.float16)  # vLLM serves these TP sizes
    convert(model, tp=tps, dtype="float16")
    assert assert_bundle_equals_vllm(model, model / "marlin-pack", tps, torch.float16) > 0


@pytest.mark.parametrize("name", list(REFUSED))
def test_checkpoints_vllm_refuses_are_refused(name: str, tmp_path: Path) -> None:
    model = copy_fixture(DATA, name, tmp_path)
    with pytest.raises(VllmRefusedError):
        reference_rank_tensors(model, 1, 0, torch.float16)
    with pytest.raises(UnsupportedCheckpointError, match=REFUSED[name]):
        convert(model, tp=(1,))
    assert not (model / "marlin-pack").exists()


@pytest.mark.parametrize(
    "name,dtype_args,dtype",
    [
        ("autoawq-llama-4bit-g64", ["--dtype", "bfloat16"], torch.bfloat16),
        ("optimum-llama-4bit-g32", [], torch.float16),
        ("gptqmodel-llama-4bit-g64-bf16", [], torch.bfloat16),  # default: config.json's dtype, not the scales'
    ],
)
def test_cli_convert_and_verify(name: str, dtype_args: list[str], dtype: torch.dtype, tmp_path: Path) -> None:
    from marlin_pack.cli import app

    runner = CliRunner()
    model = copy_fixture(DATA, name, tmp_path)
    r = runner.invoke(app, ["convert", str(model), "--tp", "1,2", *dtype_args, "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.stdout)["manifest"]
    assert [s["tp_size"] for s in manifest["tensor_parallel"]] == [1, 2]
    assert assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype) > 0
    r = runner.invoke(app, ["verify", str(model / "marlin-pack"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
