"""Tensor-parallel sizes vLLM cannot shard a checkpoint into: refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlin_pack import UnsupportedCheckpointError, convert


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


def test_group_straddles_tp_shard(awq: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"64 input features per rank at --tp 4 split a quantization group of 128"):
        convert(awq, tp=(4,))


def test_tp_not_dividing_heads(awq: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"not divisible by tensor-parallel size 3"):
        convert(awq, tp=(3,))
