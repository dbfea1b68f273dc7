"""Warm a weight-cache daemon up while vLLM initialises it: what its first ``create_model`` pays once.

A daemon process is spawned bare. Before it loads its model, vLLM builds the daemon (its cache
key, its distributed world); then the model's construction pays, on its own critical path, for
work that depends only on the configuration (py-spy of a 70B daemon fill, ~0.4-0.6 s of its
``create`` phase):

* importing the model's module and the attention backends vLLM tries for it;
* creating the GPU's CUDA context (the loader's first ``torch.cuda.mem_get_info``);
* loading the CUDA kernels of the first operations on the device (the rotary embedding's
  cos/sin cache: ``arange``, ``pow``, ``einsum``, ``cos``, ``sin``, ``cat``);
* starting the copy helpers (``processes`` mode), ~0.25 s until they are ready, on the copy's path.

:func:`start` does this on a thread, beside vLLM's initialisation. The loader waits for the thread
(:func:`wait`, inside the fill's time) once it has started the copy and before vLLM builds the
model: a module is never imported by two threads at once. It takes the helpers
(:func:`take_helpers`) if they are the ones it would start; the fill closes any it did not take
(:func:`discard_helpers`). Every step is best effort: a failure is named in the log line and the
daemon goes on as it would have (paying the cost itself).

Option ``daemon_prewarm`` (``--model-loader-extra-config``, default true) turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

__all__ = ["discard_helpers", "start", "take_helpers", "wait"]

logger = logging.getLogger("vllm.marlin_pack")

_THREAD: threading.Thread | None = None
_HELPERS: list[Any] = []  # the HelperPool started for the loader, until it takes it
_DONE: dict[str, str] = {}  # step -> "0.12 s", or "failed (RuntimeError)"


def start(vllm_config: Any, local_rank: int) -> threading.Thread | None:
    """Start warming up for ``vllm_config`` on CUDA device ``local_rank``; None if turned off."""
    global _THREAD
    if not _wanted(vllm_config):
        return None
    _DONE.clear()
    _THREAD = threading.Thread(target=_run, args=(vllm_config, local_rank), name="marlin-pack-prewarm", daemon=True)
    _THREAD.start()
    return _THREAD


def wait() -> float:
    """Wait for the warm-up thread, if one runs; the seconds waited."""
    global _THREAD
    thread, _THREAD = _THREAD, None
    if thread is None:
        return 0.0
    t0 = time.perf_counter()
    thread.join()
    waited = time.perf_counter() - t0
    logger.info(
        "marlin-pack: daemon warm-up (%s) done; the fill waited %.2f s for it",
        ", ".join(f"{k} {_DONE[k]}" for k in _STEPS if k in _DONE) or "nothing done",
        waited,
    )
    return waited


def take_helpers() -> Any:
    """The copy helpers started here (a ``HelperPool``), now the caller's to use and close; or None."""
    return _HELPERS.pop() if _HELPERS else None


def discard_helpers() -> None:
    """Close helpers started here that the loader did not take (it loaded another way)."""
    while _HELPERS:
        _HELPERS.pop().close(wait=False)


def _wanted(vllm_config: Any) -> bool:
    from marlin_pack._constants import LOAD_FORMAT

    load_config = getattr(vllm_config, "load_config", None)
    if getattr(load_config, "load_format", None) != LOAD_FORMAT:
        return False
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    return not (isinstance(extra, dict) and extra.get("daemon_prewarm") is False)


def _step(name: str, fn: Any, *args: Any) -> None:
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - best effort: the construction pays the cost instead
        logger.debug("marlin-pack: daemon warm-up step %s failed", name, exc_info=True)
        _DONE[name] = f"failed ({type(e).__name__})"
        return
    _DONE[name] = f"{time.perf_counter() - t0:.2f} s"


_STEPS = ("helpers", "cuda", "model module", "attention backends")  # the log line's order


def _run(vllm_config: Any, local_rank: int) -> None:
    _step("helpers", _helpers, vllm_config, local_rank)  # first: they start in processes of their own
    # The CUDA context (driver work, ~0.3 s on an H200) beside the imports (Python, ~0.25 s): the daemon's
    # own initialisation before the fill is short (0.3-0.5 s measured), and the fill waits for both.
    cuda = threading.Thread(target=_step, args=("cuda", _cuda, local_rank), name="marlin-pack-prewarm-cuda", daemon=True)
    cuda.start()
    _step("model module", _model_module, vllm_config.model_config)
    _step("attention backends", _attention_backends, vllm_config)
    cuda.join()


def _helpers(vllm_config: Any, local_rank: int) -> None:
    """The helper pool the loader would start (same settings), where it would start one."""
    from marlin_pack.vllm_plugin.copy_helpers import HelperPool
    from marlin_pack.vllm_plugin.loader import helpers_help
    from marlin_pack.vllm_plugin.options import parse_extra_config

    options = parse_extra_config(vllm_config.load_config.model_loader_extra_config or {})
    if options.io_mode not in ("auto", "processes"):
        return
    if options.io_mode == "auto" and not helpers_help(vllm_config, vllm_config.model_config):
        return
    _HELPERS.append(HelperPool(options.io_processes, local_rank, **HelperPool.settings_of(options)))


def _cuda(local_rank: int) -> None:
    """The device's primary context and the kernels of the first operations vLLM runs on it."""
    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.set_device(local_rank)  # this thread's current device only
    torch.cuda.mem_get_info(local_rank)
    device = torch.device("cuda", local_rank)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float, device=device) / 128))
    t = torch.arange(16, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv)
    torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    torch.cuda.synchronize(device)


def _model_module(model_config: Any) -> None:
    """Import the model's class (vLLM caches the resolution, keyed by the model's settings)."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    get_model_architecture(model_config)


def _attention_backends(vllm_config: Any) -> None:
    """Import the attention backends vLLM will try, in its own order, for this model on this GPU."""
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import _get_backend_priorities

    model_config = vllm_config.model_config
    kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    for backend in _get_backend_priorities(
        use_mla=bool(getattr(model_config, "use_mla", False)),
        device_capability=current_platform.get_device_capability(),
        kv_cache_dtype=kv_dtype,
        head_size=model_config.get_head_size(),
    ):
        with contextlib.suppress(ImportError, OSError):  # vLLM skips it too
            backend.get_class()
