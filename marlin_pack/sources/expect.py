"""What a source reader expects of a checkpoint tensor (dtype, shape) and of its quantization settings."""

from __future__ import annotations

import re

import torch

from marlin_pack._constants import SUPPORTED_GROUP_SIZES
from marlin_pack.errors import SERVE_WITHOUT, CheckpointError, UnsupportedCheckpointError
from marlin_pack.sources.checkpoint import Checkpoint

__all__ = ["expect", "expect_scales", "check_group_size", "num_groups", "check_regex"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def expect(ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """Refuse a tensor whose header dtype or shape is not what the config implies."""
    info = ckpt.info(name)
    if info.torch_dtype not in dtypes:
        raise CheckpointError(
            f"tensor {name} is {str(info.torch_dtype).removeprefix('torch.')}, expected "
            f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}; the checkpoint does not match its quantization_config"
        )
    if info.shape != shape:
        raise CheckpointError(
            f"tensor {name} has shape {list(info.shape)}, expected {list(shape)} from config.json; "
            "the checkpoint does not match its config"
        )


def expect_scales(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    """Scales are stored as 16- or 32-bit floats."""
    expect(ckpt, name, shape, _FLOATS)


def check_group_size(group_size: object, where: str) -> int:
    """The group size, if Marlin takes it; else a one-line refusal naming the accepted ones."""
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        accepted = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
        raise UnsupportedCheckpointError(
            f"{where} group_size is {group_size!r}, expected one of {accepted} (Marlin's group sizes in vLLM); "
            f"{SERVE_WITHOUT}"
        )
    return int(group_size)  # type: ignore[call-overload]


def num_groups(size_k: int, group_size: int, name: str) -> int:
    """Scale rows of a module with ``size_k`` input features."""
    if group_size == -1:
        return 1
    if size_k % group_size:
        raise UnsupportedCheckpointError(f"{name}: {size_k} input features are not a multiple of group_size {group_size}; "
                                         "the checkpoint does not match its quantization_config, restore it")
    return size_k // group_size


def check_regex(pattern: str, setting: str) -> re.Pattern[str]:
    """A regular expression from a quantization config, compiled; else a one-line refusal naming ``setting``
    (the config entry that holds it, e.g. ``GPTQ dynamic rule '-:('``).

    vLLM matches these patterns (compressed-tensors ``re:`` targets and ignore entries,
    GPTQModel ``dynamic`` rules) with ``re.match``; one that does not compile would stop vLLM
    too, so it is bad input, never an internal error.
    """
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:  # a bad pattern, a huge repeat count, deep nesting
        raise UnsupportedCheckpointError(
            f"{setting} is not a valid regular expression ({e}); fix the pattern in the checkpoint's quantization config"
        ) from None
