"""The per-rank tensors of one bundle layer: their declared specs, how to build them, how to read them back."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from marlin_pack.machete.tensors import build_machete_tensors, machete_specs
from marlin_pack.marlin.packed_codes import PackedCodes, repeated_word
from marlin_pack.marlin.repack import (
    pack_marlin_zero_points,
    pad2d,
    permute_bias,
    permute_scales,
    unpack_marlin_zero_points,
    unpermute_bias,
    unpermute_scales,
)
from marlin_pack.marlin.word_repack import marlin_weights
from marlin_pack.schemas import LayerEntry, LayerKernel, QuantScheme, SourceFormat

__all__ = ["TensorSpec", "ParamNames", "param_names", "tensor_specs", "build_rank_tensors", "decode_rank_tensors", "padded_groups"]

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


class ParamNames(NamedTuple):
    """vLLM's parameter names of one quant method's Marlin layers (as the kernel's
    ``w_q_name``/``w_s_name``/``w_zp_name``), plus parameters it keeps untouched."""

    weight: str
    scales: str
    zeros: str
    shape: str | None = None  # compressed-tensors' weight_shape: int64 [2], kept as loaded


_AUTO = ParamNames("qweight", "scales", "qzeros")
_COMPRESSED_TENSORS = ParamNames("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def param_names(fmt: SourceFormat | None = None) -> ParamNames:
    """The parameter names of the layers vLLM builds for checkpoints of ``fmt`` (AWQ/GPTQ when None)."""
    return _COMPRESSED_TENSORS if fmt is SourceFormat.compressed_tensors else _AUTO


def padded_groups(entry: LayerEntry, group_size: int) -> int:
    """Scale rows of a layer after padding (1 when channelwise)."""
    return 1 if group_size == -1 else entry.padded_k // group_size


def tensor_specs(entry: LayerEntry, scheme: QuantScheme, dtype: torch.dtype, fmt: SourceFormat | None = None) -> list[TensorSpec]:
    """Names, dtypes and shapes of a layer's tensors in a rank file, in file order (names: :func:`param_names`);
    in Machete's layout where the layer's kernel is Machete (:mod:`marlin_pack.machete.tensors`)."""
    pn = param_names(fmt)
    if entry.kernel is LayerKernel.machete:
        return machete_specs(entry, scheme, dtype, tuple(pn), keeps_packed_zeros=fmt is SourceFormat.gptq_v1)  # type: ignore[arg-type]
    kp, np_ = entry.padded_k, entry.padded_n
    gp = padded_groups(entry, scheme.group_size)
    specs: list[TensorSpec] = [
        (f"{entry.name}.{pn.weight}", torch.int32, (kp // 16, np_ * 16 * scheme.bits // 32)),
        (f"{entry.name}.{pn.scales}", dtype, (gp, np_)),
    ]
    if scheme.zero_points:
        specs.append((f"{entry.name}.{pn.zeros}", torch.int32, (gp, np_ // 8)))
    if entry.has_bias:
        specs.append((f"{entry.name}.bias", dtype, (np_,)))
    if pn.shape is not None:
        specs.append((f"{entry.name}.{pn.shape}", torch.int64, (2,)))
    return specs


def build_rank_tensors(
    entry: LayerEntry,
    scheme: QuantScheme,
    dtype: torch.dtype,
    codes: PackedCodes,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    source_slots: tuple[int, ...] | None = None,
    fmt: SourceFormat | None = None,
    weight_shape: torch.Tensor | None = None,
    empty: Callable[[str], torch.Tensor] | None = None,
    gptq_zero: int | None = None,
) -> dict[str, torch.Tensor]:
    """Pad and Marlin-transform one rank's fused, sliced layer (``[K, N]`` codes etc.); Machete-transform it where
    the layer's kernel is Machete.

    ``source_slots``: column order of ``zeros`` within each 8 (AWQ), see ModuleTensors.
    ``weight_shape``: compressed-tensors only, the value vLLM's ``weight_shape`` parameter holds.
    ``gptq_zero``: GPTQ only, the zero code its ``qzeros`` hold (a Machete layer keeps that tensor).
    ``empty``: gives, by name, the memory to build the (large) weight tensor in, on the codes'
    device (a writer's recycled buffer: :meth:`~marlin_pack.io.safetensors_io.StreamWriter.empty`);
    None for fresh memory.
    """
    pn = param_names(fmt)
    if entry.kernel is LayerKernel.machete:
        word = None if gptq_zero is None or fmt is not SourceFormat.gptq_v1 else repeated_word(gptq_zero, scheme.bits)
        return build_machete_tensors(entry, scheme, dtype, codes, scales, zeros, bias, tuple(pn), source_slots, weight_shape, word)  # type: ignore[arg-type]
    kp, np_ = entry.padded_k, entry.padded_n
    gp = padded_groups(entry, scheme.group_size)
    # vLLM copies checkpoint scales/bias into params_dtype parameters before processing.
    out = {
        f"{entry.name}.{pn.weight}": marlin_weights(codes, kp, np_, empty(f"{entry.name}.{pn.weight}") if empty else None),
        f"{entry.name}.{pn.scales}": permute_scales(pad2d(scales.to(dtype), gp, np_), scheme.group_size, kp),
    }
    if scheme.zero_points:
        assert zeros is not None
        out[f"{entry.name}.{pn.zeros}"] = pack_marlin_zero_points(pad2d(zeros, gp, np_), scheme.bits, source_slots)
    if entry.has_bias:
        assert bias is not None
        out[f"{entry.name}.bias"] = permute_bias(pad2d(bias.to(dtype).view(1, -1), 1, np_).view(-1))
    if pn.shape is not None:
        assert weight_shape is not None
        out[f"{entry.name}.{pn.shape}"] = weight_shape.to(torch.int64).reshape(2)
    return out


def decode_rank_tensors(
    entry: LayerEntry, scheme: QuantScheme, tensors: dict[str, torch.Tensor], fmt: SourceFormat | None = None
) -> dict[str, torch.Tensor]:
    """Invert :func:`build_rank_tensors` back to padded ``scales``, ``zeros``, ``bias``.

    The weights are left out: ``verify`` compares them in Marlin's layout, and decodes them
    (:func:`~marlin_pack.marlin.repack.unpack_marlin_weights`) only to name a difference.
    """
    kp = entry.padded_k
    pn = param_names(fmt)
    out = {"scales": unpermute_scales(tensors[f"{entry.name}.{pn.scales}"], scheme.group_size, kp)}
    if scheme.zero_points:
        out["zeros"] = unpack_marlin_zero_points(tensors[f"{entry.name}.{pn.zeros}"], scheme.bits)
    if entry.has_bias:
        out["bias"] = unpermute_bias(tensors[f"{entry.name}.bias"])
    return out
