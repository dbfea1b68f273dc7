"""Shape and dtype checks shared by the source readers."""

from __future__ import annotations

import torch

from marlin_pack.checkpoint import Checkpoint
from marlin_pack.errors import CheckpointError, UnsupportedCheckpointError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def expect(ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    info = ckpt.info(name)
    if info.dtype not in dtypes:
        raise CheckpointError(
            f"tensor {name} is {str(info.dtype).removeprefix('torch.')}, expected "
            f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}; the checkpoint does not match its quantization_config"
        )
    if info.shape != shape:
        raise CheckpointError(
            f"tensor {name} has shape {list(info.shape)}, expected {list(shape)} from config.json; "
            "the checkpoint does not match its config"
        )


def expect_scales(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    expect(ckpt, name, shape, _FLOATS)


def check_group_size(group_size: object, where: str) -> int:
    if group_size not in (-1, 32, 64, 128):
        raise UnsupportedCheckpointError(
            f"{where} group_size is {group_size!r}, expected one of -1, 32, 64, 128 (Marlin's group sizes in vLLM 0.33.0)"
        )
    return int(group_size)  # type: ignore[call-overload]


def num_groups(size_k: int, group_size: int, name: str) -> int:
    if group_size == -1:
        return 1
    if size_k % group_size:
        raise UnsupportedCheckpointError(f"{name}: {size_k} input features are not a multiple of group_size {group_size}")
    return size_k // group_size
