"""``helper_policy``: where an engine's worker starts the loader's copy helpers early, and how the loader
takes them (or ends them); the patch that calls it. No GPU: a stand-in pool records how it was started
and ended; the helpers' copies are checked on the H200 (tests/gpu/test_loader_gpu.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from marlin_pack.vllm_plugin import gpu_reader, helper_policy
from marlin_pack.vllm_plugin.copy_helpers import exit_in_background
from marlin_pack.vllm_plugin.helper_policy import PoolKey, claim_early, discard_early, pool_key, start_early
from marlin_pack.vllm_plugin.options import parse_extra_config


class _Pool:
    """Stands in for HelperPool (started from a PoolKey)."""

    def __init__(self, key: PoolKey) -> None:
        self.key = key
        self.closed: list[bool] = []

    def close(self, wait: bool = True) -> None:
        self.closed.append(wait)


@pytest.fixture(autouse=True)
def no_early_pool() -> Iterator[None]:
    discard_early()
    yield
    discard_early()


def _engine_config(tmp_path: Path, extra: dict | None = None, **changes: Any) -> SimpleNamespace:
    """What a worker's vllm_config offers start_early: a marlin_prepacked engine of one GPU."""
    (tmp_path / "model").mkdir(exist_ok=True)
    config = SimpleNamespace(
        load_config=SimpleNamespace(load_format="marlin_prepacked", model_loader_extra_config=extra),
        device_config=SimpleNamespace(device_type="cuda"),
        parallel_config=SimpleNamespace(world_size_across_dp=1),
        model_config=SimpleNamespace(model=str(tmp_path / "model"), revision=None, enable_sleep_mode=False),
    )
    for path, value in changes.items():
        owner, name = path.split("__")
        setattr(getattr(config, owner), name, value)
    return config


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """16 cores, the ordinary allocator, and a bundle on disk unless a test says otherwise."""
    state: dict[str, Any] = {"tmpfs": set()}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(gpu_reader, "in_base_memory_pages", lambda path: Path(path) in state["tmpfs"])
    return state


def test_started_with_the_loaders_settings_for_the_workers_device(tmp_path: Path, host: dict) -> None:
    extra = {"io_processes": 3, "io_staged": 2, "io_stage_mib": 16, "io_defer_unregister": True, "io_helper_nice": 5}
    pool = start_early(_engine_config(tmp_path, extra), 1, start=_Pool)
    assert isinstance(pool, _Pool) and pool.key == (3, 1, 2, 16, True, 5)
    claimed = claim_early(pool_key(parse_extra_config(extra), 1))
    assert claimed is not None and claimed[0] is pool and claimed[1] >= 0 and pool.closed == []  # the loader's now
    assert claim_early(pool_key(parse_extra_config(extra), 1)) is None  # claimed once


def test_defaults_start_four_helpers_without_deferred_unregistering(tmp_path: Path, host: dict) -> None:
    """An engine waits for its helpers to exit, so its defaults keep unregistering on the copy's path."""
    pool = start_early(_engine_config(tmp_path), 0, start=_Pool)
    assert pool is not None and pool.key == (4, 0, 0, 64, False, 0)
    claimed = claim_early(pool_key(parse_extra_config({}), 0))
    assert claimed is not None and claimed[0] is pool


def test_the_key_follows_the_daemon_default_for_deferred_unregistering() -> None:
    """The same options key a daemon's helpers differently: deferred unregistering is its default."""
    options = parse_extra_config({})
    assert pool_key(options, 0)[4] is False
    with exit_in_background():
        assert pool_key(options, 0)[4] is True
    assert pool_key(parse_extra_config({"io_defer_unregister": False}), 0)[4] is False


