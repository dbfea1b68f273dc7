"""The daemon warm-up (``vllm_plugin/prewarm.py``) on the CPU: what it does, when, and that it never fails a daemon.

The CUDA step has nothing to do without a GPU; the GPU daemon suite covers it (``tests/gpu/test_daemon_gpu.py``).
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from marlin_pack.vllm_plugin import prewarm


def _config(model_dir: Path, extra: dict[str, Any] | None = None, load_format: str = "marlin_prepacked") -> Any:
    from vllm.config import LoadConfig, ModelConfig

    model_config = ModelConfig(model=str(model_dir), dtype="float16", skip_tokenizer_init=True, enforce_eager=True)
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}),
    )


def test_warm_up_resolves_the_model_class_vllm_then_finds_cached(make_checkpoint, marlin_log: list[str]) -> None:
    """The model's module is imported and its class resolved on the thread; vLLM's own lookup is then a cache hit."""
    from vllm.model_executor.model_loader import utils

    config = _config(make_checkpoint("gptq", "tiny"))
    utils._MODEL_ARCH_BY_HASH.clear()
    thread = prewarm.start(config, 0)
    assert isinstance(thread, threading.Thread)
    assert prewarm.wait() >= 0.0
    assert not thread.is_alive()
    cached = list(utils._MODEL_ARCH_BY_HASH.values())
    assert len(cached) == 1 and cached[0][1] == "LlamaForCausalLM"
    assert cached[0][0].__module__ in sys.modules
    assert utils.get_model_architecture(config.model_config) is cached[0]  # the same resolution vLLM gets
    line = next(m for m in marlin_log if "daemon warm-up" in m)
    assert "model module" in line and "the fill waited" in line
    assert prewarm.wait() == 0.0  # nothing left to wait for


@pytest.mark.parametrize(
    ("extra", "load_format"),
    [({"daemon_prewarm": False}, "marlin_prepacked"), ({}, "auto")],
    ids=["turned-off", "other-load-format"],
)
def test_no_warm_up_when_turned_off_or_not_our_load_format(make_checkpoint, extra: dict, load_format: str) -> None:
    from vllm.model_executor.model_loader import utils

    utils._MODEL_ARCH_BY_HASH.clear()
    assert prewarm.start(_config(make_checkpoint("gptq", "tiny"), extra, load_format), 0) is None
    assert prewarm.wait() == 0.0
    assert not utils._MODEL_ARCH_BY_HASH


def test_a_failing_step_is_logged_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, make_checkpoint, marlin_log: list[str]
) -> None:
    calls: list[str] = []

    def boom(*_: Any) -> None:
        calls.append("cuda")
        raise RuntimeError("no device")

    monkeypatch.setattr(prewarm, "_cuda", boom)
    monkeypatch.setattr(prewarm, "_model_module", lambda *_: calls.append("model"))
    monkeypatch.setattr(prewarm, "_attention_backends", lambda *_: calls.append("attention"))
    prewarm.start(_config(make_checkpoint("gptq", "tiny")), 0)
    prewarm.wait()
    assert calls == ["cuda", "model", "attention"]
    line = next(m for m in marlin_log if "daemon warm-up" in m)
    assert "cuda failed (RuntimeError), model module 0.00 s, attention backends 0.00 s" in line


def test_run_daemon_starts_the_warm_up_and_the_fill_waits_for_it(
    registered: None, monkeypatch: pytest.MonkeyPatch, make_checkpoint, marlin_log: list[str]
) -> None:
    """run_daemon starts it with the spawn's config and local rank; the fill's get_model joins it first."""
    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.patches.weight_cache import DAEMON_MODULE, _daemon_get_model, run_daemon

    daemon_mod = importlib.import_module(DAEMON_MODULE)
    release = threading.Event()
    started: list[tuple[Any, int]] = []

    def slow_run(vllm_config: Any, local_rank: int) -> None:
        started.append((vllm_config, local_rank))
        release.wait(10)

    monkeypatch.setattr(prewarm, "_run", slow_run)
    order: list[str] = []

    def stock(*args: Any, **kwargs: Any) -> str:
        order.append("daemon init")
        release.set()  # the warm-up ends while vLLM builds the daemon
        return "done"

    monkeypatch.setattr(daemon_mod, "_run_daemon", stock)
    config = _config(make_checkpoint("gptq", "tiny"))
    try:
        assert run_daemon(0, 3, config, "tcp://127.0.0.1:9", None, "q") == "done"
    finally:
        patches.uninstall_all()
    assert started == [(config, 3)]

    def original(daemon: Any) -> str:
        order.append("fill")
        return "model"

    fake = SimpleNamespace(role="target", global_rank=0, vllm_config=SimpleNamespace(
        load_config=config.load_config, model_config=config.model_config, kernel_config=None), model_config=config.model_config)
    monkeypatch.setattr("marlin_pack.vllm_plugin.patches.weight_cache.force_marlin_for_cache", lambda *a, **k: False)
    assert _daemon_get_model(original)(fake) == "model"
    assert order == ["daemon init", "fill"]
    assert any("daemon warm-up" in m for m in marlin_log)  # waited inside the fill, which then logged its start
    fill = next(m for m in marlin_log if "filled its model" in m)
    assert "after the daemon process began its run" in fill


@pytest.mark.parametrize(
    ("extra", "helpers_help", "started"),
    [
        ({"io_mode": "processes", "io_processes": 2, "io_helper_nice": 3, "io_staged": 1}, False, True),
        ({}, True, True),  # auto, where helpers help
        ({}, False, False),  # auto, where they do not (TP>1, sleep mode, few cores...)
        ({"io_mode": "staged"}, True, False),
        ({"io_mode": "nonsense"}, True, False),  # the loader reports bad options; the warm-up just skips
    ],
)
def test_warm_up_starts_the_helpers_the_loader_would(
    monkeypatch: pytest.MonkeyPatch, make_checkpoint, extra: dict, helpers_help: bool, started: bool
) -> None:
    from marlin_pack.vllm_plugin import copy_helpers, loader

    pools: list[Any] = []

    class Pool:
        def __init__(self, count: int | None, device_index: int, **settings: Any) -> None:
            self.args, self.closed = (count, device_index, settings), False
            pools.append(self)

        def close(self, wait: bool = True) -> None:
            self.closed = True

    monkeypatch.setattr(copy_helpers.HelperPool, "__init__", Pool.__init__)
    monkeypatch.setattr(copy_helpers.HelperPool, "close", Pool.close)
    monkeypatch.setattr(loader, "helpers_help", lambda *a: helpers_help)
    monkeypatch.setattr(prewarm, "_cuda", lambda *_: None)
    monkeypatch.setattr(prewarm, "_model_module", lambda *_: None)
    monkeypatch.setattr(prewarm, "_attention_backends", lambda *_: None)
    prewarm.start(_config(make_checkpoint("gptq", "tiny"), extra), 2)
    prewarm.wait()
    if not started:
        assert pools == [] and prewarm.take_helpers() is None
        return
    options = __import__("marlin_pack.vllm_plugin.options", fromlist=["x"]).parse_extra_config(extra)
    assert [p.args for p in pools] == [(options.io_processes, 2, copy_helpers.HelperPool.settings_of(options))]
    prewarm.discard_helpers()  # the loader did not take them
    assert pools[0].closed and prewarm.take_helpers() is None
