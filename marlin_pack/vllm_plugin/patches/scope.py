"""Whether marlin-pack's own path is running in this process: the one switch the speed patches consult.

vLLM calls :func:`marlin_pack.vllm_plugin.register` in *every* process it starts (the
``vllm.general_plugins`` entry point), so every patch is installed in every engine, API server and
worker, whether or not it uses marlin-pack. Such a process must behave exactly as without the plugin.
The correctness and weight-cache patches act only on what marlin-pack's paths produce (a layer the
loader marked, weights under vLLM's ``weights_already_processed()``, a stub factory context the loader
enters, a kernel configuration the weight cache forced); the speed patches (``construct``, ``cache_key``)
would act on any model vLLM builds, so they do so only while :func:`active`.

The scope is *entered* (:func:`in_use`) where a process starts loading a model for marlin-pack:

* an engine's GPU worker, ``Worker.load_model``, when its load format is ``marlin_prepacked`` or
  ``ipc_cache`` (:func:`uses_marlin_pack`; the ``gc_freeze`` patch): the loader's create, copy and
  post-processing, or the ``ipc_cache`` key, build and fill;
* ``IpcModelLoader._build_model`` / ``_fallback_load`` (``weight_cache``), whichever runner calls them;
* a weight-cache daemon's ``WeightCacheDaemon.get_model`` (``weight_cache``): ``marlin-pack daemon`` and
  ``vllm preload`` daemons exist only to serve ``--load-format ipc_cache`` engines.

Outside (an ``auto`` engine, the API server, a ``vllm bench`` process) every speed patch's replacement
calls vLLM's original with the same arguments and does nothing else
(tests/vllm_plugin/patches/test_inert.py). The GPU worker's steps before and after its load
(``worker_preload``) are gated the same way by :func:`marlin_pack.vllm_plugin.preload.plan`, which
answers only for ``--load-format marlin_prepacked``.

Process-wide (a counter, not a context variable): a worker or daemon loads one model at a time, and what
vLLM runs on other threads during that load belongs to it. The speed paths build exactly what vLLM
builds, so a second, unrelated load overlapping in the same process would only be faster.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from marlin_pack._constants import LOAD_FORMAT

__all__ = ["LOAD_FORMATS", "active", "in_use", "pre_processed_here", "supports_in_scope", "uses_marlin_pack"]

# The load formats whose engines are marlin-pack's path (ipc_cache: marlin-pack makes it usable for AWQ/GPTQ).
LOAD_FORMATS = frozenset({LOAD_FORMAT, "ipc_cache"})

_LOCK = threading.Lock()
_DEPTH = [0]  # nesting depth of in_use() in this process (entries nest: the worker's load runs the IPC steps)


def active() -> bool:
    """Whether this process is inside one of marlin-pack's model loads (:func:`in_use`)."""
    return _DEPTH[0] > 0


@contextlib.contextmanager
def in_use() -> Iterator[None]:
    """Mark this process as running marlin-pack's path until the block ends (nests; exception-safe)."""
    with _LOCK:
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1


def uses_marlin_pack(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` (a ``VllmConfig``, or anything with ``load_config.load_format``) asks for one of
    :data:`LOAD_FORMATS`; False for None or a config without a load config."""
    load_config = getattr(vllm_config, "load_config", None)
    return str(getattr(load_config, "load_format", "")) in LOAD_FORMATS


def pre_processed_here() -> bool:
    """Whether final tensors are being post-processed for marlin-pack's weight-cache path: under vLLM's
    ``weights_already_processed()`` *and* inside :func:`in_use` (an ``ipc_cache`` engine's build, a daemon's fill).

    Elsewhere vLLM's own branch runs: from 0.34 ``reload_weights(is_checkpoint_format=False)`` post-processes under
    ``weights_already_processed()`` in any engine, and there every quant method behaves as without the plugin.
    """
    from vllm.model_executor.utils import is_weights_pre_processed

    return active() and bool(is_weights_pre_processed())


def supports_in_scope(ours: Callable[[Any], bool], original: Any) -> property:
    """A ``supports_pre_processed_weights`` property: ``ours`` inside :func:`in_use` (the weight cache's checks in an
    ``ipc_cache`` engine or a daemon), the release's own value elsewhere (``original``: the class's own property or
    value, None where it inherits ``QuantizeMethodBase``'s ``False``)."""

    def fget(self: Any) -> bool:
        if active():
            return ours(self)
        if isinstance(original, property):
            return bool(original.fget(self))  # type: ignore[misc]
        return bool(original) if original is not None else False

    return property(fget, doc=f"marlin-pack: {ours.__doc__ or ours.__name__} (inside marlin-pack's scope); vLLM's own elsewhere.")
