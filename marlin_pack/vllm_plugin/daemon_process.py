"""The spawn target of ``vllm preload``'s daemon processes: :func:`run_daemon` stands in for vLLM's ``_run_daemon``.

``vllm preload`` starts its daemons with the ``spawn`` method, and they never call
``load_general_plugins()``; the ``weight_cache`` patches replace ``_run_daemon`` with
:func:`run_daemon`, which pickles by reference, so a spawned daemon imports this module and runs
that function first: it registers marlin-pack, then runs vLLM's own ``_run_daemon``.

A spawned process unpickles its target before its arguments, so a daemon imports this module
before vLLM's configuration (whose unpickling imports torch and vLLM, seconds before the daemon
builds its model): importing it starts the page-locking :mod:`.preload` planned for this
daemon, so that it runs while the daemon is still starting. Hence its imports stay light (no
torch, no vLLM, none of the patches at import).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from marlin_pack.vllm_plugin import preload

__all__ = ["DAEMON_MODULE", "RUN_DAEMON", "run_daemon", "stands_in_for", "started"]

logger = logging.getLogger("vllm.marlin_pack")

# vLLM's daemon module and the function run_daemon stands in for (the weight_cache patches replace it).
DAEMON_MODULE = "vllm.model_executor.model_loader.weight_cache.daemon"
RUN_DAEMON = f"{DAEMON_MODULE}:_run_daemon"
# When run_daemon began in this process (perf_counter), for the fill's log line.
_DAEMON_STARTED: list[float] = []
# vLLM's _run_daemon, as the registry found it when it installed run_daemon in its place.
_VLLM_RUN_DAEMON: list[Callable[..., Any]] = []

preload.start_from_environment()  # a no-op unless vllm preload planned it for this process


def started() -> float | None:
    """When :func:`run_daemon` began in this process (``time.perf_counter()``), if it did."""
    return _DAEMON_STARTED[0] if _DAEMON_STARTED else None


def stands_in_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """The registry's factory for the ``_run_daemon`` patch: note vLLM's function, stand in with :func:`run_daemon`."""
    _VLLM_RUN_DAEMON[:] = [original]
    return run_daemon


def run_daemon(*args: Any, **kwargs: Any) -> Any:
    """Spawn target standing in for vLLM's ``_run_daemon``: register marlin-pack, then run it.

    ``vllm preload`` pickles the target by reference
    (``marlin_pack.vllm_plugin.daemon_process.run_daemon``), so the spawned process
    imports this module and runs this function first.
    """
    _DAEMON_STARTED[:] = [time.perf_counter()]
    from marlin_pack.vllm_plugin import ensure_registered

    # Spawned daemons start with logging unconfigured; configure it as _run_daemon will, first,
    # so that marlin-pack's own messages (and registration errors) are shown.
    vllm_config = args[2] if len(args) > 2 else kwargs.get("vllm_config")
    if (logging_config := getattr(vllm_config, "logging_config", None)) is not None:
        from vllm.logger import configure_logging

        configure_logging(logging_config)
    installed = ensure_registered()  # also where register() ran before and its patches were removed
    module = importlib.import_module(DAEMON_MODULE)  # patched on import (or already): stands_in_for noted vLLM's
    target = _VLLM_RUN_DAEMON[0] if installed and _VLLM_RUN_DAEMON else module._run_daemon
    if target is run_daemon:  # never recurse, whatever state the registry is in
        raise RuntimeError("marlin-pack: vLLM's _run_daemon is not available in this daemon process")
    logger.info(
        "marlin-pack: plugin active in weight-cache daemon process %d (marlin_prepacked load format, "
        "AWQ/GPTQ Marlin layers accept pre-processed weights)",
        os.getpid(),
    )
    return target(*args, **kwargs)
