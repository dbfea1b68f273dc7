"""The supported architectures, as data: which checkpoint modules vLLM fuses into which layer.

Each :class:`Architecture` says, for one Hugging Face ``architectures[0]`` value, what vLLM's
model class for it builds per decoder layer (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``ColumnParallelLinear``, ``RowParallelLinear``, under vLLM's parameter names), which checkpoint
modules feed each of them (one module per part, or one module already holding all parts, as
Phi-3's ``qkv_proj``), where the decoder layers live in the checkpoint and in vLLM, and how the
dimensions are read from ``config.json`` (as transformers' config class of its ``model_type``
exposes them: :mod:`marlin_pack.marlin.hf_config`). Adding an architecture is adding a row here, plus
a test against vLLM's own model class (``tests/marlin/test_architectures_exact.py``).

Sizes are symbols resolved per model: ``h`` hidden size, ``i`` intermediate size, ``q`` query
heads x head_dim, ``kv`` KV heads x head_dim; DeepSeek's multi-head latent attention adds the
symbols of :func:`marlin_pack.marlin.deepseek.mla_sizes` (``qh``, ``ql``, ``kva``, ``kvl``,
``kvb``, ``o``, ``se``), and its decoder layers differ by config (:class:`MlaLayout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from marlin_pack.errors import RESTORE_CONFIG, UnsupportedCheckpointError
from marlin_pack.layer_kinds import LayerKind
from marlin_pack.marlin import transformers_backend
from marlin_pack.marlin.architecture_types import Architecture, Linear, MlaLayout, MlpLayerTypes, Part

__all__ = [
    "Part",
    "Linear",
    "Architecture",
    "MlaLayout",
    "MlpLayerTypes",
    "ARCHITECTURES",
    "UNSUPPORTED_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "architecture_for",
    "config_architecture",
]


def _qkv(name: str, q: str, k: str, v: str) -> Linear:
    return Linear(name, LayerKind.qkv, "h", (Part("q", "q", q), Part("k", "kv", k), Part("v", "kv", v)))


def _merged(name: str, gate: str, up: str) -> Linear:
    return Linear(name, LayerKind.merged_column, "h", (Part("gate", "i", gate), Part("up", "i", up)))


def _row(name: str, input_size: str, module: str | None = None) -> Linear:
    return Linear(name, LayerKind.row, input_size, (Part("out", "h", module or name),))


def _column(name: str, input_size: str, size: str) -> Linear:
    return Linear(name, LayerKind.column, input_size, (Part("out", size, name),))


# The Llama layout: separate q/k/v and gate/up modules, fused by vLLM.
LLAMA_LINEARS = (
    _qkv("self_attn.qkv_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    _row("self_attn.o_proj", "q"),
    _merged("mlp.gate_up_proj", "mlp.gate_proj", "mlp.up_proj"),
    _row("mlp.down_proj", "i"),
)
# Phi-3: the checkpoint already stores qkv_proj and gate_up_proj fused; vLLM shards them per rank.
PHI3_LINEARS = (
    _qkv("self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.qkv_proj"),
    _row("self_attn.o_proj", "q"),
    _merged("mlp.gate_up_proj", "mlp.gate_up_proj", "mlp.gate_up_proj"),
    _row("mlp.down_proj", "i"),
)
# Mixture-of-experts models: only the attention is a dense Marlin linear; the routed experts are
# FusedMoE layers (``marlin.moe``), the router an unquantized ReplicatedLinear (a common tensor).
MOE_ATTENTION_LINEARS = LLAMA_LINEARS[:2]
# Qwen2-MoE adds one dense shared expert (a Qwen2MoeMLP) beside the routed experts.
QWEN2_MOE_LINEARS = (
    *MOE_ATTENTION_LINEARS,
    _merged("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    _row("mlp.shared_expert.down_proj", "i"),
)
# InternLM2: wqkv is stored fused (grouped per KV head); vLLM loads it as one QKV
# tensor cut into [q | k | v] column blocks and regroups the heads at run time (split_qkv).
INTERNLM2_LINEARS = (
    _qkv("attention.wqkv", "attention.wqkv", "attention.wqkv", "attention.wqkv"),
    _row("attention.wo", "q"),
    _merged("feed_forward.gate_up_proj", "feed_forward.w1", "feed_forward.w3"),
    _row("feed_forward.w2", "i"),
)

# DeepSeek-V2/V3, as vLLM's DeepseekV2MLAAttention (the MLA path vLLM takes on CUDA) and
# DeepseekV2MoE / DeepseekV2MLP build them; module order as vLLM registers them.
MLA_ATTENTION_LINEARS = (  # q_lora_rank null (DeepSeek-V2-Lite)
    Linear("self_attn.kv_a_proj_with_mqa", LayerKind.replicated, "h", (Part("out", "kva", "self_attn.kv_a_proj_with_mqa"),)),
    _column("self_attn.q_proj", "h", "qh"),
    _column("self_attn.kv_b_proj", "kvl", "kvb"),
    _row("self_attn.o_proj", "o"),
)
MLA_Q_LORA_ATTENTION_LINEARS = (  # q_lora_rank set: vLLM fuses q_a_proj with kv_a_proj_with_mqa, replicated
    Linear("self_attn.fused_qkv_a_proj", LayerKind.replicated, "h",
           (Part("q_a", "ql", "self_attn.q_a_proj"), Part("kv_a", "kva", "self_attn.kv_a_proj_with_mqa"))),
    _column("self_attn.q_b_proj", "ql", "qh"),
    _column("self_attn.kv_b_proj", "kvl", "kvb"),
    _row("self_attn.o_proj", "o"),
)
DEEPSEEK_SHARED_EXPERTS_LINEARS = (  # one dense MLP of n_shared_experts x moe_intermediate_size
    Linear("mlp.shared_experts.gate_up_proj", LayerKind.merged_column, "h",
           (Part("gate", "se", "mlp.shared_experts.gate_proj"), Part("up", "se", "mlp.shared_experts.up_proj"))),
    _row("mlp.shared_experts.down_proj", "se"),
)
DEEPSEEK_DENSE_MLP_LINEARS = LLAMA_LINEARS[2:]  # layers without routed experts: mlp.gate_up_proj, mlp.down_proj


DEEPSEEK_MLA = MlaLayout(MLA_ATTENTION_LINEARS, MLA_Q_LORA_ATTENTION_LINEARS, DEEPSEEK_SHARED_EXPERTS_LINEARS,
                         DEEPSEEK_DENSE_MLP_LINEARS)

# Where decoder layers live in multimodal checkpoints: transformers >= 4.52 writes
# model.language_model.layers, older versions language_model.model.layers (Gemma 3, Mistral 3)
# or model.layers (Qwen2-VL, Qwen2.5-VL). vLLM's hf_to_vllm_mapper of Qwen2-VL, Qwen2.5-VL
# and Mistral 3 also maps "model." to "language_model.model." (Mistral 3: text-only PEFT/merged
# names), so model.layers loads there too; Gemma 3's has no such rule and refuses it.
_MM_PREFIXES = ("model.language_model.layers", "language_model.model.layers")


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama.LlamaForCausalLM", LLAMA_LINEARS),
        Architecture("MistralForCausalLM", "llama.LlamaForCausalLM", LLAMA_LINEARS),
        Architecture("Qwen2ForCausalLM", "qwen2.Qwen2ForCausalLM", LLAMA_LINEARS, head_dim="derived"),
        Architecture("Qwen3ForCausalLM", "qwen3.Qwen3ForCausalLM", LLAMA_LINEARS),
        Architecture("GemmaForCausalLM", "gemma.GemmaForCausalLM", LLAMA_LINEARS),
        Architecture("Gemma2ForCausalLM", "gemma2.Gemma2ForCausalLM", LLAMA_LINEARS,
                     loads_lm_head=False),
        Architecture("Gemma3ForCausalLM", "gemma3.Gemma3ForCausalLM", LLAMA_LINEARS),
        Architecture("Phi3ForCausalLM", "phi3.Phi3ForCausalLM", PHI3_LINEARS),
        Architecture("GraniteForCausalLM", "granite.GraniteForCausalLM", LLAMA_LINEARS),
        Architecture("CohereForCausalLM", "commandr.CohereForCausalLM", LLAMA_LINEARS),
        Architecture("Cohere2ForCausalLM", "commandr.CohereForCausalLM", LLAMA_LINEARS),
        Architecture("InternLM2ForCausalLM", "internlm2.InternLM2ForCausalLM", INTERNLM2_LINEARS, head_dim="derived",
                     output_head="output.weight"),
        Architecture("MixtralForCausalLM", "mixtral.MixtralForCausalLM", MOE_ATTENTION_LINEARS, moe=True),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe.Qwen3MoeForCausalLM", MOE_ATTENTION_LINEARS, moe=True),
        Architecture("Qwen2MoeForCausalLM", "qwen2_moe.Qwen2MoeForCausalLM", QWEN2_MOE_LINEARS, head_dim="derived",
                     moe=True, intermediate_key="shared_expert_intermediate_size"),
        # vLLM 0.30.0-0.33.0 build olmoe.py, 0.34.0 its Transformers backend: the same layers (both paths; bit-exact on
        # 0.30.0, 0.33.0 and 0.34.0)
        Architecture("OlmoeForCausalLM", "olmoe.OlmoeForCausalLM", MOE_ATTENTION_LINEARS, moe=True),
        # DeepSeek-V3 is vLLM's DeepseekV2ForCausalLM code path too (same class body, deepseek_v2.py).
        Architecture("DeepseekV2ForCausalLM", "deepseek_v2.DeepseekV2ForCausalLM",
                     MLA_ATTENTION_LINEARS + DEEPSEEK_SHARED_EXPERTS_LINEARS, moe=True, mla=DEEPSEEK_MLA),
        Architecture("DeepseekV3ForCausalLM", "deepseek_v2.DeepseekV3ForCausalLM",
                     MLA_ATTENTION_LINEARS + DEEPSEEK_SHARED_EXPERTS_LINEARS, moe=True, mla=DEEPSEEK_MLA),
        Architecture(
            "Qwen2VLForConditionalGeneration", "qwen2_vl.Qwen2VLForConditionalGeneration", LLAMA_LINEARS,
            layers="language_model.model.layers", checkpoint_layers=(*_MM_PREFIXES, "model.layers"),
            text_config=True, head_dim="derived", multimodal=True,
        ),
        Architecture(
            "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration", LLAMA_LINEARS,
            layers="language_model.model.layers", checkpoint_layers=(*_MM_PREFIXES, "model.layers"),
            text_config=True, head_dim="derived", multimodal=True,
        ),
        Architecture(
            "Gemma3ForConditionalGeneration", "gemma3_mm.Gemma3ForConditionalGeneration", LLAMA_LINEARS,
            layers="language_model.model.layers", checkpoint_layers=_MM_PREFIXES,
            text_config=True, multimodal=True,
        ),
        Architecture(
            "Mistral3ForConditionalGeneration", "mistral3.Mistral3ForConditionalGeneration", LLAMA_LINEARS,
            layers="language_model.model.layers", checkpoint_layers=(*_MM_PREFIXES, "model.layers"),
            text_config=True, multimodal=True,
        ),
    )
}


def _merge_backend_rows() -> None:
    """Add the Transformers backend's rows (:func:`~marlin_pack.marlin.transformers_backend.rows`). An architecture with
    a native row too (Gemma: vLLM 0.30.0-0.33.0 build gemma.py, 0.34.0 the backend) keeps it, serving both paths, only
    where the backend's rules give the same layers."""
    for name, row in transformers_backend.rows().items():
        native = ARCHITECTURES.get(name)
        if native is None:
            ARCHITECTURES[name] = row
            continue
        if (native.linears, native.layers, native.checkpoint_layers) != (row.linears, row.layers, row.checkpoint_layers):
            raise AssertionError(f"{name}: the Transformers backend's layers differ from {native.vllm_class}'s")
        ARCHITECTURES[name] = replace(native, paths=native.paths | row.paths)


