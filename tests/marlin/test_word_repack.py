"""The word-level Marlin repack (marlin.word_repack) against vLLM's pure-torch helpers, bit for bit,
and the packed-codes layouts (slicing, concatenation) against unpacked codes."""

from __future__ import annotations

import pytest
import torch

from marlin_pack.marlin import repack
from marlin_pack.marlin.packed_codes import ColumnParts, PackedCodes, cat_columns
from marlin_pack.marlin.word_repack import marlin_weights

mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")


def _codes(k: int, n: int, bits: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + k * n)
    return torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)


def _awq_words(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ packing by hand: column c of each 8 in nibble slot AWQ_SLOTS[c]."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for c, slot in enumerate(repack.AWQ_SLOTS):
        words |= codes[:, c::8].long() << (4 * slot)
    return torch.tensor(words.numpy().astype("uint32").view("int32"))


def _layouts(codes: torch.Tensor, bits: int) -> dict[str, PackedCodes]:
    k, n = codes.shape
    gptq = qu.pack_rows(codes, bits, k, n)
    out = {
        "gptq": PackedCodes(gptq, bits, "k"),
        # compressed-tensors: [N, K/per] words, handed over transposed (a strided view)
        "compressed-tensors": PackedCodes(gptq.t().contiguous().t(), bits, "k"),
        "unpacked": PackedCodes.from_codes(codes, bits),
    }
    if bits == 4:
        out["awq"] = PackedCodes(_awq_words(codes), bits, "n", repack.AWQ_SLOTS)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,kp,np_", [(16, 64, 16, 64), (128, 64, 128, 128), (256, 192, 256, 192), (384, 320, 512, 384),
                                        (1408, 960, 1408, 960), (2048, 2560, 2048, 2560)])
def test_word_repack_matches_marlin_weights(bits: int, k: int, n: int, kp: int, np_: int) -> None:
    codes = _codes(k, n, bits)
    padded = torch.zeros(kp, np_, dtype=torch.int32)
    padded[:k, :n] = codes
    want = mut.marlin_weights(padded, kp, np_, bits, mut.get_weight_perm(bits))
    for layout, packed in _layouts(codes, bits).items():
        assert packed.shape == (k, n)
        assert torch.equal(packed.unpack(), codes.to(torch.uint8)), layout
        got = marlin_weights(packed, kp, np_)
        assert got.dtype == torch.int32 and torch.equal(got, want), layout
        # Into a caller's buffer (a writer's recycled one) holding garbage: the same bytes, in that buffer.
        out = torch.full_like(want, -1)
        assert marlin_weights(packed, kp, np_, out).data_ptr() == out.data_ptr() and torch.equal(out, want), layout


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_and_concatenation_match_unpacked_codes(bits: int) -> None:
    a, b = _codes(256, 192, bits, 1), _codes(256, 128, bits, 2)
    for layout in _layouts(a, bits):
        pa, pb = _layouts(a, bits)[layout], _layouts(b, bits)[layout]
        # word-aligned (rows of 64, columns of 64) and unaligned (columns 3..) blocks
        for k0, k, n0, n in [(0, 256, 0, 192), (64, 128, 64, 64), (0, 256, 3, 101)]:
            got = cat_columns([pa.block(k0, k, n0, n), pb.block(k0, k, 0, 64)])
            want = torch.cat([a[k0 : k0 + k, n0 : n0 + n], b[k0 : k0 + k, :64]], 1).to(torch.uint8)
            assert got.shape == tuple(want.shape)
            assert torch.equal(got.unpack(), want), (layout, k0, k, n0, n)
            np_, kp = repack.padded_nk(want.shape[1], k, -1)
            assert torch.equal(marlin_weights(got, kp, np_), repack.pack_marlin_weights(repack.pad2d(want, kp, np_), bits))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("pieces", [True, False])
@pytest.mark.parametrize("widths,k,kp", [((128, 64, 64), 256, 256), ((192, 128), 128, 128), ((64, 32), 128, 256), ((96, 160), 128, 128)],
                         ids=["qkv", "gate-up", "padded", "parts-split-a-64-column-block"])
