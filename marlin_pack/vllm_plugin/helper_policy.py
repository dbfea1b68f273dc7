"""When the ``marlin_prepacked`` loader copies with helper processes, and when they start.

In an engine the loader starts its copy helpers (:class:`~.copy_helpers.HelperPool`) as vLLM asks
it to build the model; the rank file's copy then waits ~0.25 s for their CUDA contexts. A
weight-cache daemon's process spends 0.3-0.4 s before its fill with nothing for the GPU to do:
registering marlin-pack (which imports vLLM's model-loading modules) and vLLM's daemon set-up.
:func:`start_early` starts the helpers there (from ``run_daemon``, first), and the loader
:func:`claim_early`\\ s them when it would start its own; the daemon's fill :func:`discard_early`\\ s
a pool nobody claimed (a draft model, a bundle not used, a mismatch of settings).

No vLLM import: the early start runs before the loader module is imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.errors import BundleError
from marlin_pack.vllm_plugin.copy_helpers import DEFAULT_PROCESSES, HelperPool
from marlin_pack.vllm_plugin.gpu_reader import resolve_mode
from marlin_pack.vllm_plugin.options import LoaderOptions, parse_extra_config

__all__ = ["PoolKey", "claim_early", "discard_early", "helpers_help", "pool_key", "start_early", "uses_helpers"]

logger = logging.getLogger("vllm.marlin_pack")

# io_mode auto starts copy helpers only with this many usable cores (4 helpers x 4 threads measured best on 16).
HELPER_MIN_CORES = 8

# (count, CUDA device index, staging threads, defer unregister, nice): what a HelperPool is started with.
PoolKey = tuple[int, int, int, bool, int]
# The pool start_early started and nobody has claimed yet, with its key.
_EARLY: list[tuple[PoolKey, HelperPool]] = []


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


def pool_key(options: LoaderOptions, device_index: int) -> PoolKey:
    """What the loader starts its helpers with, under ``options``, for CUDA device ``device_index``."""
    return (options.io_processes or DEFAULT_PROCESSES, device_index, options.io_staged, options.io_defer_unregister,
            options.io_helper_nice)


def start_early(vllm_config: Any, device_index: int, start: Callable[..., HelperPool] = HelperPool) -> HelperPool | None:
    """In a weight-cache daemon process, as it begins: start the copy helpers its fill will use.

    Only where the loader would start them itself (load format ``marlin_prepacked`` on CUDA,
    ``io_early_helpers`` on, ``io_mode`` ``processes``, or ``auto`` where :func:`helpers_help`
    and the bundle directory is not on a tmpfs of 4 KiB pages); never raises: anything unclear
    (unparsable options, a model whose bundle is not found) leaves the start to the loader, which
    reports it. What the loader checks later (GPU memory for the contexts) may still turn the
    pool down: it then ends.
    """
    try:
        load = vllm_config.load_config
        if load.load_format != LOAD_FORMAT or getattr(vllm_config.device_config, "device_type", None) != "cuda":
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
    except (ValueError, BundleError, AttributeError) as e:
        logger.debug("marlin-pack: copy helpers not started early (%s)", e)
        return None
    discard_early()
    key = pool_key(options, device_index)
    count, _, staged, defer_unregister, nice = key
    pool = start(count, device_index, staged=staged, defer_unregister=defer_unregister, nice=nice)
    _EARLY.append((key, pool))
    logger.info("marlin-pack: %d copy helpers started for the weight-cache daemon's fill (device %d)", count, device_index)
    return pool


def claim_early(key: PoolKey) -> HelperPool | None:
    """The pool :func:`start_early` started, if it was started as ``key`` says (then it is the caller's);
    a pool started otherwise ends."""
    if not _EARLY:
        return None
    started, pool = _EARLY.pop()
    if started == key:
        return pool
    logger.info("marlin-pack: the copy helpers started early do not match the loader's settings %s; starting others", key)
    pool.close(wait=False)
    return None


def discard_early() -> None:
    """End a pool :func:`start_early` started that nobody claimed (without waiting for its exit)."""
    while _EARLY:
        _EARLY.pop()[1].close(wait=False)
