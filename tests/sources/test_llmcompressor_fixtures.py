"""Checkpoints written by llm-compressor (compressed-tensors pack-quantized), committed under
``tests/data/llmcompressor/`` (see its README.md and make_fixtures.py): converted, compared bit for
bit with what stock vLLM holds (``tests/oracles/vllm_reference.py``), verified, and refused exactly
where vLLM refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marlin_pack import UnsupportedCheckpointError, convert, verify

pytest.importorskip("vllm")
from committed_fixtures import copy_fixture  # noqa: E402
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402
from oracles.vllm_reference import VllmRefusedError, reference_rank_tensors  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data" / "llmcompressor"
# fixture -> TP sizes vLLM serves with Marlin (hidden 256: o_proj has 64 input features per rank
# at TP 4, which split a group of 128 or 64... but not of 32).
ACCEPTED: dict[str, tuple[int, ...]] = {
    "gptq-w4a16-g128": (1, 2),  # W4A16: symmetric, group 128, actorder static
    "awq-w4a16-asym": (1, 2),  # W4A16_ASYM: zero points, group 128
    "rtn-w8a16-g128": (1, 2),  # W8A16: symmetric 8-bit, group 128
    "gptq-w4a16-actorder-ignore": (1, 2, 4),  # group 64, actorder static, layer 1 o_proj ignored
}


# Mixture-of-experts fixtures (make_moe_fixtures.py), tested in test_llmcompressor_moe_fixtures.py: fixture -> TP sizes.
MOE_ACCEPTED: dict[str, tuple[int, ...]] = {
    "qwen3moe-gptq-w4a16": (1, 2),  # W4A16 GPTQ, group 128; routers ignored
    "mixtral-rtn-w4a16-asym": (1, 2),  # W4A16_ASYM round-to-nearest, group 128; experts named {gate,up,down}_proj
}


def test_every_fixture_is_listed_and_small() -> None:
    assert sorted(p.parent.name for p in DATA.glob("*/config.json")) == sorted([*ACCEPTED, *MOE_ACCEPTED])
    for name in ACCEPTED:
        assert sum(f.stat().st_size for f in (DATA / name).iterdir()) < 1 << 20, name
    for name in MOE_ACCEPTED:
        assert sum(f.stat().st_size for f in (DATA / name).iterdir()) < 2 << 20, name


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_fixture_bundle_equals_stock_vllm(name: str, tmp_path: Path) -> None:
    model = copy_fixture(DATA, name, tmp_path)
    tps = ACCEPTED[name]
    manifest = convert(model, tp=tps).manifest
    assert manifest.source.format.value == "compressed-tensors"
    assert assert_bundle_equals_vllm(model, model / "marlin-pack", tps, torch.bfloat16) > 0
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure
    for tp in {1, 2, 4, 8} - set(tps):  # refused by both
        with pytest.raises(UnsupportedCheckpointError):
            convert(model, tmp_path / f"tp{tp}", tp=(tp,))
        with pytest.raises((VllmRefusedError, ValueError)):
            reference_rank_tensors(model, tp, 0, torch.bfloat16)


def test_ignored_module_goes_to_common(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = copy_fixture(DATA, "gptq-w4a16-actorder-ignore", tmp_path)
    convert(model, tp=(1,))
    with safe_open(str(model / "marlin-pack" / "common.safetensors"), "pt") as f:
        assert "model.layers.1.self_attn.o_proj.weight" in f.keys()  # noqa: SIM118
    with safe_open(str(model / "marlin-pack" / "tp1" / "rank-0.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "model.layers.1.self_attn.o_proj.weight_packed" not in names
    assert {"model.layers.0.self_attn.o_proj.weight_packed", "model.layers.0.self_attn.o_proj.weight_shape"} <= names


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.update(actorder="group"), "actorder is 'group'"),
        (lambda w: w.update(num_bits=8, symmetric=False), "8-bit asymmetric"),
    ],
)
def test_refused_like_vllm(tmp_path: Path, edit, message: str) -> None:
    model = copy_fixture(DATA, "gptq-w4a16-g128", tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    edit(cfg["quantization_config"]["config_groups"]["group_0"]["weights"])
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=message):
        convert(model, tp=(1,))
    with pytest.raises((VllmRefusedError, ValueError)):
        reference_rank_tensors(model, 1, 0, torch.bfloat16)
