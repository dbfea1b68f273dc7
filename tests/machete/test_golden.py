"""``prepack_codes`` against outputs of the real ``ops.machete_prepack_B`` recorded on an H200.

The files in ``tests/machete/golden/`` are written by ``tests/on_gpu/test_machete_golden_gpu.py``
(with ``MARLIN_PACK_GOLDEN_OUT`` set) and committed:

* ``machete_*.safetensors``: ``input`` (the op's int32 ``[K/P, N]`` packed-along-K words, stored
  contiguous), ``output`` (what the op returned), metadata ``bits``, ``K``, ``N``, ``a_type``,
  ``b_type``, ``output_stride``;
* ``block_perm.safetensors``: ``perm_4``/``perm_8``, the in-block permutation recovered from the op
  by probing (offset -> natural index ``n + 128*k``).

Skipped, with the reason, while the directory holds no such files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marlin_pack.machete import layout as L

GOLDEN = Path(__file__).parent / "golden"
OP_FILES = sorted(GOLDEN.glob("machete_*.safetensors")) if GOLDEN.is_dir() else []
PERM_FILE = GOLDEN / "block_perm.safetensors"
NO_FILES = "no golden files in tests/machete/golden yet (write them on the GPU: tests/on_gpu/test_machete_golden_gpu.py)"


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118 (safe_open is not iterable)


@pytest.mark.skipif(not OP_FILES, reason=NO_FILES)
@pytest.mark.parametrize("path", OP_FILES, ids=[p.stem for p in OP_FILES])
def test_prepack_matches_the_op(path: Path) -> None:
    tensors, meta = _load(path)
    bits, K, N = int(meta["bits"]), int(meta["K"]), int(meta["N"])
    words, want = tensors["input"], tensors["output"]
    assert words.dtype == want.dtype == torch.int32
    assert tuple(words.shape) == tuple(want.shape) == (K * bits // 32, N)
    if "output_stride" in meta:  # the op returned a row-major contiguous tensor
        assert meta["output_stride"] == f"{N},1"
    got = L.prepack_b(words, bits)
    if not torch.equal(got, want):
        other = [a for a in L.ATOM_M_CHOICES if a != L.ATOM_M and torch.equal(L.prepack_b(words, bits, a), want)]
        pytest.fail(f"{path.name}: prepack_codes differs from the op; atom_m={other} would match" if other else f"{path.name}: differs")
    assert torch.equal(L.unpack_prepacked(want, bits, K, N), L.unpack_k_packed(words, bits))


@pytest.mark.skipif(not PERM_FILE.is_file(), reason=NO_FILES)
@pytest.mark.parametrize("bits", [4, 8])
def test_block_permutation_matches_the_probed_op(bits: int) -> None:
    tensors, _ = _load(PERM_FILE)
    probed = tensors[f"perm_{bits}"].to(torch.int64)
    assert torch.equal(probed, L.block_permutation(bits)), [
        a for a in L.ATOM_M_CHOICES if torch.equal(probed, L.block_permutation(bits, a))
    ]
