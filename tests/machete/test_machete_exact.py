"""``convert --kernel machete``: every tensor equals what stock vLLM holds on an SM90 GPU, bit for bit.

The reference is ``tests/oracles/vllm_reference.py`` with ``kernel="machete"``: vLLM's real layers, weight
loaders, AWQ conversion, kernel choice (Machete's own ``can_implement``, else Marlin) and
``MacheteLinearKernel.process_weights_after_loading`` on the CPU. Only the CUDA op ``machete_prepack_B``
is stood in for by marlin-pack's layout, whose bytes ``test_golden.py`` and the GPU suite check against the
real op. So this file proves everything around the layout: which layers Machete takes (group 32 and
untiled shapes stay Marlin), the codes fed to it per rank, scales, pre-scaled zero points, bias, and which
parameters a layer keeps (GPTQ's unused ``qzeros``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify
from marlin_pack.bundle.reader import read_manifest

pytest.importorskip("vllm")
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402


def _check(make_checkpoint, tmp_path: Path, fmt: str, bits: int, preset: str, group_size: int, dtype: torch.dtype,
           tps: tuple[int, ...], sharded: bool = False) -> tuple[set[str], Path]:
    model = tmp_path / "model"
    shutil.copytree(make_checkpoint(fmt, preset, bits=bits, group_size=group_size, sharded=sharded), model)
    result = convert(model, tp=tps, dtype=str(dtype).removeprefix("torch."), kernel="machete")
    assert assert_bundle_equals_vllm(model, result.bundle, tps, dtype, kernel="machete") > 0
    report = verify(result.bundle)
    assert report.ok, report.first_failure
    kernels = {e.kernel.value for s in result.manifest.tensor_parallel for e in s.layers}
    return kernels, result.bundle


CASES = [
    ("awq", 4, 128), ("awq", 4, 64), ("awq", 4, -1), ("gptq", 4, 128), ("gptq", 4, -1), ("gptq", 8, 64), ("gptq", 8, 128),
    ("ct", 4, 128), ("ct", 8, -1), ("ct-asym", 4, 64),
]


@pytest.mark.parametrize("fmt,bits,group_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_machete_layers_equal_vllms(make_checkpoint, tmp_path, fmt, bits, group_size, dtype) -> None:
    tps = (1,) if fmt == "awq" and group_size == -1 else (1, 2)  # AWQ channelwise: vLLM keeps no row shards
    kernels, bundle = _check(make_checkpoint, tmp_path, fmt, bits, "tiny", group_size, dtype, tps)
    assert kernels == {"machete"}
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("fmt,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_tp_1_2_4_8_with_kv_replication(make_checkpoint, tmp_path, fmt, bits) -> None:
    # Per-rank widths shrink with TP: at TP 8 some layers stop tiling 64 x 128 and fall back to Marlin, as in vLLM.
    kernels, _ = _check(make_checkpoint, tmp_path, fmt, bits, "wide", 64, torch.float16, (1, 2, 4, 8))
    assert "machete" in kernels


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("awq", 4)])
def test_group_32_stays_marlin_and_keeps_format_4(make_checkpoint, tmp_path, fmt, bits) -> None:
    kernels, bundle = _check(make_checkpoint, tmp_path, fmt, bits, "tiny", 32, torch.float16, (1, 2))
    assert kernels == {"marlin"} and read_manifest(bundle).format_version == 4
    text = (bundle / "manifest.json").read_text()
    assert '"kernel": "marlin"' not in text and '"kernel": "machete"' not in text  # a Marlin bundle's manifest, as before


def test_untiled_shapes_stay_marlin_padded(make_checkpoint, tmp_path) -> None:
    """K=320, N=480 at TP 1: Machete needs N % 128, vLLM gives those layers to Marlin (which pads them)."""
    kernels, bundle = _check(make_checkpoint, tmp_path, "gptq", 4, "tiny-padded", -1, torch.float16, (1,))
    layers = read_manifest(bundle).tensor_parallel[0].layers
    assert "marlin" in kernels and any(e.padded_n != e.size_n or e.padded_k != e.size_k for e in layers if e.kernel.value == "marlin")


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_architectures_with_bias_and_head_dim(make_checkpoint, tmp_path, preset) -> None:
    kernels, _ = _check(make_checkpoint, tmp_path, "gptq", 4, preset, 64, torch.float16, (1, 2))
    assert "machete" in kernels


def test_sharded_checkpoint(make_checkpoint, tmp_path) -> None:
    kernels, _ = _check(make_checkpoint, tmp_path, "awq", 4, "tiny", 128, torch.float16, (1,), sharded=True)
    assert kernels == {"machete"}
