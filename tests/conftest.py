"""Shared fixtures: tiny checkpoints written by the project's own synthetic writer, cached per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from marlin_pack.synthetic import PRESETS, ModelShape, write_awq_checkpoint, write_gptq_checkpoint

# Eight query heads, two KV heads: TP 8 replicates each KV head on four ranks.
WIDE = ModelShape(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
# Aligned at TP 1 but not at TP 2: down_proj gets 352 input features per rank, padded to 384.
PADDED_AT_TP2 = ModelShape(hidden_size=384, intermediate_size=704, num_attention_heads=6, num_key_value_heads=2)
SHAPES = {**PRESETS, "wide": WIDE, "padded-at-tp2": PADDED_AT_TP2, "mistral": ModelShape(model_type="mistral")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


CheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``make_checkpoint(fmt, preset, bits=4, group_size=128, dtype=float16, sharded=False)``, cached."""
    cache: dict[tuple, Path] = {}

    def make(
        fmt: str,
        preset: str = "tiny",
        *,
        bits: int = 4,
        group_size: int = 128,
        dtype: torch.dtype = torch.float16,
        sharded: bool = False,
        seed: int = 0,
    ) -> Path:
        key = (fmt, preset, bits, group_size, dtype, sharded, seed)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{fmt}{bits}-{preset}-g{group_size}".replace("-1", "ch"))
            shard = 200_000 if sharded else None
            kw = dict(group_size=group_size, dtype=dtype, seed=seed, max_shard_bytes=shard, tokenizer=False)
            if fmt == "awq":
                cache[key] = write_awq_checkpoint(d, SHAPES[preset], **kw)
            else:
                cache[key] = write_gptq_checkpoint(d, SHAPES[preset], bits=bits, **kw)
        return cache[key]

    return make
