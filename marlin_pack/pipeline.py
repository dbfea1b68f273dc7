"""Pipeline parallelism: which decoder layers each stage of a vLLM 0.33.0 engine builds (issue 51, groundwork).

vLLM gives stage ``s`` of ``P`` the layers ``[start, end)`` of its partition of ``L`` decoder layers: an
even split, with the remainder spread one layer each over the stages before the last, from the
second-to-last backwards (the last stage also holds the final norm and head); or the partition
``VLLM_PP_LAYER_PARTITION`` names (comma-separated sizes summing to ``L``). A pipeline rank of a
bundle then needs only the layers of its stage. Pure: no vLLM import (checked against vLLM's own
``get_pp_indices`` in the tests).
"""

from __future__ import annotations

import os

__all__ = ["PARTITION_ENV", "stage_partition", "stage_layers"]

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def stage_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """How many decoder layers each of ``pp_size`` stages builds (``partition``: ``VLLM_PP_LAYER_PARTITION``).

    Raises:
        ValueError: a partition that is not integers, has another count than ``pp_size`` or another sum
            than ``num_layers`` (vLLM refuses it too).
    """
    if pp_size < 1 or num_layers < 0:
        raise ValueError(f"pipeline of {pp_size} stages over {num_layers} layers is not a pipeline")
    if partition is not None:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={partition!r} is not comma-separated layer counts") from None
        if len(sizes) != pp_size:
            raise ValueError(f"{PARTITION_ENV}={partition!r} names {len(sizes)} stages, the engine runs {pp_size}")
        if sum(sizes) != num_layers:
            raise ValueError(f"{PARTITION_ENV}={partition!r} sums to {sum(sizes)} layers, the model has {num_layers}")
        return sizes
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for k in range(extra):  # second-to-last stage first, then backwards; the last stage never gets one
        sizes[pp_size - 2 - k] += 1
    return sizes


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, partition: str | None = None) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` stage ``pp_rank`` builds; ``partition`` defaults to the environment's."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside pipeline_parallel_size {pp_size}")
    sizes = stage_partition(num_layers, pp_size, os.environ.get(PARTITION_ENV) if partition is None else partition)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
