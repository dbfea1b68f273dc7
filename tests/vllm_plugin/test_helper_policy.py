"""``helper_policy``: where a weight-cache daemon starts the loader's copy helpers early, and how the
loader takes them (or ends them). No GPU: a stand-in pool records how it was started and ended; the
helpers' copies are checked on the H200 (tests/gpu/test_daemon_gpu.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from marlin_pack.vllm_plugin import gpu_reader, helper_policy
from marlin_pack.vllm_plugin.helper_policy import claim_early, discard_early, pool_key, start_early
from marlin_pack.vllm_plugin.options import parse_extra_config


class _Pool:
    """Stands in for HelperPool."""

    def __init__(self, count: int, device_index: int, **settings: Any) -> None:
        self.started = (count, device_index, settings)
        self.closed: list[bool] = []

    def close(self, wait: bool = True) -> None:
        self.closed.append(wait)


@pytest.fixture(autouse=True)
def no_early_pool() -> Iterator[None]:
    discard_early()
    yield
    discard_early()


def _daemon_config(tmp_path: Path, extra: dict | None = None, **changes: Any) -> SimpleNamespace:
    """What run_daemon's vllm_config offers start_early: a marlin_prepacked daemon of one GPU."""
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


def test_started_with_the_loaders_settings_for_the_daemons_device(tmp_path: Path, host: dict) -> None:
    extra = {"io_processes": 3, "io_staged": 2, "io_defer_unregister": True, "io_helper_nice": 5}
    pool = start_early(_daemon_config(tmp_path, extra), 1, start=_Pool)
    assert isinstance(pool, _Pool)
    assert pool.started == (3, 1, {"staged": 2, "defer_unregister": True, "nice": 5})
    key = pool_key(parse_extra_config(extra), 1)
    assert claim_early(key) is pool and pool.closed == []  # the loader's now
    assert claim_early(key) is None  # claimed once


def test_defaults_start_four_helpers(tmp_path: Path, host: dict) -> None:
    pool = start_early(_daemon_config(tmp_path), 0, start=_Pool)
    assert pool is not None and pool.started == (4, 0, {"staged": 0, "defer_unregister": False, "nice": 0})
    assert claim_early(pool_key(parse_extra_config({}), 0)) is pool


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
    assert start_early(_daemon_config(tmp_path, extra, **changes), 0, start=_Pool) is None, why
    assert helper_policy._EARLY == []


def test_explicit_processes_mode_starts_them_even_where_auto_would_not(
    tmp_path: Path, host: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    extra = {"io_mode": "processes", "bundle": str(tmp_path / "b")}
    host["tmpfs"].add(tmp_path / "b")
    assert start_early(_daemon_config(tmp_path, extra), 0, start=_Pool) is not None


def test_auto_finds_the_bundle_beside_the_model(tmp_path: Path, host: dict) -> None:
    """No ``bundle`` option: the default MODEL_DIR/marlin-pack is the directory asked about."""
    host["tmpfs"].add(tmp_path / "model" / "marlin-pack")
    assert start_early(_daemon_config(tmp_path), 0, start=_Pool) is None
    host["tmpfs"].clear()
    assert start_early(_daemon_config(tmp_path), 0, start=_Pool) is not None


def test_a_pool_started_otherwise_ends_and_is_not_given(tmp_path: Path, host: dict) -> None:
    pool = start_early(_daemon_config(tmp_path), 0, start=_Pool)
    assert pool is not None
    assert claim_early(pool_key(parse_extra_config({}), 1)) is None  # another device
    assert pool.closed == [False]
    assert claim_early(pool_key(parse_extra_config({}), 0)) is None  # gone


def test_discard_ends_an_unclaimed_pool_without_waiting(tmp_path: Path, host: dict) -> None:
    first = start_early(_daemon_config(tmp_path), 0, start=_Pool)
    second = start_early(_daemon_config(tmp_path), 0, start=_Pool)  # a second start ends the first
    assert first is not None and second is not None and first.closed == [False] and second.closed == []
    discard_early()
    assert second.closed == [False] and helper_policy._EARLY == []
