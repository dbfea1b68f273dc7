"""Reading source checkpoints: the directory (``checkpoint.py``) and one module per quantization format.

The format is chosen from ``quantization_config`` by :func:`source_from_quant_config`.
"""

from __future__ import annotations

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.sources.awq import AwqGemmSource
from marlin_pack.sources.base import ModuleTensors, QuantSource
from marlin_pack.sources.checkpoint import Checkpoint
from marlin_pack.sources.gptq import GptqV1Source

__all__ = ["Checkpoint", "AwqGemmSource", "GptqV1Source", "ModuleTensors", "QuantSource", "source_from_quant_config"]


def source_from_quant_config(qc: dict | None) -> QuantSource:
    """Pick and validate the reader for a checkpoint's ``quantization_config``.

    Raises:
        UnsupportedCheckpointError: not quantized, or a scheme vLLM 0.33.0 does not
            serve through Marlin.
    """
    if qc is None:
        raise UnsupportedCheckpointError(
            "config.json has no quantization_config (and there is no quantize_config.json): the checkpoint is not quantized; "
            "marlin-pack converts AWQ (GEMM) and GPTQ checkpoints only"
        )
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return AwqGemmSource.from_quant_config(qc)
    if method == "gptq":
        return GptqV1Source.from_quant_config(qc)
    raise UnsupportedCheckpointError(
        f"quant_method is {method or 'missing'!r}, expected 'awq' or 'gptq'; other methods do not use this Marlin path"
    )
