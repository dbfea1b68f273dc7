"""compressed-tensors (llm-compressor pack-quantized) bundles equal what stock vLLM holds, bit for bit.

Same oracle as ``test_conversion_exact.py`` (``tests/oracles/vllm_reference.py``): vLLM's own model class,
``CompressedTensorsConfig``, ``CompressedTensorsWNA16`` with ``MarlinLinearKernel`` and its real
weight loaders and post-processing, on the CPU. Compared per rank: ``weight_packed``,
``weight_scale``, ``weight_zero_point`` (asymmetric), ``weight_shape`` and bias.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify

pytest.importorskip("vllm")
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402

# (make_checkpoint format, bits): symmetric 4/8-bit (uint4b8/uint8b128), 4-bit with zero points (uint4).
SCHEMES = [("ct", 4), ("ct", 8), ("ct-asym", 4)]


def _check(make_checkpoint, tmp_path: Path, fmt: str, bits: int, preset: str, group_size: int, dtype: torch.dtype,
           tps: tuple[int, ...], sharded: bool = False) -> int:
    src = make_checkpoint(fmt, preset, bits=bits, group_size=group_size, dtype=torch.bfloat16, sharded=sharded)
    model = tmp_path / "model"
    shutil.copytree(src, model)
    convert(model, tp=tps, dtype=str(dtype).removeprefix("torch."))
    n = assert_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure
    return n


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("fmt,bits", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tp_1_2_4(make_checkpoint, tmp_path, fmt, bits, group_size, dtype) -> None:
    # tiny: 4 query heads, 2 KV heads (TP 4 replicates them); o_proj K=256, down_proj K=512. A group of 128
    # would straddle o_proj's TP-4 shard (64 rows): vLLM refuses that, so TP 4 is left out there.
    tps = (1, 2) if group_size == 128 else (1, 2, 4)
    assert _check(make_checkpoint, tmp_path, fmt, bits, "tiny", group_size, dtype, tps) > 0


@pytest.mark.parametrize("fmt,bits", SCHEMES)
def test_padding_at_tp1(make_checkpoint, tmp_path, fmt, bits) -> None:
    _check(make_checkpoint, tmp_path, fmt, bits, "tiny-padded", 32, torch.float16, (1,))


@pytest.mark.parametrize("fmt,bits", [("ct", 4), ("ct-asym", 4)])
def test_qwen2_bias_and_sharded(make_checkpoint, tmp_path, fmt, bits) -> None:
    # Qwen2 q/k/v biases; a sharded checkpoint (weight_shape of the fused parts may come from different files).
    _check(make_checkpoint, tmp_path, fmt, bits, "tiny-qwen2", 64, torch.bfloat16, (1, 2))
    _check(make_checkpoint, tmp_path / "s", fmt, bits, "tiny", 128, torch.bfloat16, (1, 2), sharded=True)
