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
from dataclasses import dataclass, replace
from typing import Any

from marlin_pack.errors import RESTORE_CONFIG, UnsupportedCheckpointError
from marlin_pack.layer_kinds import LayerKind

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


@dataclass(frozen=True)
class Part:
    """One part of a vLLM layer's output: its role and size symbol, and the checkpoint module holding it."""

    role: str  # q / k / v (attention heads), gate / up, or out (a layer of one part)
    size: str  # size symbol of its output columns
    module: str  # checkpoint module under the layer prefix, e.g. "self_attn.q_proj"


@dataclass(frozen=True)
class Linear:
    """One quantized vLLM layer of a decoder layer."""

    name: str  # vLLM's module name under the layer prefix, e.g. "self_attn.qkv_proj"
    kind: LayerKind
    input: str  # size symbol of its input features
    parts: tuple[Part, ...]


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


@dataclass(frozen=True)
class MlaLayout:
    """DeepSeek's decoder layers: which linears each has depends on the config (``marlin.deepseek``)."""

    attention: tuple[Linear, ...]  # q_lora_rank null
    attention_q_lora: tuple[Linear, ...]  # q_lora_rank set
    shared_experts: tuple[Linear, ...]  # beside the routed experts, when n_shared_experts is set
    dense_mlp: tuple[Linear, ...]  # decoder layers vLLM builds without routed experts


@dataclass(frozen=True)
class MlpLayerTypes:
    """An MoE model whose decoder layers are sparse (routed experts) or dense by config (Mellum's ``mlp_layer_types``):
    ``key`` lists each decoder layer's type, ``"sparse"`` or ``"dense"`` (absent or null: every layer sparse, as the
    config class defaults it); a dense layer has ``dense`` after the architecture's ``linears`` and no experts."""

    key: str
    dense: tuple[Linear, ...]

    def sparse_layers(self, config: Mapping[str, Any], architecture: str, num_layers: int) -> list[int]:
        """The decoder layers with routed experts, as ``config`` (its config class's view) lists them.

        Raises:
            UnsupportedCheckpointError: the list is not one ``"sparse"`` or ``"dense"`` per decoder layer.
        """
        types = config.get(self.key)
        if types is None:
            return list(range(num_layers))
        if not (isinstance(types, list) and len(types) == num_layers and all(t in ("sparse", "dense") for t in types)):
            found = repr(types) if len(repr(types)) <= 120 else repr(types)[:117] + "..."
            raise UnsupportedCheckpointError(
                f"config.json {self.key} is {found}, expected a list of \"sparse\" or \"dense\" for each of the "
                f"{num_layers} decoder layers ({architecture}); {RESTORE_CONFIG}"
            )
        return [i for i, t in enumerate(types) if t == "sparse"]


DEEPSEEK_MLA = MlaLayout(MLA_ATTENTION_LINEARS, MLA_Q_LORA_ATTENTION_LINEARS, DEEPSEEK_SHARED_EXPERTS_LINEARS,
                         DEEPSEEK_DENSE_MLP_LINEARS)

# Where decoder layers live in multimodal checkpoints: transformers >= 4.52 writes
# model.language_model.layers, older versions language_model.model.layers (Gemma 3, Mistral 3)
# or model.layers (Qwen2-VL, Qwen2.5-VL). vLLM's hf_to_vllm_mapper of Qwen2-VL, Qwen2.5-VL
# and Mistral 3 also maps "model." to "language_model.model." (Mistral 3: text-only PEFT/merged
# names), so model.layers loads there too; Gemma 3's has no such rule and refuses it.
_MM_PREFIXES = ("model.language_model.layers", "language_model.model.layers")


@dataclass(frozen=True)
class Architecture:
    """How vLLM's model class for one Hugging Face architecture lays out its quantized layers."""

    name: str  # config.json architectures[0]
    vllm_class: str  # vLLM's model class (module.Class), for docs and error messages
    linears: tuple[Linear, ...]
    layers: str = "model.layers"  # vLLM's prefix of decoder layer i: f"{layers}.{i}"
    checkpoint_layers: tuple[str, ...] = ("model.layers",)  # accepted checkpoint prefixes, in order
    text_config: bool = False  # dimensions are under config["text_config"] (top level as fallback)
    # head_dim: "config" uses config.head_dim when set, else hidden/heads (vLLM's Llama, Gemma, ...);
    # "derived" ignores config.head_dim (vLLM's Qwen2Attention and InternLM2Attention compute it).
    head_dim: str = "config"
    multimodal: bool = False
    # False: vLLM's class has no lm_head at all (logits always from the embeddings) and its
    # load_weights refuses a checkpoint that stores one (gemma2.py has no lm_head).
    loads_lm_head: bool = True
    # The output head's checkpoint name (InternLM2: output.weight); see output_heads.
    output_head: str = "lm_head.weight"
    # Mixture of experts: the routed experts are described by ``marlin.moe.MOE_ARCHITECTURES[name]``.
    moe: bool = False
    # config key of the "i" size symbol (Qwen2-MoE: its shared expert's width)
    intermediate_key: str = "intermediate_size"
    # DeepSeek (multi-head latent attention): per-layer linears chosen by config; ``linears`` is then
    # the most common layer (an MoE layer of a q_lora_rank-null model), for the docs.
    mla: MlaLayout | None = None
    # Dense decoder layers beside the sparse ones, chosen per layer by config (Mellum): their MLP's linears.
    mlp_layer_types: MlpLayerTypes | None = None
    # How vLLM serves it: "native" (its own model class, ``vllm_class``), "transformers" (its Transformers backend,
    # :mod:`marlin_pack.marlin.transformers_backend`), or both where the two build the same layers (Gemma). Which one
    # a release takes is the release table's (``vllm_plugin/releases.py``); a bundle serves where its path is taken.
    paths: frozenset[str] = frozenset({"native"})

    @property
    def output_heads(self) -> tuple[str, ...]:
        """The checkpoint names of the output head vLLM's class loads: what a tied head stored once may be fed as
        (``common_aliases``, :func:`~marlin_pack.schemas.output_head_problem`). A multimodal checkpoint of
        transformers < 4.52 names it ``language_model.lm_head.weight``; a class without an lm_head has none."""
        if not self.loads_lm_head:
            return ()
        return (self.output_head, f"language_model.{self.output_head}") if self.multimodal else (self.output_head,)

    def all_linears(self) -> tuple[Linear, ...]:
        """Every linear a decoder layer of this architecture may have, whatever its config."""
        if self.mlp_layer_types is not None:
            return (*self.linears, *self.mlp_layer_types.dense)
        if self.mla is None:
            return self.linears
        m = self.mla
        return (*m.attention, *m.attention_q_lora, *m.shared_experts, *m.dense_mlp)


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
    from marlin_pack.marlin import transformers_backend

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
