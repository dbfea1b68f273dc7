"""An engine's model load for marlin-pack: the GC heap frozen first, marlin-pack's scope entered.

vLLM's GPU model runner times "Model loading took" around a ``DeviceMemoryProfiler``
whose ``__enter__`` and ``__exit__`` run ``gc.collect()`` (three full collections inside the
span). Each walks every object the process tracks, ~0.35 s in an engine process on an H200
host, most of it the objects of the imports. The loader used to freeze the heap at its own
start, after the first of them; ``Worker.load_model`` is the last point before the span.
``gc.freeze`` moves what exists now to the permanent generation, as vLLM itself does after
warm-up; those objects (imports, configs) live as long as the process anyway.

The same wrapper is where an engine enters marlin-pack's scope (:mod:`.scope`) for its whole load
(the ``marlin_prepacked`` loader's create, copy and post-processing; an ``ipc_cache`` engine's key,
build and fill), which the ``construct`` and ``cache_key`` patches consult.

A ``speed`` patch (:mod:`.catalog`), only for ``--load-format marlin_prepacked`` and ``ipc_cache``
(:func:`.scope.uses_marlin_pack`): any other engine's ``load_model`` is vLLM's, called with the same
arguments, with nothing frozen and the scope not entered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from marlin_pack.vllm_plugin.patches import catalog, scope

__all__ = ["PATCHES"]


def _worker_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not scope.uses_marlin_pack(getattr(self, "vllm_config", None)):
            return original(self, *args, **kwargs)
        from marlin_pack.vllm_plugin.engine import freeze_gc_heap

        with scope.in_use():
            freeze_gc_heap()
            return original(self, *args, **kwargs)

    return load_model


PATCHES = catalog.patches(__name__, {"vllm.v1.worker.gpu_worker:Worker.load_model": _worker_load_model})
