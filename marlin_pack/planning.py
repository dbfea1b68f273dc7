"""Planning a conversion: everything decided from headers and config before any tensor data is read.

:func:`plan_conversion` validates the checkpoint (layers, fused parts, biases, experts, what vLLM's model
class loads) and fixes every layer's per-rank shapes and layout for each TP size (:class:`ConversionPlan`);
``convert`` and ``verify`` share it, so a bundle is checked against the same decisions that made it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlin_pack.errors import CheckpointError, MarlinPackError, UnsupportedCheckpointError
from marlin_pack.kernel_choice import machete_entry
from marlin_pack.marlin.sharding import (
    LayerSpec,
    ModelDims,
    checkpoint_modules,
    layer_entry,
    layer_specs,
    model_dims,
    vllm_part_names,
)
from marlin_pack.moe_conversion import MoePlan, check_moe_settings, plan_moe
from marlin_pack.schemas import (
    LayerEntry,
    LayerKernel,
    SourceFormat,
)
from marlin_pack.sources import Checkpoint, QuantSource, source_from_quant_config
from marlin_pack.sources.hub import resolve_model

__all__ = ["ConversionPlan", "plan_conversion", "layer_weight_shape", "convertible_tp_sizes"]



@dataclass
class ConversionPlan:
    """Everything decided from headers and config before any tensor data is read."""

    dims: ModelDims
    source: QuantSource
    dtype: torch.dtype
    layers: list[LayerSpec] = field(default_factory=list)
    bias: dict[str, bool] = field(default_factory=dict)
    entries: dict[int, list[LayerEntry]] = field(default_factory=dict)
    common: list[str] = field(default_factory=list)
    moe: MoePlan | None = None  # the routed experts of a mixture-of-experts model


def plan_conversion(
    ckpt: Checkpoint, source: QuantSource, tp_sizes: list[int], dtype: torch.dtype, kernel: LayerKernel = LayerKernel.marlin
) -> ConversionPlan:
    """Validate everything that can be validated without reading tensor data.

    ``kernel``: ``machete`` lays out each layer as vLLM does on an SM90 GPU: Machete's layout where
    Machete implements the layer (per rank), Marlin's where it does not
    (:func:`~marlin_pack.kernel_choice.machete_entry`).

    Raises:
        CheckpointError, UnsupportedCheckpointError: naming the first tensor or setting at fault.
    """
    plan = ConversionPlan(dims=model_dims(ckpt.config, ckpt.tensors), source=source, dtype=dtype)
    _check_layer_count(ckpt, plan.dims)
    if plan.dims.arch.moe:
        check_moe_settings(ckpt, source, plan.dims)
    if not plan.dims.arch.loads_lm_head and "lm_head.weight" in ckpt.tensors:
        name = plan.dims.architecture
        raise UnsupportedCheckpointError(
            f"the checkpoint stores lm_head.weight, but vLLM's {name} has no lm_head (logits come from the "
            f"embeddings) and refuses to load it; if it is a copy of the embeddings (GPTQModel saves one), remove it"
        )
    owned: set[str] = set()
    for i in range(plan.dims.num_layers):
        for spec in layer_specs(plan.dims, i):
            modules = checkpoint_modules(spec)
            quantized = [f"{m.prefix}.{source.packed_weight}" in ckpt.tensors for m in modules]
            source.check_layer(spec.name, any(quantized), ckpt=ckpt, parts=vllm_part_names(spec),
                               modules=tuple(m.prefix for m in modules))
            if not any(quantized):
                # Left unquantized (modules_to_not_convert): loaded by vLLM from common, if it is there.
                missing = next((m.prefix for m in modules if f"{m.prefix}.weight" not in ckpt.tensors), None)
                if missing is not None:
                    _missing_module(ckpt, plan.dims, missing)
                continue
            if not all(quantized):
                missing = next(m.prefix for m, q in zip(modules, quantized, strict=True) if not q)
                raise CheckpointError(
                    f"tensor {missing}.{source.packed_weight} is missing although its fused siblings are quantized; "
                    "the checkpoint is incomplete"
                )
            biases = [f"{m.prefix}.bias" in ckpt.tensors for m in modules]
            if any(biases) and not all(biases):
                raise UnsupportedCheckpointError(f"{spec.name}: only some fused parts have a bias; vLLM needs all or none: "
                                                 "the checkpoint is incomplete, restore it")
            for m in modules:
                source.validate(ckpt, m.prefix, m.size_k, m.size_n)
                owned.update(n for n in source.tensor_names(m.prefix) if n in ckpt.tensors)
                if biases[0]:
                    owned.add(f"{m.prefix}.bias")
                    bias_info = ckpt.info(f"{m.prefix}.bias")
                    if bias_info.shape != (m.size_n,):
                        raise CheckpointError(f"tensor {m.prefix}.bias has shape {list(bias_info.shape)}, expected [{m.size_n}]")
            plan.layers.append(spec)
            plan.bias[spec.name] = biases[0]
    if plan.dims.arch.moe:
        plan.moe, experts = plan_moe(ckpt, source, plan.dims, tp_sizes)
        owned |= experts
    if not plan.layers:
        raise UnsupportedCheckpointError(f"no quantized decoder linear layers (…{source.packed_weight}) found; nothing to convert")
    # Layers vLLM's model skips (DeepSeek-V3's multi-token prediction): neither converted nor kept.
    skipped = {n for n in ckpt.tensors if n.startswith(plan.dims.skipped_prefixes)} if plan.dims.skipped_prefixes else set()
    owned |= skipped
    stray = sorted(n for n in ckpt.tensors if n.endswith(f".{source.packed_weight}") and n not in owned)
    if stray:
        kind = "MoE expert" if ".experts." in stray[0] else "unsupported"
        what = "dense decoder linears and the routed experts of its MoE architectures" if plan.dims.arch.moe else "dense decoder linears"
        raise UnsupportedCheckpointError(f"{stray[0]} is an {kind} quantized module; marlin-pack converts {what} only")
    awq = source.format is SourceFormat.awq_gemm  # AWQ keeps no scales for channel-wise row shards at TP > 1
    for tp in tp_sizes:
        plan.entries[tp] = [
            layer_entry(s, plan.dims, tp, source.scheme.group_size, awq, plan.bias[s.name], source.scheme.bits)
            for s in plan.layers
        ]
        if kernel is LayerKernel.machete:
            plan.entries[tp] = [machete_entry(e, source.scheme, dtype) for e in plan.entries[tp]]
    plan.common = sorted(n for n in ckpt.tensors if n not in owned)
    return plan


def _natural_key(name: str) -> list[int | str]:
    """vLLM's ``_natural_sort_key`` of weight files (the order its default loader streams them)."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def layer_weight_shape(ckpt: Checkpoint, spec: LayerSpec, parts: dict) -> torch.Tensor | None:
    """compressed-tensors: the ``weight_shape`` vLLM's fused layer holds after loading.

    vLLM loads each part's ``[N, K]`` whole into the one ``int64[2]`` parameter, so the part it
    streams last wins: files in natural order, tensors by name within a file (``safe_open.keys()``).
    """
    first = parts[spec.parts[0].name]
    if first.weight_shape is None:
        return None
    files = sorted(ckpt.files, key=_natural_key)

    def key(p: object) -> tuple[int, str]:
        name = f"{p.prefix}.weight_shape"  # type: ignore[attr-defined]
        return files.index(ckpt.info(name).file), name

    last = max(spec.parts, key=key)
    return parts[last.name].weight_shape  # type: ignore[no-any-return]


