"""Did vLLM build exactly the layers a bundle holds, each on the bundle's kernel (Marlin, or Machete per layer)
with the bundle's configuration?

A pure function over :class:`LayerFacts` (gathered from the built model by
``engine.layer_facts``); no vLLM import, so every message is testable on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from marlin_pack._constants import KERNEL_NAME, MACHETE_KERNEL_NAME
from marlin_pack.errors import BundleMismatchError, MismatchField
from marlin_pack.schemas import LayerKernel, Manifest, TensorParallelSet

__all__ = ["SUPPORTED_METHODS", "SUPPORTED_MOE_METHODS", "MOE_BACKEND", "LayerFacts", "MoeLayerFacts", "check_layers",
           "check_moe_layers"]

# The quant methods whose layers a bundle can fill (vLLM dense AWQ / GPTQ, and compressed-tensors'
# linear method with its weight-only WNA16 scheme, named "method:scheme" as engine.layer_facts reports it).
SUPPORTED_METHODS = (
    "AutoAWQMarlinLinearMethod",
    "AutoGPTQLinearMethod",
    "CompressedTensorsLinearMethod:CompressedTensorsWNA16",
)
# The AWQ/GPTQ/compressed-tensors fused-MoE methods whose experts a bundle can fill, on this WNA16 MoE backend only.
SUPPORTED_MOE_METHODS = {"awq-gemm": "AutoAWQMoEMethod", "gptq-v1": "AutoGPTQMoEMethod",
                         "compressed-tensors": "CompressedTensorsWNA16MoEMethod"}
MOE_BACKEND = "MARLIN"
F = MismatchField


@dataclass(frozen=True)
class LayerFacts:
    """One quantized layer as vLLM built it (see ``engine.layer_facts``)."""

    method: str
    kernel: str | None = None
    partition_shape: tuple[int, int] | None = None  # (size_k, size_n) per rank
    padded_nk: tuple[int, int] | None = None  # vLLM's marlin_padded_nk(size_n, size_k, group_size)
    group_size: int | None = None
    weight_type: str | None = None
    act_dtype: str | None = None
    zero_points: bool | None = None
    has_bias: bool = False
    skips_when_marked: bool = True  # its post-processing honours the prepacked mark


@dataclass(frozen=True)
class MoeLayerFacts:
    """One routed-experts layer as vLLM built it (see ``moe_engine.moe_layer_facts``)."""

    method: str
    backend: str | None = None  # WNA16MoEBackend value
    num_experts: int | None = None  # on this rank
    global_num_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None  # per rank
    padded_intermediate: int | None = None  # vLLM's marlin_moe_padded_intermediate
    group_size: int | None = None
    weight_type: str | None = None
    act_dtype: str | None = None
    zero_points: bool | None = None
    has_bias: bool = False
    skips_when_marked: bool = True


def _sample(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _check_same_names(expected: Mapping[str, object], found: Mapping[str, object], what: str) -> None:
    """Raise a ``layers`` mismatch naming the layers only one side has."""
    only_bundle = sorted(set(expected) - set(found))
    only_engine = sorted(set(found) - set(expected))
    if only_bundle or only_engine:
        parts = []
        if only_bundle:
            parts.append(f"{len(only_bundle)} only in the bundle ({_sample(only_bundle)})")
        if only_engine:
            parts.append(f"{len(only_engine)} only in the engine ({_sample(only_engine)})")
        raise BundleMismatchError(F.layers, f"the engine's {what} differ from the bundle's: " + "; ".join(parts) + "; re-convert")


def check_layers(manifest: Manifest, tp_set: TensorParallelSet, found: Mapping[str, LayerFacts]) -> None:
    """Check that vLLM built exactly the bundle's layers, each with Marlin and its configuration.

    Raises:
        BundleMismatchError: ``layers`` (set, shapes, bias), ``kernel``, ``layout``,
            ``group_size``, ``weight_type``, ``activation_dtype`` or ``zero_points``.
    """
    expected = {entry.name: entry for entry in tp_set.layers}
    _check_same_names(expected, found, "quantized layers")
    q = manifest.quant
    for name, entry in expected.items():
        f = found[name]
        if f.method not in SUPPORTED_METHODS:
            raise BundleMismatchError(
                F.kernel, f"layer {name} uses {f.method}, expected one of {list(SUPPORTED_METHODS)} with {KERNEL_NAME}"
            )
        want_kernel = MACHETE_KERNEL_NAME if entry.kernel is LayerKernel.machete else KERNEL_NAME
        if f.kernel != want_kernel:
            raise BundleMismatchError(
                F.kernel, f"vLLM chose {f.kernel} for layer {name}; the bundle holds the {want_kernel} layout"
            )
        if not f.skips_when_marked:
            raise BundleMismatchError(
                F.kernel, f"layer {name}: {f.method}.process_weights_after_loading is not patched by marlin-pack"
            )
        checks: list[tuple[MismatchField, object, object, str]] = [
            (F.layers, f.partition_shape, (entry.size_k, entry.size_n), "per-rank (K, N)"),
            *([(F.layout, f.padded_nk, (entry.padded_n, entry.padded_k), "Marlin padded (N, K)")] if want_kernel == KERNEL_NAME else []),
            (F.group_size, f.group_size, q.group_size, "group size"),
            (F.weight_type, f.weight_type, q.weight_type.value, "weight type"),
            (F.activation_dtype, f.act_dtype, manifest.activation_dtype.value, "activation dtype"),
            (F.zero_points, f.zero_points, q.zero_points, "zero points"),
            (F.layers, f.has_bias, entry.has_bias, "bias"),
        ]
        for field, got, want, what in checks:
            if got != want:
                raise BundleMismatchError(field, f"layer {name}: the engine's {what} is {got}, the bundle's is {want}")


def check_moe_layers(manifest: Manifest, tp_set: TensorParallelSet, found: Mapping[str, MoeLayerFacts],
                     global_experts: int | None = None) -> None:
    """Check that vLLM built exactly the bundle's experts layers, each on Marlin MoE with its configuration.

    ``global_experts``: the model's experts where this GPU holds only some (expert parallelism: the entries' own
    ``num_experts`` are the local ones); None: each entry holds every expert.

    Raises:
        BundleMismatchError: ``layers`` (set, experts, shapes), ``kernel`` (method, backend),
            ``layout``, ``group_size``, ``weight_type``, ``activation_dtype`` or ``zero_points``.
    """
    expected = {entry.name: entry for entry in tp_set.moe_layers}
    _check_same_names(expected, found, "mixture-of-experts layers")
    q = manifest.quant
    want_method = SUPPORTED_MOE_METHODS.get(manifest.source.format.value)
    for name, entry in expected.items():
        f = found[name]
        if f.method != want_method:
            raise BundleMismatchError(F.kernel, f"experts layer {name} uses {f.method}, the bundle holds {want_method} experts")
        if f.backend != MOE_BACKEND:
            raise BundleMismatchError(
                F.kernel,
                f"vLLM chose the {f.backend} MoE backend for experts layer {name}; the bundle holds the Marlin MoE layout "
                "(use --moe-backend auto or marlin)",
            )
        if not f.skips_when_marked:
            raise BundleMismatchError(
                F.kernel, f"experts layer {name}: {f.method}.process_weights_after_loading is not patched by marlin-pack"
            )
        checks: list[tuple[MismatchField, object, object, str]] = [
            (F.layers, f.num_experts, entry.num_experts, "local experts"),
            (F.layers, f.global_num_experts, global_experts or entry.num_experts, "experts"),
            (F.layers, f.hidden_size, entry.hidden_size, "hidden size"),
            (F.layers, f.intermediate_size, entry.intermediate_size, "per-rank intermediate size"),
            (F.layout, f.padded_intermediate, entry.padded_intermediate, "Marlin MoE padded intermediate size"),
            (F.group_size, f.group_size, q.group_size, "group size"),
            (F.weight_type, f.weight_type, q.weight_type.value, "weight type"),
            (F.activation_dtype, f.act_dtype, manifest.activation_dtype.value, "activation dtype"),
            (F.zero_points, f.zero_points, q.zero_points, "zero points"),
            (F.layers, f.has_bias, False, "expert bias"),
        ]
        for field, got, want, what in checks:
            if got != want:
                raise BundleMismatchError(field, f"experts layer {name}: the engine's {what} is {got}, the bundle's is {want}")
