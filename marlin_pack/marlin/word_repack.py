"""Marlin 4-bit weights built straight from the checkpoint's int32 words, with integer arithmetic.

:func:`~marlin_pack.marlin.repack.pack_marlin_weights` is the readable definition (codes, one
per byte, gathered by index); this module computes the same bytes about ten times faster by
never unpacking: every code is a nibble, and moving nibbles between words is a *delta swap*.

Why a delta swap is enough. Within one 16-row strip, index a nibble by its word and its position
in the word (3 bits: nibbles 0..7). Marlin's 4-bit order puts, in output word ``(c, a, b, j)`` of a
strip (column ``n0 = 64c + 16j + a``), nibble ``4l + 2bl + h`` = code (row ``8h + 2b + l``, column
``n0 + 8bl``). So the repack is a permutation of *address bits*: some bits that select the word in
the source select the nibble position in Marlin, and back. A delta swap between two word slots
``x``, ``y`` (differing in one word-address bit) with shift ``4 * 2^i`` exchanges that word bit with
nibble bit ``i``; three swaps exchange all three nibble bits, which is a whole 8x8 nibble
transpose. What remains is moving whole words into Marlin's order: plain copies of int32
(or int64) tensors with permuted strides, which torch does without index tensors.

Each swap runs on whole tensor halves (contiguous runs of thousands of words), in place, with
one temporary; all ops are ordinary torch ops, so the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from marlin_pack.marlin.packed_codes import ColumnParts, PackedCodes
from marlin_pack.marlin.repack import AWQ_SLOTS, pack_marlin_weights, pad2d
from marlin_pack.marlin.scratch import scratch as _workspace

__all__ = ["marlin_weights", "marlin_from_k_words", "marlin_from_k_words8", "marlin_from_awq_words"]

Words = torch.Tensor | tuple[torch.Tensor, ...]  # one tensor, or a fused layer's parts side by side along N


def _delta_swap(x: torch.Tensor, y: torch.Tensor, shift: int, mask: int, tmp: torch.Tensor) -> None:
    """Swap the bits of ``x`` at ``mask << shift`` with the bits of ``y`` at ``mask``, in place.

    ``mask`` has its top ``shift`` bits clear, so the sign bits of the arithmetic right shift
    of int32/int64 never reach the result.
    """
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_xor_(y).bitwise_and_(mask)
    y.bitwise_xor_(tmp)
    x.bitwise_xor_(tmp.bitwise_left_shift_(shift))


def _delta_swap_within(v: torch.Tensor, shift: int, mask: int, tmp: torch.Tensor) -> None:
    """Swap the bits of ``v`` at ``mask`` with those at ``mask << shift`` (same element), in place."""
    torch.bitwise_right_shift(v, shift, out=tmp)
    tmp.bitwise_xor_(v).bitwise_and_(mask)
    v.bitwise_xor_(tmp)
    v.bitwise_xor_(tmp.bitwise_left_shift_(shift))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two views of the same shape; on the CPU through numpy.

    The repack's moves are copies between permuted views. Measured on the 2-core VM (one thread,
    a 4 MiB piece of a llama-1gb gate_up weight): torch 4.4 ms and 2.1 ms for the two moves of
    :func:`marlin_from_k_words`, numpy 0.8 ms (its innermost contiguous run moved as one
    ``void`` item) and 1.1 ms. A GPU keeps torch's copy (one kernel).
    """
    if dst.device.type != "cpu":
        dst.copy_(src)
        return
    d, s = dst.numpy(), src.numpy()
    if d.ndim and d.shape[-1] > 1 and dst.stride(-1) == 1 and src.stride(-1) == 1:
        run = np.dtype((np.void, d.shape[-1] * d.itemsize))  # the contiguous innermost run, as one item
        d, s = d.view(run), s.view(run)
    np.copyto(d, s)


