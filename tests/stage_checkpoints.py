"""Tiny quantized checkpoints with a chosen number of decoder layers, converted, for the pipeline-stage tests.

``kind``: ``llama``, ``llama-tied``, ``qwen2``, ``qwen3`` (marlin-pack's synthetic Llama-like checkpoints), an
architecture of ``arch_checkpoints.ARCH_CONFIGS`` or of ``moe_checkpoints.MOE_CONFIGS`` (tensors from
transformers' own model class). Gemma 2/3 get bfloat16, as vLLM serves them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from arch_checkpoints import ARCH_CONFIGS, write_arch_checkpoint
from moe_checkpoints import MOE_CONFIGS, write_moe_checkpoint

from marlin_pack import convert
from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint

__all__ = ["dtype_of", "write_stage_bundle"]

_PRESETS = {"llama": ("tiny", False), "llama-tied": ("tiny", True), "qwen2": ("tiny-qwen2", False), "qwen3": ("tiny-qwen3", False)}


def dtype_of(kind: str) -> torch.dtype:
    return torch.bfloat16 if kind.startswith("Gemma") else torch.float16


def write_stage_bundle(out: Path, kind: str, layers: int, tp: tuple[int, ...] = (1, 2), fmt: str = "gptq") -> Path:
    """The checkpoint of ``kind`` with ``layers`` decoder layers, in ``out``, with its bundle for the TP sizes ``tp``."""
    dtype = dtype_of(kind)
    if kind in _PRESETS:
        preset, tied = _PRESETS[kind]
        shape = dataclasses.replace(PRESETS[preset], num_hidden_layers=layers, tie_word_embeddings=tied)
        model = write_gptq_checkpoint(out, shape, group_size=64, tokenizer=False)
    elif kind in MOE_CONFIGS:
        model = write_moe_checkpoint(out, kind, fmt, dtype=dtype, num_hidden_layers=layers)
    elif kind in ARCH_CONFIGS and "text_config" in ARCH_CONFIGS[kind]:  # multimodal: its tiny config's layers only
        if layers != ARCH_CONFIGS[kind]["text_config"]["num_hidden_layers"]:
            raise ValueError(f"{kind}: only {ARCH_CONFIGS[kind]['text_config']['num_hidden_layers']} layers")
        model = write_arch_checkpoint(out, kind, fmt, dtype=dtype)
    elif kind in ARCH_CONFIGS:
        model = write_arch_checkpoint(out, kind, fmt, dtype=dtype, num_hidden_layers=layers)
    else:
        raise KeyError(kind)
    convert(model, tp=tp, kernel="marlin")
    return Path(model)
