"""marlin_pack.repack against vLLM's own pure-torch Marlin helpers, bit for bit."""

from __future__ import annotations

import pytest
import torch

from marlin_pack.marlin import repack

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", [(16, 64), (128, 64), (256, 192), (384, 320), (1408, 960)])
def test_weights_match_marlin_weights(bits: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * n + bits)
    codes = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    want = mut.marlin_weights(codes, k, n, bits, mut.get_weight_perm(bits))
    got = repack.pack_marlin_weights(codes.to(torch.uint8), bits)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(repack.unpack_marlin_weights(got, bits), codes.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size,padded_k", [(-1, 256), (32, 256), (64, 128), (128, 256), (128, 128)])
def test_scales_match_marlin_permute_scales(dtype: torch.dtype, group_size: int, padded_k: int) -> None:
    groups = 1 if group_size == -1 else padded_k // group_size
    s = torch.randn(groups, 320, dtype=torch.float32).to(dtype)
    want = mu.marlin_permute_scales(s, padded_k, 320, group_size)
    got = repack.permute_scales(s, group_size, padded_k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(repack.unpermute_scales(got, group_size, padded_k), s)


@pytest.mark.parametrize("groups,n", [(1, 64), (4, 192), (11, 960)])
def test_zero_points_match_marlin_zero_points(groups: int, n: int) -> None:
    zp = torch.randint(0, 16, (groups, n), dtype=torch.int32)
    want = mu.marlin_zero_points(zp, groups, n, 4)
    got = repack.pack_marlin_zero_points(zp, 4)
    assert torch.equal(got, want)
    assert torch.equal(repack.unpack_marlin_zero_points(got, 4), zp.to(torch.uint8))


def test_bias_matches_marlin_permute_bias() -> None:
    b = torch.randn(960).to(torch.bfloat16)
    assert torch.equal(repack.permute_bias(b), mu.marlin_permute_bias(b))
    assert torch.equal(repack.unpermute_bias(repack.permute_bias(b)), b)


@pytest.mark.parametrize("n", [64, 96, 320, 480, 960, 1376, 4096])
@pytest.mark.parametrize("k", [64, 160, 320, 480, 1376, 4096])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
def test_padded_nk_matches(n: int, k: int, group_size: int) -> None:
    assert repack.padded_nk(n, k, group_size) == mu.marlin_padded_nk(n, k, group_size)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_unpack_matches_pack_rows(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (256, 64), dtype=torch.int32)
    packed = qu.pack_rows(codes, bits, 256, 64)
    assert torch.equal(repack.unpack_gptq_qweight(packed, bits), codes.to(torch.uint8))


def test_awq_unpack_inverts_awq_order() -> None:
    # Build an AWQ word by hand: nibble slot s holds column [0, 2, 4, 6, 1, 3, 5, 7][s].
    cols = torch.randint(0, 16, (3, 16), dtype=torch.int64)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = torch.zeros(3, 2, dtype=torch.int64)
    for s, c in enumerate(order):
        words |= cols[:, c::8] << (4 * s)
    packed = torch.tensor(words.numpy().astype("uint32").view("int32"))
    slots = repack.unpack_awq_cols(packed)
    assert torch.equal(repack.awq_to_natural(slots), cols.to(torch.uint8))


@pytest.mark.parametrize("bits_n", [(4, 64), (4, 320)])
def test_source_slots_fold_equals_reordering(bits_n: tuple[int, int]) -> None:
    bits, n = bits_n
    natural = torch.randint(0, 16, (128, n), dtype=torch.uint8)
    inv = [repack.AWQ_SLOTS.index(i) for i in range(8)]
    slot_order = natural.view(128, n // 8, 8)[:, :, inv].reshape(128, n)
    assert torch.equal(repack.awq_to_natural(slot_order), natural)
    assert torch.equal(repack.pack_marlin_weights(slot_order, bits, repack.AWQ_SLOTS), repack.pack_marlin_weights(natural, bits))
    zp = natural[:4]
    assert torch.equal(
        repack.pack_marlin_zero_points(slot_order[:4], 4, repack.AWQ_SLOTS), repack.pack_marlin_zero_points(zp, 4)
    )
