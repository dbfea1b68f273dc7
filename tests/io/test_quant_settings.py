"""parse_quant_settings: the one reader of which quantization settings matter, checked against vLLM's own."""

from __future__ import annotations

import pytest

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.io.checkpoint_files import parse_quant_settings
from marlin_pack.schemas import AwqSettings, GptqSettings

# What quantizers store beside the settings: optimum's calibration dataset, GPTQModel's meta, paths, dates.
JUNK = {
    "dataset": ["a calibration sample " * 50] * 20,
    "meta": {"quantizer": ["gptqmodel:1.4.0"], "uri": "https://github.com/modelcloud/gptqmodel", "damp_auto_increment": 0.0025},
    "tmp_dir": "/tmp/gptqmodel-3f9c2a",
    "quantized_at": "2025-03-01T12:00:00Z",
    "damp_percent": 0.01,
    "tokenizer": None,
    "use_exllama": True,
    "backend": "autoawq",
}

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, "checkpoint_format": "gptq"}


def test_awq_keeps_only_what_decides_the_bundle() -> None:
    s = parse_quant_settings({**AWQ, **JUNK})
    assert s == AwqSettings(
        bits=4, group_size=128, zero_point=True, version="gemm", lm_head=False, modules_to_not_convert=[], dynamic=False
    )


def test_gptq_keeps_only_what_decides_the_bundle() -> None:
    s = parse_quant_settings({**GPTQ, **JUNK, "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.down_proj"]]})
    assert s == GptqSettings(
        bits=4,
        group_size=128,
        sym=True,
        desc_act=False,
        checkpoint_format="gptq",
        lm_head=False,
        modules_in_block_to_quantize=["self_attn.q_proj", "mlp.down_proj"],
        dynamic={},
    )


def test_awq_aliases_in_vllms_order() -> None:
    # vLLM's AutoAWQConfig reads w_bit before bits and q_group_size before group_size.
    s = parse_quant_settings({"quant_method": "AWQ", "w_bit": 4, "bits": 8, "q_group_size": 64, "group_size": 128, "zero_point": True})
    assert isinstance(s, AwqSettings) and (s.bits, s.group_size, s.version) == (4, 64, "gemm")


def test_defaults_and_nulls() -> None:
    s = parse_quant_settings({"quant_method": "gptq", "bits": 8, "checkpoint_format": None, "lm_head": None, "dynamic": None})
    assert isinstance(s, GptqSettings)
    assert (s.group_size, s.sym, s.desc_act, s.checkpoint_format, s.lm_head, s.dynamic) == (None, None, None, "gptq", False, {})


@pytest.mark.parametrize(
    "qc,match",
    [
        ({**AWQ, "bits": "4"}, r"quantization_config bits is '4', expected an integer; .* restore its config"),
        ({**GPTQ, "group_size": True}, r"quantization_config group_size is True, expected an integer"),
        ({**GPTQ, "sym": "true"}, r"quantization_config sym is 'true', expected true or false"),
        ({**AWQ, "modules_to_not_convert": "lm_head"}, r"modules_to_not_convert is 'lm_head', expected a list of module names"),
        ({**GPTQ, "modules_in_block_to_quantize": [["q_proj", 3]]}, r"modules_in_block_to_quantize is 3, expected a list"),
        ({"quant_method": "fp8"}, r"quant_method is 'fp8', expected 'awq', 'gptq' or 'compressed-tensors'"),
        ({"bits": 4}, r"quant_method is 'missing', expected 'awq', 'gptq' or 'compressed-tensors'"),
    ],
)
def test_malformed_settings_refused(qc: dict, match: str) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=match):
        parse_quant_settings(qc)


@pytest.mark.parametrize(
    "qc",
    [
        AWQ,
        {**AWQ, "w_bit": 4, "q_group_size": 64, "modules_to_not_convert": ["visual", "mlp.gate"], "lm_head": True},
        {**AWQ, "modules_to_not_convert": None, **JUNK},
    ],
)
def test_awq_settings_are_what_vllm_reads(qc: dict) -> None:
    vr = pytest.importorskip("oracles.vllm_reference")
    cfg = vr._vllm().auto_awq.AutoAWQConfig.from_config(qc)
    s = parse_quant_settings(qc)
    assert isinstance(s, AwqSettings)
    assert (s.bits, s.group_size, s.zero_point, s.lm_head, s.modules_to_not_convert) == (
        cfg.weight_bits, cfg.group_size, cfg.zero_point, cfg.lm_head_quantized, cfg.modules_to_not_convert
    )


@pytest.mark.parametrize(
    "qc",
    [
        GPTQ,
        {**GPTQ, "bits": 8, "group_size": -1, "desc_act": True, "lm_head": False, **JUNK},
        {**GPTQ, "modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj"], ["mlp.up_proj"]]},
        {**GPTQ, "dynamic": {r"-:.*visual.*": {}, r"+:.*layers\.1\..*": {"bits": 4}}},
    ],
)
def test_gptq_settings_are_what_vllm_reads(qc: dict) -> None:
    vr = pytest.importorskip("oracles.vllm_reference")
    cfg = vr._vllm().auto_gptq.AutoGPTQConfig.from_config(qc)
    from vllm.model_executor.layers.quantization.utils.gptq_utils import flatten_list

    s = parse_quant_settings(qc)
    assert isinstance(s, GptqSettings)
    # vLLM normalises desc_act (a no-op with one group per channel); the recorded value is the checkpoint's.
    assert (s.bits, s.group_size, s.sym, s.lm_head, s.dynamic, s.modules_in_block_to_quantize) == (
        cfg.weight_bits, cfg.group_size, cfg.is_sym, cfg.lm_head_quantized, cfg.dynamic,
        flatten_list(cfg.modules_in_block_to_quantize),
    )


@pytest.mark.parametrize("dynamic", [["-:x"], {"-:x": []}, {"+:x": {"bits": [8]}}])
def test_malformed_dynamic_is_refused(dynamic: object) -> None:
    with pytest.raises(UnsupportedCheckpointError, match="dynamic"):
        parse_quant_settings({**GPTQ, "dynamic": dynamic})
