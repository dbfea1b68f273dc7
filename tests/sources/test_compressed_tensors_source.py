"""compressed-tensors settings: what marlin-pack accepts, and the refusals (worded after vLLM's own)."""

from __future__ import annotations

import copy

import pytest

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.io.checkpoint_files import parse_quant_settings
from marlin_pack.schemas import CompressedTensorsSettings, WeightType
from marlin_pack.sources import CompressedTensorsSource, source_from_quant_config
from marlin_pack.testing.synthetic import compressed_tensors_config


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "bits,group_size,symmetric,wtype",
    [(4, 128, True, WeightType.uint4b8), (8, 32, True, WeightType.uint8b128), (4, -1, False, WeightType.uint4),
     (4, 64, False, WeightType.uint4), (8, -1, True, WeightType.uint8b128)],
)
def test_accepted_schemes(bits, group_size, symmetric, wtype) -> None:
    src = source_from_quant_config(compressed_tensors_config(bits, group_size, symmetric))
    assert isinstance(src, CompressedTensorsSource)
    assert src.scheme.weight_type is wtype and src.scheme.group_size == group_size and src.scheme.zero_points is not symmetric


def test_settings_keep_only_what_decides_the_bundle() -> None:
    qc = compressed_tensors_config(4, 128, True)
    _weights(qc)["observer_kwargs"] = {"maxshrink": 0.2}
    s = parse_quant_settings(qc)
    assert isinstance(s, CompressedTensorsSettings)
    dumped = s.model_dump()
    assert "observer" not in str(dumped) and "version" not in dumped and "quantization_status" not in dumped
    assert dumped["config_groups"]["group_0"]["weights"]["group_size"] == 128


@pytest.mark.parametrize("alias,ok", [("static", True), ("weight", True), (None, True), (False, True),
                                      ("group", False), ("dynamic", False), (True, False)])
def test_actorder(alias, ok) -> None:
    qc = compressed_tensors_config(4, 128, True, actorder=alias)
    if ok:
        source_from_quant_config(qc)
        return
    with pytest.raises(UnsupportedCheckpointError, match="actorder is 'group'.*no longer supports compressed-tensors group/dynamic"):
        source_from_quant_config(qc)


def _edit(edit) -> dict:
    qc = compressed_tensors_config(4, 128, True)
    edit(qc)
    return qc


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda qc: _weights(qc).update(num_bits=8, symmetric=False),
         "8-bit asymmetric: vLLM's Marlin runs zero points only for 4-bit.*; serve it without --load-format marlin_prepacked"),
        (lambda qc: _weights(qc).update(num_bits=2), "num_bits is 2, expected 4 or 8"),
        (lambda qc: _weights(qc).update(group_size=256),
         "group_size is 256, expected one of -1, 32, 64, 128 .*; serve it without --load-format marlin_prepacked"),
        (lambda qc: _weights(qc).update(group_size=16), "group_size is 16"),
        (lambda qc: _weights(qc).update(type="float", num_bits=8), "type is 'float', expected 'int'"),
        (lambda qc: _weights(qc).update(strategy="tensor", group_size=None), "strategy is 'tensor', expected 'channel' or 'group'"),
        (lambda qc: qc["config_groups"]["group_0"].update(format="int-quantized"), "format is 'int-quantized', expected 'pack-quantized'"),
        (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
         "quantizes input_activations: not a weight-only"),
        (lambda qc: qc.update(transform_config={"config_groups": {"u": {}}}), "transform_config"),
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24", "targets": ["Linear"]}), "removed sparsity support"),
        (lambda qc: qc["config_groups"].update(
            g2={"targets": ["re:.*mlp.*"], "weights": {**_weights(qc), "group_size": 64}, "format": "pack-quantized"}),
         "config_groups use different weight schemes.*a bundle holds one scheme"),
    ],
)
def test_refusals_name_the_setting(edit, message) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=message):
        source_from_quant_config(_edit(edit))


def test_groups_with_the_same_scheme_and_attention_only_groups() -> None:
    qc = compressed_tensors_config(4, 128, True)
    qc["config_groups"]["group_1"] = copy.deepcopy(qc["config_groups"]["group_0"]) | {"targets": ["re:.*mlp.*"]}
    # vLLM skips a group whose only target is an attention module (KV-cache quantization).
    qc["config_groups"]["attn"] = {"targets": ["LlamaAttention"], "weights": None, "input_activations": {"num_bits": 8}}
    src = source_from_quant_config(qc)
    assert "attn" not in src.settings.config_groups


def test_ignore_and_targets_per_layer() -> None:
    qc = compressed_tensors_config(4, 128, True, ignore=["lm_head", "re:.*layers\\.1\\.mlp\\..*", "model.layers.0.self_attn.q_proj"])
    src = source_from_quant_config(qc)
    assert src.vllm_quantizes("model.layers.0.mlp.down_proj")
    assert not src.vllm_quantizes("model.layers.1.mlp.gate_up_proj")
    assert not src.vllm_quantizes("model.layers.1.mlp.down_proj")
    with pytest.raises(UnsupportedCheckpointError, match="some shards of model.layers.0.self_attn.qkv_proj"):
        src.vllm_quantizes("model.layers.0.self_attn.qkv_proj")
    src.check_layer("model.layers.1.mlp.down_proj", quantized=False)
    stored = "make model.layers.0.mlp.down_proj quantized in vLLM, but the checkpoint stores it unquantized"
    with pytest.raises(UnsupportedCheckpointError, match=stored):
        src.check_layer("model.layers.0.mlp.down_proj", quantized=False)
    # Targets by name: only the MLP is quantized.
    qc = compressed_tensors_config(4, 128, True)
    qc["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.(gate|up|down)_proj$"]
    src = source_from_quant_config(qc)
    assert src.vllm_quantizes("model.layers.0.mlp.gate_up_proj") and not src.vllm_quantizes("model.layers.0.self_attn.o_proj")


@pytest.mark.parametrize(
    "where,pattern,setting",
    [("ignore", "re:(", "ignore entry 're:('"), ("targets", "re:[a-", "config_groups['group_0'] targets entry 're:[a-'"),
     ("targets", "re:a{99999999999}", "config_groups['group_0'] targets entry"),
     ("ignore", "re:" + "(" * 2000 + ")" * 2000, "ignore entry")],
    ids=["ignore-unclosed", "targets-bad-set", "targets-huge-repeat", "ignore-deep-nesting"],
)
def test_a_regex_that_does_not_compile_is_refused_naming_the_setting(where: str, pattern: str, setting: str) -> None:
    qc = compressed_tensors_config(4, 128, True)
    if where == "ignore":
        qc["ignore"] = ["lm_head", pattern]
    else:
        qc["config_groups"]["group_0"]["targets"] = ["Linear", pattern]
    with pytest.raises(UnsupportedCheckpointError, match="is not a valid regular expression") as e:
        source_from_quant_config(qc)
    assert f"compressed-tensors {setting}" in str(e.value) and "\n" not in str(e.value)