_merge_backend_rows()
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# Architectures vLLM serves whose layers marlin-pack does not lay out, and why (the refusal says it in one line).
_MULTIMODAL_BACKEND = "a multimodal model vLLM serves through its Transformers backend ({cls}); marlin-pack does not lay out its layers"
_FALLBACK_BACKEND = ("vLLM's registry lists no such architecture and serves transformers' class through its Transformers "
                     "backend, whose layers for it marlin-pack does not lay out: {why}")
_UNCHECKED_EXPERTS = "whose experts and blocks marlin-pack has not checked against the backend"
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    # vLLM's registry sends it to TransformersForCausalLM, which builds AutoModel.from_config: no transformers release
    # has a nanbeige model type, so that is the checkpoint's remote code (auto_map, trust_remote_code)
    "NanbeigeForCausalLM": (
        "vLLM builds it through its Transformers backend from the modeling code each checkpoint ships "
        "(config.json auto_map, trust_remote_code); no transformers release has the class, so its layers cannot be "
        "checked offline"
    ),
    # no registry entry either: vLLM's registry falls back to its backend because transformers has the class (as for
    # Helium, Ministral and NanoChat, releases.py's backend_fallback), but the backend's rules do not give their layers
    **{name: _FALLBACK_BACKEND.format(why=why) for name, why in (
        ("DogeForCausalLM", ("its attention has a dt_proj beside q_proj, k_proj and v_proj (a dynamic mask from the "
                             "values), and its MLP may be a cross-domain mixture of experts")),
        ("YoutuForCausalLM", ("its attention is multi-head latent attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
                              "kv_b_proj), which the backend builds through its MLA fuser")),
        ("SolarOpenForCausalLM", "a mixture-of-experts model (shared experts beside the routed ones, a sigmoid router "
                                 "with a score correction bias) " + _UNCHECKED_EXPERTS),
        ("MiniMaxM3VLForCausalLM", "a mixture-of-experts model with a sparse-attention indexer " + _UNCHECKED_EXPERTS),
    )},
    **{name: _MULTIMODAL_BACKEND.format(cls=cls) for name, cls in (
        ("AriaForConditionalGeneration", "TransformersMultiModalMoEForCausalLM"),
        ("Emu3ForConditionalGeneration", "TransformersMultiModalForCausalLM"),
        ("HunYuanVLForConditionalGeneration", "TransformersMultiModalForCausalLM"),
        ("VibeVoiceAsrForConditionalGeneration", "TransformersMultiModalForCausalLM"),
    )},
}