@pytest.mark.parametrize(
    ("extra", "changes", "why"),
    [
        (None, {"load_config__load_format": "auto"}, "another load format"),
        (None, {"device_config__device_type": "rocm"}, "not CUDA"),
        ({"io_early_helpers": False}, {}, "turned off"),
        ({"io_mode": "registered"}, {}, "a mode without helpers"),
        ({"io_mode": "staged"}, {}, "a mode without helpers"),
        ({"io_mode": "bogus"}, {}, "options the loader will refuse"),
        ({"bundel": "/x"}, {}, "options the loader will refuse"),
        (None, {"parallel_config__world_size_across_dp": 2}, "auto: several ranks"),
        (None, {"model_config__enable_sleep_mode": True}, "auto: the sleep-mode allocator"),
        (None, {"model_config__model": "no-such-org/no-such-model"}, "auto: no bundle found"),
        ("tmpfs", {}, "auto: a bundle on a tmpfs of 4 KiB pages is staged"),
    ],
)
def test_not_started_where_the_loader_would_not_use_them(
    tmp_path: Path, host: dict, monkeypatch: pytest.MonkeyPatch, extra: Any, changes: dict, why: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if extra == "tmpfs":
        extra = {"bundle": str(tmp_path / "b")}
        host["tmpfs"].add(tmp_path / "b")
    assert start_early(_engine_config(tmp_path, extra, **changes), 0, start=_Pool) is None, why
    assert helper_policy._EARLY == []


def test_explicit_processes_mode_starts_them_even_where_auto_would_not(tmp_path: Path, host: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    extra = {"io_mode": "processes", "bundle": str(tmp_path / "b")}
    host["tmpfs"].add(tmp_path / "b")
    assert start_early(_engine_config(tmp_path, extra), 0, start=_Pool) is not None


def test_auto_finds_the_bundle_beside_the_model(tmp_path: Path, host: dict) -> None:
    """No ``bundle`` option: the default MODEL_DIR/marlin-pack is the directory asked about."""
    host["tmpfs"].add(tmp_path / "model" / "marlin-pack")
    assert start_early(_engine_config(tmp_path), 0, start=_Pool) is None
    host["tmpfs"].clear()
    assert start_early(_engine_config(tmp_path), 0, start=_Pool) is not None


def test_a_pool_started_otherwise_ends_waited_for_and_is_not_given(tmp_path: Path, host: dict) -> None:
    pool = start_early(_engine_config(tmp_path), 0, start=_Pool)
    assert pool is not None
    assert claim_early(pool_key(parse_extra_config({}), 1)) is None  # another device
    assert pool.closed == [True]
    assert claim_early(pool_key(parse_extra_config({}), 0)) is None  # gone


def test_discard_ends_an_unclaimed_pool(tmp_path: Path, host: dict) -> None:
    first = start_early(_engine_config(tmp_path), 0, start=_Pool)
    second = start_early(_engine_config(tmp_path), 0, start=_Pool)  # a second start ends the first, without waiting
    assert first is not None and second is not None and first.closed == [False] and second.closed == []
    discard_early()
    assert second.closed == [True] and helper_policy._EARLY == []


# -- the patch ---------------------------------------------------------------------------------------------


def _worker(load_format: str, index: int | None = 2) -> SimpleNamespace:
    return SimpleNamespace(
        vllm_config=SimpleNamespace(load_config=SimpleNamespace(load_format=load_format)),
        device=SimpleNamespace(index=index),
    )


@pytest.mark.parametrize(
    ("load_format", "index", "starts"), [("marlin_prepacked", 2, True), ("auto", 2, False), ("marlin_prepacked", None, False)]
)
def test_worker_starts_them_before_building_its_model_runner(
    monkeypatch: pytest.MonkeyPatch, load_format: str, index: int | None, starts: bool
) -> None:
    """Only for marlin_prepacked on a device with an index, and before vLLM's own step."""
    from marlin_pack.vllm_plugin.patches.early_helpers import _init_workspace_and_model_runner

    calls: list[object] = []
    monkeypatch.setattr(helper_policy, "start_early", lambda config, device_index: calls.append(("start", device_index)))
    wrapped = _init_workspace_and_model_runner(lambda self: calls.append("runner") or "built")
    assert wrapped(_worker(load_format, index)) == "built"
    assert calls == ([("start", 2), "runner"] if starts else ["runner"])


def test_worker_start_never_stops_the_engine(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A failure to start them is logged; vLLM's step runs all the same (the loader starts its own)."""
    from marlin_pack.vllm_plugin.patches.early_helpers import _init_workspace_and_model_runner

    def boom(config: object, device_index: int) -> None:
        raise RuntimeError("no helpers today")

    monkeypatch.setattr(helper_policy, "start_early", boom)
    wrapped = _init_workspace_and_model_runner(lambda self: "built")
    with caplog.at_level("ERROR", logger="vllm.marlin_pack"):
        assert wrapped(_worker("marlin_prepacked")) == "built"
    assert "could not start the copy helpers early" in caplog.text
