"""Tied word embeddings: a checkpoint that saves the tied lm_head as a copy stores it once in the bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from marlin_pack import convert, verify


def _tied_copy(src: Path, dst: Path, *, same: bool = True) -> Path:
    """``src`` with tie_word_embeddings true and lm_head.weight saved as a copy of the embeddings."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if same else embed.flip(0).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _common_names(model: Path) -> set[str]:
    with safe_open(str(model / "marlin-pack" / "common.safetensors"), "pt") as f:
        return set(f.keys())


def test_tied_copy_is_stored_once(make_checkpoint, tmp_path: Path) -> None:
    model = _tied_copy(make_checkpoint("awq", "tiny"), tmp_path / "m")
    manifest = convert(model, tp=(1, 2)).manifest
    assert manifest.common_aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in _common_names(model) and "model.embed_tokens.weight" in _common_names(model)
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure
    assert "stored once" in next(c.detail for c in report.checks if c.name == "common")


def test_tied_but_different_lm_head_is_kept(make_checkpoint, tmp_path: Path) -> None:
    model = _tied_copy(make_checkpoint("gptq", "tiny"), tmp_path / "m", same=False)
    manifest = convert(model).manifest
    assert manifest.common_aliases == {}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= _common_names(model)


def test_untied_equal_tensors_are_not_touched(make_checkpoint, tmp_path: Path, edit_config) -> None:
    model = _tied_copy(make_checkpoint("gptq", "tiny"), tmp_path / "m")
    edit_config(model, tie_word_embeddings=False)
    assert convert(model).manifest.common_aliases == {}


def test_verify_refuses_an_alias_to_a_missing_tensor(make_checkpoint, tmp_path: Path) -> None:
    model = _tied_copy(make_checkpoint("awq", "tiny"), tmp_path / "m")
    convert(model)
    path = model / "marlin-pack" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["common_aliases"] = {"lm_head.weight": "model.norm.nothing"}
    path.write_text(json.dumps(raw))
    assert not verify(model / "marlin-pack").ok


def test_loader_feeds_the_tensor_under_both_names(make_checkpoint, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from marlin_pack.gpu.host_map import HostMap
    from marlin_pack.gpu.plan import IoPlan
    from marlin_pack.gpu.reader import ParallelReader
    from marlin_pack.vllm_plugin.common_tensors import common_weights
    from marlin_pack.vllm_plugin.decision import EngineFacts, decide
    from marlin_pack.vllm_plugin.options import parse_extra_config

    model = _tied_copy(make_checkpoint("awq", "tiny"), tmp_path / "m")
    convert(model)
    import vllm

    facts = EngineFacts(model=str(model), vllm_version=vllm.__version__, tp_size=1, tp_rank=0, pp_size=1,
                        dtype="float16", quantization="awq", marlin_input_dtype=None, batch_invariant=False,
                        disabled_kernels=(), linear_backend="auto", linear_backend_per_quant=None)
    bundle = decide(parse_extra_config({}, "marlin_prepacked"), facts).bundle
    assert bundle is not None
    want = load_file(str(model / "model.safetensors"))
    with ParallelReader(IoPlan(threads=1, window=1 << 20)) as reader, HostMap(bundle.common_file) as host:
        fed = dict(common_weights(reader, host, bundle, torch.nn.Module(), torch.device("cpu")))
        assert fed["lm_head.weight"] is fed["model.embed_tokens.weight"]
        assert torch.equal(fed["lm_head.weight"], want["lm_head.weight"])


def test_only_the_head_is_deduplicated(make_checkpoint, tmp_path: Path) -> None:
    """Equal norms stay two tensors: a weight loader may change what it is given in place."""
    model = _tied_copy(make_checkpoint("awq", "tiny"), tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert convert(model).manifest.common_aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= _common_names(model)
