"""An engine's GPU worker starts the copy helpers that page-lock its bundle early, and stops them once the KV cache is sized;
it also starts the loader's decision ahead of the load (:mod:`marlin_pack.vllm_plugin.decide_ahead`).

vLLM's ``Worker.init_device`` sets up CUDA, NCCL and cuBLAS, takes the memory snapshot the KV
cache is sized from and builds the model runner; ``load_model`` then builds the model and the loader
copies the bundle. Starting the helpers (and their page-locking) as ``init_device`` begins puts that
work beside vLLM's own set-up and construction (:mod:`marlin_pack.vllm_plugin.preload`). The helpers'
contexts must be on the GPU at the snapshot and at the measurement after the profile run alike, so
they are stopped just before ``initialize_from_config`` allocates the KV cache, the first step after
both (and one vLLM takes for attention-free models too, which skip the profile run).

``speed`` patches (:mod:`.catalog`). Only ``--load-format marlin_prepacked`` engines for which
``preload.plan`` finds a plan (``engine_preload``, default on) are touched: ``plan`` answers None for any
other load format before it reads anything, and ``stop_after_memory_profile`` does nothing where no
engine helpers were started, so every other engine runs vLLM's methods with the same arguments and
nothing else happens (they run before and after the load, outside :mod:`.scope`'s ``in_use``; the load
format is the same test as :func:`.scope.uses_marlin_pack`, narrowed to ``marlin_prepacked``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from marlin_pack.vllm_plugin import decide_ahead, preload
from marlin_pack.vllm_plugin.patches import catalog

__all__ = ["PATCHES"]

def _init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        preload.start_in_worker(self)  # a no-op (None) unless this worker's loader will copy a bundle with helpers
        decide_ahead.start_in_worker(self)  # a no-op (None) unless this worker's loader is marlin_prepacked
        return original(self, *args, **kwargs)

    return init_device


def _initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        preload.stop_after_memory_profile()  # the KV cache is sized: the helpers' memory is free for it now
        return original(self, *args, **kwargs)

    return initialize_from_config


PATCHES = catalog.patches(
    __name__,
    {
        "vllm.v1.worker.gpu_worker:Worker.init_device": _init_device,
        "vllm.v1.worker.gpu_worker:Worker.initialize_from_config": _initialize_from_config,
    },
)
