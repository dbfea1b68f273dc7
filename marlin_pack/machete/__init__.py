"""vLLM's Machete (SM90) weight layout, computed offline without the engine.

:mod:`.layout` gives the tensors ``MacheteLinearKernel.process_weights_after_loading`` keeps
(prepacked codes, scales, pre-scaled zero points); :mod:`.supports` says which layers vLLM gives
to Machete at all.
"""

from .layout import (
    ATOM_M,
    BLOCK_K,
    BLOCK_N,
    block_offset_slow,
    block_permutation,
    machete_scales,
    machete_zero_points,
    pack_k,
    prepack_b,
    prepack_codes,
    prepack_offsets_slow,
    stream_code,
    unpack_k_packed,
    unpack_prepacked,
)
from .supports import machete_supports

__all__ = [
    "ATOM_M",
    "BLOCK_K",
    "BLOCK_N",
    "block_offset_slow",
    "block_permutation",
    "machete_scales",
    "machete_supports",
    "machete_zero_points",
    "pack_k",
    "prepack_b",
    "prepack_codes",
    "prepack_offsets_slow",
    "stream_code",
    "unpack_k_packed",
    "unpack_prepacked",
]
