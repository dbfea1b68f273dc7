"""The Machete prepacked layout (``marlin_pack.machete.layout``) checked against its definitions.

* anchors: single (k, n) -> offset values read off the CuTe source (justified below);
* the fast digit-permute path, the explicit gather path and the index-by-index slow definition
  agree for every code of several shapes, 4 and 8 bit, both ``AtomLayoutMNK`` hypotheses;
* a CuTe layout-algebra derivation with NVIDIA's pycute (skipped when pycute is not importable;
  ``pip install --no-deps nvidia-cutlass`` ships it) gives the same offsets;
* the inverse, a flipped nibble, the output's shape/stride/dtype, input checks;
* scales and zero points bit-identical to what vLLM's own ``MacheteLinearKernel`` computes on
  the CPU (skipped without vLLM), and the op's input as vLLM builds it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from marlin_pack.machete import layout as L

SHAPES = [(64, 128), (128, 256), (192, 384), (256, 128), (64, 512)]  # (K, N): 1x1 .. 4x1, 3x3 blocks


def _codes(K: int, N: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + K * 7 + N + bits)
    return torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.uint8)


# (k, n) -> offset in codes, from machete_prepacked_layout.cuh with AtomLayoutMNK (2,1,1):
# ALayout_64x16 = ((4,8,4),(2,2,2)):((128,1,16),(64,8,512)) over m + 64*k (m = n here), so the thread
# digits are t0 = (k%8)//2, t1 = n%8, t2 = (n%64)//16 and the warpgroup ThrM = n//64; the value
# digits v0 = k%2, v1 = (n%16)//8, v2 = (k%16)//8 and RestK = k//16. Ordered storage (values inner,
# 32 per thread, col-major): k+2 -> next thread = 32, n+1 -> 4 threads = 128, n+16 -> 1024,
# n+64 -> 4096; values k+1, n+8, k+8, k+16 -> 1, 2, 4, 8. 4-bit interleaves each run of 8 values by
# (2,4):(4,1) (value v stored at 4*(v%2) + v//2): k+1 -> 4, n+8 -> 1, k+8 -> 2, (9, 8) -> 7.
# Blocks of 8192 codes are col-major over (N/128, K/64): n+128 -> 8192, k+64 -> 8192*N/128.
ANCHORS_4 = {(0, 0): 0, (1, 0): 4, (0, 8): 1, (8, 0): 2, (9, 8): 7, (2, 0): 32, (0, 1): 128, (16, 0): 8,
             (0, 16): 1024, (0, 64): 4096, (0, 128): 8192}  # fmt: skip
ANCHORS_8 = {**ANCHORS_4, (1, 0): 1, (0, 8): 2, (8, 0): 4, (9, 8): 7}


@pytest.mark.parametrize("bits, anchors", [(4, ANCHORS_4), (8, ANCHORS_8)])
@pytest.mark.parametrize("N", [256, 384])
def test_anchors(bits: int, anchors: dict, N: int) -> None:
    K = 128
    for (k, n), want in anchors.items():
        assert L.prepack_offsets_slow(k, n, K, N, bits) == want, (k, n)
    assert L.prepack_offsets_slow(64, 0, K, N, bits) == 8192 * N // 128
    # and the fast path puts a lone marked code exactly there
    for (k, n), want in list(anchors.items()) + [((64, 0), 8192 * N // 128)]:
        codes = torch.zeros(K, N, dtype=torch.uint8)
        codes[k, n] = 5
        stream = L.prepack_codes(codes, bits).view(-1)
        per = 32 // bits
        nz = torch.nonzero(stream).flatten().tolist()
        assert nz == [want // per], (k, n)
        assert L.stream_code(stream, want, bits) == 5


def test_atom_hypotheses_differ_and_default_is_cooperative() -> None:
    assert L.ATOM_M == 2  # KernelTmaWarpSpecializedCooperative -> AtomLayoutMNK (2,1,1)
    for bits in (4, 8):
        assert not torch.equal(L.block_permutation(bits, 2), L.block_permutation(bits, 1))
        # (1,1,1): 128 threads x 64 values, n+64 becomes a value (RestM) at +8 codes in the thread
        assert L.block_offset_slow(64, 0, bits, atom_m=1) == 8
        assert L.block_offset_slow(0, 16, bits, atom_m=1) == 16
        assert L.block_offset_slow(1, 0, bits, atom_m=1) == 4 * 64


@pytest.mark.parametrize("atom_m", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_block_permutation_is_a_bijection_matching_the_slow_definition(bits: int, atom_m: int) -> None:
    perm = L.block_permutation(bits, atom_m)
    assert sorted(perm.tolist()) == list(range(L.BLOCK_SIZE))
    for n, k in itertools.product(range(128), range(64)):
        assert int(perm[L.block_offset_slow(n, k, bits, atom_m)]) == n + 128 * k


@pytest.mark.parametrize("atom_m", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K, N", SHAPES)
def test_fast_gather_and_slow_agree(K: int, N: int, bits: int, atom_m: int) -> None:
    codes = _codes(K, N, bits)
    fast = L.prepack_codes(codes, bits, atom_m)
    assert torch.equal(fast, L.gather_prepack_codes(codes, bits, atom_m))
    stream = fast.view(-1)
    per = 32 // bits
    words = stream.tolist()
    for k, n in itertools.product(range(K), range(0, N, 3 if K * N > 32768 else 1)):
        off = L.prepack_offsets_slow(k, n, K, N, bits, atom_m)
        code = ((words[off // per] & 0xFFFFFFFF) >> (bits * (off % per))) & ((1 << bits) - 1)
        assert code == codes[k, n], (k, n)
    assert torch.equal(L.unpack_prepacked(fast, bits, K, N, atom_m), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_output_contract(bits: int) -> None:
    K, N = 192, 384
    codes = _codes(K, N, bits)
    out = L.prepack_codes(codes, bits)
    # the op allocates empty(B.sizes(), B.dtype, contiguous): the input's [K/P, N] int32, row-major
    assert out.shape == (K * bits // 32, N) and out.dtype == torch.int32
    assert out.is_contiguous() and out.stride() == (N, 1)
    # int32 codes, a transposed (column-major) view and the op-like word input give the same words
    assert torch.equal(L.prepack_codes(codes.to(torch.int32), bits), out)
    assert torch.equal(L.prepack_codes(codes.t().contiguous().t(), bits), out)
    words = L.pack_k(codes, bits)
    assert torch.equal(L.unpack_k_packed(words, bits), codes)
    assert torch.equal(L.prepack_b(words.t().contiguous().t(), bits), out)


def test_pack_k_is_gptq_order() -> None:
    codes = torch.zeros(64, 128, dtype=torch.uint8)
    codes[1, 0], codes[7, 0], codes[8, 3] = 3, 15, 9
    w = L.pack_k(codes, 4)
    assert int(w[0, 0]) & 0xFFFFFFFF == (3 << 4) | (15 << 28)
    assert int(w[1, 3]) == 9


@pytest.mark.parametrize("bits", [4, 8])
def test_flipping_one_stored_bit_changes_exactly_one_code(bits: int) -> None:
    K, N = 128, 256
    codes = _codes(K, N, bits, seed=3)
    out = L.prepack_codes(codes, bits)
    g = torch.Generator().manual_seed(bits)
    for _ in range(20):
        flat = out.clone().view(-1)
        word = int(torch.randint(0, flat.numel(), (1,), generator=g))
        bit = int(torch.randint(0, 32, (1,), generator=g))
        flat[word] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        back = L.unpack_prepacked(flat, bits, K, N)
        diff = torch.nonzero(back != codes).tolist()
        assert len(diff) == 1
        k, n = diff[0]
        assert L.prepack_offsets_slow(k, n, K, N, bits) == word * (32 // bits) + bit // bits


@pytest.mark.parametrize(
    "shape, bits, exc",
    [((64, 100), 4, ValueError), ((96, 128), 4, ValueError), ((64, 128), 3, ValueError), ((64, 128, 1), 4, ValueError)],
)
def test_rejects_what_the_op_rejects(shape: tuple, bits: int, exc: type) -> None:
    with pytest.raises(exc):
        L.prepack_codes(torch.zeros(shape, dtype=torch.uint8), bits)


def test_rejects_out_of_range_codes() -> None:
    with pytest.raises(ValueError, match="codes must lie"):
        L.prepack_codes(torch.full((64, 128), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="codes must lie"):
        L.prepack_codes(torch.full((64, 128), -1, dtype=torch.int32), 8)
    with pytest.raises(TypeError):
        L.prepack_codes(torch.zeros(64, 128), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_gives_the_cpu_words() -> None:
    codes = _codes(256, 384, 4)
    assert torch.equal(L.prepack_codes(codes.cuda(), 4).cpu(), L.prepack_codes(codes, 4))


# --- pycute: the CuTe composition, executed -------------------------------------------------


def _pycute_block_offsets(bits: int, atom_m: int):
    """``ppblock_ilvd_NK_to_offset`` built with pycute's layout algebra as the C++ composes it."""
    pc = pytest.importorskip("pycute")
    Layout, make_layout, composition = pc.Layout, pc.make_layout, pc.composition

    def zip2_by(layout, guide):
        # cute::zip2_by: a leaf guide (Underscore included) takes the mode as (tile, rest).
        # pycute's hier_unzip treats None differently, so this follows the C++ tile_unzip.
        if isinstance(guide, tuple):
            parts = [zip2_by(layout[i], g) for i, g in enumerate(guide)]
            rest = [layout[i] for i in range(len(guide), len(layout))]
            return make_layout(make_layout([p[0] for p in parts]), make_layout([p[1] for p in parts] + rest))
        assert len(layout) == 2
        return layout

    def ldiv(layout, tiler):
        if tiler is None:
            return layout
        if isinstance(tiler, tuple):
            return make_layout([ldiv(layout[i], t) for i, t in enumerate(tiler)] + [layout[i] for i in range(len(tiler), len(layout))])
        return pc.logical_divide(layout, tiler)

    def zipped_divide(layout, tiler):
        return zip2_by(ldiv(layout, tiler), tiler)

    def compact_col_major(shape, start):
        flat, mul = [], start
        for s in pc.flatten(shape):
            flat.append(mul)
            mul *= s
        it = iter(flat)

        def unflat(sh):
            return tuple(unflat(x) for x in sh) if isinstance(sh, tuple) else next(it)

        return unflat(shape)

    alayout = Layout(((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512)))  # GMMA::ALayout_64x16
    # TiledMMA::thrfrg_A with the default (identity) permutation and AtomShape (64, _, 16)
    a_tensor = zipped_divide(Layout((128, 64)), (Layout(64), Layout(16)))
    tv = make_layout(composition(a_tensor[0], alayout), a_tensor[1])
    # thr_layout_vmnk = tiled_product(ThrID=128, AtomLayoutMNK): sizes <1> = atom_m, <3> = 1
    tv = zipped_divide(tv, (None, (Layout(atom_m), Layout(1))))
    assert pc.size(tv[0]) == 128 * atom_m and pc.size(tv) == 8192
    nk_to_tv = composition(pc.right_inverse(tv), Layout((128, 64)))  # .with_shape(PPBlockShape_NK)
    # make_ordered_layout(shape(TV), Step<_1,_0>): values innermost, col-major within each mode
    nval = pc.size(tv[1])
    ordered = Layout(tv.shape, (compact_col_major(tv.shape[0], nval), compact_col_major(tv.shape[1], 1)))
    if bits == 4:  # FrgV -> ((IlvdBlk (2,4):(4,1)), size/8):(.., 8)
        frg = ordered[1][0]
        ilvd = Layout(((2, 4), pc.size(frg) // 8), ((4, 1), 8))
        ordered = make_layout(ordered[0], make_layout(ilvd, ordered[1][1]))
    nk_to_off = composition(ordered, nk_to_tv)
    # the kernel reads through right_inverse(nk_to_off): must be an exact inverse
    inv = pc.right_inverse(nk_to_off)
    assert pc.size(inv) == 8192
    return nk_to_off, inv


@pytest.mark.parametrize("atom_m", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_pycute_block_layout(bits: int, atom_m: int) -> None:
    nk_to_off, inv = _pycute_block_offsets(bits, atom_m)
    perm = L.block_permutation(bits, atom_m)
    for n, k in itertools.product(range(128), range(64)):
        off = nk_to_off(n, k)
        assert off == L.block_offset_slow(n, k, bits, atom_m), (n, k)
        assert int(perm[off]) == n + 128 * k
        assert inv(off) == n + 128 * k


@pytest.mark.parametrize("atom_m", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K, N", [(128, 256), (192, 384)])
def test_pycute_whole_tensor(K: int, N: int, bits: int, atom_m: int) -> None:
    pc = pytest.importorskip("pycute")
    nk_to_off, _ = _pycute_block_offsets(bits, atom_m)
    nbn, nbk = N // 128, K // 64
    # bNbKL_to_offset: compact col-major over (BlocksN, BlocksK) with stride size(PPBlockShape_NK)
    blocks = pc.Layout((nbn, nbk), (8192, 8192 * nbn))
    codes = _codes(K, N, bits, seed=11)
    stream = L.prepack_codes(codes, bits, atom_m).view(-1)
    got = L.unpack_prepacked(stream, bits, K, N, atom_m)
    assert torch.equal(got, codes)
    per, words = 32 // bits, stream.tolist()
    for k, n in itertools.product(range(0, K, 5), range(N)):
        off = blocks(n // 128, k // 64) + nk_to_off(n % 128, k % 64)
        assert off == L.prepack_offsets_slow(k, n, K, N, bits, atom_m)
        assert ((words[off // per] & 0xFFFFFFFF) >> (bits * (off % per))) & ((1 << bits) - 1) == codes[k, n]


# --- scales and zero points: vLLM's own transform on the CPU ---------------------------------


def _run_vllm_machete_transform(monkeypatch, *, fmt: str, bits: int, act: torch.dtype, group: int, K: int, N: int):
    """Run vLLM's ``MacheteLinearKernel.process_weights_after_loading`` on a layer of ``fmt``'s layout.

    ``ops.machete_prepack_B`` (CUDA only) is replaced by a recorder that returns our words.
    """
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops
    import vllm.model_executor.parameter as vparam
    from vllm.model_executor.kernels.linear.mixed_precision.machete import MacheteLinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
    from vllm.scalar_type import scalar_types

    # parameters ask for the TP rank and size: one rank, no process group
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    zp = fmt == "ct-asym"
    wtype = {
        (4, False): scalar_types.uint4b8,
        (8, False): scalar_types.uint8b128,
        (4, True): scalar_types.uint4,
        (8, True): scalar_types.uint8,
    }[(bits, zp)]
    per, G = 32 // bits, (1 if group == -1 else K // group)
    g = torch.Generator().manual_seed(bits * 100 + G)
    codes = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.uint8)
    zcodes = torch.randint(0, 1 << bits, (G, N), generator=g, dtype=torch.uint8)
    # scales over a wide range (subnormal to large) so the zero-point product rounds differently
    scales = (torch.rand(G, N, generator=g) * 2 - 1) * torch.exp2(torch.randint(-20, 8, (G, N), generator=g).float())
    scales = scales.to(act)

    def noop(*args, **kwargs):
        return None

    layer = torch.nn.Module()
    if fmt == "gptq":  # qweight [K/P, N] packed along K, scales [G, N]
        w = PackedvLLMParameter(data=L.pack_k(codes, bits), input_dim=0, output_dim=1, packed_dim=0, packed_factor=per, weight_loader=noop)
        s = GroupQuantScaleParameter(data=scales.clone(), input_dim=0, output_dim=1, weight_loader=noop)
    else:  # compressed-tensors: weight_packed [N, K/P] packed along K (dim 1), scales [N, G]
        w = PackedvLLMParameter(
            data=L.pack_k(codes, bits).t().contiguous(), input_dim=1, output_dim=0, packed_dim=1, packed_factor=per, weight_loader=noop
        )
        s = GroupQuantScaleParameter(data=scales.t().contiguous(), input_dim=1, output_dim=0, weight_loader=noop)
    layer.register_parameter("weight_packed", w)
    layer.register_parameter("weight_scale", s)
    if zp:  # weight_zero_point [N/P, G] packed along N (dim 0)
        zpk = L.pack_k(zcodes.t().contiguous(), bits)  # pack along N of the [N, G] codes
        z = PackedvLLMParameter(data=zpk, input_dim=1, output_dim=0, packed_dim=0, packed_factor=per, weight_loader=noop)
        layer.register_parameter("weight_zero_point", z)

    calls = []

    def recorder(b, a_type, b_type, group_scales_type):
        # a copy: from vLLM 0.34.0 replace_parameter copies a smaller result into the loaded storage b may view
        calls.append((b.clone(), a_type, b_type, group_scales_type))
        return L.prepack_b(b, bits)

    monkeypatch.setattr(ops, "machete_prepack_B", recorder)
    cfg = MPLinearLayerConfig((K, N), (K, N), wtype, act, group, zp)
    kernel = MacheteLinearKernel(cfg, "weight_packed", "weight_scale", "weight_zero_point" if zp else None)
    kernel.process_weights_after_loading(layer)
    return layer, calls, codes, zcodes, scales, wtype


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("fmt", ["gptq", "ct", "ct-asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [-1, 64, 128])
def test_scales_zero_points_and_op_input_match_vllm(monkeypatch, fmt: str, bits: int, act: torch.dtype, group: int) -> None:
    K, N = 256, 384
    layer, calls, codes, zcodes, scales, wtype = _run_vllm_machete_transform(
        monkeypatch, fmt=fmt, bits=bits, act=act, group=group, K=K, N=N
    )
    # what reaches the op: [K/P, N] int32 with stride (1, K/P), the codes packed along K
    (b, a_type, b_type, gs_type), = calls  # fmt: skip
    assert b.shape == (K * bits // 32, N) and b.dtype == torch.int32 and b.stride() == (1, K * bits // 32)
    assert torch.equal(L.unpack_k_packed(b, bits), codes)
    assert (a_type, b_type, gs_type) == (act, wtype, act)
    assert torch.equal(layer.weight_packed.data, L.prepack_codes(codes, bits))

    ours_s = L.machete_scales(scales if fmt == "gptq" else scales.t().contiguous().t())
    assert _same_bits(layer.weight_scale.data, ours_s) and layer.weight_scale.data.is_contiguous()
    if fmt == "ct-asym":
        want = layer.weight_zero_point.data
        ours_z = L.machete_zero_points(zcodes, ours_s)
        assert want.is_contiguous() and ours_z.is_contiguous()
        assert _same_bits(want, ours_z)
        # the int32 codes vLLM unpacks give the same bits as uint8 ones
        assert _same_bits(L.machete_zero_points(zcodes.to(torch.int32), ours_s), want)


def test_zero_points_formula_is_one_rounding_in_the_scale_dtype() -> None:
    s = torch.tensor([[0.1, 3.3, 1e-5, 65000.0]], dtype=torch.float16)
    z = torch.tensor([[7, 15, 3, 1]], dtype=torch.uint8)
    got = L.machete_zero_points(z, s)
    assert got.dtype == torch.float16 and got.shape == (1, 4)
    assert torch.equal(got, -(s * z.to(torch.float16)))
    with pytest.raises(ValueError):
        L.machete_zero_points(z[:, :2], s)
    with pytest.raises(TypeError):
        L.machete_zero_points(z.float(), s)
