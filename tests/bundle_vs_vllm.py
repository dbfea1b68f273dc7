"""Compare a bundle's rank files with what stock vLLM 0.33.0 holds (``vllm_reference``), bit for bit.

Shared by ``test_conversion_exact.py`` (synthetic checkpoints) and
``sources/test_thirdparty_fixtures.py`` (checkpoints written by the real quantizers).
Import it only after ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm_reference import reference_rank_tensors


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as an integer tensor (float16 and bfloat16 compared bit for bit, -0.0 and NaN included)."""
    return t if t.dtype == torch.int32 else t.view(torch.int16)


def assert_bundle_equals_vllm(model: Path, bundle: Path, tps: tuple[int, ...], dtype: torch.dtype) -> int:
    """Every rank file of ``bundle`` at each TP size in ``tps`` holds exactly vLLM's tensors; returns how many were compared."""
    compared = 0
    for tp in tps:
        for rank in range(tp):
            want = reference_rank_tensors(model, tp, rank, dtype)
            got = load_file(bundle / f"tp{tp}" / f"rank-{rank}.safetensors")
            for name, ref in want.items():
                if name.endswith(".qzeros") and ref.numel() == 0:
                    assert name not in got, f"{name}: GPTQ keeps no zero points in vLLM"
                    continue
                assert name in got, f"{name} missing (tp {tp} rank {rank})"
                assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
                assert torch.equal(bits_of(got[name]), bits_of(ref)), f"{name} differs (tp {tp} rank {rank})"
                compared += 1
            extra = set(got) - set(want)
            assert not extra, f"unexpected tensors {sorted(extra)[:3]}"
    return compared
