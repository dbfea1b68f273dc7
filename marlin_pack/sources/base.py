"""The interface every source format implements."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from marlin_pack.marlin.sharding import ModuleTensors
from marlin_pack.schemas import QuantScheme, SourceFormat
from marlin_pack.sources.checkpoint import Checkpoint

__all__ = ["ModuleTensors", "QuantSource"]


class QuantSource(Protocol):
    """Reads one quantization format's modules (see ``awq.py``, ``gptq.py``)."""

    format: SourceFormat
    scheme: QuantScheme
    packed_weight: str  # suffix of the tensor that marks a quantized module (qweight, weight_packed)

    @classmethod
    def from_settings(cls, s: Any) -> QuantSource:
        """The reader for a checkpoint's settings (its format's ``*Settings``), or an ``UnsupportedCheckpointError``."""
        ...

    def tensor_names(self, prefix: str) -> list[str]:
        """Checkpoint tensor names owned by a quantized module (bias excluded)."""
        ...

    def validate(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int) -> None:
        """Check presence, dtypes and shapes of a module's tensors, without reading data."""
        ...

    def read(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int, device: torch.device) -> ModuleTensors:
        """Read and decode one module."""
        ...

    def check_layer(self, name: str, quantized: bool, *, ckpt: Checkpoint | None = None, parts: tuple[str, ...] = (),
                    modules: tuple[str, ...] = ()) -> None:
        """Refuse a layer (vLLM's name) whose quantization the format's per-module rules contradict.

        ``parts``: vLLM's names of a fused layer's parts; ``modules``: the checkpoint modules it is read from.
        """
        ...

    def describe(self) -> str: ...
