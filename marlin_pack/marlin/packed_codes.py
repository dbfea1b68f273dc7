"""Quantized weights as the checkpoint stores them: unsigned codes packed into int32 words.

Unpacking a 4-bit checkpoint into one code per byte and packing it again for Marlin moves
eight times the data the conversion needs. :class:`PackedCodes` keeps the checkpoint's words
instead and slices, concatenates and pads them as words; ``marlin.word_repack`` then builds
the Marlin words from them with integer arithmetic. Unpacked codes (:meth:`PackedCodes.unpack`)
remain available for the generic path and for verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from marlin_pack.marlin.repack import awq_to_natural, unpack_awq_cols, unpack_gptq_qweight
from marlin_pack.marlin.scratch import scratch

__all__ = ["ColumnParts", "PackedCodes", "cat_columns", "repeated_word"]

Along = Literal["k", "n", "none"]


@dataclass(frozen=True)
class PackedCodes:
    """Unsigned ``bits``-bit codes ``[K, N]`` in one of three layouts (``along``):

    - ``"k"``: int32 ``words [K*bits/32, N]``, code ``k`` in bits ``(k % per) * bits`` of word row
      ``k // per`` (GPTQ ``qweight``; compressed-tensors ``weight_packed`` transposed, as a view);
    - ``"n"``: int32 ``words [K, N*bits/32]``, packed along N with column ``c`` of each word in
      nibble slot ``slots[c]`` (AutoAWQ ``qweight``, ``slots`` = ``repack.AWQ_SLOTS``);
    - ``"none"``: uint8 ``words [K, N]``, one code per element in natural order (what is left when
      a slice does not fall on word boundaries).
    """

    words: torch.Tensor
    bits: int
    along: Along
    slots: tuple[int, ...] | None = None

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.words.shape
        if self.along == "k":
            return rows * self.per_word, cols
        if self.along == "n":
            return rows, cols * self.per_word
        return rows, cols

    @classmethod
    def from_codes(cls, codes: torch.Tensor, bits: int) -> PackedCodes:
        """Unpacked codes ``[K, N]`` (natural order) as ``along="none"``."""
        return cls(codes.to(torch.uint8), bits, "none")

    def unpack(self) -> torch.Tensor:
        """The codes as uint8 ``[K, N]``, natural column order."""
        if self.along == "k":
            return unpack_gptq_qweight(self.words, self.bits)
        if self.along == "n":
            codes = unpack_awq_cols(self.words)
            return codes if self.slots is None else awq_to_natural(codes)
        return self.words

    def block(self, k0: int, k: int, n0: int, n: int) -> PackedCodes:
        """Codes ``[k0:k0+k, n0:n0+n]``: a view of the words when the block falls on word
        boundaries along the packed dimension, else unpacked (``along="none"``)."""
        per = self.per_word
        if self.along == "k" and k0 % per == 0 and k % per == 0:
            return PackedCodes(self.words[k0 // per : (k0 + k) // per, n0 : n0 + n], self.bits, "k")
        if self.along == "n" and n0 % per == 0 and n % per == 0:
            return PackedCodes(self.words[k0 : k0 + k, n0 // per : (n0 + n) // per], self.bits, "n", self.slots)
        if self.along == "none":
            return PackedCodes(self.words[k0 : k0 + k, n0 : n0 + n], self.bits, "none")
        return PackedCodes.from_codes(self.unpack()[k0 : k0 + k, n0 : n0 + n], self.bits)


@dataclass(frozen=True)
class ColumnParts:
    """Packed codes of one layout side by side along N, not copied together (a fused layer's parts).

    The repack (:func:`~marlin_pack.marlin.word_repack.marlin_weights`) copies them, a piece of rows
    at a time, straight into its first buffer: a concatenated copy would cost one more pass through
    memory for most of a model's bytes (the fused layers).
    """

    parts: tuple[PackedCodes, ...]

    @property
    def bits(self) -> int:
        return self.parts[0].bits

    @property
    def along(self) -> Along:
        return self.parts[0].along

    @property
    def slots(self) -> tuple[int, ...] | None:
        return self.parts[0].slots

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].shape[0], sum(p.shape[1] for p in self.parts)

    @property
    def word_rows(self) -> int:
        return self.parts[0].words.shape[0]

    @property
    def word_cols(self) -> int:
        return sum(p.words.shape[1] for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].words.device

    def unpack(self) -> torch.Tensor:
        """The codes as uint8 ``[K, N]``, natural column order (see :meth:`PackedCodes.unpack`)."""
        return torch.cat([p.unpack() for p in self.parts], 1)

    def row_views(self, r0: int, r1: int) -> tuple[torch.Tensor, ...]:
        """Word rows ``r0:r1`` of each part: views, side by side along N (the repack copies them in place)."""
        return tuple(p.words[r0:r1] for p in self.parts)

    def concatenated(self) -> PackedCodes:
        """All of it as one :class:`PackedCodes`: a single part as it is, else in this thread's scratch buffer
        (valid until the next call on the thread)."""
        if len(self.parts) == 1:
            return self.parts[0]
        words = [p.words for p in self.parts]
        out = scratch("cat_columns", (words[0].shape[0], sum(w.shape[1] for w in words)), words[0].dtype, words[0].device)
        return PackedCodes(torch.cat(words, 1, out=out), self.bits, self.along, self.slots)


def cat_columns(parts: list[PackedCodes], lazy: bool = False) -> PackedCodes | ColumnParts:
    """Concatenate along N (fused layers): as words when every part shares one packed layout.

    ``lazy``: return those words as :class:`ColumnParts` (views of the parts, concatenated by the
    repack piece by piece) instead of copying them together; for a converter that consumes each
    result at once.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(p.along == first.along and p.slots == first.slots for p in parts) and first.along != "none":
        if lazy:
            return ColumnParts(tuple(parts))
        return PackedCodes(torch.cat([p.words for p in parts], 1), first.bits, first.along, first.slots)
    return PackedCodes.from_codes(torch.cat([p.unpack() for p in parts], 1), first.bits)


def repeated_word(code: int, bits: int) -> int:
    """The signed int32 word holding ``code`` in every ``bits``-bit slot (what symmetric GPTQ ``qzeros`` hold)."""
    word = 0
    for i in range(32 // bits):
        word |= code << (bits * i)
    return word - (1 << 32) if word >= 1 << 31 else word
