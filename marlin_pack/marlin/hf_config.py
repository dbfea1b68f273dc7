"""``config.json`` as vLLM 0.33.0 reads it: through transformers' config classes, as data.

vLLM never reads ``config.json`` by hand: ``ModelConfig`` builds the transformers config class
of the checkpoint's ``model_type`` (``AutoConfig``; none of the model types marlin-pack supports
is in vLLM's own ``transformers_utils/config.py`` registry) and its model classes read that
object's attributes. Two things make those attributes differ from the file's keys:

- ``attribute_map``: an alias read or written under another name. transformers 5 writes
  Qwen3-MoE's expert count as ``num_local_experts`` (``num_experts`` maps to it), where
  transformers 4 wrote ``num_experts``; vLLM's ``Qwen3MoeSparseMoeBlock`` reads
  ``config.num_experts`` and gets either. DeepSeek-V2 maps ``num_experts`` and DeepSeek-V3
  ``num_local_experts`` to ``n_routed_experts`` (and ``num_mtp_layers`` to
  ``num_nextn_predict_layers``); Mixtral ``num_experts`` to ``num_local_experts``.
- defaults: a key the file omits has the class's default (Qwen3's ``head_dim`` is 128, not
  hidden / heads; Qwen2's ``num_key_value_heads`` is 32, not the number of heads).

Why data and not transformers itself: marlin-pack's converter needs only torch (transformers is
no dependency of it, and ``convert`` runs where vLLM does not); the transformers that happens to be
installed beside it need not be the one vLLM 0.33.0 pins (``>=5.16.1,<5.21``), whose classes
decide what vLLM serves; and building a config class runs model-specific validation and rope
standardisation that have nothing to do with the layout. So this module keeps, per model type,
the attribute map and the defaults of exactly the keys marlin-pack reads (dimensions, expert
counts, the MoE/MLA layout keys), taken from transformers 5.20 (the version vLLM 0.33.0
resolves to); ``tests/marlin/test_hf_config.py`` checks every entry against the installed
transformers' classes, and that configs written by transformers 4 and 5 read the same here as
there. Keys a class derives from others rather than defaulting (``num_key_value_heads`` = heads,
``head_dim`` = hidden / heads on Llama-like classes) are left to :func:`~marlin_pack.marlin.sharding.model_dims`.

InternLM2 has no transformers class (its config is remote code, ``configuration_internlm2.py``
in the checkpoint, without an attribute map); its defaults are that file's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from marlin_pack.errors import RESTORE_CONFIG, UnsupportedCheckpointError
from marlin_pack.marlin.architectures import config_architecture

__all__ = ["ConfigClass", "CONFIG_CLASSES", "ARCHITECTURE_MODEL_TYPES", "language_config", "top_config", "resolve"]


@dataclass(frozen=True)
class ConfigClass:
    """What one transformers config class makes of the keys marlin-pack reads."""

    name: str  # transformers' class, for docs and the tests
    attribute_map: Mapping[str, str] = field(default_factory=dict)  # alias -> the attribute it stands for
    defaults: Mapping[str, Any] = field(default_factory=dict)  # attribute -> value when the file omits it
    text: str | None = None  # multimodal: the model type of its text_config
    # attribute -> how the class computes it from the others (GPTBigCode's intermediate size and KV heads)
    derived: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)


_LLAMA_DIMS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
               "num_attention_heads": 32, "tie_word_embeddings": False}
_GEMMA3_TEXT = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True}
_QWEN2_VL_TEXT = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8}
_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

CONFIG_CLASSES: dict[str, ConfigClass] = {
    "llama": ConfigClass("LlamaConfig", defaults=_LLAMA_DIMS),
    # tie_word_embeddings (False) left out: Mistral 3's text config without it keeps marlin-pack's reading of the top level's.
    "mistral": ConfigClass("MistralConfig", defaults={**{k: v for k, v in _LLAMA_DIMS.items() if k != "tie_word_embeddings"},
                                                      "intermediate_size": 14336, "num_key_value_heads": 8}),
    "qwen2": ConfigClass("Qwen2Config", defaults={**_LLAMA_DIMS, "vocab_size": 151936, "intermediate_size": 22016,
                                                  "num_key_value_heads": 32}),
    "qwen3": ConfigClass("Qwen3Config", defaults={**_LLAMA_DIMS, "vocab_size": 151936, "intermediate_size": 22016,
                                                  "num_key_value_heads": 32, "head_dim": 128}),
    "gemma": ConfigClass("GemmaConfig", defaults={"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                                                  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                                                  "head_dim": 256, "tie_word_embeddings": True}),
    "gemma2": ConfigClass("Gemma2Config", defaults={**_GEMMA3_TEXT, "vocab_size": 256000}),
    "gemma3_text": ConfigClass("Gemma3TextConfig", defaults=_GEMMA3_TEXT),
    "phi3": ConfigClass("Phi3Config", defaults={**_LLAMA_DIMS, "vocab_size": 32064, "hidden_size": 3072,
                                                "intermediate_size": 8192}),
    "granite": ConfigClass("GraniteConfig", defaults=_LLAMA_DIMS),
    "cohere": ConfigClass("CohereConfig", defaults={"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                                                    "num_hidden_layers": 40, "num_attention_heads": 64,
                                                    "tie_word_embeddings": True}),
    "cohere2": ConfigClass("Cohere2Config", defaults={"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                                                      "num_hidden_layers": 40, "num_attention_heads": 64,
                                                      "tie_word_embeddings": True}),
    "internlm2": ConfigClass("InternLM2Config (remote code)", defaults={
        "vocab_size": 103168, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "tie_word_embeddings": False}),
    "mixtral": ConfigClass("MixtralConfig", {"num_experts": "num_local_experts"},
                           {**_LLAMA_DIMS, "intermediate_size": 14336, "num_key_value_heads": 8, "num_local_experts": 8}),
    "qwen3_moe": ConfigClass("Qwen3MoeConfig", {"num_experts": "num_local_experts"}, {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False, "num_local_experts": 128,
        "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen2_moe": ConfigClass("Qwen2MoeConfig", defaults={
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False, "num_experts": 60,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
        "mlp_only_layers": []}),
    "deepseek_v2": ConfigClass("DeepseekV2Config", {"num_experts": "n_routed_experts"}, {
        **_LLAMA_DIMS, "vocab_size": 102400, "moe_intermediate_size": 1407, "n_routed_experts": 64, "n_shared_experts": 2,
        "first_k_dense_replace": 0, "n_group": None, **_MLA}),
    "deepseek_v3": ConfigClass("DeepseekV3Config", {"num_local_experts": "n_routed_experts",
                                                    "num_mtp_layers": "num_nextn_predict_layers"}, {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "tie_word_embeddings": False, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "n_group": 8,
        **_MLA}),
    # Architectures vLLM serves through its Transformers backend (marlin.transformers_backend), transformers 5.22.
    **{t: ConfigClass(n, defaults=d) for t, n, d in (
        ("olmo", "OlmoConfig", {**_LLAMA_DIMS, "vocab_size": 50304}),
        ("olmo2", "Olmo2Config", {**_LLAMA_DIMS, "vocab_size": 50304}),
        ("olmo3", "Olmo3Config", {**_LLAMA_DIMS, "vocab_size": 50304}),
        ("starcoder2", "Starcoder2Config", {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
                                            "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
                                            "tie_word_embeddings": True}),
        ("gpt_neox", "GPTNeoXConfig", {"vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576,
                                        "num_hidden_layers": 44, "num_attention_heads": 64, "tie_word_embeddings": False}),
        ("phi", "PhiConfig", {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                              "num_attention_heads": 32, "tie_word_embeddings": False}),
        ("smollm3", "SmolLM3Config", {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
                                       "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                                       "tie_word_embeddings": True}),
        ("stablelm", "StableLmConfig", {"vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                                         "tie_word_embeddings": False}),
        ("glm", "GlmConfig", {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                              "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                              "tie_word_embeddings": False}),
        ("arcee", "ArceeConfig", {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 32,
                                  "num_attention_heads": 32, "tie_word_embeddings": False}),
        ("seed_oss", "SeedOssConfig", {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648,
                                        "num_hidden_layers": 64, "num_attention_heads": 80, "num_key_value_heads": 8,
                                        "head_dim": 128, "tie_word_embeddings": False}),
        ("hunyuan_v1_dense", "HunYuanDenseV1Config", {"vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008,
                                                       "num_hidden_layers": 32, "num_attention_heads": 32,
                                                       "tie_word_embeddings": False}),
        ("vaultgemma", "VaultGemmaConfig", {**_GEMMA3_TEXT, "vocab_size": 256000}),
        ("cwm", "CwmConfig", {"vocab_size": 128256, "hidden_size": 6144, "intermediate_size": 21504, "num_hidden_layers": 64,
                              "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}),
        ("jais2", "Jais2Config", {"vocab_size": 150272, "hidden_size": 3328, "intermediate_size": 26624, "num_hidden_layers": 32,
                                  "num_attention_heads": 26, "tie_word_embeddings": False}),
        # served through the backend although no registry lists them (releases.py's backend_fallback); Helium's head_dim
        # defaults to 128 whatever hidden_size / num_attention_heads is, Ministral's to null (its attention then fails)
        ("helium", "HeliumConfig", {"vocab_size": 48000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24,
                                    "num_attention_heads": 20, "num_key_value_heads": 20, "head_dim": 128,
                                    "tie_word_embeddings": False}),
        ("ministral", "MinistralConfig", {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                                          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                          "tie_word_embeddings": False}),
        ("nanochat", "NanoChatConfig", {"vocab_size": 50304, "hidden_size": 768, "intermediate_size": 8192,
                                        "num_hidden_layers": 12, "num_attention_heads": 6, "tie_word_embeddings": False}),
    )},
    # MoE through the backend: the experts' width is intermediate_size; transformers 5 maps num_local_experts
    "olmoe": ConfigClass("OlmoeConfig", {"num_local_experts": "num_experts"}, {
        "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 16, "tie_word_embeddings": False, "num_experts": 64}),
    "flex_olmo": ConfigClass("FlexOlmoConfig", {"num_local_experts": "num_experts"}, {
        "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "tie_word_embeddings": False, "num_experts": 7}),
    "hunyuan_v1_moe": ConfigClass("HunYuanMoEV1Config", {"num_local_experts": "num_experts"}, {
        "vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "tie_word_embeddings": False, "num_experts": 1}),
    # Qwen3-MoE's keys: the experts moe_intermediate_size wide; Kolibri 1's shared expert shared_expert_intermediate_size,
    # Mellum's dense layers (mlp_layer_types, null: every layer sparse) intermediate_size
    "kolibri1": ConfigClass("Kolibri1Config", {"num_experts": "num_local_experts"}, {
        "vocab_size": 128000, "hidden_size": 2560, "num_hidden_layers": 50, "num_attention_heads": 48,
        "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False, "num_local_experts": 384,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}),
    "mellum": ConfigClass("MellumConfig", {"num_experts": "num_local_experts"}, {
        "vocab_size": 98304, "hidden_size": 2304, "intermediate_size": 7168, "num_hidden_layers": 28,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False,
        "num_local_experts": 64, "moe_intermediate_size": 896}),
    # GPTBigCode: GPT-2's key names; intermediate n_inner or 4 x hidden, one KV head with multi_query (the default)
    "gpt_bigcode": ConfigClass(
        "GPTBigCodeConfig", {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
        {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "multi_query": True,
         "tie_word_embeddings": True},
        derived={"intermediate_size": lambda c: c.get("n_inner") or 4 * c["n_embd"],
                 "num_key_value_heads": lambda c: 1 if c.get("multi_query", True) else c["n_head"]}),
    "qwen2_vl_text": ConfigClass("Qwen2VLTextConfig", defaults=_QWEN2_VL_TEXT),
    "qwen2_5_vl_text": ConfigClass("Qwen2_5_VLTextConfig", defaults=_QWEN2_VL_TEXT),
    "qwen2_vl": ConfigClass("Qwen2VLConfig", text="qwen2_vl_text"),
    "qwen2_5_vl": ConfigClass("Qwen2_5_VLConfig", text="qwen2_5_vl_text"),
    "gemma3": ConfigClass("Gemma3Config", text="gemma3_text"),
    "mistral3": ConfigClass("Mistral3Config", text="mistral"),
}

# The model type transformers writes for each supported architecture: the class used when a
# config.json has no model_type (transformers itself would refuse such a file; marlin-pack stays lenient).
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite", "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2", "InternLM2ForCausalLM": "internlm2", "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3", "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Gemma3ForConditionalGeneration": "gemma3",
    "Mistral3ForConditionalGeneration": "mistral3",
    "OlmoForCausalLM": "olmo", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3", "Starcoder2ForCausalLM": "starcoder2",
    "GPTNeoXForCausalLM": "gpt_neox", "PhiForCausalLM": "phi", "SmolLM3ForCausalLM": "smollm3", "StableLmForCausalLM": "stablelm",
    "GlmForCausalLM": "glm", "ArceeForCausalLM": "arcee", "SeedOssForCausalLM": "seed_oss",
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense", "VaultGemmaForCausalLM": "vaultgemma", "CwmForCausalLM": "cwm",
    "Jais2ForCausalLM": "jais2", "GPTBigCodeForCausalLM": "gpt_bigcode", "OlmoeForCausalLM": "olmoe",
    "FlexOlmoForCausalLM": "flex_olmo", "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe", "Kolibri1ForCausalLM": "kolibri1",
    "MellumForCausalLM": "mellum", "HeliumForCausalLM": "helium", "MinistralForCausalLM": "ministral",
    "NanoChatForCausalLM": "nanochat",
}


def _checked_model_type(config: Mapping[str, Any], where: str) -> str | None:
    """``config[model_type]``: a string or absent (null).

    Raises:
        UnsupportedCheckpointError: another JSON type (transformers' ``AutoConfig`` finds no class by it).
    """
    mt = config.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise UnsupportedCheckpointError(
            f"config.json {where}model_type is {mt!r:.100} ({type(mt).__name__}), expected a string such as 'llama'; {RESTORE_CONFIG}"
        )
    return mt


def _model_type(config: Mapping[str, Any]) -> str | None:
    mt = _checked_model_type(config, "")
    if mt in CONFIG_CLASSES:
        return mt
    return mt or ARCHITECTURE_MODEL_TYPES.get(config_architecture(config) or "")


def resolve(config: Mapping[str, Any], model_type: str | None) -> dict[str, Any]:
    """``config`` as the model type's config class exposes it: defaults for omitted keys, and every
    attribute-map alias and the attribute it stands for both holding the value the class holds.

    An explicit null stays null (DeepSeek's ``q_lora_rank: null`` is meaningful). A file giving an
    alias and its attribute different values is refused: which one wins differs between transformers
    versions, so what vLLM builds is not determined by the file.
    """
    cls = CONFIG_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if cls is None:
        return dict(config)
    out = {**cls.defaults, **config}
    for alias, attribute in cls.attribute_map.items():
        given = config.get(alias)  # a null alias (transformers 5 writes num_experts: null for Mixtral) sets nothing
        if given is not None and config.get(attribute) is not None and given != config[attribute]:
            raise UnsupportedCheckpointError(
                f"config.json has {alias} {given!r} and {attribute} {config[attribute]!r}; transformers' "
                f"{cls.name} reads both as one attribute ({alias} -> {attribute}); keep one of them"
            )
        if given is not None:
            out[attribute] = given
        elif alias in config and attribute not in config:
            out[attribute] = cls.defaults.get(attribute)
        if attribute in out:
            out[alias] = out[attribute]
    for attribute, compute in cls.derived.items():
        if out.get(attribute) is None:
            out[attribute] = compute(out)
    return out


def top_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The top level of ``config`` as its model type's config class exposes it (aliases and defaults applied)."""
    return resolve(config, _model_type(config))


def language_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config as vLLM 0.33.0's model class reads it (``hf_text_config`` for
    multimodal models: ``text_config``, else the top level, as transformers < 4.52 wrote Qwen2-VL), aliases and
    defaults applied. The text config's own ``model_type`` picks its class where it names one (Mistral 3 does so)."""
    model_type = _model_type(config)
    cls = CONFIG_CLASSES.get(model_type) if model_type is not None else None
    if cls is None or cls.text is None:
        return resolve(config, model_type)
    text = config.get("text_config")
    if text is None:
        return resolve(config, cls.text)
    if not isinstance(text, dict):
        raise UnsupportedCheckpointError(
            f"config.json text_config is {type(text).__name__}, expected an object; {RESTORE_CONFIG}"
        )
    own = _checked_model_type(text, "text_config.")
    known = own in CONFIG_CLASSES and CONFIG_CLASSES[own].text is None
    return resolve(text, own if known else cls.text)
