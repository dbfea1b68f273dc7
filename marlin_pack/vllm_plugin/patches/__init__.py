"""Every patch marlin-pack applies to vLLM 0.33.0, in one registry.

``post_processing``: the AWQ/GPTQ Marlin quant methods accept final tensors (from a bundle or
the weight cache); ``moe_post_processing``: likewise their Marlin MoE experts methods.
``placeholders``: the linear methods' ``create_weights`` makes placeholders without memory while the
loader builds a model it fills from a bundle.
``weight_cache``: Marlin for weight-cache processes, an unchanged cache key, the plugin in
``vllm preload``'s spawned daemons and the page-locking planned for them (``daemon_preload``).
``worker_preload``: an engine's GPU worker starts the helpers that page-lock its bundle as it sets up, and
stops them once the KV cache is sized (``engine_preload``).
``gc_freeze``: the GC heap frozen before vLLM's timed model loading for marlin-pack's start paths.
``construct``: vLLM's per-layer bookkeeping while it builds a model (GPTQ quant-config copies and
quantized-module lookups, reload records) made cheap for those paths; ``cache_key``: likewise the
checkpoint fingerprint of the weight cache's key. ``registry``: install (version guarded,
idempotent) and uninstall. Each patch names the upstream change that retires it.
"""

from __future__ import annotations

from marlin_pack._constants import TARGET_VLLM_VERSION
from marlin_pack.vllm_plugin.patches import (
    cache_key,
    construct,
    gc_freeze,
    moe_post_processing,
    placeholders,
    post_processing,
    weight_cache,
    worker_preload,
)
from marlin_pack.vllm_plugin.patches.registry import Patch, installed, uninstall_all
from marlin_pack.vllm_plugin.version_guard import vllm_version

__all__ = ["PATCHES", "Patch", "install", "installed", "uninstall_all"]

PATCHES: tuple[Patch, ...] = (
    *post_processing.PATCHES,
    *placeholders.PATCHES,
    *moe_post_processing.PATCHES,
    *weight_cache.PATCHES,
    *worker_preload.PATCHES,
    *gc_freeze.PATCHES,
    *construct.PATCHES,
    *cache_key.PATCHES,
)


def install() -> bool:
    """Install every patch (idempotent) if vLLM is exactly the targeted release; else log once.

    Imports the patched vLLM modules (the daemon's only when vLLM imports it).
    """
    from marlin_pack.vllm_plugin.patches import registry

    return registry.install_all(PATCHES, running=vllm_version(), targeted=TARGET_VLLM_VERSION)
