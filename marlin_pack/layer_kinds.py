"""How vLLM shards a fused linear layer across tensor-parallel ranks: one word per parallel linear class.

Its own module, below both the manifest (:mod:`marlin_pack.schemas`, which records it) and the architecture table
(:mod:`marlin_pack.marlin.architectures`, which assigns it), so neither imports the other to name it.
"""

from __future__ import annotations

from enum import Enum, unique

__all__ = ["LayerKind"]


@unique
class LayerKind(str, Enum):
    """How vLLM shards a fused linear layer across tensor-parallel ranks."""

    qkv = "qkv"  # QKVParallelLinear
    merged_column = "merged-column"  # MergedColumnParallelLinear
    column = "column"  # ColumnParallelLinear
    row = "row"  # RowParallelLinear
    # ReplicatedLinear, or MergedColumnParallelLinear(disable_tp=True): every rank holds the whole layer
    # (DeepSeek's kv_a_proj_with_mqa / fused_qkv_a_proj)
    replicated = "replicated"
