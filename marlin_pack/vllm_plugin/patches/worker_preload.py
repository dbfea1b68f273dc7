"""An engine's GPU worker starts the copy helpers that page-lock its bundle early, and stops them once the KV cache is sized.

vLLM 0.33.0's ``Worker.init_device`` sets up CUDA, NCCL and cuBLAS, takes the memory snapshot the KV
cache is sized from and builds the model runner; ``load_model`` then builds the model and the loader
copies the bundle. Starting the helpers (and their page-locking) as ``init_device`` begins puts that
work beside vLLM's own set-up and construction (:mod:`marlin_pack.vllm_plugin.preload`). The helpers'
contexts must be on the GPU at the snapshot and at the measurement after the profile run alike, so
they are stopped just before ``initialize_from_config`` allocates the KV cache, the first step after
both (and one vLLM takes for attention-free models too, which skip the profile run).

Only ``--load-format marlin_prepacked`` engines for which ``preload.plan`` finds a plan
(``engine_preload``, default on) are touched; every other engine runs vLLM's methods unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from marlin_pack.vllm_plugin import preload
from marlin_pack.vllm_plugin.patches.registry import Patch

__all__ = ["PATCHES"]

_REMOVE_WHEN = "vLLM gives model loaders a hook before its GPU worker's init_device and one after its memory profile"


def _init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        preload.start_in_worker(self)  # a no-op (None) unless this worker's loader will copy a bundle with helpers
        return original(self, *args, **kwargs)

    return init_device


def _initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        preload.stop_after_memory_profile()  # the KV cache is sized: the helpers' memory is free for it now
        return original(self, *args, **kwargs)

    return initialize_from_config


PATCHES = (
    Patch("vllm.v1.worker.gpu_worker:Worker.init_device", _init_device, remove_when=_REMOVE_WHEN, deferred=True),
    Patch("vllm.v1.worker.gpu_worker:Worker.initialize_from_config", _initialize_from_config, remove_when=_REMOVE_WHEN, deferred=True),
)
