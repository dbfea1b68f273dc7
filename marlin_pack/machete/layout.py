"""vLLM's Machete prepacked weight layout, computed on any device without the engine.

On Hopper (SM90) vLLM serves W4A16/W8A16 linears with ``MacheteLinearKernel``. Its
``process_weights_after_loading`` hands the weight, packed along K as an int32 ``[K/P, N]``
(P = 32/bits codes per word), to the CUDA op ``machete_prepack_B`` and keeps what it returns. To
write that tensor offline we need the op's output bit for bit; this module derives it from the
op's CuTe definition (``PrepackedLayoutBTemplate`` in vLLM's ``machete_prepacked_layout.cuh``), not
from running it.

What the op does (one 128x64 (N, K) block of codes at a time):

* ``ppblock_TV_to_NK = TiledMma.thrfrg_A(Layout<(128,64)>)``: the weight is the register-sourced A
  operand of a ``64x128x16`` WGMMA whose ``ALayout_64x16`` is
  ``((4,8,4),(2,2,2)):((128,1,16),(64,8,512))``, tiled by ``AtomLayoutMNK``. The kernel schedule is
  ``KernelTmaWarpSpecializedCooperative``, for which the layout picks ``(2,1,1)`` (two warpgroups
  along N: 256 threads x 32 values). :data:`ATOM_M` holds that choice; ``atom_m=1`` is the
  alternative reading (128 threads x 64 values), kept so one GPU run can settle it.
* storage order ``make_ordered_layout(shape(TV), Step<1,0>)``: a thread's values are contiguous,
  threads follow each other, both compact column-major.
* for 4-bit codes with a 16-bit convert type, each run of 8 values is interleaved by
  ``(2,4):(4,1)`` (value ``v`` of the run is stored at ``4*(v%2) + v//2``); 8-bit is not
  interleaved.
* blocks are stored compact column-major over (N/128, K/64): N-blocks fastest, 8192 codes each.
* the output is a new row-major contiguous int32 tensor with the input's sizes ``[K/P, N]``; only
  its flat storage means something: code ``e`` of the stream sits at bits ``bits*(e%P)`` of word
  ``e//P`` (CuTe sub-byte order, lowest bits first).

The fast path (:func:`prepack_codes`) gathers codes through one cached 8192-entry permutation
built by *evaluating* the TV->NK layout (thread and value digits times their strides) and packs
them little-endian. :func:`prepack_offsets_slow` goes the other way, (k, n) -> stream offset, by
inverting the WGMMA A layout digit by digit; tests check that the two agree and that both agree
with a CuTe layout-algebra derivation (pycute), so the derivation does not rest on one reading.

Nothing here imports vLLM; it is plain torch and works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import functools
import sys

import torch

BLOCK_N = 128  # PPBlockShape_NK
BLOCK_K = 64
BLOCK_SIZE = BLOCK_N * BLOCK_K

ATOM_M = 2
"""Warpgroups of the tiled MMA along N (``AtomLayoutMNK = (ATOM_M,1,1)``): 2 for the cooperative
schedule vLLM instantiates. Set to 1 to switch every default to the alternative reading."""

ATOM_M_CHOICES = (2, 1)

# cute GMMA::ALayout_64x16 (register-sourced A of a 16-bit WGMMA): (thr, val) -> m + 64*k
_A_THR_SHAPE, _A_THR_STRIDE = (4, 8, 4), (128, 1, 16)
_A_VAL_SHAPE, _A_VAL_STRIDE = (2, 2, 2), (64, 8, 512)
_ATOM_M, _ATOM_K = 64, 16  # Shape_MNK of SM90_64x128x16_F*_RS: M, K

# get_interleaved_blk_layout<uint4, 16, 32>() = (2,4):(4,1); 8-bit: none
_ILV_SHAPE, _ILV_STRIDE = (2, 4), (4, 1)


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"Machete prepacks 4- or 8-bit codes, not {bits}-bit")


def _atom(atom_m: int | None) -> int:
    atom_m = ATOM_M if atom_m is None else atom_m
    if atom_m not in ATOM_M_CHOICES:
        raise ValueError(f"atom_m must be one of {ATOM_M_CHOICES}, not {atom_m}")
    return atom_m


def _check_shape(K: int, N: int) -> None:
    if K <= 0 or N <= 0 or K % BLOCK_K or N % BLOCK_N:
        raise ValueError(f"Machete needs K % {BLOCK_K} == 0 and N % {BLOCK_N} == 0, got K={K}, N={N}")


def _digits(x: int, shape: tuple[int, ...]) -> list[int]:
    """Column-major digits of ``x`` over ``shape``."""
    out = []
    for s in shape:
        out.append(x % s)
        x //= s
    return out


def _colmajor(digits: list[int], shape: tuple[int, ...]) -> int:
    idx, mul = 0, 1
    for d, s in zip(digits, shape, strict=True):
        idx += d * mul
        mul *= s
    return idx


def _invert_compact(idx: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int]:
    """Coordinate (one digit per mode) at which the bijective compact layout shape:stride gives ``idx``."""
    digits = [0] * len(shape)
    for i in sorted(range(len(shape)), key=lambda i: stride[i]):
        digits[i] = (idx // stride[i]) % shape[i]
    return digits


def block_offset_slow(n: int, k: int, bits: int, atom_m: int | None = None) -> int:
    """Storage offset (in codes) of (n, k) inside one 128x64 block, step by step as the CuTe composes it.

    ``ppblock_ilvd_TV_to_offset(ppblock_NK_to_TV(n, k))``: (n, k) -> WGMMA atom tile and rest ->
    inverse of ALayout_64x16 -> thread/value coordinate of ``thrfrg_A`` -> ordered storage offset
    -> 4-bit interleave.
    """
    _check_bits(bits)
    atom_m = _atom(atom_m)
    if not (0 <= n < BLOCK_N and 0 <= k < BLOCK_K):
        raise ValueError(f"(n, k) = ({n}, {k}) is outside a {BLOCK_N}x{BLOCK_K} block")
    # zipped_divide((128,64), (64,16)): atom coordinate and rest
    m_in, rest_m = n % _ATOM_M, n // _ATOM_M
    k_in, rest_k = k % _ATOM_K, k // _ATOM_K
    # ALayout maps (thr, val) -> m + 64*k; invert it as one compact layout over (thr..., val...)
    tv = _invert_compact(m_in + _ATOM_M * k_in, _A_THR_SHAPE + _A_VAL_SHAPE, _A_THR_STRIDE + _A_VAL_STRIDE)
    thr_v, frg_v = tv[:3], tv[3:]
    # zipped_divide(tv, (_, (ATOM_M, 1))): rest_m splits into ThrM (tile) and RestM; ThrK = 1
    thr_m, rest_m2 = rest_m % atom_m, rest_m // atom_m
    thr_shape = _A_THR_SHAPE + (atom_m, 1)
    val_shape = _A_VAL_SHAPE + ((BLOCK_N // _ATOM_M) // atom_m, BLOCK_K // _ATOM_K)
    t = _colmajor([*thr_v, thr_m, 0], thr_shape)
    v = _colmajor([*frg_v, rest_m2, rest_k], val_shape)
    nval = BLOCK_SIZE // (128 * atom_m)
    if bits == 4:  # FrgV (8 values) -> ((2,4),1):((4,1),8)
        ilv = _digits(v % 8, _ILV_SHAPE)
        v = 8 * (v // 8) + sum(d * s for d, s in zip(ilv, _ILV_STRIDE, strict=True))
    return nval * t + v


def prepack_offsets_slow(k: int, n: int, K: int, N: int, bits: int, atom_m: int | None = None) -> int:
    """Offset, in codes, of weight code (k, n) in the flat prepacked stream of a [K, N] weight.

    The index-based definition (python ints, one code at a time) that :func:`prepack_codes` must
    agree with; ``verify`` uses it on samples. Blocks are compact column-major over (N/128, K/64).
    """
    _check_shape(K, N)
    if not (0 <= k < K and 0 <= n < N):
        raise ValueError(f"(k, n) = ({k}, {n}) is outside [{K}, {N}]")
    block = n // BLOCK_N + (N // BLOCK_N) * (k // BLOCK_K)
    return BLOCK_SIZE * block + block_offset_slow(n % BLOCK_N, k % BLOCK_K, bits, atom_m)


def block_permutation(bits: int, atom_m: int | None = None) -> torch.Tensor:
    """``perm[e]`` = natural index ``k*128 + n`` of the code stored at offset ``e`` of a block (CPU, int64).

    Built in the forward direction, independently of :func:`block_offset_slow`: offset -> (thread,
    stored value) -> undo the interleave -> evaluate ``ppblock_TV_to_NK`` (each digit times its
    stride in the column-major (128, 64) block, whose index ``n + 128*k`` is the natural index).
    """
    _check_bits(bits)
    return _block_permutation(bits, _atom(atom_m)).clone()


@functools.lru_cache(maxsize=8)
def _block_permutation(bits: int, atom_m: int) -> torch.Tensor:
    e = torch.arange(BLOCK_SIZE, dtype=torch.int64)
    nval = BLOCK_SIZE // (128 * atom_m)
    t, p = e // nval, e % nval
    if bits == 4:
        p8 = p % 8  # stored at 4*(v%2) + v//2  =>  v = 2*(p%4) + p//4
        p = 8 * (p // 8) + 2 * (p8 % 4) + p8 // 4
    # thread digits over (4, 8, 4, ThrM): strides in the (128,64) block, atom strides scaled
    # by the atom tile (m + 64*k in the atom -> m + 128*k in the block)
    thr_stride = (256, 1, 16, 64)
    val_shape = (2, 2, 2, 2 // atom_m, 4)
    val_stride = (128, 8, 1024, 64, 2048)  # RestM has size 1 when atom_m == 2
    idx = torch.zeros_like(e)
    for s, st in zip((4, 8, 4, atom_m), thr_stride, strict=True):
        idx += (t % s) * st
        t = t // s
    for s, st in zip(val_shape, val_stride, strict=True):
        idx += (p % s) * st
        p = p // s
    return idx


def _tv_modes(bits: int, atom_m: int) -> list[tuple[int, int, int]]:
    """Flat modes of one block's TV layout as (size, stride in the natural index, stride in storage).

    The natural index of (n, k) in a block is ``n + 128*k`` (``make_layout((128,64))``); storage
    strides come from ``ppblock_ilvd_TV_to_offset`` (threads outer, values inner, 4-bit FrgV
    interleaved ``(2,4):(4,1)``, i.e. its three size-2 digits stored at strides 4, 1, 2). Every mode
    is a power of two, so the whole block map is a permutation of index digits.
    """
    nval = BLOCK_SIZE // (128 * atom_m)
    thr = [(4, 256), (8, 1), (4, 16), (atom_m, 64)]
    frg = [(2, 128), (2, 8), (2, 1024)]
    rest = [(2 // atom_m, 64), (4, 2048)]
    frg_off = (4, 1, 2) if bits == 4 else (1, 2, 4)
    modes, mul = [], nval
    for size, nat in thr:
        modes.append((size, nat, mul))
        mul *= size
    modes += [(size, nat, off) for (size, nat), off in zip(frg, frg_off, strict=True)]
    mul = 8
    for size, nat in rest:
        modes.append((size, nat, mul))
        mul *= size
    return [m for m in modes if m[0] > 1]


@functools.lru_cache(maxsize=8)
def _digit_plan(bits: int, atom_m: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """View sizes of k and n digits (high first), storage order of the digits (high first), as view dims.

    A chunk of codes is viewed as ``[rows, *k_sizes, nbn, *n_sizes]``; permuting it to
    ``[rows, nbn, *order]`` gives the prepacked stream of those block rows.
    """
    modes = _tv_modes(bits, atom_m)
    k_modes = sorted((m for m in modes if m[1] >= BLOCK_N), key=lambda m: -m[1])
    n_modes = sorted((m for m in modes if m[1] < BLOCK_N), key=lambda m: -m[1])
    dims = {m: 1 + i for i, m in enumerate(k_modes)}
    dims.update({m: 2 + len(k_modes) + i for i, m in enumerate(n_modes)})
    storage = sorted(modes, key=lambda m: -m[2])
    order = tuple(dims[m] for m in storage)
    return tuple(m[0] for m in k_modes), tuple(m[0] for m in n_modes), order, tuple(m[0] for m in storage)


def _chunk_blocks(nbn: int, budget_codes: int = 1 << 24) -> int:
    """K-block rows per chunk so one chunk holds about ``budget_codes`` codes."""
    return max(1, budget_codes // (nbn * BLOCK_SIZE))


def _check_little_endian() -> None:
    # int32 <-> bytes views below assume little-endian words, as on x86, ARM and CUDA
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("marlin_pack.machete needs a little-endian host")


def prepack_codes(codes: torch.Tensor, bits: int, atom_m: int | None = None) -> torch.Tensor:
    """``machete_prepack_B``'s output for the unsigned weight codes ``codes[K, N]`` (k = input feature).

    Returns a row-major contiguous int32 tensor ``[K*bits/32, N]`` on ``codes``' device whose flat
    storage is the prepacked stream. Works in chunks of K-block rows (~16M codes), each one
    permuted view written straight into the output, so the extra memory is about one chunk.
    ``codes`` may be any integer dtype holding values in ``[0, 2**bits)``.
    """
    _check_bits(bits)
    atom_m = _atom(atom_m)
    _check_little_endian()
    if codes.dim() != 2:
        raise ValueError(f"codes must be [K, N], got shape {tuple(codes.shape)}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    K, N = codes.shape
    _check_shape(K, N)
    lo = 0 if codes.dtype == torch.uint8 else int(codes.min())
    hi = int(codes.max())
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(f"{bits}-bit codes must lie in [0, {1 << bits}), got [{lo}, {hi}]")
    nbk, nbn = K // BLOCK_K, N // BLOCK_N
    k_sizes, n_sizes, order, storage = _digit_plan(bits, atom_m)
    out = torch.empty(K * bits // 32, N, dtype=torch.int32, device=codes.device)
    out_bytes = out.view(-1).view(torch.uint8)
    bytes_per_row = nbn * BLOCK_SIZE * bits // 8
    step = _chunk_blocks(nbn)
    for r0 in range(0, nbk, step):
        r1 = min(nbk, r0 + step)
        rows = r1 - r0
        chunk = codes[r0 * BLOCK_K : r1 * BLOCK_K]
        if chunk.dtype != torch.uint8:
            chunk = chunk.to(torch.uint8)
        stream = chunk.reshape(rows, *k_sizes, nbn, *n_sizes).permute(0, len(k_sizes) + 1, *order)
        target = out_bytes[r0 * bytes_per_row : r1 * bytes_per_row]
        if bits == 8:
            target.view(rows, nbn, *storage).copy_(stream)
        else:  # the lowest storage digit pairs codes into a byte: even offset low nibble
            assert storage[-1] == 2
            torch.bitwise_or(stream[..., 0], stream[..., 1] << 4, out=target.view(rows, nbn, *storage[:-1]))
    return out


def unpack_prepacked(words: torch.Tensor, bits: int, K: int, N: int, atom_m: int | None = None) -> torch.Tensor:
    """The inverse of :func:`prepack_codes`: codes ``[K, N]`` (uint8) from the prepacked words.

    Only the flat storage of ``words`` is read (its shape is ignored beyond the element count), as
    the op's output has no meaningful 2-D indexing.
    """
    _check_bits(bits)
    atom_m = _atom(atom_m)
    _check_little_endian()
    _check_shape(K, N)
    if words.dtype != torch.int32:
        raise TypeError(f"prepacked words must be int32, got {words.dtype}")
    if words.numel() * 32 != K * N * bits:
        raise ValueError(f"{words.numel()} words do not hold {K}x{N} {bits}-bit codes")
    nbk, nbn = K // BLOCK_K, N // BLOCK_N
    k_sizes, n_sizes, order, storage = _digit_plan(bits, atom_m)
    data = words.contiguous().view(-1).view(torch.uint8)
    out = torch.empty(K, N, dtype=torch.uint8, device=words.device)
    bytes_per_row = nbn * BLOCK_SIZE * bits // 8
    step = _chunk_blocks(nbn)
    for r0 in range(0, nbk, step):
        r1 = min(nbk, r0 + step)
        rows = r1 - r0
        # the same permuted view of the output rows, filled from the stream
        target = out[r0 * BLOCK_K : r1 * BLOCK_K].view(rows, *k_sizes, nbn, *n_sizes).permute(0, len(k_sizes) + 1, *order)
        src = data[r0 * bytes_per_row : r1 * bytes_per_row]
        if bits == 8:
            target.copy_(src.view(rows, nbn, *storage))
        else:
            src = src.view(rows, nbn, *storage[:-1])
            target[..., 0].copy_(src & 0xF)
            target[..., 1].copy_(src >> 4)
    return out


def gather_prepack_codes(codes: torch.Tensor, bits: int, atom_m: int | None = None) -> torch.Tensor:
    """:func:`prepack_codes` by an explicit gather through :func:`block_permutation` (slower; for checks).

    An independent route to the same words: the codes of each block are taken in the order the
    evaluated TV->NK layout gives, then packed with integer shifts.
    """
    _check_bits(bits)
    K, N = codes.shape
    _check_shape(K, N)
    nbk, nbn = K // BLOCK_K, N // BLOCK_N
    perm = block_permutation(bits, atom_m).to(codes.device)
    blocks = codes.to(torch.int64).reshape(nbk, BLOCK_K, nbn, BLOCK_N).permute(0, 2, 1, 3).reshape(nbk, nbn, BLOCK_SIZE)
    stream = blocks[:, :, perm].reshape(-1, 32 // bits)
    shifts = torch.arange(0, 32, bits, device=codes.device, dtype=torch.int64)
    words = (stream << shifts).sum(dim=1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).view(K * bits // 32, N)


def stream_code(words: torch.Tensor, offset: int, bits: int) -> int:
    """Code at ``offset`` of a prepacked (or any flat, lowest-bits-first) int32 word stream."""
    per = 32 // bits
    word = int(words.reshape(-1)[offset // per]) & 0xFFFFFFFF
    return (word >> (bits * (offset % per))) & ((1 << bits) - 1)


def unpack_k_packed(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[K, N]`` (uint8) from the op's input: int32 ``[K/P, N]`` packed along K, lowest bits first.

    Code (k, n) is bits ``bits*(k%P)`` of ``words[k//P, n]`` (GPTQ order; any strides).
    """
    _check_bits(bits)
    if words.dtype != torch.int32 or words.dim() != 2:
        raise TypeError(f"expected int32 [K/P, N] words, got {words.dtype} {tuple(words.shape)}")
    per, mask = 32 // bits, (1 << bits) - 1
    out = torch.empty(words.shape[0] * per, words.shape[1], dtype=torch.uint8, device=words.device)
    for i in range(per):
        out[i::per] = ((words >> (bits * i)) & mask).to(torch.uint8)
    return out


