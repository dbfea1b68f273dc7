"""The ``convert`` API: argument checks, and the defaults and refusals decided from the config alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlin_pack import MarlinPackError, UnsupportedCheckpointError, convert


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


@pytest.mark.parametrize("device", ["foo", "meta"])
def test_unsupported_device(awq: Path, device: str, no_leftovers) -> None:
    with pytest.raises(MarlinPackError, match=rf"`device='{device}'` is not supported; expected 'cpu' or 'cuda"):  # the API's word
        convert(awq, device=device)
    no_leftovers(awq)


_DTYPES = [None, "float16", "bfloat16", "float32"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "gemma3", "gemma3_text", "glm4"])
@pytest.mark.parametrize("config_dtype", [d for d in _DTYPES if d])
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_default_dtype_is_what_vllm_auto_picks(model_type: str, config_dtype: str, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The oracle is vLLM's own --dtype auto resolution on a bfloat16-capable platform.
    import torch

    vllm_model = pytest.importorskip("vllm.config.model")
    from vllm.platforms import current_platform

    from marlin_pack.dtypes import default_serving_dtype

    monkeypatch.setattr(type(current_platform), "supported_dtypes", property(lambda self: [torch.bfloat16, torch.float16, torch.float32]))
    monkeypatch.setattr(current_platform, "get_device_name", lambda *a, **k: "H200", raising=False)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda *a, **k: None, raising=False)
    want = vllm_model._resolve_auto_dtype(model_type, getattr(torch, config_dtype), is_pooling_model=False)
    got = default_serving_dtype({"model_type": model_type, key: config_dtype})
    assert got.value == str(want).removeprefix("torch.")


def test_default_dtype_from_sub_config_or_weights() -> None:
    from marlin_pack.dtypes import default_serving_dtype

    assert default_serving_dtype({"text_config": {"torch_dtype": "bfloat16"}}).value == "bfloat16"
    assert default_serving_dtype({}, {"I32", "F16"}).value == "float16"  # quantized words are not a dtype choice
    assert default_serving_dtype({}, {"BF16", "F16"}).value == "bfloat16"
    assert default_serving_dtype({}).value == "bfloat16"  # vLLM: float32, downcast to bfloat16


def test_float32_checkpoint_converts_to_bfloat16_by_default(awq_copy: Path, edit_config) -> None:
    edit_config(awq_copy, torch_dtype="float32")
    assert convert(awq_copy).manifest.serving_dtype.value == "bfloat16"


def test_awq_dynamic_overrides_are_refused(awq_copy: Path, edit_config) -> None:
    edit_config(awq_copy, q_dynamic={"-:.*down_proj.*": {}})
    with pytest.raises(UnsupportedCheckpointError, match=r"AWQ 'dynamic' per-module overrides .*cannot load"):
        convert(awq_copy)


def test_gptq_quantized_lm_head_is_named_as_such(tmp_path: Path, edit_config) -> None:
    from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint

    d = write_gptq_checkpoint(tmp_path / "g", PRESETS["tiny"], tokenizer=False)
    edit_config(d, q_lm_head=True, q_dynamic={"lm_head": {"bits": 4}})
    with pytest.raises(UnsupportedCheckpointError, match=r"GPTQ lm_head is true"):
        convert(d)


def test_gptq_settings_only_in_quantize_config_json(tmp_path: Path, edit_config) -> None:
    # Older AutoGPTQ: config.json has no quantization_config; vLLM reads quantize_config.json.
    import json

    from safetensors.torch import load_file

    from marlin_pack import verify
    from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint
    from marlin_pack.vllm_plugin.preflight import preflight

    d = write_gptq_checkpoint(tmp_path / "g", PRESETS["tiny"], group_size=64, tokenizer=False)
    ref = convert(d, tmp_path / "ref").manifest
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    qc = json.loads((d / "quantize_config.json").read_text())
    del qc["quant_method"]
    (d / "quantize_config.json").write_text(json.dumps(qc))
    m = convert(d).manifest
    assert m.quant == ref.quant and m.source.quant_settings.quant_method == "gptq"
    assert (m.source.quant_settings_file, ref.source.quant_settings_file) == ("quantize_config.json", "config.json")
    got, want = load_file(d / "marlin-pack/tp1/rank-0.safetensors"), load_file(tmp_path / "ref/tp1/rank-0.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)
    assert verify(d / "marlin-pack").ok
    assert preflight(d).decision == "load"
    (d / "quantize_config.json").write_text(json.dumps({**qc, "group_size": 128}))
    assert preflight(d).ranks[0].field == "source.quant_settings"


@pytest.mark.parametrize("write", ["cached", "direct"])
def test_the_bundle_is_in_the_page_cache_after_convert_where_memory_holds_it(
    awq: Path, tmp_path: Path, write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start after ``convert`` finds the bundle warm where the host's memory holds it (the default
    here); forced around the cache (a host short of memory) the rank file is written with O_DIRECT and is cold."""
    from marlin_pack.io.residency import cached_fraction, takes_direct_reads

    if write == "cached":
        monkeypatch.delenv("MARLIN_PACK_WRITE", raising=False)
        monkeypatch.setattr("marlin_pack.conversion.available_memory", lambda: 64 << 30)
    else:
        monkeypatch.setenv("MARLIN_PACK_WRITE", "direct")
    out = convert(awq, tmp_path / "b").bundle
    rank = next(out.glob("tp1/*.safetensors"))
    if write == "cached":
        assert cached_fraction(rank) == 1.0
    else:
        if not takes_direct_reads(rank):
            pytest.skip("this file system refuses O_DIRECT: writes go through the page cache")
        assert cached_fraction(rank) < 0.5


def test_an_unknown_write_path_is_one_line(awq: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers) -> None:
    monkeypatch.setenv("MARLIN_PACK_WRITE", "fast")
    with pytest.raises(MarlinPackError, match="expected 'direct' or 'cached'"):
        convert(awq, tmp_path / "b")
