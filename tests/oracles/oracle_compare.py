"""Compare a bundle's rank files with the oracle (``vllm_reference``): shared by the exactness tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .vllm_reference import reference_rank_tensors

__all__ = ["assert_bundle_equals_vllm", "assert_rank_file_equals"]


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.int32, torch.int64) else t.view(torch.int16)


def assert_bundle_equals_vllm(model: Path, bundle: Path, tps: tuple[int, ...], dtype: torch.dtype,
                              model_class: list[str] | None = None, kernel: str = "marlin") -> int:
    """Every tensor of every rank file equals what vLLM holds on that rank, and nothing else is there.

    ``kernel="machete"``: against vLLM's own per-layer choice on an SM90 GPU, and each layer's kernel in the
    manifest is the one vLLM chose. Returns the number of tensors compared (GPTQ's empty zero-point
    placeholders excluded).
    """
    from marlin_pack.bundle.reader import read_manifest

    manifest = read_manifest(bundle)
    compared = 0
    for tp in tps:
        for rank in range(tp):
            kernels: dict[str, str] = {}
            want = reference_rank_tensors(model, tp, rank, dtype, model_class=model_class, kernel=kernel, kernels=kernels)
            compared += assert_rank_file_equals(bundle, tp, rank, want)
            held = {e.name: f"{e.kernel.value.capitalize()}LinearKernel" for e in manifest.tensor_parallel_set(tp).layers}
            assert held == kernels, f"tp {tp} rank {rank}: the bundle's kernels differ from vLLM's choice"
    return compared


def assert_rank_file_equals(bundle: Path, tp: int, rank: int, want: dict[str, torch.Tensor]) -> int:
    """The rank file holds exactly ``want`` (bit for bit), GPTQ's empty zero-point placeholders
    aside; returns the number of tensors compared."""
    compared = 0
    got = load_file(bundle / f"tp{tp}" / f"rank-{rank}.safetensors")
    for name, ref in want.items():
        # (the kernel's empty zero-point parameter: qzeros/weight_zero_point up to vLLM 0.33, w_zp from 0.34)
        if name.endswith((".qzeros", ".weight_zero_point", ".w_zp")) and ref.numel() == 0:
            assert name not in got, f"{name}: GPTQ keeps no zero points in vLLM"
            continue
        assert name in got, f"{name} missing (tp {tp} rank {rank})"
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        assert torch.equal(_bits_of(got[name]), _bits_of(ref)), f"{name} differs (tp {tp} rank {rank})"
        compared += 1
    extra = set(got) - set(want)
    assert not extra, f"unexpected tensors {sorted(extra)[:3]}"
    return compared