def _output(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``out`` (a caller's buffer, e.g. a writer's recycled one), checked, or a fresh int32 tensor of ``shape``."""
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=device)
    if out.dtype != torch.int32 or tuple(out.shape) != shape or not out.is_contiguous() or out.device != device:
        raise ValueError(f"internal error: output {out.dtype} {list(out.shape)} on {out.device}, need int32 {list(shape)} on {device}")
    return out


def _parts(words: Words) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """``words`` as a tuple of column parts, with the rows and the columns of their concatenation."""
    parts = words if isinstance(words, tuple) else (words,)
    return parts, parts[0].shape[0], sum(w.shape[1] for w in parts)


def _row_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` with unit column stride (a column block of a wider tensor stays a view; a transposed one is copied)."""
    return w if w.stride(-1) == 1 else w.contiguous()


def marlin_from_k_words(words: Words, out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit codes packed along K (GPTQ), ``[Kp/8, Np]`` int32, into Marlin's ``[Kp/16, 2*Np]``.

    A strip's source words are ``(h, n)``: rows ``8h..8h+7`` of column ``n``, nibble ``i`` = row
    ``8h + i``. With ``n = 64c + 16j + 8bl + a``, the four slots ``(h, bl)`` of each ``(c, j, a)``
    become Marlin words ``b = 2h + bl`` after swapping word bit h with nibble bit 0 (rows r/r+8),
    bl with nibble bit 1 and h with nibble bit 2. ``words``: one tensor, or a fused layer's parts
    side by side along N. ``out``: where to write the result (else fresh).
    """
    parts, rows, np_ = _parts(words)
    s, c = rows // 2, np_ // 64
    device = parts[0].device
    # Slots outermost within each 64-column block, so every swap works on contiguous halves.
    buf = _workspace("buf", (s, c, 2, 2, 4, 8), torch.int32, device)  # s c h bl j a
    if any(w.shape[1] % 64 for w in parts):  # a part splits a 64-column block: concatenate first
        parts = (torch.cat(parts, 1, out=_workspace("cat", (rows, np_), torch.int32, device)),)
    c0 = 0
    for w in parts:  # each part straight into its 64-column blocks (no concatenated copy first)
        cw = w.shape[1] // 64
        _copy(buf[:, c0 : c0 + cw], _row_major(w).view(s, 2, cw, 4, 2, 8).permute(0, 2, 1, 4, 3, 5))
        c0 += cw
    tmp = _workspace("tmp", (s, c, 2, 4, 8), torch.int32, device)
    _delta_swap(buf[:, :, 0], buf[:, :, 1], 4, 0x0F0F0F0F, tmp)  # h <-> nibble bit 0
    _delta_swap(buf[:, :, :, 0], buf[:, :, :, 1], 8, 0x00FF00FF, tmp)  # bl <-> nibble bit 1
    _delta_swap(buf[:, :, 0], buf[:, :, 1], 16, 0x0000FFFF, tmp)  # h <-> nibble bit 2
    # Slot (h, bl) of (c, j, a) is Marlin word (c, a, b = 2h + bl, j): a batched 16x8 transpose.
    result = _output(out, (s, 2 * np_), device)
    _copy(result.view(s * c, 8, 16), buf.view(s * c, 16, 8).transpose(1, 2))
    return result


def marlin_from_k_words8(words: Words, out: torch.Tensor | None = None) -> torch.Tensor:
    """8-bit codes packed along K (GPTQ), ``[Kp/4, Np]`` int32, into Marlin's ``[Kp/16, 4*Np]``.

    A strip's source words ``S0..S3`` of column ``n`` hold rows ``4w..4w+3``, one byte each. Marlin's
    word ``m`` of column ``n = 64q + 16j + 8bl + a`` holds rows ``(2m, 2m+8, 2m+1, 2m+9)``: bytes of
    ``S[m//2]`` and ``S[m//2 + 2]``, the low halves for even ``m``, the high for odd. Swapping the
    high half of ``S0`` with the low half of ``S2`` (and of ``S1``, ``S3``), then bytes 1 and 2 within
    every word, leaves word ``m = 2*wl + wh`` in slot ``S[2*wh + wl]``; a permuted copy puts the words
    in Marlin's order ``(q, a, m, j, bl)``. ``words`` and ``out``: as :func:`marlin_from_k_words`.
    """
    parts, rows, np_ = _parts(words)
    s = rows // 4
    device = parts[0].device
    buf = _workspace("buf", (rows, np_), torch.int32, device)
    torch.cat(parts, 1, out=buf)
    tmp = _workspace("tmp", (s, 2, np_), torch.int32, device)
    pairs = buf.view(s, 2, 2, np_)  # s wh wl n: word 2*wh + wl of the strip
    _delta_swap(pairs[:, 0], pairs[:, 1], 16, 0xFFFF, tmp)  # high half of S[wl] <-> low half of S[wl + 2]
    _delta_swap_within(buf, 8, 0x0000FF00, _workspace("tmp", (rows, np_), torch.int32, device))  # byte 1 <-> byte 2
    result = _output(out, (s, 4 * np_), device)
    q = np_ // 64
    _copy(result.view(s, q, 8, 2, 2, 4, 2), buf.view(s, 2, 2, q, 4, 2, 8).permute(0, 3, 6, 2, 1, 4, 5))
    return result


def marlin_from_awq_words(words: Words, out: torch.Tensor | None = None) -> torch.Tensor:
    """AutoAWQ 4-bit words (packed along N in :data:`AWQ_SLOTS` order), ``[Kp, Np/8]``, into ``[Kp/16, 2*Np]``.

    Source word ``(row 8h + 2b + l, column word 8c + 2j + bl)`` holds column ``a`` at nibble
    ``p`` with ``(p2, p1, p0) = (a0, a2, a1)``. Swapping word bits l, bl, h with nibble bits 2, 1, 0
    leaves Marlin word ``(c, a, b, j)`` in slot ``(h, l, bl) = (a1, a0, a2)``. ``out``: as
    :func:`marlin_from_k_words`; ``words`` too.
    """
    parts, kp, cols = _parts(words)
    s, c = kp // 16, cols // 8
    device = parts[0].device
    buf = _workspace("buf", (kp, cols), torch.int32, device)
    torch.cat(parts, 1, out=buf)  # the parts side by side: one pass, no concatenated copy first
    tmp = _workspace("tmp", (kp // 2, cols), torch.int32, device)
    rows = buf.view(s, 2, 4, 2, cols)  # s h b l: row 8h + 2b + l
    _delta_swap(rows[:, :, :, 0], rows[:, :, :, 1], 16, 0xFFFF, tmp.view(s, 2, 4, cols))  # l <-> nibble bit 2
    # bl is the lowest word bit: the pair (bl=0, bl=1) is one int64, so swap within it (by halves, as tmp is half).
    for half in buf.view(torch.int64).chunk(2):
        _delta_swap_within(half, 24, 0xFF00FF00, tmp.view(torch.int64))  # bl <-> nibble bit 1
    _delta_swap(rows[:, 0], rows[:, 1], 4, 0x0F0F0F0F, tmp.view(s, 4, 2, cols))  # h <-> nibble bit 0
    # buf is now [s, a1, b1, b0, a0, c, j, a2]; Marlin wants [s, c, a2, a1, a0, b1, b0, j].
    # Two moves with long runs: int64 pairs (j, a2) into (s, c) blocks, then a batched 64x2 transpose.
    pairs = _workspace("pairs", (s, c, 2, 2, 2, 2, 4), torch.int64, device)  # s c a1 a0 b1 b0 j
    _copy(pairs, buf.view(torch.int64).view(s, 2, 2, 2, 2, c, 4).permute(0, 5, 1, 4, 2, 3, 6))
    result = _output(out, (s, 2 * cols * 8), device)
    _copy(result.view(s * c, 2, 64), pairs.view(torch.int32).view(s * c, 64, 2).transpose(1, 2))
    return result


# Source bytes repacked per pass on the CPU. Every step of the word repack streams its whole input
# through memory; in pieces that stay in the caches the steps run faster (measured on one core of the
# 2-core VM, llama-1gb's four linears: GPTQ 197 ms per 8 layers in one pass, 138 ms in 4 MiB pieces,
# 147 ms in 2 MiB, 165 ms in 8 MiB; AWQ 213 ms against 174 ms).
_CPU_PIECE_BYTES = 4 << 20

RepackFn = Callable[[Words, "torch.Tensor | None"], torch.Tensor]


def _by_strips(fn: RepackFn, words: ColumnParts, rows_per_strip: int, out_cols: int, out: torch.Tensor | None) -> torch.Tensor:
    """``fn(words, out)``, on the CPU in pieces of whole 16-row strips (output row ``i`` is strip ``i``).

    The word repacks work strip by strip, so a piece's output is exactly its strips' rows; each
    piece's parts go straight into the repack's first buffer, which stays in the caches.
    On a GPU one pass is best (fewer kernel launches, and the caches do not decide there).
    """
    strips = words.word_rows // rows_per_strip
    per_piece = max(1, _CPU_PIECE_BYTES // max(1, rows_per_strip * words.word_cols * 4))
    if words.device.type != "cpu" or strips <= per_piece:
        return fn(words.row_views(0, words.word_rows), out)
    result = _output(out, (strips, out_cols), words.device)
    for s0 in range(0, strips, per_piece):
        s1 = min(strips, s0 + per_piece)
        fn(words.row_views(s0 * rows_per_strip, s1 * rows_per_strip), result[s0:s1])
    return result


def _padded_words(codes: PackedCodes | ColumnParts, rows: int, cols: int) -> ColumnParts:
    """The words zero-padded to ``[rows, cols]``, as parts; :class:`ColumnParts` as they are (only unpadded ones get here)."""
    if isinstance(codes, ColumnParts):
        return codes
    return ColumnParts((PackedCodes(pad2d(codes.words, rows, cols), codes.bits, codes.along, codes.slots),))


def marlin_weights(
    codes: PackedCodes | ColumnParts, padded_k: int, padded_n: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Marlin-repacked weights ``[Kp/16, Np*bits/2]`` of ``codes`` zero-padded to ``[Kp, Np]``.

    Words packed along K (4- and 8-bit), or AWQ's words, take the word-level path; anything else
    (unpacked codes) the generic :func:`~marlin_pack.marlin.repack.pack_marlin_weights`. Both give
    the same bytes (tests/marlin). ``out``: an int32 tensor of that shape to write the result
    into (returned), else the result is fresh memory. :class:`ColumnParts` that need no padding
    are concatenated piece by piece (see :func:`_by_strips`).
    """
    if isinstance(codes, ColumnParts) and codes.shape != (padded_k, padded_n):
        codes = codes.concatenated()  # padded as a whole
    if codes.bits == 4 and codes.along == "k":
        return _by_strips(marlin_from_k_words, _padded_words(codes, padded_k // 8, padded_n), 2, padded_n * 2, out)
    if codes.bits == 8 and codes.along == "k":
        return _by_strips(marlin_from_k_words8, _padded_words(codes, padded_k // 4, padded_n), 4, padded_n * 4, out)
    if codes.bits == 4 and codes.along == "n" and codes.slots == AWQ_SLOTS:
        return _by_strips(marlin_from_awq_words, _padded_words(codes, padded_k, padded_n // 8), 16, padded_n * 2, out)
    packed = pack_marlin_weights(pad2d(codes.unpack(), padded_k, padded_n), codes.bits)
    if out is None:
        return packed
    return _output(out, tuple(packed.shape), packed.device).copy_(packed)