def pack_k(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`unpack_k_packed`: int32 ``[K/P, N]`` (contiguous) packed along K."""
    _check_bits(bits)
    per = 32 // bits
    if codes.dim() != 2 or codes.shape[0] % per:
        raise ValueError(f"codes must be [K, N] with K % {per} == 0, got {tuple(codes.shape)}")
    c = codes.to(torch.int32)
    out = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int32, device=codes.device)
    for i in range(per):
        out |= c[i::per] << (bits * i)  # int32 shifts wrap, as the word's top bits must
    return out


def prepack_b(words: torch.Tensor, bits: int, atom_m: int | None = None) -> torch.Tensor:
    """What ``ops.machete_prepack_B(words, ...)`` returns, for int32 ``[K/P, N]`` packed along K.

    The op's own shape checks are applied (K % 64, N % 128); it needs ``words.stride(0) == 1``,
    which this function does not (vLLM always passes ``w.t().contiguous().t()``).
    """
    return prepack_codes(unpack_k_packed(words, bits), bits, atom_m)


def machete_scales(scales: torch.Tensor) -> torch.Tensor:
    """The group scales Machete keeps: ``[G, N]`` (input groups, output features) contiguous, same dtype.

    ``transform_w_s`` views the parameter as (input_dim=0, output_dim=1) and calls
    ``.contiguous()``: a copy for compressed-tensors' ``[N, G]`` (pass ``.t()`` of it), none for
    GPTQ/AWQ's ``[G, N]``. Channelwise (group size -1) scales are ``[1, N]``.
    """
    if scales.dim() != 2:
        raise ValueError(f"scales must be [G, N], got shape {tuple(scales.shape)}")
    return scales.contiguous()


def machete_zero_points(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Zero points as Machete keeps them: ``(-1.0 * s * z.to(s.dtype)).contiguous()``, ``[G, N]``.

    ``zeros`` are the unsigned zero-point codes ``[G, N]`` (any integer dtype; vLLM unpacks them to
    int32), ``scales`` the transformed scales (:func:`machete_scales`). Same expression, same
    dtype steps as ``transform_w_zp``: the codes are cast to the scale dtype, then
    ``(-1.0 * s) * z`` is rounded once in that dtype (exact negation, one correctly rounded product,
    so CPU and GPU give the same bits).
    """
    if zeros.shape != scales.shape:
        raise ValueError(f"zero points {tuple(zeros.shape)} and scales {tuple(scales.shape)} differ in shape")
    if zeros.dtype.is_floating_point:
        raise TypeError(f"zero points must be integer codes, got {zeros.dtype}")
    return (-1.0 * scales * zeros.to(scales.dtype)).contiguous()
