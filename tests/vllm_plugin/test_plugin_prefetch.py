"""The ``prefetch`` patches: an ``ipc_cache`` engine's request to the daemon runs while it builds its model.

The patch factories are applied to stand-ins of vLLM's ``_state_for_key``, ``initialize_model`` and
``check_ipc_quant_support``, called in the order ``IpcModelLoader.load_model`` calls them. On the
GPU, tests/gpu/test_daemon_gpu.py runs real attaches, a disk fallback without a daemon and refusals
with these patches installed.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from marlin_pack.vllm_plugin.patches import prefetch


@pytest.fixture(autouse=True)
def nothing_pending() -> Any:
    """Each test starts and ends with no state asked for and unread in this context."""
    prefetch._PENDING.set(None)
    yield
    prefetch._PENDING.set(None)


@pytest.fixture
def states() -> Any:
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheState

    return WeightCacheState({"w": "entry"}, {"tied": "w"}, {"flag": True})


def _asker(answer: Any, asked: threading.Event | None = None, gate: threading.Event | None = None,
           threads: list[str] | None = None) -> Any:
    """A stand-in for vLLM's ``_state_for_key``: records its thread, waits for ``gate``, answers or raises."""

    def state_for_key(self: Any, cache_key: Any, *, is_reload: bool = False) -> Any:
        if threads is not None:
            threads.append(threading.current_thread().name)
        if asked is not None:
            asked.set()
        if gate is not None:
            assert gate.wait(10)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return state_for_key


def test_the_daemon_is_asked_before_the_construction_and_answers_after_it(states: Any) -> None:
    asked, gate, threads, checked = threading.Event(), threading.Event(), [], []
    state_for_key = prefetch._state_for_key(_asker(states, asked, gate, threads))

    def construct() -> str:
        assert asked.wait(10)  # the request is out before the model is built
        gate.set()  # the daemon answers only now, while the construction runs
        return "model"

    pending = state_for_key(SimpleNamespace(mode="zero_copy"), "key")
    assert isinstance(pending, prefetch.PendingState)
    assert prefetch._initialize_model(construct)() == "model"
    prefetch._check_quant_support(checked.append)("model")
    assert checked == ["model"]
    assert (pending.entries, pending.aliases, pending.attrs) == tuple(states)
    assert threads == ["marlin-pack-ipc-state"]


@pytest.mark.parametrize("mode, is_reload", [("copy", False), ("zero_copy", True)])
def test_copy_mode_and_reloads_ask_on_the_callers_thread(states: Any, mode: str, is_reload: bool) -> None:
    threads: list[str] = []
    state = prefetch._state_for_key(_asker(states, threads=threads))(SimpleNamespace(mode=mode), "key", is_reload=is_reload)
    assert state is states and threads == [threading.current_thread().name]


def test_a_daemon_error_comes_before_the_quant_check() -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import (
        UnsupportedQuantForIPCError,
        WeightCacheUnavailableError,
    )

    prefetch._state_for_key(_asker(WeightCacheUnavailableError("no daemon")))(SimpleNamespace(mode="zero_copy"), "key")
    assert prefetch._initialize_model(lambda: "model")() == "model"

    def refuse(model: Any) -> None:
        raise UnsupportedQuantForIPCError("layer x: refused")

    # vLLM asks before it checks: without a daemon the engine falls back (this error), it is not refused.
    with pytest.raises(WeightCacheUnavailableError, match="no daemon"):
        prefetch._check_quant_support(refuse)("model")
    with pytest.raises(UnsupportedQuantForIPCError):  # the error was raised once; the next load checks as usual
        prefetch._check_quant_support(refuse)("model")


def test_a_daemon_error_comes_before_a_construction_error(states: Any) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import CacheConfigMismatchError

    def broken() -> None:
        raise RuntimeError("construction failed")

    prefetch._state_for_key(_asker(CacheConfigMismatchError("tp_size")))(SimpleNamespace(mode="zero_copy"), "key")
    with pytest.raises(CacheConfigMismatchError, match="tp_size"):
        prefetch._initialize_model(broken)()

    pending = prefetch._state_for_key(_asker(states))(SimpleNamespace(mode="zero_copy"), "key")
    with pytest.raises(RuntimeError, match="construction failed"):  # the daemon answered: the construction's own error
        prefetch._initialize_model(broken)()
    assert pending.result() is states


def test_prefetch_patches_are_installed(patched: Any) -> None:
    from vllm.model_executor.model_loader.weight_cache import ipc_loader

    from marlin_pack.vllm_plugin.patches import registry

    for fn in (ipc_loader.IpcModelLoader._state_for_key, ipc_loader.initialize_model, ipc_loader.check_ipc_quant_support):
        assert registry.is_replacement(fn)
