"""``patches.gc_freeze``: an engine's ``Worker.load_model`` for marlin-pack freezes the GC heap before vLLM's timed span
and runs inside marlin-pack's scope; any other engine's is vLLM's, with nothing frozen and no scope."""

from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace
from typing import Any

import pytest

from marlin_pack.vllm_plugin.patches import scope
from marlin_pack.vllm_plugin.patches.gc_freeze import _worker_load_model


@pytest.fixture
def unfrozen() -> Any:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(("load_format", "ours"), [("marlin_prepacked", True), ("ipc_cache", True), ("auto", False)])
def test_worker_load_model_freezes_and_enters_the_scope_for_our_load_formats(unfrozen: None, load_format: str, ours: bool) -> None:
    calls = []
    wrapped = _worker_load_model(lambda self, **kw: calls.append((kw, scope.active())) or "model")
    worker = SimpleNamespace(vllm_config=SimpleNamespace(load_config=SimpleNamespace(load_format=load_format)))
    _ = [[] for _ in range(10)]  # some tracked objects to freeze
    assert wrapped(worker, load_dummy_weights=False) == "model"
    assert calls == [({"load_dummy_weights": False}, ours)]
    assert (gc.get_freeze_count() > 0) is ours
    assert not scope.active()


@pytest.mark.parametrize(("load_format", "ours"), [("marlin_prepacked", True), ("ipc_cache", True), ("auto", False)])
def test_vllms_worker_load_model_runs_its_model_runner_in_the_scope(patched: Any, unfrozen: None, load_format: str,
                                                                    ours: bool) -> None:
    """vLLM's own ``Worker.load_model``, as installed: the model runner's load (the loader) sees the scope, for our
    load formats only; vLLM's own context managers still run around it."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, get_current_vllm_config_or_none
    from vllm.v1.worker.gpu_worker import Worker

    from marlin_pack.vllm_plugin.patches import registry

    assert registry.is_replacement(Worker.load_model)
    config = VllmConfig(device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format=load_format))
    seen: list[tuple[bool, bool, Any]] = []

    def runner_load_model(load_dummy_weights: bool) -> None:
        seen.append((load_dummy_weights, scope.active(), get_current_vllm_config_or_none()))

    worker = SimpleNamespace(
        vllm_config=config,
        model_runner=SimpleNamespace(load_model=runner_load_model),
        _maybe_get_memory_pool_context=lambda tag: contextlib.nullcontext(),
        _scoped_allocator_max_split=lambda max_split_size_mb: contextlib.nullcontext(),
        _external_weight_charges=SimpleNamespace(track=contextlib.nullcontext, fallback_bytes=0),  # vLLM 0.34.0
    )
    Worker.load_model(worker, load_dummy_weights=True)  # type: ignore[arg-type]
    assert seen == [(True, ours, config)]
    assert (gc.get_freeze_count() > 0) is ours and not scope.active()
