"""The routed experts of a mixture-of-experts checkpoint in a conversion: plan, read, build.

AWQ (GEMM), symmetric GPTQ and compressed-tensors pack-quantized (WNA16) experts: the last are
quantized or not per layer as vLLM's ``CompressedTensorsMoEMethod`` decides from ``ignore`` /
``targets`` (:func:`ct_expert_names`); their dense parts (attention, shared experts, an ignored
router left in 16-bit) go through the dense plan.

:func:`plan_moe` validates every experts layer from headers and config (beside the dense plan
of :func:`~marlin_pack.planning.plan_conversion`, which covers attention and shared experts);
:func:`read_moe_layer` reads one decoder layer's experts and :func:`build_moe_layer` lays them
out for one rank (``marlin.moe``), so a conversion holds one layer's experts at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from marlin_pack.errors import RESTORE_CONFIG, SERVE_WITHOUT, UnsupportedCheckpointError
from marlin_pack.marlin.hf_config import top_config
from marlin_pack.marlin.moe import (
    MOE_ARCHITECTURES,
    ExpertNaming,
    ExpertTensors,
    MoeArchitecture,
    MoeRankShape,
    build_moe_rank_tensors,
    expert_naming,
    moe_layer_entry,
    moe_rank_shape,
    moe_tensor_specs,
    read_expert,
)
from marlin_pack.marlin.sharding import ModelDims
from marlin_pack.schemas import GptqSettings, MoeLayerEntry, QuantScheme, SourceFormat
from marlin_pack.sources import Checkpoint, QuantSource

__all__ = ["MoePlan", "check_moe_settings", "ct_expert_names", "plan_moe", "read_moe_layer", "build_moe_layer"]

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class MoePlan:
    """The experts layers of a checkpoint, and their per-rank shape at each TP size."""

    arch: MoeArchitecture
    layers: list[int]  # decoder layers with routed experts (see _sparse_layers)
    checkpoint_layers: str
    vllm_layers: str
    hidden: int
    intermediate: int
    awq: bool
    naming: ExpertNaming  # the checkpoint's names of the experts (no experts layers: the architecture's first)
    shapes: dict[int, MoeRankShape] = field(default_factory=dict)
    fmt: SourceFormat | None = None  # the source format (compressed-tensors names its experts' tensors its own way)

    def expert(self, layer: int, e: int) -> str:
        """Checkpoint module of expert ``e`` of decoder layer ``layer``."""
        return self.naming.expert(self.checkpoint_layers, layer, e)

    def name(self, layer: int) -> str:
        """vLLM's experts module of decoder layer ``layer`` (the manifest's and the rank files' name)."""
        return self.arch.vllm_prefix(self.vllm_layers, layer)

    def entries(self, tp: int) -> list[MoeLayerEntry]:
        return [moe_layer_entry(self.name(i), self.shapes[tp]) for i in self.layers]

    def specs(self, tp: int, scheme: QuantScheme, dtype: torch.dtype) -> list[TensorSpec]:
        return [s for i in self.layers for s in moe_tensor_specs(self.name(i), self.shapes[tp], scheme, dtype, self.fmt)]


def check_moe_settings(ckpt: Checkpoint, source: QuantSource, dims: ModelDims) -> None:
    """Refuse, before any per-layer check, the settings whose experts marlin-pack does not lay out for vLLM's Marlin MoE."""
    arch = dims.architecture
    _sparse_layers(top_config(ckpt.config), dims)
    if source.format is SourceFormat.compressed_tensors:
        _check_ct_experts(source, dims, top_config(ckpt.config))
        return
    found = ckpt.quant_settings()
    s = found.settings if found is not None else None
    if isinstance(s, GptqSettings):
        if s.desc_act:
            raise UnsupportedCheckpointError(
                f"{arch}: GPTQ desc_act is true; marlin-pack converts act-order-free GPTQ experts only "
                "(vLLM keeps sort indices for them), use a checkpoint quantized with desc_act=false"
            )
        if s.checkpoint_format != "gptq":
            raise UnsupportedCheckpointError(
                f"{arch}: GPTQ checkpoint_format is {s.checkpoint_format!r}; marlin-pack converts gptq (v1) experts only"
            )
        if s.dynamic:
            raise UnsupportedCheckpointError(f"{arch}: GPTQ dynamic per-module rules are not supported on mixture-of-experts models")


def ct_expert_names(arch: MoeArchitecture, vllm_layers: str, layer: int) -> tuple[str, str, str]:
    """vLLM's names of expert 0's gate, up and down projections in decoder layer ``layer``: what
    ``CompressedTensorsMoEMethod.get_moe_method`` looks up in ``ignore``/``targets`` (the experts
    module's prefix and the model's checkpoint projection names, e.g. Mixtral's ``w1``/``w3``/``w2``)."""
    n = arch.namings[0]
    block = arch.vllm_experts.removesuffix(".routed_experts")
    return tuple(f"{vllm_layers}.{layer}.{block}.0.{leaf}" for leaf in (n.gate, n.up, n.down))  # type: ignore[return-value]