def test_lazy_column_parts_repack_as_their_concatenation(
    bits: int, pieces: bool, widths: tuple[int, ...], k: int, kp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused layer's parts left side by side (``cat_columns(lazy=True)``): the repack concatenates them
    piece by piece (or as a whole where it pads, or on the generic path) into vLLM's bytes."""
    import marlin_pack.marlin.word_repack as word_repack

    if pieces:
        monkeypatch.setattr(word_repack, "_CPU_PIECE_BYTES", 1)  # one strip per piece
    codes = [_codes(k, w, bits, i) for i, w in enumerate(widths)]
    whole = torch.cat(codes, 1)
    np_ = repack.padded_nk(whole.shape[1], kp, -1)[0]
    padded = torch.zeros(kp, np_, dtype=torch.int32)
    padded[:k, : whole.shape[1]] = whole
    want = mut.marlin_weights(padded, kp, np_, bits, mut.get_weight_perm(bits))
    for layout in _layouts(codes[0], bits):
        if layout == "unpacked":
            continue
        lazy = cat_columns([_layouts(c, bits)[layout] for c in codes], lazy=True)
        assert isinstance(lazy, ColumnParts) and lazy.shape == tuple(whole.shape), layout
        assert torch.equal(lazy.unpack(), whole.to(torch.uint8)), layout
        out = torch.full_like(want, -1)
        assert marlin_weights(lazy, kp, np_, out).data_ptr() == out.data_ptr() and torch.equal(out, want), layout


def test_marlin_weights_refuses_an_output_of_another_shape() -> None:
    packed = PackedCodes.from_codes(_codes(16, 64).to(torch.uint8), 4)
    with pytest.raises(ValueError, match="internal error: output"):
        marlin_weights(packed, 16, 64, torch.empty(1, 127, dtype=torch.int32))


@pytest.mark.parametrize("layout,bits", [("gptq", 4), ("compressed-tensors", 4), ("awq", 4), ("gptq", 8), ("compressed-tensors", 8)])
def test_word_repack_in_pieces_equals_one_pass(layout: str, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import marlin_pack.marlin.word_repack as word_repack

    k, n = 256, 192
    packed = _layouts(_codes(k, n, bits), bits)[layout]
    want = marlin_weights(packed, k, n)
    monkeypatch.setattr(word_repack, "_CPU_PIECE_BYTES", 1)  # one strip per piece
    assert torch.equal(marlin_weights(packed, k, n), want)
    out = torch.full_like(want, -1)
    assert marlin_weights(packed, k, n, out).data_ptr() == out.data_ptr() and torch.equal(out, want)


@pytest.mark.parametrize(
    ("shape", "perm", "dtype"),
    [
        ((3, 2, 5, 8), (0, 2, 1, 3), torch.int32),  # innermost run contiguous on both sides: moved as void items
        ((4, 16, 8), (0, 2, 1), torch.int32),  # a transpose: element by element
        ((2, 3, 4, 1), (1, 0, 2, 3), torch.int64),  # a last dimension of one
        ((5,), (0,), torch.int32),
    ],
)
def test_cpu_copy_through_numpy_equals_torch_copy(shape: tuple[int, ...], perm: tuple[int, ...], dtype: torch.dtype) -> None:
    from marlin_pack.marlin.word_repack import _copy

    src = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int64).to(dtype).permute(*perm)
    want = torch.empty(src.shape, dtype=dtype).copy_(src)
    got = torch.full(src.shape, -1, dtype=dtype)
    _copy(got, src)
    assert torch.equal(got, want)
    # into a strided destination (rows of a larger tensor), as the repack's pieces write theirs
    wide = torch.full((*src.shape[:-1], src.shape[-1] * 2), -1, dtype=dtype)
    _copy(wide[..., : src.shape[-1]], src)
    assert torch.equal(wide[..., : src.shape[-1]], want) and bool((wide[..., src.shape[-1] :] == -1).all())
