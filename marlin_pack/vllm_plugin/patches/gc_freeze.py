"""Freeze the GC heap before vLLM's model-loading span, for marlin-pack's start paths.

vLLM 0.33.0's GPU model runner times "Model loading took" around a ``DeviceMemoryProfiler``
whose ``__enter__`` and ``__exit__`` run ``gc.collect()`` (three full collections inside the
span). Each walks every object the process tracks, ~0.35 s in an engine process on an H200
host, most of it the objects of the imports. The loader used to freeze the heap at its own
start, after the first of them; ``Worker.load_model`` is the last point before the span.

Only for ``--load-format marlin_prepacked`` and ``ipc_cache`` (which marlin-pack makes usable
for AWQ/GPTQ): other engines keep vLLM's behaviour. ``gc.freeze`` moves what exists now to
the permanent generation, as vLLM itself does after warm-up; those objects (imports, configs)
live as long as the process anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.vllm_plugin.patches.registry import Patch

__all__ = ["FREEZING_LOAD_FORMATS", "PATCHES"]

FREEZING_LOAD_FORMATS = frozenset({LOAD_FORMAT, "ipc_cache"})


def _worker_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        load_config = getattr(getattr(self, "vllm_config", None), "load_config", None)
        if str(getattr(load_config, "load_format", "")) in FREEZING_LOAD_FORMATS:
            from marlin_pack.vllm_plugin.engine import freeze_gc_heap

            freeze_gc_heap()
        return original(self, *args, **kwargs)

    return load_model


PATCHES = (
    Patch(
        "vllm.v1.worker.gpu_worker:Worker.load_model",
        _worker_load_model,
        remove_when="vLLM's model runner stops running full gc.collect() inside the span 'Model loading took' reports",
        deferred=True,  # imported by vLLM only in GPU worker processes
    ),
)
