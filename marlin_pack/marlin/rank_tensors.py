"""The per-rank tensors of one bundle layer: their declared specs, how to build them, how to read them back."""

from __future__ import annotations

import torch

from marlin_pack.marlin.repack import (
    pack_marlin_weights,
    pack_marlin_zero_points,
    pad2d,
    permute_bias,
    permute_scales,
    unpack_marlin_weights,
    unpack_marlin_zero_points,
    unpermute_bias,
    unpermute_scales,
)
from marlin_pack.schemas import LayerEntry, QuantScheme

__all__ = ["TensorSpec", "tensor_specs", "build_rank_tensors", "decode_rank_tensors", "padded_groups"]

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


def padded_groups(entry: LayerEntry, group_size: int) -> int:
    """Scale rows of a layer after padding (1 when channelwise)."""
    return 1 if group_size == -1 else entry.padded_k // group_size


def tensor_specs(entry: LayerEntry, scheme: QuantScheme, dtype: torch.dtype) -> list[TensorSpec]:
    """Names, dtypes and shapes of a layer's tensors in a rank file, in file order."""
    kp, np_ = entry.padded_k, entry.padded_n
    gp = padded_groups(entry, scheme.group_size)
    specs: list[TensorSpec] = [
        (f"{entry.name}.qweight", torch.int32, (kp // 16, np_ * 16 * scheme.bits // 32)),
        (f"{entry.name}.scales", dtype, (gp, np_)),
    ]
    if scheme.zero_points:
        specs.append((f"{entry.name}.qzeros", torch.int32, (gp, np_ // 8)))
    if entry.has_bias:
        specs.append((f"{entry.name}.bias", dtype, (np_,)))
    return specs


def build_rank_tensors(
    entry: LayerEntry,
    scheme: QuantScheme,
    dtype: torch.dtype,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    source_slots: tuple[int, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Pad and Marlin-transform one rank's fused, sliced layer (``[K, N]`` codes etc.).

    ``source_slots``: column order of ``codes``/``zeros`` within each 8 (AWQ), see ModuleTensors.
    """
    kp, np_ = entry.padded_k, entry.padded_n
    gp = padded_groups(entry, scheme.group_size)
    # vLLM copies checkpoint scales/bias into params_dtype parameters before processing.
    out = {
        f"{entry.name}.qweight": pack_marlin_weights(pad2d(codes, kp, np_), scheme.bits, source_slots),
        f"{entry.name}.scales": permute_scales(pad2d(scales.to(dtype), gp, np_), scheme.group_size, kp),
    }
    if scheme.zero_points:
        assert zeros is not None
        out[f"{entry.name}.qzeros"] = pack_marlin_zero_points(pad2d(zeros, gp, np_), scheme.bits, source_slots)
    if entry.has_bias:
        assert bias is not None
        out[f"{entry.name}.bias"] = permute_bias(pad2d(bias.to(dtype).view(1, -1), 1, np_).view(-1))
    return out


def decode_rank_tensors(
    entry: LayerEntry, scheme: QuantScheme, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Invert :func:`build_rank_tensors` back to padded ``codes``, ``scales``, ``zeros``, ``bias``."""
    kp = entry.padded_k
    out = {
        "codes": unpack_marlin_weights(tensors[f"{entry.name}.qweight"], scheme.bits),
        "scales": unpermute_scales(tensors[f"{entry.name}.scales"], scheme.group_size, kp),
    }
    if scheme.zero_points:
        out["zeros"] = unpack_marlin_zero_points(tensors[f"{entry.name}.qzeros"], scheme.bits)
    if entry.has_bias:
        out["bias"] = unpermute_bias(tensors[f"{entry.name}.bias"])
    return out
