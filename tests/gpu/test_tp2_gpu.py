"""TP=2 on two GPUs: ordinary loading (Marlin forced) and ``marlin_prepacked`` agree, rank by rank.

Needs two GPUs (``nvidia-h200-x2``). Checkpoints with 2 KV heads (split across ranks) and
one with 1 KV head (replicated on both ranks); bundles converted with ``--tp 2``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_loader_gpu import assert_params_identical, check_logprobs_close, run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

KINDS = ["awq4", "gptq4", "gptq8", "awq4-kv1"]


def _write(kind: str, out: Path) -> Path:
    from marlin_pack.synthetic import PRESETS, ModelShape, write_awq_checkpoint, write_gptq_checkpoint

    if kind == "awq4":
        return write_awq_checkpoint(out, PRESETS["tiny"], group_size=64)
    if kind == "gptq4":
        return write_gptq_checkpoint(out, PRESETS["tiny"], group_size=64)
    if kind == "gptq8":
        return write_gptq_checkpoint(out, PRESETS["tiny"], bits=8, group_size=64)
    return write_awq_checkpoint(out, ModelShape(num_key_value_heads=1), group_size=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from marlin_pack import convert

    root = tmp_path_factory.mktemp("tp2")
    out = {}
    for kind in KINDS:
        d = _write(kind, root / kind)
        convert(d, tp_sizes=(1, 2), dtype="float16")
        out[kind] = d
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_prepacked_matches_ordinary(checkpoints: dict[str, Path], tmp_path: Path, kind: str) -> None:
    from safetensors.torch import load_file

    model = checkpoints[kind]
    code, log, ref = run_engine(tmp_path / "a", model, all_ranks=True, tensor_parallel_size=2, linear_backend="marlin")
    assert code == 0 and ref is not None, log[-4000:]
    code, log, got = run_engine(tmp_path / "b", model, all_ranks=True, tensor_parallel_size=2, load_format="marlin_prepacked")
    assert code == 0 and got is not None, log[-4000:]
    assert "marlin-pack: validate" in log
    check_logprobs_close(ref["outputs"], got["outputs"], "ordinary", "marlin_prepacked")
    assert len(ref["params"]) == len(got["params"]) == 2
    for rank in range(2):
        assert_params_identical(ref["params"][rank], got["params"][rank])
        bundle = load_file(model / "marlin-pack" / "tp2" / f"rank-{rank}.safetensors")
        for name, t in bundle.items():  # the bundle itself equals stock vLLM's rank tensors
            assert torch.equal(ref["params"][rank][name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    print(f"{kind}: TP=2, both ranks bit-identical, outputs agree")


def test_tp1_bundle_refused_by_tp2_engine(tmp_path: Path) -> None:
    from marlin_pack import convert
    from marlin_pack.synthetic import PRESETS, write_awq_checkpoint

    model = write_awq_checkpoint(tmp_path / "m", PRESETS["tiny"], group_size=64)
    convert(model, tp_sizes=(1,), dtype="float16")
    code, log, _ = run_engine(tmp_path / "e", model, params=False, tensor_parallel_size=2, load_format="marlin_prepacked")
    assert code != 0 and "[tp_size]" in log and "tensor_parallel_size=2" in log, log[-4000:]
