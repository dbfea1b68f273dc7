"""The per-rank tensors of one bundle layer in Machete's layout: specs, how to build them, how to read them back.

What ``MacheteLinearKernel.process_weights_after_loading`` (vLLM) leaves on a layer, under the
parameter names vLLM's quant method gives it (:func:`~marlin_pack.marlin.rank_tensors.param_names`):

- weight: ``machete_prepack_B`` of the codes packed along K, int32 ``[K*bits/32, N]`` row-major, its flat
  storage the prepacked code stream (:func:`~marlin_pack.machete.layout.prepack_codes`);
- scales: ``[G, N]`` contiguous in the activation dtype (compressed-tensors' ``[N, G]`` transposed);
- zero points (AWQ, asymmetric compressed-tensors): ``-1.0 * s * z`` ``[G, N]`` in the activation dtype;
- bias: as loaded, ``[N]`` (Machete adds it after the GEMM; nothing is permuted);
- GPTQ's ``qzeros`` (symmetric: Machete never reads them, vLLM keeps them as loaded): int32
  ``[G, N*bits/32]`` of the one word every checkpoint entry holds (the GPTQ source checks that);
- compressed-tensors' ``weight_shape``: as loaded.

Nothing is padded: vLLM gives a layer to Machete only where K % 64 == 0 and N % 128 == 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from marlin_pack.machete.layout import machete_scales, machete_zero_points, prepack_codes, unpack_prepacked
from marlin_pack.schemas import LayerEntry, QuantScheme

if TYPE_CHECKING:
    class PackedCodes(Protocol):  # marlin_pack.marlin.packed_codes.PackedCodes, without importing the Marlin package
        def unpack(self) -> torch.Tensor: ...

__all__ = ["machete_specs", "build_machete_tensors", "decode_machete_tensors", "natural_zero_columns"]

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


def _groups(entry: LayerEntry, group_size: int) -> int:
    return 1 if group_size == -1 else entry.size_k // group_size


def machete_specs(
    entry: LayerEntry, scheme: QuantScheme, dtype: torch.dtype, names: tuple[str, str, str, str | None], keeps_packed_zeros: bool = False
) -> list[TensorSpec]:
    """Names, dtypes and shapes of a Machete layer's tensors, in file order (``names``: weight, scales, zeros, shape;
    ``keeps_packed_zeros``: GPTQ, whose unused ``qzeros`` vLLM keeps as loaded)."""
    weight, scales, zeros, shape = names
    k, n, g = entry.size_k, entry.size_n, _groups(entry, scheme.group_size)
    specs: list[TensorSpec] = [
        (f"{entry.name}.{weight}", torch.int32, (k * scheme.bits // 32, n)),
        (f"{entry.name}.{scales}", dtype, (g, n)),
    ]
    if scheme.zero_points:
        specs.append((f"{entry.name}.{zeros}", dtype, (g, n)))
    elif keeps_packed_zeros:
        specs.append((f"{entry.name}.{zeros}", torch.int32, (g, n * scheme.bits // 32)))
    if entry.has_bias:
        specs.append((f"{entry.name}.bias", dtype, (n,)))
    if shape is not None:
        specs.append((f"{entry.name}.{shape}", torch.int64, (2,)))
    return specs


def natural_zero_columns(zeros: torch.Tensor, source_slots: tuple[int, ...] | None) -> torch.Tensor:
    """Zero-point codes ``[G, N]`` in natural column order (AWQ's are in slot order within each 8)."""
    if source_slots is None:
        return zeros
    rows, n = zeros.shape
    return zeros.reshape(rows, n // 8, 8)[:, :, list(source_slots)].reshape(rows, n)


def build_machete_tensors(
    entry: LayerEntry,
    scheme: QuantScheme,
    dtype: torch.dtype,
    codes: PackedCodes,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    names: tuple[str, str, str, str | None],
    source_slots: tuple[int, ...] | None = None,
    weight_shape: torch.Tensor | None = None,
    kept_zero_word: int | None = None,
) -> dict[str, torch.Tensor]:
    """One rank's fused, sliced layer (``[K, N]`` codes etc.) in Machete's post-processed form.

    ``kept_zero_word``: GPTQ, the int32 word every ``qzeros`` entry holds (vLLM keeps that tensor as loaded)."""
    weight, scales_name, zeros_name, shape_name = names
    # vLLM copies checkpoint scales (and bias) into params_dtype parameters before processing.
    s = machete_scales(scales.to(dtype))
    out = {
        f"{entry.name}.{weight}": prepack_codes(codes.unpack(), scheme.bits),
        f"{entry.name}.{scales_name}": s,
    }
    if scheme.zero_points:
        assert zeros is not None
        out[f"{entry.name}.{zeros_name}"] = machete_zero_points(natural_zero_columns(zeros, source_slots), s)
    elif kept_zero_word is not None:
        g = _groups(entry, scheme.group_size)
        out[f"{entry.name}.{zeros_name}"] = torch.full((g, entry.size_n * scheme.bits // 32), kept_zero_word, dtype=torch.int32)
    if entry.has_bias:
        assert bias is not None
        out[f"{entry.name}.bias"] = bias.to(dtype).reshape(-1).contiguous()
    if shape_name is not None:
        assert weight_shape is not None
        out[f"{entry.name}.{shape_name}"] = weight_shape.to(torch.int64).reshape(2)
    return out


def decode_machete_tensors(
    entry: LayerEntry, scheme: QuantScheme, tensors: dict[str, torch.Tensor], names: tuple[str, str, str, str | None]
) -> dict[str, torch.Tensor]:
    """The codes ``[K, N]`` (uint8), ``scales`` and ``bias`` back from a Machete layer's tensors, and its stored
    pre-scaled zero points (``zp_scaled``: zero codes cannot be recovered exactly from ``-s*z`` in 16 bits, so
    ``verify`` rebuilds ``-s*z`` from the checkpoint and compares that)."""
    weight, scales_name, zeros_name, _ = names
    out = {
        "codes": unpack_prepacked(tensors[f"{entry.name}.{weight}"], scheme.bits, entry.size_k, entry.size_n),
        "scales": tensors[f"{entry.name}.{scales_name}"],
    }
    if scheme.zero_points:
        out["zp_scaled"] = tensors[f"{entry.name}.{zeros_name}"]
    elif f"{entry.name}.{zeros_name}" in tensors:
        out["kept_zeros"] = tensors[f"{entry.name}.{zeros_name}"]
    if entry.has_bias:
        out["bias"] = tensors[f"{entry.name}.bias"]
    return out
