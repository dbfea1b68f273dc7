"""Every patch marlin-pack applies to vLLM, in one registry, grouped by purpose (each row says the releases it applies to).

What is patched, why (``correctness``, ``weight_cache``, ``speed``) and which upstream change retires
each patch is data, in :mod:`.catalog`; the modules below build the replacements of their rows:

* ``correctness`` (a bundle is loaded right): ``post_processing`` (the AWQ/GPTQ/compressed-tensors Marlin
  linear methods finish a layer the loader marked instead of re-processing it), ``moe_post_processing``
  (likewise their Marlin MoE experts methods), ``placeholders`` (placeholders without memory while the
  loader builds a model it fills from a bundle).
* ``weight_cache`` (vLLM's weight cache for those layers): ``post_processing`` / ``moe_post_processing``
  (``supports_pre_processed_weights`` and the pre-processed branch), ``weight_cache`` (Marlin for
  weight-cache processes with an unchanged key, compressed-tensors attention on ``meta``, the plugin in
  ``vllm preload``'s spawned daemons and the page-locking planned for them).
* ``speed`` (a faster start, inert outside marlin-pack's paths: :mod:`.scope`): ``gc_freeze`` (the GC heap
  frozen before vLLM's timed loading; an engine's scope entered), ``worker_preload`` (an engine's GPU worker
  starts the helpers that page-lock its bundle), ``construct`` (vLLM's per-layer bookkeeping while it builds
  a model), ``cache_key`` (the weight-cache key's checkpoint fingerprint).

``registry``: install (only on a release marlin-pack serves, idempotent) and uninstall. Importing this package imports neither
vLLM nor torch (``marlin-pack env`` lists :data:`.catalog.ROWS` through it); :data:`PATCHES` imports the
patch modules when first read, :func:`install` imports the patched vLLM modules.
"""

from __future__ import annotations

import importlib
from typing import Any

from marlin_pack.vllm_plugin.patches import catalog
from marlin_pack.vllm_plugin.patches.registry import PURPOSES, Patch, installed, uninstall_all

__all__ = ["PATCHES", "PURPOSES", "Patch", "for_release", "install", "installed", "uninstall_all"]

_LOADED: list[tuple[Patch, ...]] = []


def _patches() -> tuple[Patch, ...]:
    """Every provider's patches, in catalog order (each provider's module checks its rows as it builds them)."""
    if not _LOADED:
        by_target = {
            patch.target: patch
            for provider in catalog.PROVIDERS
            for patch in importlib.import_module(f"{__name__}.{provider}").PATCHES
        }
        _LOADED.append(tuple(by_target[row.target] for row in catalog.ROWS))
    return _LOADED[0]


def __getattr__(name: str) -> Any:
    if name == "PATCHES":
        return _patches()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install() -> bool:
    """Install every patch whose catalog row applies to the running vLLM release (idempotent), if marlin-pack serves
    that release (:mod:`..releases`); else log once and install nothing.

    Imports the patched vLLM modules (the daemon's and the GPU worker's only when vLLM imports them).
    """
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.patches import registry
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    running = vllm_version()
    if releases.release(running) is None:
        return registry.install_all((), running=running, served=False, reason=releases.unsupported_reason(running))
    return registry.install_all(for_release(running), running=running, served=True)


def for_release(version: str) -> tuple[Patch, ...]:
    """The patches whose catalog rows apply to the release ``version``, in catalog order."""
    return tuple(p for p, row in zip(_patches(), catalog.ROWS, strict=True) if row.applies_to(version))
