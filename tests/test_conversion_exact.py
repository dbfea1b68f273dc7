"""Every tensor the converter writes equals what stock vLLM holds, bit for bit.

The reference is ``tests/oracles/vllm_reference.py``: vLLM's real layers, weight loaders and
``process_weights_after_loading`` on the CPU, with only the CUDA repack op replaced by
vLLM's own pure-torch reference (``marlin_utils_test.marlin_weights``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify

pytest.importorskip("vllm")
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402

FORMATS = [("awq", 4), ("gptq", 4), ("gptq", 8)]


def _valid_tps(fmt: str, group_size: int, row_k: int, candidates: tuple[int, ...]) -> tuple[int, ...]:
    """TP sizes vLLM accepts: no group split across ranks, AWQ g=-1 only unsharded (see plan.py)."""
    ok = []
    for tp in candidates:
        if group_size == -1:
            if fmt == "awq" and tp > 1:
                continue
        elif (row_k // tp) % group_size:
            continue
        ok.append(tp)
    return tuple(ok)


def _check(make_checkpoint, tmp_path: Path, fmt: str, bits: int, preset: str, group_size: int,
           dtype: torch.dtype, candidates: tuple[int, ...], row_k: int, sharded: bool = False) -> None:
    tps = _valid_tps(fmt, group_size, row_k, candidates)
    src = make_checkpoint(fmt, preset, bits=bits, group_size=group_size, sharded=sharded)
    model = tmp_path / "model"
    shutil.copytree(src, model)
    convert(model, tp=tps, dtype=str(dtype).removeprefix("torch."))
    n = assert_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    assert n > 0
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("fmt,bits", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tp_1_2_4_8_with_kv_replication(make_checkpoint, tmp_path, fmt, bits, group_size, dtype) -> None:
    # 8 query heads, 2 KV heads: TP 4 and 8 replicate KV heads; o_proj has 512 input features.
    _check(make_checkpoint, tmp_path, fmt, bits, "wide", group_size, dtype, (1, 2, 4, 8), row_k=512)


@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("fmt,bits", FORMATS)
def test_marlin_padding_at_tp1(make_checkpoint, tmp_path, fmt, bits, group_size) -> None:
    _check(make_checkpoint, tmp_path, fmt, bits, "tiny-padded", group_size, torch.float16, (1,), row_k=320)


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8)])
def test_marlin_padding_per_rank(make_checkpoint, tmp_path, fmt, bits) -> None:
    _check(make_checkpoint, tmp_path, fmt, bits, "padded-at-tp2", 32, torch.bfloat16, (1, 2), row_k=352 * 2)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "mistral"])
@pytest.mark.parametrize("fmt,bits", FORMATS)
def test_architectures(make_checkpoint, tmp_path, preset, fmt, bits) -> None:
    _check(make_checkpoint, tmp_path, fmt, bits, preset, 64, torch.float16, (1, 2, 4), row_k=256)


@pytest.mark.parametrize("fmt,bits", FORMATS)
def test_sharded_checkpoint(make_checkpoint, tmp_path, fmt, bits) -> None:
    src = make_checkpoint(fmt, "tiny", bits=bits, group_size=128, sharded=True)
    assert (src / "model.safetensors.index.json").exists() and len(list(src.glob("*.safetensors"))) > 1
    _check(make_checkpoint, tmp_path, fmt, bits, "tiny", 128, torch.bfloat16, (1, 2), row_k=256, sharded=True)


def test_same_input_same_bytes(make_checkpoint, tmp_path) -> None:
    src = make_checkpoint("awq", "tiny", group_size=64)
    a, b = tmp_path / "a", tmp_path / "b"
    convert(src, a, tp=(1, 2))
    convert(src, b, tp=(1, 2))
    for f in sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
