"""``patches.cache_key``: the weight-cache key's checkpoint fingerprint reads the index once per file name,
and finds exactly the files (or raises exactly the errors) vLLM's ``filter_duplicate_safetensors_files`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plugin_fakes
import pytest

from marlin_pack.vllm_plugin.patches import cache_key, scope

INDEX = "model.safetensors.index.json"


def _folder(tmp_path: Path, files: list[str], weight_map: Any | None) -> tuple[list[str], str]:
    for name in files:
        (tmp_path / name).write_bytes(b"")
    if weight_map is not None:
        (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(str(tmp_path / f) for f in files), str(tmp_path)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "returned", fn(*args)
    except Exception as e:
        return type(e).__name__, str(e)


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
CASES = {
    "sharded": (SHARDS, {f"layers.{i}.w": SHARDS[i % 2] for i in range(50)}),
    "consolidated-beside-shards": ([*SHARDS, "consolidated.safetensors"], {f"layers.{i}.w": SHARDS[i % 2] for i in range(9)}),
    "no-index": (SHARDS, None),
    "missing-shard": (SHARDS[:1], {"a": SHARDS[0], "b": SHARDS[1]}),
    "not-a-map": (SHARDS, ["a", "b"]),
    "not-names": (SHARDS, {"a": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_files_and_errors_as_vllm(tmp_path: Path, case: str) -> None:
    from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files as stock

    files, folder = _folder(tmp_path, *CASES[case])
    patched = cache_key._filter(stock)
    with scope.in_use():  # an ipc_cache engine's load
        assert _outcome(patched, list(files), folder, INDEX) == _outcome(stock, list(files), folder, INDEX)
    # The valid indexes are answered without vLLM's per-tensor loop; the rest by vLLM itself.
    assert (cache_key.indexed_files(list(files), folder, INDEX) is not None) is (case in ("sharded", "consolidated-beside-shards"))


def test_weight_cache_key_unchanged(patched: Any, make_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key an ipc_cache engine sends (inside marlin-pack's scope) equals stock vLLM's (the daemon's is computed
    outside it, in WeightCacheDaemon.__init__)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config

    model = make_checkpoint("gptq", sharded=True)
    assert (model / INDEX).is_file()
    mc = ModelConfig(model=str(model), dtype="float16", skip_tokenizer_init=True, enforce_eager=True)

    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="ipc_cache"))

    def key() -> Any:
        with set_current_vllm_config(vc):
            return plugin_fakes.weight_cache_key(mc, 1, 0, cache_config=vc.cache_config, kernel_config=vc.kernel_config)

    answered: list[bool] = []
    indexed = cache_key.indexed_files
    monkeypatch.setattr(cache_key, "indexed_files", lambda *a: answered.append(True) or indexed(*a))
    stock = key()
    assert answered == []  # outside the scope: vLLM's own function
    with scope.in_use():
        engine = key()
    assert answered == [True] and engine == stock
