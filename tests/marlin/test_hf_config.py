"""``marlin.hf_config`` against transformers' own config classes (what vLLM reads configs through).

* Every attribute map and default the table keeps equals the installed transformers' class's.
* ``config.json`` files written by transformers 4.51 and 5 for every supported architecture
  (``tests/data/configs``) give the same dimensions and expert counts through marlin-pack
  (:func:`~marlin_pack.marlin.sharding.model_dims`, :func:`~marlin_pack.marlin.hf_config.top_config`)
  as through ``AutoConfig.from_pretrained`` read the way vLLM's model classes read it.
* So do configs that omit every key but the architecture (the class defaults).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.architectures import ARCHITECTURES
from marlin_pack.marlin.hf_config import ARCHITECTURE_MODEL_TYPES, CONFIG_CLASSES, language_config, top_config
from marlin_pack.marlin.moe import MOE_ARCHITECTURES
from marlin_pack.marlin.sharding import model_dims

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[1] / "data" / "configs"
# The quantizers' fixtures too: what GPTQModel 7.7 (transformers 5.25) and AutoAWQ (transformers 4.51) wrote.
THIRDPARTY = Path(__file__).resolve().parents[1] / "data" / "thirdparty"
FILES = sorted(DATA.glob("transformers*/*.json")) + sorted(THIRDPARTY.glob("*/config.json"))
# Keys a class derives from others instead of defaulting: left to model_dims (kv heads = heads, head_dim = hidden / heads).
DERIVED = {"num_key_value_heads", "head_dim"}


def _hf(config: dict[str, Any], tmp_path: Path) -> Any:
    """The config object vLLM builds from this file (``AutoConfig.from_pretrained``)."""
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return transformers.AutoConfig.from_pretrained(str(d))


def _vllm_view(config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """What vLLM's model class of ``architectures[0]`` reads from the config object."""
    name = config["architectures"][0]
    arch = ARCHITECTURES[name]
    hf = _hf(config, tmp_path)
    text = hf.get_text_config() if arch.text_config else hf
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None)
    out = {
        "hidden_size": hidden, "num_heads": heads, "num_layers": text.num_hidden_layers,
        "num_kv_heads": text.num_key_value_heads if getattr(text, "num_key_value_heads", None) is not None else heads,
        "head_dim": hidden // heads if arch.head_dim == "derived" or head_dim is None else head_dim,
        # GPTBigCode has no intermediate_size: its MLP is n_inner wide, 4 x hidden without it
        "intermediate_size": getattr(text, arch.intermediate_key, None) or getattr(text, "n_inner", None) or 4 * hidden,
    }
    if name in MOE_ARCHITECTURES:  # vLLM's attribute: Mixtral num_local_experts, Qwen num_experts, DeepSeek n_routed_experts
        m = MOE_ARCHITECTURES[name]
        out["experts"] = getattr(text, m.num_experts_key)
        out["moe_intermediate"] = getattr(text, m.intermediate_key)
    if arch.mla is not None:
        del out["head_dim"]
    return out


def _ours(config: dict[str, Any]) -> dict[str, Any]:
    name = config["architectures"][0]
    d = model_dims(config)
    out = {"hidden_size": d.hidden_size, "num_heads": d.num_heads, "num_layers": d.num_layers, "num_kv_heads": d.num_kv_heads,
           "head_dim": d.head_dim, "intermediate_size": d.intermediate_size}
    if ARCHITECTURES[name].mla is not None:  # vLLM's MLA reads the head dims of its own keys (marlin.deepseek), not head_dim
        del out["head_dim"]
    if name in MOE_ARCHITECTURES:
        m, cfg = MOE_ARCHITECTURES[name], top_config(config)
        out["experts"], out["moe_intermediate"] = cfg[m.num_experts_key], cfg[m.intermediate_key]
    return out


