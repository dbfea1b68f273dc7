"""The facts the I/O plan depends on, read from vLLM's configuration (duck-typed: vLLM is not imported here).

:func:`plan_for` is the only place a ``marlin_prepacked`` process makes its :class:`~marlin_pack.gpu.plan.IoPlan`:
the page-locking planned ahead of the copy (:mod:`.preload`) makes it once and the loader takes that one;
otherwise the loader makes it as it starts its copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from marlin_pack.gpu.gpu_room import gpu_room
from marlin_pack.gpu.plan import IoFacts, IoPlan, plan_io, usable_cores
from marlin_pack.io.files import in_base_memory_pages
from marlin_pack.io.residency import available_memory, cached_fraction, room_for, takes_direct_reads

__all__ = ["io_facts", "plan_for"]


def _legacy_ipc(model_config: Any, environ: dict[str, str] | os._Environ[str]) -> bool:
    """Device memory from PyTorch's ordinary allocator: legacy CUDA IPC cannot open what the sleep-mode
    allocator or ``expandable_segments`` hand out."""
    alloc = environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return not getattr(model_config, "enable_sleep_mode", False) and "expandable_segments:true" not in alloc


def io_facts(
    vllm_config: Any, model_config: Any, files: tuple[Path, Path], *, experts: bool, role: Literal["engine", "daemon"],
    preload: bool, device: int, gpu: bool = True,
) -> IoFacts:
    """:class:`IoFacts` for the rank file and common file ``files`` of an engine (or daemon) on CUDA device ``device``.

    ``gpu``: ask NVML for the device's memory (False where no GPU is used: the CPU tests).
    """
    rank_file, common_file = files
    rank_bytes = os.stat(rank_file).st_size
    return IoFacts(
        role=role,
        processes=int(vllm_config.parallel_config.world_size_across_dp),
        cores=usable_cores(),
        legacy_ipc=_legacy_ipc(model_config, os.environ),
        base_pages=in_base_memory_pages(rank_file),
        experts=experts,
        bundle_bytes=rank_bytes + os.stat(common_file).st_size,
        gpu=gpu_room(device) if gpu else None,
        utilization=float(vllm_config.cache_config.gpu_memory_utilization),
        preload=preload,
        cached=cached_fraction(rank_file),
        direct_reads=takes_direct_reads(rank_file),
        cache_room=room_for(rank_bytes, available_memory()),
    )


def plan_for(*args: Any, **kwargs: Any) -> IoPlan:
    """:func:`~marlin_pack.gpu.plan.plan_io` of :func:`io_facts` (same arguments)."""
    return plan_io(io_facts(*args, **kwargs))
