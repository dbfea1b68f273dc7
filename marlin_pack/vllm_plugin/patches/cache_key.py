"""A cheaper checkpoint fingerprint for the weight cache's key, for marlin-pack's start paths.

An ``ipc_cache`` engine computes its ``WeightCacheKey`` inside "Model loading took";
``hash_checkpoint`` first asks ``filter_duplicate_safetensors_files`` which files the index
lists, and vLLM joins the directory to the file name of *every tensor* of the index to
find out: 74,739 ``os.path.join`` calls for Qwen3-30B-A3B (0.2 s of a 2-core machine's 0.34 s).
Joining each distinct file name once gives the same set, hence the same files (and, for a
missing file, vLLM's own error: it then runs itself).

Only vLLM's weight-cache module is patched (its imported name; the default loader keeps its
own). A ``speed`` patch (:mod:`.catalog`): it answers only inside marlin-pack's scope (:mod:`.scope`:
an ``ipc_cache`` engine's load, where the engine's key is computed); outside it, and wherever the
index is unusual, vLLM's function runs with the same arguments.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable

from marlin_pack.vllm_plugin.patches import catalog, scope

__all__ = ["PATCHES", "indexed_files"]


def indexed_files(hf_weights_files: list[str], hf_folder: str, index_file: str) -> list[str] | None:
    """``hf_weights_files`` restricted to the files the index lists, as vLLM computes it; None where
    vLLM's own function must decide (no index, an unusual one, or a listed file missing)."""
    index_path = os.path.join(hf_folder, index_file)
    if not os.path.isfile(index_path):
        return None
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        listed = {os.path.join(hf_folder, name) for name in set(weight_map.values())}
    except Exception:
        return None
    if not listed <= set(hf_weights_files):
        return None
    return [f for f in hf_weights_files if f in listed]


def _filter(original: Callable[[list[str], str, str], list[str]]) -> Callable[[list[str], str, str], list[str]]:
    @functools.wraps(original)
    def filter_duplicate_safetensors_files(hf_weights_files: list[str], hf_folder: str, index_file: str) -> list[str]:
        files = indexed_files(hf_weights_files, hf_folder, index_file) if scope.active() else None
        return original(hf_weights_files, hf_folder, index_file) if files is None else files

    return filter_duplicate_safetensors_files


PATCHES = catalog.patches(
    __name__,
    {"vllm.model_executor.model_loader.weight_cache.protocol:filter_duplicate_safetensors_files": _filter},
)
