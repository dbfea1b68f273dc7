"""The types of the architecture table (:mod:`marlin_pack.marlin.architectures`): an architecture's quantized linears,
their parts and the checkpoint modules feeding them, and what varies per decoder layer by config.

Both the table of vLLM's own model classes and the rows of its Transformers backend
(:mod:`marlin_pack.marlin.transformers_backend`) are made of these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from marlin_pack.errors import RESTORE_CONFIG, UnsupportedCheckpointError
from marlin_pack.layer_kinds import LayerKind

__all__ = ["Part", "Linear", "MlaLayout", "MlpLayerTypes", "Architecture"]


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