def _skip_where_transformers_lacks(model_type: str) -> None:
    """Kolibri 1 is in transformers from 5.20 (vLLM 0.33.0's pin); older releases' environments have no class to compare."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} config class")


def test_every_supported_architecture_has_a_config_class() -> None:
    assert set(ARCHITECTURE_MODEL_TYPES) == set(ARCHITECTURES)
    assert set(ARCHITECTURE_MODEL_TYPES.values()) <= set(CONFIG_CLASSES)


@pytest.mark.parametrize("model_type", [m for m in CONFIG_CLASSES if m != "internlm2"])
def test_table_matches_transformers_classes(model_type: str) -> None:
    _skip_where_transformers_lacks(model_type)
    ours = CONFIG_CLASSES[model_type]
    cls = transformers.AutoConfig.for_model(model_type)
    assert type(cls).__name__ == ours.name
    read = {*ours.defaults, *ours.attribute_map.values(), "num_experts", "num_local_experts", "n_routed_experts"}
    theirs = {a: t for a, t in type(cls).attribute_map.items() if t in read or a in read}
    assert dict(ours.attribute_map) == theirs
    for key, value in ours.defaults.items():
        assert getattr(cls, key) == value, (model_type, key)
    if ours.text is not None:
        assert cls.get_text_config().model_type == ours.text


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}-{p.stem}" if p.stem != "config" else p.parent.name for p in FILES])
def test_configs_written_by_transformers_4_and_5_read_as_vllm_reads_them(path: Path, tmp_path: Path) -> None:
    config = json.loads(path.read_text())
    assert _ours(config) == _vllm_view(config, tmp_path)


def test_the_fixture_configs_carry_each_versions_names() -> None:
    """What the files are for: if a regeneration loses these, the test above no longer covers them."""
    tf4, tf5 = DATA / "transformers4", DATA / "transformers5"
    assert (tf4 / "VERSION").read_text().startswith("4.") and (tf5 / "VERSION").read_text().startswith("5.")
    q4, q5 = (json.loads((d / "qwen3_moe.json").read_text()) for d in (tf4, tf5))
    assert "num_experts" in q4 and "num_local_experts" not in q4
    assert "num_local_experts" in q5 and "num_experts" not in q5
    assert "text_config" not in json.loads((tf4 / "qwen2_vl.json").read_text())
    assert "hidden_size" in json.loads((tf5 / "qwen2_vl.json").read_text())["text_config"]


# Mistral 3 without text_config: transformers builds its own default text config (hidden 5120), which
# no checkpoint relies on; marlin-pack reads the top level then, as before.
# Ministral's class default head_dim is null, which its attention cannot build with: refused (below).
@pytest.mark.parametrize("name", [n for n in ARCHITECTURES if n not in (
    "InternLM2ForCausalLM", "Mistral3ForConditionalGeneration", "MinistralForCausalLM")])
def test_omitted_keys_take_the_class_defaults(name: str, tmp_path: Path) -> None:
    model_type = ARCHITECTURE_MODEL_TYPES[name]
    _skip_where_transformers_lacks(model_type)
    config: dict[str, Any] = {"architectures": [name], "model_type": model_type}
    if name.startswith("Deepseek"):  # transformers refuses its own default head dims otherwise
        config.update(n_group=1, topk_group=1)
    assert _ours(config) == _vllm_view(config, tmp_path)


def test_transformers_5_qwen3_moe_expert_count_under_its_alias() -> None:
    cfg = top_config({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_local_experts": 4})
    assert cfg["num_experts"] == cfg["num_local_experts"] == 4
    assert top_config({"model_type": "qwen3_moe"})["num_experts"] == 128  # Qwen3MoeConfig's default


def test_an_alias_and_its_attribute_disagreeing_is_refused() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="num_experts 8 and num_local_experts 4"):
        top_config({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": 4})


def test_multimodal_text_config_through_its_class() -> None:
    text = language_config({"model_type": "mistral3", "text_config": {"model_type": "mistral", "hidden_size": 512}})
    assert text["hidden_size"] == 512 and text["intermediate_size"] == 14336  # MistralConfig's default
    flat = language_config({"model_type": "qwen2_vl", "hidden_size": 512})  # transformers < 4.52: flat
    assert flat["hidden_size"] == 512 and flat["num_key_value_heads"] == 8  # Qwen2VLTextConfig's default


@pytest.mark.parametrize("value,kind", [([{"a": 1}], "an array holding an object"), ([["LlamaForCausalLM"]], "an array holding an array"),
                                        ([1], "an array holding a number"), ([None], "an array holding null"),
                                        (["LlamaForCausalLM", 2], "an array holding a number"), ("LlamaForCausalLM", "a string"),
                                        ({"a": 1}, "an object"), (True, "a boolean")])
def test_architectures_of_another_json_type_are_refused(value: object, kind: str) -> None:
    """``architectures`` is read in one place (``config_architecture``): a non-string entry is one line naming the field,
    never ``unhashable type`` (issue 68, item 10); without model_type the config class is found through it too."""
    from marlin_pack.marlin.architectures import config_architecture

    config = {**json.loads((DATA / "transformers5" / "llama.json").read_text()), "architectures": value}
    match = rf"^config\.json architectures is .* \({kind}\), expected an array of model class names"
    for read in (config_architecture, model_dims, lambda c: top_config({k: v for k, v in c.items() if k != "model_type"})):
        with pytest.raises(UnsupportedCheckpointError, match=match):
            read(config)
    assert config_architecture({}) is None and config_architecture({"architectures": None}) is None
    assert config_architecture({"architectures": []}) is None


@pytest.mark.parametrize("where", ["top", "text_config"])
@pytest.mark.parametrize("value", [[1], {"a": 1}, 5, True])
def test_model_type_of_another_json_type_is_refused(where: str, value: object) -> None:
    from marlin_pack.dtypes import serving_dtype_for

    config = json.loads((DATA / "transformers5" / "qwen2_vl.json").read_text())
    (config if where == "top" else config["text_config"])["model_type"] = value
    prefix = "" if where == "top" else "text_config."
    with pytest.raises(UnsupportedCheckpointError, match=rf"^config\.json {prefix}model_type is "):
        language_config(config)
    with pytest.raises(UnsupportedCheckpointError, match=rf"^config\.json {prefix}model_type is "):
        model_dims(config)
    serving_dtype_for(None, config, [])  # the dtype vLLM would pick: no model type to look up, no error


def test_output_heads_are_what_each_vllm_class_loads() -> None:
    from marlin_pack.schemas import OUTPUT_HEAD_NAMES, output_head_problem

    assert ARCHITECTURES["LlamaForCausalLM"].output_heads == ("lm_head.weight",)
    assert ARCHITECTURES["InternLM2ForCausalLM"].output_heads == ("output.weight",)
    assert ARCHITECTURES["Gemma2ForCausalLM"].output_heads == ()
    assert ARCHITECTURES["Qwen2VLForConditionalGeneration"].output_heads == ("lm_head.weight", "language_model.lm_head.weight")
    assert {h for a in ARCHITECTURES.values() for h in a.output_heads} == set(OUTPUT_HEAD_NAMES)
    assert output_head_problem("lm_head.weight", "LlamaForCausalLM") is None
    for name in ("model.layers.0.mlp.lm_head.weight", "model.lm_head.weight", "output.weight", "xlm_head.weight"):
        assert output_head_problem(name, "LlamaForCausalLM") is not None
    assert "none" in str(output_head_problem("lm_head.weight", "NoSuchForCausalLM"))


def test_a_config_transformers_builds_no_model_from_is_refused(tmp_path: Path) -> None:
    """MinistralForCausalLM without head_dim: MinistralConfig defaults it to null and MinistralAttention computes with it
    as is, so transformers (and vLLM's Transformers backend, which builds transformers' class) builds nothing; refused in
    one line. With head_dim set it reads as vLLM does."""
    import torch

    config: dict[str, Any] = {"architectures": ["MinistralForCausalLM"], "model_type": "ministral", "hidden_size": 256,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
                              "num_hidden_layers": 1, "vocab_size": 512}
    with pytest.raises(TypeError), torch.device("meta"):
        transformers.MinistralForCausalLM(_hf(config, tmp_path))
    with pytest.raises(UnsupportedCheckpointError) as e:
        model_dims(config)
    assert str(e.value).startswith("config.json head_dim is null or absent, expected a positive integer for "
                                   "MinistralForCausalLM: transformers' MinistralAttention computes with it as is")
    assert "\n" not in str(e.value)
    config["head_dim"] = 64
    assert _ours(config) == _vllm_view(config, tmp_path)