def _missing_module(ckpt: Checkpoint, dims: ModelDims, module: str) -> None:
    """Refuse a module the architecture needs; name what the checkpoint has there instead."""
    parent = module.rsplit(".", 1)[0]
    instead = sorted({n[len(parent) + 1 :].split(".")[0] for n in ckpt.tensors if n.startswith(f"{parent}.")})
    known = {p.module.rsplit(".", 1)[-1] for lin in dims.arch.all_linears() for p in lin.parts}
    if any(name not in known for name in instead):  # other modules stand where this one should
        raise UnsupportedCheckpointError(
            f"module {module} is not in the checkpoint, which has {', '.join(instead)} under {parent}: "
            f"not the layout vLLM's {dims.arch.vllm_class.split('.')[-1]} loads for {dims.architecture}, "
            "so vLLM cannot serve it either"
        )
    raise CheckpointError(
        f"module {module} has no weights in the checkpoint (neither qweight nor weight); "
        f"the checkpoint is incomplete or not a {dims.architecture} checkpoint"
    )


def _check_layer_count(ckpt: Checkpoint, dims: ModelDims) -> None:
    """config.json's layer count against the layers the weights hold (before any per-layer work)."""
    layer_index = re.compile(rf"^{re.escape(dims.checkpoint_layers)}\.(\d+)\.")
    present = {int(m.group(1)) for name in ckpt.tensors if (m := layer_index.match(name))}
    held = max(present) + 1 if present else 0
    if not present:
        _elsewhere(ckpt, dims)
    if dims.num_layers > held:
        raise CheckpointError(
            f"config.json num_hidden_layers is {dims.num_layers}, the checkpoint holds decoder layers "
            f"0..{held - 1}; the config does not match the weights (layer {held} is missing)"
        )


def _elsewhere(ckpt: Checkpoint, dims: ModelDims) -> None:
    """Refuse decoder layers stored under a prefix the architecture's vLLM class does not load (Gemma 3
    multimodal's ``model.layers``: its hf_to_vllm_mapper has no rule for it), naming both prefixes."""
    held: dict[str, set[str]] = {}  # prefix of layer 0 -> the modules under it
    for n in ckpt.tensors:
        if m := re.match(r"^(.+\.layers)\.0\.(.+)\.[^.]+$", n):
            held.setdefault(m.group(1), set()).add(m.group(2))
    modules = {p.module for lin in dims.linears(0) for p in lin.parts}  # all of them: not a vision tower's layers
    found = sorted(prefix for prefix, under in held.items() if modules <= under)
    if found:
        accepted = " or ".join(dims.arch.checkpoint_layers)
        raise UnsupportedCheckpointError(
            f"the checkpoint's decoder layers are under {', '.join(found)}, but vLLM's "
            f"{dims.arch.vllm_class.split('.')[-1]} loads {dims.architecture}'s only from {accepted} "
            f"(its hf_to_vllm_mapper maps no other prefix to {dims.arch.layers}), so vLLM cannot serve it either"
        )




def convertible_tp_sizes(model: str | Path, candidates: Iterable[int] = (1, 2, 4, 8), revision: str | None = None) -> list[int]:
    """The sizes among ``candidates`` that ``convert --tp`` accepts for this checkpoint (headers only, nothing
    converted): what a suggestion to re-convert may name. Empty where the checkpoint cannot be read."""
    try:
        ckpt = Checkpoint(resolve_model(model, revision, download=False).dir)
    except MarlinPackError:
        return []
    try:
        source = source_from_quant_config(ckpt.quantization_config())
        found = []
        for tp in candidates:
            try:
                plan_conversion(ckpt, source, [tp], torch.float16)
            except MarlinPackError:
                continue
            found.append(tp)
        return found
    except MarlinPackError:
        return []
    finally:
        ckpt.close()


