"""Reading source checkpoints: the directory (``checkpoint.py``) and one module per quantization format.

The settings that matter are extracted from ``quantization_config`` by
:func:`~marlin_pack.io.checkpoint_files.parse_quant_settings` (torch-free, shared with the
staleness checks); :func:`source_for` picks the format's reader from them.
"""

from __future__ import annotations

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.io.checkpoint_files import parse_quant_settings
from marlin_pack.schemas import AwqSettings, CompressedTensorsSettings, QuantSettings
from marlin_pack.sources.awq import AwqGemmSource
from marlin_pack.sources.base import ModuleTensors, QuantSource
from marlin_pack.sources.checkpoint import Checkpoint
from marlin_pack.sources.compressed_tensors import CompressedTensorsSource
from marlin_pack.sources.gptq import GptqV1Source

__all__ = [
    "Checkpoint",
    "AwqGemmSource",
    "CompressedTensorsSource",
    "GptqV1Source",
    "ModuleTensors",
    "QuantSource",
    "source_for",
    "source_from_quant_config",
]


def source_for(settings: QuantSettings) -> QuantSource:
    """Pick and validate the reader for a checkpoint's quantization settings.

    Raises:
        UnsupportedCheckpointError: a scheme vLLM does not serve through Marlin.
    """
    if isinstance(settings, AwqSettings):
        return AwqGemmSource.from_settings(settings)
    if isinstance(settings, CompressedTensorsSettings):
        return CompressedTensorsSource.from_settings(settings)
    return GptqV1Source.from_settings(settings)


def source_from_quant_config(qc: dict | None) -> QuantSource:
    """Pick and validate the reader for a checkpoint's ``quantization_config``.

    Raises:
        UnsupportedCheckpointError: not quantized, or a scheme vLLM does not
            serve through Marlin.
    """
    if qc is None:
        raise UnsupportedCheckpointError(
            "config.json has no quantization_config (and there is no quantize_config.json): the checkpoint is not quantized, "
            "so it has no bundle; marlin-pack converts AWQ (GEMM), GPTQ and compressed-tensors (pack-quantized) checkpoints only: "
            "serve this one with vLLM as it is (no --load-format marlin_prepacked), or use an AWQ or GPTQ checkpoint of the model"
        )
    return source_for(parse_quant_settings(qc))
