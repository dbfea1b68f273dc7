"""The interface every source format implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from marlin_pack.schemas import QuantScheme, SourceFormat
from marlin_pack.sources.checkpoint import Checkpoint

__all__ = ["ModuleTensors", "QuantSource"]


@dataclass
class ModuleTensors:
    """One checkpoint linear module in canonical form (natural ``[K, N]`` order).

    ``codes`` are unsigned weights (uint8); ``zeros`` the unsigned zero points (AWQ)
    or None; ``scales`` and ``bias`` as stored in the checkpoint. When ``column_slots``
    is set, the columns of ``codes`` and ``zeros`` are in that order within each aligned
    8 (AWQ's packing order, left in place to save a pass; see ``repack.AWQ_SLOTS``).
    """

    codes: torch.Tensor  # [K, N] uint8
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor | None  # [G, N] uint8
    bias: torch.Tensor | None  # [N]
    column_slots: tuple[int, ...] | None = None


class QuantSource(Protocol):
    """Reads one quantization format's modules (see ``awq.py``, ``gptq.py``)."""

    format: SourceFormat
    scheme: QuantScheme

    @classmethod
    def from_quant_config(cls, qc: dict) -> QuantSource: ...

    def tensor_names(self, prefix: str) -> list[str]:
        """Checkpoint tensor names owned by a quantized module (bias excluded)."""
        ...

    def validate(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int) -> None:
        """Check presence, dtypes and shapes of a module's tensors, without reading data."""
        ...

    def read(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int, device: torch.device) -> ModuleTensors:
        """Read and decode one module."""
        ...

    def describe(self) -> str: ...
