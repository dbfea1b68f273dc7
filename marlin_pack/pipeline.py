"""Pipeline parallelism: which decoder layers each stage of a vLLM engine builds, and which common tensors it loads.

vLLM gives stage ``s`` of ``P`` the layers ``[start, end)`` of its partition of ``L`` decoder layers: an
even split, with the remainder spread one layer each over the stages before the last, from the
second-to-last backwards (the last stage also holds the final norm and head); or the partition
``VLLM_PP_LAYER_PARTITION`` names (comma-separated sizes summing to ``L``). A pipeline rank of a
bundle then needs only the layers of its stage. Pure: no vLLM import (checked against vLLM's own
``get_pp_indices`` in the tests).

Which common (unquantized) tensors a stage loads (:func:`stage_common`): a decoder layer's (its norms, a
router) on the stage of that layer; the embedding, final norm and output head where vLLM's model
class builds them. Most classes build them on every stage (Gemma 2, Mixtral, Qwen3-MoE, ...: vLLM's
loader fills them there, so every stage reads them); the classes in :data:`FIRST_LAST_STAGE` build the
embedding only on the first stage (and on the last with tied embeddings, where some do), the norm and
head only on the last. Everything else of the checkpoint (a vision tower: vLLM builds it on later
stages too unless its V2 model runner runs) goes to every stage, as vLLM's loader skips what a stage
lacks. ``tests/oracles/test_pipeline_stages.py`` checks these rules
against the names vLLM's own stage models load.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["FIRST_LAST_STAGE", "PARTITION_ENV", "layer_index", "stage_common", "stage_layers", "stage_partition"]

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"

# vLLM classes whose embedding is built on the first stage only (True: also on the last one when the
# embeddings are tied, llama.py's `is_first_rank or (tie_word_embeddings and is_last_rank)`), whose final
# norm and lm_head are built on the last stage only (PPMissingLayer elsewhere). Any other class: on every stage.
FIRST_LAST_STAGE: dict[str, bool] = {
    "LlamaForCausalLM": True,
    "MistralForCausalLM": True,  # llama.LlamaForCausalLM
    "Phi3ForCausalLM": True,  # a LlamaForCausalLM
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": True,  # Qwen3Model is a Qwen2Model
    "GraniteForCausalLM": True,
    "DeepseekV2ForCausalLM": False,
    "DeepseekV3ForCausalLM": False,
    # Multimodal: their language model is a Qwen2ForCausalLM (vision towers: every stage, see stage_common). Not
    # Mistral 3: its Mistral language model builds the embedding on the last stage with a text config saying untied.
    "Qwen2VLForConditionalGeneration": True,
    "Qwen2_5_VLForConditionalGeneration": True,
}


def stage_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """How many decoder layers each of ``pp_size`` stages builds (``partition``: ``VLLM_PP_LAYER_PARTITION``).

    Raises:
        ValueError: a partition that is not integers, has another count than ``pp_size`` or another sum
            than ``num_layers`` (vLLM refuses it too).
    """
    if pp_size < 1 or num_layers < 0:
        raise ValueError(f"pipeline of {pp_size} stages over {num_layers} layers is not a pipeline")
    if partition is not None:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={partition!r} is not comma-separated layer counts") from None
        if len(sizes) != pp_size:
            raise ValueError(f"{PARTITION_ENV}={partition!r} names {len(sizes)} stages, the engine runs {pp_size}")
        if sum(sizes) != num_layers:
            raise ValueError(f"{PARTITION_ENV}={partition!r} sums to {sum(sizes)} layers, the model has {num_layers}")
        return sizes
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for k in range(extra):  # second-to-last stage first, then backwards; the last stage never gets one
        sizes[pp_size - 2 - k] += 1
    return sizes


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, partition: str | None = None) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` stage ``pp_rank`` builds; ``partition`` defaults to the environment's."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside pipeline_parallel_size {pp_size}")
    sizes = stage_partition(num_layers, pp_size, os.environ.get(PARTITION_ENV) if partition is None else partition)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def layer_index(name: str, prefix: str) -> int | None:
    """The decoder layer ``name`` belongs to under ``prefix`` (``model.layers.3.mlp.down_proj`` -> 3), else None."""
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def stage_common(
    names: Iterable[str], *, architecture: str, checkpoint_layers: str, num_layers: int, tied: bool,
    pp_size: int, pp_rank: int, partition: str | None = None,
) -> set[str]:
    """The checkpoint names of ``common.safetensors`` that stage ``pp_rank`` of ``pp_size`` loads.

    ``checkpoint_layers``: the checkpoint's prefix of decoder layer ``i`` (``model.layers``); a layer's
    tensors go to its stage, a layer past ``num_layers`` (DeepSeek's multi-token-prediction layer, which
    vLLM skips) to none. The embedding (``<model>.embed_tokens``), final norm (``<model>.norm``) and
    ``lm_head`` follow :data:`FIRST_LAST_STAGE`; every other name goes to every stage.
    """
    start, end = stage_layers(num_layers, pp_size, pp_rank, partition)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    base = checkpoint_layers.rpartition(".")[0]  # "model" of "model.layers"
    rule = FIRST_LAST_STAGE.get(architecture)
    parts: list[tuple[str, bool]] = []
    if rule is not None:
        parts = [
            (f"{base}.embed_tokens.", first or (rule and tied and last)),
            (f"{base}.norm.", last),
            ("lm_head.", last),
        ]
        if base.endswith(".model"):  # language_model.model.layers: the head is language_model.lm_head
            parts.append((f"{base.removesuffix('.model')}.lm_head.", last))
    held: set[str] = set()
    for name in names:
        index = layer_index(name, checkpoint_layers)
        if index is not None:
            if start <= index < end:
                held.add(name)
            continue
        part = next((keep for prefix, keep in parts if name.startswith(prefix)), True)
        if part:
            held.add(name)
    return held
