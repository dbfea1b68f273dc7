"""DeepSeek-V2 / V3 decoder layers as vLLM's ``models/deepseek_v2.py`` builds them from ``config.json``.

Both architectures are that module's ``DeepseekV2ForCausalLM`` code path (``DeepseekV3ForCausalLM``
only subclasses it). Per decoder layer ``i`` vLLM builds:

- attention: ``DeepseekV2MLAAttention`` (multi-head latent attention; ``ModelConfig.use_mla`` is
  true for these model types unless ``VLLM_MLA_DISABLE`` is set): with ``q_lora_rank`` null
  ``kv_a_proj_with_mqa`` (ReplicatedLinear) and ``q_proj`` (column); with it set
  ``fused_qkv_a_proj`` = ``[q_a_proj | kv_a_proj_with_mqa]`` (MergedColumnParallelLinear with
  ``disable_tp``: replicated) and ``q_b_proj`` (column); always ``kv_b_proj`` (column) and
  ``o_proj`` (row). The norms (``q_a_layernorm``, ``kv_a_layernorm``) are unquantized.
- MLP: on layers with ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` the routed
  experts (``marlin.moe``), the unquantized router ``mlp.gate`` and, with ``n_shared_experts``,
  the shared experts as one dense MLP of ``n_shared_experts x moe_intermediate_size``
  (``mlp.shared_experts.gate_up_proj`` / ``down_proj``; fused into the experts only by ROCm's
  AITER); every other layer a dense MLP (``mlp.gate_up_proj`` / ``down_proj``, ``intermediate_size``).

Size symbols (:func:`mla_sizes`): ``qh`` heads x (qk_nope_head_dim + qk_rope_head_dim) (q_proj,
q_b_proj), ``ql`` q_lora_rank, ``kva`` kv_lora_rank + qk_rope_head_dim (kv_a_proj_with_mqa),
``kvl`` kv_lora_rank, ``kvb`` heads x (qk_nope_head_dim + v_head_dim) (kv_b_proj), ``o`` heads x
v_head_dim (o_proj's input), ``se`` the shared experts' width.
"""

from __future__ import annotations

from marlin_pack.errors import RESTORE_CONFIG, UnsupportedCheckpointError
from marlin_pack.marlin.architectures import Architecture, Linear, MlaLayout
from marlin_pack.marlin.hf_config import ARCHITECTURE_MODEL_TYPES, CONFIG_CLASSES

__all__ = ["check_config", "mla_sizes", "sparse_layers", "decoder_linears", "spec_layer_prefixes", "check_tp"]


def _get(config: dict, arch: Architecture, key: str) -> object:
    """``config[key]`` as vLLM reads it through transformers' config class (``marlin.hf_config``): its
    default when the key is absent, but an explicit null stays null (q_lora_rank, n_shared_experts)."""
    if key in config:
        return config[key]
    return CONFIG_CLASSES[ARCHITECTURE_MODEL_TYPES[arch.name]].defaults.get(key)


# Far above any real model's size or count, far below what would make planning loop for hours (as marlin.sharding's).
_MAX_CONFIG_INT = 1 << 24
# DeepSeek-V3 has one multi-token-prediction layer: a count past this is a corrupt config, not a model.
_MAX_MTP_LAYERS = 64


