"""GPTQModel's ``dynamic`` rules: exclusions and no-op overrides convert bit-exact; real mixed schemes are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack import convert, verify
from marlin_pack.errors import UnsupportedCheckpointError

MLP1 = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")


def _with_dynamic(src: Path, dst: Path, dynamic: dict, unquantize: tuple[str, ...] = ()) -> Path:
    """``src`` with ``dynamic`` in its quantization settings and ``unquantize`` modules stored as plain fp16 weights."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for m in unquantize:
        k = tensors[f"{m}.g_idx"].shape[0]
        n = tensors[f"{m}.scales"].shape[1]
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"{m}.{leaf}"]
        tensors[f"{m}.weight"] = (torch.randn(n, k, generator=g) * 0.02).half()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "quantize_config.json"):
        raw = json.loads((dst / name).read_text())
        qc = raw.get("quantization_config", raw) if name == "config.json" else raw
        qc["dynamic"] = dynamic
        (dst / name).write_text(json.dumps(raw))
    return dst


def test_excluded_layers_stay_unquantized_bit_exact(make_checkpoint, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from oracles.oracle_compare import assert_bundle_equals_vllm

    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m",
                          {r"-:.*layers\.1\.mlp\..*": {}, r"+:.*self_attn.*": {"bits": 4, "group_size": 128}}, MLP1)
    manifest = convert(model, tp=(1, 2)).manifest
    names = {e.name for e in manifest.tensor_parallel[0].layers}
    assert "model.layers.1.mlp.gate_up_proj" not in names and "model.layers.0.mlp.gate_up_proj" in names
    assert manifest.source.quant_settings.dynamic == {r"-:.*layers\.1\.mlp\..*": {}, r"+:.*self_attn.*": {"bits": 4, "group_size": 128}}
    assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.float16)
    assert verify(model / "marlin-pack").ok


def test_excluding_a_quantized_layer_is_refused(make_checkpoint, tmp_path: Path) -> None:
    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m", {r"-:.*down_proj": {}})
    with pytest.raises(UnsupportedCheckpointError, match=r"rule '-:\.\*down_proj' leaves model\.layers\.0\.mlp\.down_proj unquantized"):
        convert(model)


@pytest.mark.parametrize("override,match", [({"bits": 8}, "sets bits 8"), ({"group_size": 32}, "sets group_size 32"),
                                            ({"sym": False}, "sets sym False")])
def test_mixed_schemes_are_refused(make_checkpoint, tmp_path: Path, override: dict, match: str) -> None:
    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m", {r"+:.*layers\.1\..*": override})
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(model)


def test_bad_regex_is_refused(make_checkpoint, tmp_path: Path) -> None:
    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m", {"-:([": {}})
    with pytest.raises(UnsupportedCheckpointError, match="not a valid regular expression"):
        convert(model)


@pytest.mark.parametrize("rule", ["+:a{99999999999}", "-:" + "(" * 2000 + ")" * 2000], ids=["huge-repeat", "deep-nesting"])
def test_regex_that_overflows_the_compiler_is_refused(make_checkpoint, tmp_path: Path, rule: str) -> None:
    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m", {rule: {}})
    with pytest.raises(UnsupportedCheckpointError, match=r"GPTQ dynamic rule .* is not a valid regular expression"):
        convert(model)


def test_float_settings_in_a_rule_are_read(make_checkpoint, tmp_path: Path) -> None:
    """GPTQModel writes float settings into its rules (``mse``, ``damp_percent``): numbers, not malformed; a rule
    that keeps the layer's scheme converts as without them."""
    rule = {r"+:.*self_attn.*": {"bits": 4, "group_size": 128, "mse": 2.4, "damp_percent": 0.05}}
    model = _with_dynamic(make_checkpoint("gptq", "tiny"), tmp_path / "m", rule)
    manifest = convert(model).manifest
    assert manifest.source.quant_settings.dynamic == rule
    assert "model.layers.0.self_attn.qkv_proj" in {e.name for e in manifest.tensor_parallel[0].layers}
