"""GPU: ``convert(device="cuda")`` writes byte for byte the bundle ``convert(device="cpu")`` writes.

The pipelined conversion's CUDA-only code (``marlin_pack.stages.Device``: the read thread's copy
stream, the repack stream's wait on its event, ``record_stream``, non-blocking copies into pinned
writer buffers that the writer threads wait for; experts layers built in device memory) never runs
in the CPU suite. Each case converts one small synthetic checkpoint twice, on the CPU and on the
GPU, and compares every rank file and the common file byte for byte (and the manifests, which
record their hashes). Dense AWQ, GPTQ 4/8-bit (padded and channel-wise included), compressed-tensors,
and Qwen3-MoE AWQ/GPTQ experts; several TP sizes at once (several writers in flight). No vLLM needed.

Run on the GPU machine::

    python -m pytest tests/on_gpu/test_convert_cuda_gpu.py -m gpu -v
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from marlin_pack import CheckpointError, convert
from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# case -> (make_checkpoint format, preset, bits, group size, dtype, sharded, TP sizes)
DENSE = {
    "awq-tiny": ("awq", "tiny", 4, 128, torch.float16, False, (1, 2)),
    "awq-padded-bf16": ("awq", "tiny-padded", 4, 32, torch.bfloat16, False, (1,)),
    "awq-wide-sharded": ("awq", "wide", 4, 64, torch.float16, True, (1, 2, 4, 8)),
    "gptq4-padded-at-tp2-bf16": ("gptq", "padded-at-tp2", 4, 32, torch.bfloat16, False, (1, 2)),
    "gptq4-channelwise": ("gptq", "tiny", 4, -1, torch.float16, False, (1, 2)),
    "gptq8-tiny-sharded": ("gptq", "tiny", 8, 128, torch.float16, True, (1, 2)),
    "ct-tiny": ("ct", "tiny", 4, 128, torch.float16, False, (1, 2)),
}
# case -> (format, bits, group size, TP sizes): tiny Qwen3-MoE, 2 layers x 8 experts, sharded
MOE = {
    "moe-awq": ("awq", 4, 128, (1, 2)),
    "moe-gptq4": ("gptq", 4, 64, (1, 2, 4)),
    "moe-gptq8": ("gptq", 8, 128, (1, 2)),
    "moe-ct4-asym": ("ct-asym", 4, 64, (1, 2, 4)),  # compressed-tensors W4A16_ASYM experts
    "moe-ct8": ("ct", 8, 128, (1, 2)),  # compressed-tensors W8A16
}


def _bundle_files(bundle: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(bundle)): p.read_bytes()
        for p in sorted(bundle.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def _assert_cuda_equals_cpu(model: Path, out: Path, tps: tuple[int, ...]) -> None:
    cpu = convert(model, out / "cpu", tp=tps, device="cpu").manifest
    cuda = convert(model, out / "cuda", tp=tps, device="cuda").manifest
    want, got = _bundle_files(out / "cpu"), _bundle_files(out / "cuda")
    assert sorted(got) == sorted(want)
    assert "common.safetensors" in want and sum(f.startswith("tp") for f in want) == sum(tps)
    for name in want:
        assert got[name] == want[name], f"{name} differs between device=cuda and device=cpu"
    assert cuda.to_json() == cpu.to_json()
    assert (out / "cuda" / MANIFEST_NAME).read_bytes() == (out / "cpu" / MANIFEST_NAME).read_bytes()


@pytest.mark.parametrize("case", list(DENSE))
def test_dense_cuda_conversion_is_byte_identical_to_cpu(make_checkpoint, tmp_path: Path, case: str) -> None:
    fmt, preset, bits, group_size, dtype, sharded, tps = DENSE[case]
    model = make_checkpoint(fmt, preset, bits=bits, group_size=group_size, dtype=dtype, sharded=sharded)
    _assert_cuda_equals_cpu(model, tmp_path, tps)


@pytest.mark.parametrize("case", list(MOE))
def test_moe_cuda_conversion_is_byte_identical_to_cpu(tmp_path: Path, case: str) -> None:
    fmt, bits, group_size, tps = MOE[case]
    ct = {"fmt": "compressed-tensors", "symmetric": fmt == "ct"} if fmt.startswith("ct") else {"fmt": fmt}
    model = write_moe_checkpoint(tmp_path / "model", MOE_PRESETS["tiny-qwen3moe"], bits=bits, group_size=group_size,
                                 max_shard_bytes=1 << 20, **ct)
    _assert_cuda_equals_cpu(model, tmp_path, tps)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cuda_read_error_is_one_line_and_leaves_no_bundle(make_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          moe: bool) -> None:
    """A read failing on the read thread mid-conversion, with copies, events and writer threads in flight."""
    from marlin_pack.sources.checkpoint import Checkpoint

    if moe:
        model = write_moe_checkpoint(tmp_path / "model", MOE_PRESETS["tiny-qwen3moe"], "gptq", max_shard_bytes=1 << 20)
        bad = "model.layers.1.mlp.experts.3.up_proj.qweight"
    else:
        model = make_checkpoint("awq", "tiny")
        bad = "model.layers.1.mlp.down_proj.qweight"
    real_get = Checkpoint.get
    readers = set()

    def get(self: Checkpoint, name: str) -> torch.Tensor:
        if name == bad:
            readers.add(threading.current_thread().name)
            raise CheckpointError(f"cannot read tensor {name} (boom); the file is corrupt, download it again")
        return real_get(self, name)

    monkeypatch.setattr(Checkpoint, "get", get)
    out = tmp_path / "bundle"
    with pytest.raises(CheckpointError, match=rf"^cannot read tensor {re.escape(bad)} \(boom\).*again$") as e:
        convert(model, out, tp=(1, 2), device="cuda")
    assert "\n" not in str(e.value) and readers == {"marlin-pack-read"}
    assert not out.exists() and not list(tmp_path.glob(".bundle.tmp-*"))
    torch.cuda.synchronize()  # nothing left running on the device that fails later
