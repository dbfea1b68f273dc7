"""``prepack_codes`` against outputs of the real ``ops.machete_prepack_B`` recorded on an H200.

``tests/machete/golden/machete_golden.safetensors`` is written by ``tests/on_gpu/test_machete_golden_gpu.py``
(``test_write_golden``, with ``MARLIN_PACK_GOLDEN_OUT`` set) and committed. It holds, per case ``i``,
``case{i}.input`` (the op's int32 ``[K/P, N]`` packed-along-K words, stored contiguous) and ``case{i}.output``
(what the op returned), with metadata ``case{i}`` (JSON: ``bits``, ``K``, ``N``, ``a_type``, ``b_type``,
``output_stride``); and ``perm_4`` / ``perm_8``, the in-block permutation recovered from the op by probing
(offset -> natural index ``n + 128*k``).

Skipped, with the reason, while the file is not there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marlin_pack.machete import layout as L

GOLDEN = Path(__file__).parent / "golden" / "machete_golden.safetensors"
NO_FILE = "no tests/machete/golden/machete_golden.safetensors yet (write it on the GPU: tests/on_gpu/test_machete_golden_gpu.py)"


def _load() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(GOLDEN), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118 (safe_open is not iterable)


def _cases() -> list[str]:
    if not GOLDEN.is_file():
        return []
    return sorted(k for k in _load()[1] if k.startswith("case"))


@pytest.mark.skipif(not GOLDEN.is_file(), reason=NO_FILE)
def test_the_file_holds_cases_of_both_widths() -> None:
    cases = [json.loads(_load()[1][c]) for c in _cases()]
    assert {c["bits"] for c in cases} == {4, 8}


@pytest.mark.skipif(not GOLDEN.is_file(), reason=NO_FILE)
@pytest.mark.parametrize("case", _cases())
def test_prepack_matches_the_op(case: str) -> None:
    tensors, meta = _load()
    m = json.loads(meta[case])
    bits, K, N = m["bits"], m["K"], m["N"]
    words, want = tensors[f"{case}.input"], tensors[f"{case}.output"]
    assert words.dtype == want.dtype == torch.int32
    assert tuple(words.shape) == tuple(want.shape) == (K * bits // 32, N)
    assert m["output_stride"] == [N, 1]  # the op returned a row-major contiguous tensor
    got = L.prepack_b(words, bits)
    if not torch.equal(got, want):
        other = [a for a in L.ATOM_M_CHOICES if a != L.ATOM_M and torch.equal(L.prepack_b(words, bits, a), want)]
        pytest.fail(f"{case} ({m}): prepack_codes differs from the op; atom_m={other} would match" if other else f"{case}: differs")
    assert torch.equal(L.unpack_prepacked(want, bits, K, N), L.unpack_k_packed(words, bits))


@pytest.mark.skipif(not GOLDEN.is_file(), reason=NO_FILE)
@pytest.mark.parametrize("bits", [4, 8])
def test_block_permutation_matches_the_probed_op(bits: int) -> None:
    tensors, _ = _load()
    probed = tensors[f"perm_{bits}"].to(torch.int64)
    assert torch.equal(probed, L.block_permutation(bits)), [
        a for a in L.ATOM_M_CHOICES if torch.equal(probed, L.block_permutation(bits, a))
    ]