def _int(config: dict, arch: Architecture, key: str, *, minimum: int = 1, maximum: int = _MAX_CONFIG_INT) -> int:
    """``config[key]`` (:func:`_get`) as an integer in ``[minimum, maximum]``: a bool, a float (``2.0``, ``1e400``, NaN),
    a string, a list, an object or null is refused, as vLLM's arithmetic on it would fail or mean nothing."""
    value = _get(config, arch, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UnsupportedCheckpointError(
            f"config.json {key} is {value!r:.100}, expected an integer >= {minimum} ({arch.name}); {RESTORE_CONFIG}"
        )
    if value > maximum:
        raise UnsupportedCheckpointError(
            f"config.json {key} is {value!r:.100}, expected at most {maximum} ({arch.name}); the config is corrupt, {RESTORE_CONFIG}"
        )
    return value


def _optional(config: dict, arch: Architecture, key: str) -> int | None:
    return None if _get(config, arch, key) is None else _int(config, arch, key)


def check_config(config: dict, arch: Architecture) -> None:
    """Refuse the DeepSeek variants vLLM does not build through the layout described here."""
    name = arch.name
    if "index_topk" in config:
        raise UnsupportedCheckpointError(
            f"{name} with index_topk is DeepSeek-V3.2 (sparse attention with a quantizable indexer); marlin-pack "
            "converts DeepSeek-V2/V3 multi-head latent attention only"
        )
    if config.get("is_causal") is False:
        raise UnsupportedCheckpointError(
            f"{name} with is_causal false uses vLLM's non-MLA attention; marlin-pack converts the causal MLA layout only"
        )
    if _int(config, arch, "qk_nope_head_dim", minimum=0) == 0 and _int(config, arch, "qk_rope_head_dim", minimum=0) == 0:
        raise UnsupportedCheckpointError(
            f"{name} with qk_nope_head_dim and qk_rope_head_dim 0 uses vLLM's multi-head attention path; "
            "marlin-pack converts the MLA layout only"
        )
    if _get(config, arch, "n_routed_experts") is None:
        raise UnsupportedCheckpointError(f"{name} without n_routed_experts has no routed experts; marlin-pack converts MoE DeepSeek models")


def mla_sizes(config: dict, arch: Architecture, num_heads: int) -> dict[str, int]:
    """The size symbols of DeepSeek's linears (module docstring), from ``config.json``."""
    nope, rope = _int(config, arch, "qk_nope_head_dim", minimum=0), _int(config, arch, "qk_rope_head_dim", minimum=0)
    v, kv_lora = _int(config, arch, "v_head_dim"), _int(config, arch, "kv_lora_rank")
    sizes = {"qh": num_heads * (nope + rope), "kva": kv_lora + rope, "kvl": kv_lora, "kvb": num_heads * (nope + v),
             "o": num_heads * v}
    q_lora = _optional(config, arch, "q_lora_rank")
    if q_lora is not None:
        sizes["ql"] = q_lora
    shared = _optional(config, arch, "n_shared_experts")
    if shared is not None:
        sizes["se"] = _int(config, arch, "moe_intermediate_size") * shared
    return sizes


def sparse_layers(config: dict, arch: Architecture, num_layers: int) -> list[int]:
    """The decoder layers vLLM builds with routed experts (``DeepseekV2DecoderLayer``'s ``is_moe_layer``)."""
    first = _int(config, arch, "first_k_dense_replace", minimum=0)
    freq = _int(config, arch, "moe_layer_freq") if "moe_layer_freq" in config else 1  # vLLM's getattr default
    return [i for i in range(num_layers) if i >= first and i % freq == 0]


def decoder_linears(config: dict, arch: Architecture, layer: int, sparse: bool) -> tuple[Linear, ...]:
    """The quantized linears vLLM builds in decoder layer ``layer`` (``sparse``: it has routed experts)."""
    m: MlaLayout | None = arch.mla
    assert m is not None
    attention = m.attention if _optional(config, arch, "q_lora_rank") is None else m.attention_q_lora
    if not sparse:
        return (*attention, *m.dense_mlp)
    return (*attention, *m.shared_experts) if _optional(config, arch, "n_shared_experts") is not None else attention


def spec_layer_prefixes(config: dict, arch: Architecture, layers: str) -> tuple[str, ...]:
    """Checkpoint prefixes of the multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``, none when
    absent or null) that vLLM's model skips when loading (``get_spec_layer_idx_from_weight_name``); a draft model loads them."""
    if _get(config, arch, "num_nextn_predict_layers") is None:
        return ()
    n = _int(config, arch, "num_hidden_layers")
    extra = _int(config, arch, "num_nextn_predict_layers", minimum=0, maximum=_MAX_MTP_LAYERS)
    return tuple(f"{layers}.{n + i}." for i in range(extra))


def check_tp(num_heads: int, tp: int, arch: Architecture) -> None:
    """vLLM asserts ``num_attention_heads % tp == 0`` for MLA (heads are never replicated)."""
    if num_heads % tp:
        raise UnsupportedCheckpointError(
            f"{arch.name}: num_attention_heads ({num_heads}) is not divisible by --tp {tp}; vLLM's MLA "
            "attention splits whole heads, choose another --tp"
        )
