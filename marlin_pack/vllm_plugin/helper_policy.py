"""When the ``marlin_prepacked`` loader copies with helper processes, and when those start.

The loader's copy helpers (:class:`~.copy_helpers.HelperPool`) each create a CUDA context before
they can copy: ~0.25 s for four on an H200 host (the driver creates contexts one after another,
``benchmarks/bench_helpers_ready.py``). Started as vLLM begins building the model, that start sits
inside the copy, and so inside "Model loading took". In an engine, vLLM's worker builds its model
runner between its GPU memory snapshot and the model's loading: :func:`start_early` starts the
helpers there (patch ``patches/early_helpers.py``), the loader :func:`claim_early`\\ s them when it
would start its own, and whatever it did not claim ends when the load does (:func:`discard_early`).

Not earlier: vLLM sizes the KV cache from the free memory its snapshot saw, and helpers whose
contexts were up then, and gone after loading, would make it count their memory as free.

No vLLM import: decisions over the plain attributes of vLLM's config objects.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.errors import BundleError, CheckpointError
from marlin_pack.vllm_plugin.copy_helpers import DEFAULT_PROCESSES, HelperPool, exits_in_background
from marlin_pack.vllm_plugin.gpu_reader import resolve_mode
from marlin_pack.vllm_plugin.options import LoaderOptions, parse_extra_config

__all__ = [
    "PoolKey", "claim_early", "default_in_daemon", "discard_early", "helpers_help", "pool_key", "start_early", "uses_helpers",
]

logger = logging.getLogger("vllm.marlin_pack")

# io_mode auto starts copy helpers only with this many usable cores (4 helpers x 4 threads measured best on 16).
HELPER_MIN_CORES = 8

# (count, CUDA device index, staging threads, staging MiB, defer unregister, nice): what a HelperPool is started with.
PoolKey = tuple[int, int, int, int, bool, int]
# The pool start_early started and nobody has claimed yet: its key and its start (perf_counter).
_EARLY: list[tuple[PoolKey, HelperPool, float]] = []


def helpers_help(vllm_config: Any, model_config: Any) -> bool:
    """Whether ``io_mode: auto`` should copy a bundle with helper processes (``processes``).

    Only where that was measured to pay and to work: one engine process on the host's GPUs
    (TP=1, no pipeline or data parallelism: several ranks would each start helpers and contend
    for cores and page pins), enough cores, and device memory from PyTorch's ordinary
    allocator (the helpers open it with legacy CUDA IPC, which the sleep-mode allocator and
    ``expandable_segments`` do not support). Elsewhere ``auto`` stays ``registered``.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return (
        vllm_config.parallel_config.world_size_across_dp == 1
        and not model_config.enable_sleep_mode
        and "expandable_segments:true" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        and cores >= HELPER_MIN_CORES
    )


def uses_helpers(io_mode: str, path: Callable[[], Path], usable: Callable[[], bool]) -> bool:
    """Whether ``io_mode`` copies the bundle file at ``path()`` with helper processes (``processes``).

    ``auto`` does where helpers are ``usable()`` and the file is not on a tmpfs of 4 KiB pages
    (:func:`~.gpu_reader.resolve_mode`); both are asked only for ``auto``.
    """
    if io_mode != "auto":
        return io_mode == "processes"
    return resolve_mode(io_mode, path(), helpers=usable()) == "processes"


def default_in_daemon(option: bool | None, helpers: bool) -> bool:
    """An option whose default (None) is on in a weight-cache daemon's fill that copies with helpers,
    and off in an engine (or without helpers, where it was not measured); an explicit value wins.

    ``common_during_build`` with ``io_defer_unregister``: the helpers copy the rank file and the
    common tensors in one job each beside vLLM's construction and unregister the pages after it.
    A daemon does not wait for them to exit; an engine would (vLLM measures the free memory after
    loading), and there the 70B figures did not settle it (see docs/performance.md).
    """
    return exits_in_background() and helpers if option is None else option


def pool_key(options: LoaderOptions, device_index: int) -> PoolKey:
    """What the loader starts its helpers with, under ``options``, for CUDA device ``device_index``."""
    return (
        options.io_processes or DEFAULT_PROCESSES, device_index, options.io_staged, options.io_stage_mib,
        default_in_daemon(options.io_defer_unregister, helpers=True), options.io_helper_nice,
    )


def start_pool(key: PoolKey) -> HelperPool:
    """A :class:`HelperPool` started as ``key`` says."""
    count, device_index, staged, stage_mib, defer_unregister, nice = key
    return HelperPool(count, device_index, staged=staged, stage_mib=stage_mib, defer_unregister=defer_unregister, nice=nice)


def start_early(vllm_config: Any, device_index: int, start: Callable[[PoolKey], HelperPool] = start_pool) -> HelperPool | None:
    """In an engine's worker, before vLLM builds its model runner: start the copy helpers its load will use.

    Only where the loader would start them itself (load format ``marlin_prepacked`` on CUDA,
    ``io_early_helpers`` on, ``io_mode`` ``processes``, or ``auto`` where :func:`helpers_help`
    and the bundle directory is not on a tmpfs of 4 KiB pages). Never raises: anything unclear
    (unparsable options, a model whose bundle is not found) leaves the start to the loader, which
    reports it. What the loader checks later (the bundle's own files, GPU memory) may still turn
    the pool down: it then ends.
    """
    try:
        load = vllm_config.load_config
        if str(load.load_format) != LOAD_FORMAT or getattr(vllm_config.device_config, "device_type", None) != "cuda":
            return None
        options = parse_extra_config(load.model_loader_extra_config or {})
        if not options.io_early_helpers:
            return None
        model_config = vllm_config.model_config

        def bundle_dir() -> Path:
            from marlin_pack.vllm_plugin.decision import resolve_bundle_dir

            return resolve_bundle_dir(options, str(model_config.model), getattr(model_config, "revision", None))

        if not uses_helpers(options.io_mode, bundle_dir, lambda: helpers_help(vllm_config, model_config)):
            return None
    except (ValueError, OSError, BundleError, CheckpointError, AttributeError) as e:
        logger.debug("marlin-pack: copy helpers not started early (%s)", e)
        return None
    discard_early(wait=False)
    key = pool_key(options, device_index)
    pool = start(key)
    _EARLY.append((key, pool, time.perf_counter()))
    logger.info("marlin-pack: %d copy helpers started while vLLM builds its model runner (device %d)", key[0], device_index)
    return pool


def claim_early(key: PoolKey) -> tuple[HelperPool, float] | None:
    """The pool :func:`start_early` started, if it was started as ``key`` says (then it is the caller's),
    with the seconds since its start; a pool started otherwise ends (waited for, as the caller goes on in-process)."""
    if not _EARLY:
        return None
    started, pool, t0 = _EARLY.pop()
    if started == key:
        return pool, time.perf_counter() - t0
    logger.info("marlin-pack: the copy helpers started early do not match the loader's settings %s; starting others", key)
    pool.close(wait=True)
    return None


def discard_early(wait: bool = True) -> None:
    """End a pool :func:`start_early` started that nobody claimed.

    ``wait``: until the helpers have exited (their CUDA contexts hold GPU memory that vLLM must not
    see as used when it measures what is left after loading).
    """
    while _EARLY:
        _EARLY.pop()[1].close(wait=wait)