def architecture_for(name: str | None) -> Architecture | None:
    """The table row for ``config.json``'s ``architectures[0]``, or None if unsupported."""
    return ARCHITECTURES.get(name) if isinstance(name, str) else None


def _json_kind(value: object) -> str:
    """What JSON made ``value``: ``a string``, ``an object``, ``null``..."""
    kinds = ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"), (dict, "an object"), (list, "an array"))
    return next((k for t, k in kinds if isinstance(value, t)), "null")


def config_architecture(config: Mapping[str, Any]) -> str | None:
    """``config.json``'s ``architectures[0]``, the model class vLLM builds; None where the file names none (no key,
    null, an empty list). The one reader of that key.

    Raises:
        UnsupportedCheckpointError: ``architectures`` is not a list of strings (a string, an object, a list holding a
            number, a list, an object or null): transformers and vLLM would not find a model class by it.
    """
    archs = config.get("architectures")
    if archs is None or archs == []:
        return None
    if isinstance(archs, list) and all(isinstance(a, str) for a in archs):
        return archs[0]
    bad = next((a for a in archs if not isinstance(a, str)), None) if isinstance(archs, list) else archs
    what = f"an array holding {_json_kind(bad)}" if isinstance(archs, list) else _json_kind(archs)
    found = repr(archs) if len(repr(archs)) <= 120 else repr(archs)[:117] + "..."
    raise UnsupportedCheckpointError(
        f"config.json architectures is {found} ({what}), expected an array of model class names (strings), "
        f'e.g. ["LlamaForCausalLM"]; {RESTORE_CONFIG}'
    )