def _check_ct_experts(source: QuantSource, dims: ModelDims, config: dict) -> None:
    """compressed-tensors: every experts layer must be quantized as vLLM decides it from ``ignore``/``targets``
    (else ``UnquantizedFusedMoEMethod`` serves it, and there is nothing of Marlin to prepare)."""
    arch = MOE_ARCHITECTURES[dims.architecture]
    for layer in _sparse_layers(config, dims):
        names = ct_expert_names(arch, dims.arch.layers, layer)
        if not source.vllm_quantizes_experts(names):  # type: ignore[attr-defined]
            raise UnsupportedCheckpointError(
                f"compressed-tensors ignore/targets leave the experts of decoder layer {layer} unquantized ({names[0]}); "
                "vLLM serves them with UnquantizedFusedMoEMethod, marlin-pack converts quantized experts only; "
                "use a checkpoint whose experts are quantized"
            )


def _config_int(config: dict, key: str, arch: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedCheckpointError(
            f"config.json {key} is {value!r}, expected a positive integer ({arch}); {RESTORE_CONFIG}"
        )
    return value


def _sparse_layers(config: dict, dims: ModelDims) -> list[int]:
    """The decoder layers with routed experts: DeepSeek's as vLLM picks them, Mellum's as its ``mlp_layer_types``
    lists them (the rest are dense MLPs, ordinary linears of the dense plan); for the other architectures every layer
    must hold experts (Qwen's ``decoder_sparse_step``/``mlp_only_layers`` may make some dense)."""
    n_layers, arch = dims.num_layers, dims.architecture
    if dims.arch.mla is not None:
        from marlin_pack.marlin.deepseek import sparse_layers

        return sparse_layers(config, dims.arch, n_layers)
    if dims.arch.mlp_layer_types is not None:  # Mellum's mlp_layer_types
        return dims.arch.mlp_layer_types.sparse_layers(config, arch, n_layers)
    step = config.get("decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if step != 1 or only:
        raise UnsupportedCheckpointError(
            f"{arch}: decoder_sparse_step {step} / mlp_only_layers {only} mix dense and sparse decoder layers; "
            "marlin-pack converts models whose every layer has routed experts"
        )
    return list(range(n_layers))


def plan_moe(ckpt: Checkpoint, source: QuantSource, dims: ModelDims, tp_sizes: list[int]) -> tuple[MoePlan, set[str]]:
    """Validate every expert of every layer from headers; the plan and the checkpoint tensors it owns.

    Raises:
        CheckpointError, UnsupportedCheckpointError: naming the first expert or setting at fault.
    """
    name = dims.architecture
    arch = MOE_ARCHITECTURES[name]
    check_moe_settings(ckpt, source, dims)
    config = top_config(ckpt.config)  # as vLLM reads it: transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    n_experts = _config_int(config, arch.num_experts_key, name)
    inter = _config_int(config, arch.intermediate_key, name)
    awq = source.format is SourceFormat.awq_gemm
    layers = _sparse_layers(config, dims)
    # One naming for the whole checkpoint: every layer is then checked against it.
    naming = expert_naming(arch, ckpt.tensors, dims.checkpoint_layers, layers[0]) if layers else arch.namings[0]
    ct = source.format is SourceFormat.compressed_tensors
    plan = MoePlan(arch, layers, dims.checkpoint_layers, dims.arch.layers, dims.hidden_size, inter, awq, naming,
                   fmt=source.format)
    for tp in tp_sizes:
        plan.shapes[tp] = moe_rank_shape(n_experts, dims.hidden_size, inter, tp, source.scheme, awq, ct)
    owned: set[str] = set()
    dims_of = naming.leaf_dims(dims.hidden_size, inter)
    for layer in plan.layers:
        if not ct:  # compressed-tensors: decided per layer from expert 0's names (check_moe_settings)
            source.check_layer(plan.name(layer), True, ckpt=ckpt)
        for e in range(n_experts):
            prefix = plan.expert(layer, e)
            for leaf, (k, n) in dims_of.items():
                module = f"{prefix}.{leaf}"
                source.validate(ckpt, module, k, n)
                if f"{module}.bias" in ckpt.tensors:
                    raise UnsupportedCheckpointError(f"{module}.bias: expert biases are not supported; {SERVE_WITHOUT}")
                owned.update(t for t in source.tensor_names(module) if t in ckpt.tensors)
    return plan, owned


def read_moe_layer(plan: MoePlan, source: QuantSource, ckpt: Checkpoint, layer: int, device: torch.device) -> list[ExpertTensors]:
    """Every expert of one decoder layer, through the format's reader."""
    n_experts = next(iter(plan.shapes.values())).num_experts
    return [
        read_expert(source, ckpt, plan.naming, plan.expert(layer, e), plan.hidden,
                    plan.intermediate, device)
        for e in range(n_experts)
    ]


def build_moe_layer(plan: MoePlan, scheme: QuantScheme, dtype: torch.dtype, tp: int, rank: int, layer: int,
                    experts: list[ExpertTensors],
                    empty: Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One rank's tensors of one experts layer, in file order (``empty``: see :func:`~marlin_pack.marlin.moe.build_moe_rank_tensors`)."""
    return build_moe_rank_tensors(plan.name(layer), plan.shapes[tp], scheme, dtype, rank, experts, plan.awq, empty, plan.fmt)
