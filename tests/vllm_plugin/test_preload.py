"""``preload``: copy helpers page-lock the bundle before the loader copies it, in a weight-cache daemon as it
starts and in an engine as its GPU worker sets up (the ``preload`` option, where the I/O plan copies with helpers).

The plan is made from a real bundle and a stand-in configuration, the machine as the plan sees it stood in for
(NVML's room, cores, the file system); the helpers are a stand-in ``HelperPool`` (the real ones need a GPU: the
GPU suite runs them), except in the spawned-process test, which checks the premise the daemon's side rests on: a
spawned daemon imports the spawn target's module before it unpickles its configuration.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from marlin_pack.gpu.plan import GpuRoom, IoPlan
from marlin_pack.vllm_plugin import LOAD_FORMAT, io_facts, preload

MIB, GIB = 1 << 20, 1 << 30


_ROOM: list[GpuRoom | None] = [None]  # what NVML says of the GPU in this test


@pytest.fixture(autouse=True)
def rooms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """No page-locking left from another test, no overrides; a machine where copy helpers pay and work (16 cores,
    the bundle on disk, an almost empty 141 GiB GPU). Returns the devices NVML was asked about."""
    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.delenv(preload.ENV, raising=False)
    monkeypatch.delenv("MARLIN_PACK_IO", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(io_facts, "in_base_memory_pages", lambda path: False)
    asked: list[int] = []
    _set_room(GpuRoom(free=140 * GIB, total=141 * GIB))
    monkeypatch.setattr(io_facts, "gpu_room", lambda device: asked.append(device) or _ROOM[0])
    return asked


def _set_room(room: GpuRoom | None) -> None:
    _ROOM[0] = room


def _config(model: Path, extra: dict | None = None, *, load_format: str = LOAD_FORMAT, tp: int = 1, dp: int = 1,
            sleep: bool = False, utilization: float = 0.9) -> SimpleNamespace:
    """What plan() and export() read of a VllmConfig."""
    from vllm.config.kernel import KernelConfig

    return SimpleNamespace(
        load_config=SimpleNamespace(load_format=load_format, model_loader_extra_config=extra or {}),
        kernel_config=KernelConfig(),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=dp,
                                        world_size_across_dp=tp * dp),
        cache_config=SimpleNamespace(gpu_memory_utilization=utilization),
        model_config=SimpleNamespace(model=str(model), dtype=torch.float16, quantization="auto_awq", enable_sleep_mode=sleep,
                                     revision=None),
    )


@pytest.fixture
def model(make_bundle) -> Path:  # type: ignore[no-untyped-def]
    return make_bundle("awq", "tiny", tp_sizes=(1, 2))


def _files(model: Path) -> list[str]:
    bundle = model / "marlin-pack"
    return [str((bundle / "tp1" / "rank-0.safetensors").resolve()), str((bundle / "common.safetensors").resolve())]


# -- the plan ---------------------------------------------------------------------------------------------------


def test_plan_names_the_files_the_daemons_fill_copies_and_carries_its_io_plan(model: Path, rooms: list[int]) -> None:
    found = preload.plan(_config(model))
    assert found is not None and json.loads(json.dumps(found)) == found  # travels through the environment
    assert found["files"] == _files(model)
    assert found["bytes"] == sum(os.stat(f).st_size for f in found["files"])
    assert found["parent"] == os.getpid() and found["device"] == 0 and rooms == [0]
    p = IoPlan.from_json(found["plan"])
    assert (p.mode, p.helpers, p.threads, p.window, p.preload) == ("helpers", 4, 4, 256 * MIB, True)
    assert (p.defer_unregister, p.common_during_build, p.during_build) == (True, True, True)  # a daemon's fill
    assert "page-lock the bundle ahead of the copy" in p.why


def test_an_engines_plan_is_for_its_device_and_role(model: Path, rooms: list[int]) -> None:
    found = preload.plan(_config(model), role="engine", device=2)
    assert found is not None and found["device"] == 2 and rooms == [2]
    p = IoPlan.from_json(found["plan"])
    assert (p.mode, p.preload, p.defer_unregister, p.common_during_build) == ("helpers", True, False, False)


def test_no_plan_for_a_pipeline_stage(model: Path, rooms: list[int]) -> None:
    """Page-locking the rank file would read every stage's layers; a stage reads only its own (loader's copy)."""
    config = _config(model)
    assert preload.plan(config) is not None  # the same engine at PP=1 has one
    config.parallel_config.pipeline_parallel_size = 2
    assert preload.plan(config) is None and preload.plan(config, role="engine") is None


def test_the_plan_takes_the_overrides(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARLIN_PACK_IO", '{"helpers": 2, "window_mib": 64}')
    found = preload.plan(_config(model))
    assert found is not None
    p = IoPlan.from_json(found["plan"])
    assert (p.helpers, p.window) == (2, 64 * MIB) and p.why.endswith("(overridden by MARLIN_PACK_IO)")


@pytest.mark.parametrize(
    "case",
    ["another load format", "preload off", "an unknown option", "a removed option", "no bundle", "a bundle for another dtype",
     "too few cores", "sleep mode", "a 4 KiB-page tmpfs", "tp 2", "no room on the GPU", "an unknown GPU",
     "overridden to registered", "overridden to no preload", "an override that is not JSON"],
)
def test_no_plan_where_the_copy_would_not_use_page_locked_helpers(
    model: Path, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra: dict[str, Any] = {
        "preload off": {"preload": False},
        "an unknown option": {"no_such_option": 1},
        "a removed option": {"io_mode": "processes"},
        "no bundle": {"bundle": str(tmp_path / "missing")},
    }.get(case, {})
    config = _config(model, extra, load_format="auto" if case == "another load format" else LOAD_FORMAT,
                     sleep=case == "sleep mode", tp=2 if case == "tp 2" else 1)
    if case == "too few cores":
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    if case == "a 4 KiB-page tmpfs":  # staged in the process's own threads: no helpers
        monkeypatch.setattr(io_facts, "in_base_memory_pages", lambda path: True)
    if case == "a bundle for another dtype":
        config.model_config.dtype = torch.bfloat16
    if case == "no room on the GPU":  # not for 4 helpers' contexts and the process's own (5 GiB), whatever the role
        _set_room(GpuRoom(free=4 * GIB, total=141 * GIB))
    if case == "an unknown GPU":
        _set_room(None)
    override = {"overridden to registered": '{"mode": "registered"}', "overridden to no preload": '{"preload": false}',
                "an override that is not JSON": "{"}.get(case)
    if override is not None:
        monkeypatch.setenv("MARLIN_PACK_IO", override)
    for role in ("daemon", "engine"):
        assert preload.plan(config, role=role) is None  # never raises: the loader reports a bad bundle or option


@pytest.mark.parametrize("case", ["one daemon", "tp 2", "dp 2", "a draft daemon"])
def test_export_plans_only_a_single_daemon(model: Path, case: str) -> None:
    env = {preload.ENV: "left from before"}
    config = _config(model, tp=2 if case == "tp 2" else 1, dp=2 if case == "dp 2" else 1)
    found = preload.export(config, draft=case == "a draft daemon", environ=env)
    if case == "one daemon":
        assert found is not None and json.loads(env[preload.ENV]) == found
    else:
        assert found is None and preload.ENV not in env


# -- a stand-in HelperPool ------------------------------------------------------------------------------------------


class _FakePool:
    """Stands in for gpu.helpers.HelperPool: records what preload asked of it."""

    made: list[_FakePool] = []
    ready_count = 2  # helpers that say they are ready
    fail: Exception | None = None  # raised by the constructor
    gate: threading.Event | None = None  # ready() waits for it

    def __init__(self, count: int = 4, device_index: int = 0, *, defer_unregister: bool = False) -> None:
        if _FakePool.fail is not None:
            raise _FakePool.fail
        self.args = (count, device_index, defer_unregister)
        self.calls: list[Any] = []
        self.failures: list[str] = []
        self.ready_after: float | None = None
        self.retained_bytes: int | None = None
        _FakePool.made.append(self)

    def ready(self) -> int:
        self.calls.append("ready")
        if _FakePool.gate is not None:
            assert _FakePool.gate.wait(timeout=10), "the test never opened the gate"
        if not _FakePool.ready_count:
            self.failures.append("a helper did not start: no CUDA driver")
        return _FakePool.ready_count

    def retain(self, files: list[str], window: int) -> int:
        self.calls.append(("retain", list(files), window))
        self.retained_bytes = 3 << 20
        return 3 << 20

    def let_go(self, wait: bool = True) -> None:
        self.calls.append("let go")

    def close(self, wait: bool = True) -> None:
        self.calls.append("close")


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch) -> type[_FakePool]:
    from marlin_pack.gpu import helpers

    _FakePool.made, _FakePool.ready_count, _FakePool.fail, _FakePool.gate = [], 2, None, None
    monkeypatch.setattr(helpers, "HelperPool", _FakePool)  # preload imports it from there as it starts
    return _FakePool


def _plan(**changes: Any) -> IoPlan:
    return IoPlan(**{**dict(mode="helpers", threads=4, window=256 * MIB, helpers=2, common_during_build=True,
                            defer_unregister=True, preload=True, why="planned for the daemon"), **changes})


def _spec(**changes: Any) -> dict:
    spec = {"parent": os.getppid(), "files": ["/b/tp1/rank-0.safetensors", "/b/common.safetensors"], "bytes": 3 << 20,
            "device": 1, "plan": _plan().to_json()}
    return {**spec, **changes}


def _until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


# -- a weight-cache daemon -------------------------------------------------------------------------------------------


def test_a_daemon_page_locks_its_bundle_in_its_helpers_then_stops_them(fake_pool: type[_FakePool], marlin_log: list[str]) -> None:
    env = {preload.ENV: json.dumps(_spec())}
    pl = preload.start_from_environment(env)
    assert pl is not None and preload.current() is pl and not pl.engine
    assert preload.ENV not in env  # the daemon's own children never see the plan
    assert pl.done.wait(timeout=10) and pl.error is None
    (pool,) = fake_pool.made
    assert pool.args == (2, 1, True)  # the carried plan's helpers, the spec's device, deferred unregistering
    assert pool.calls == ["ready", ("retain", ["/b/tp1/rank-0.safetensors", "/b/common.safetensors"], 256 * MIB)]
    assert pl.plan == _plan() and pl.locked == 3 << 20 and pl.helpers_up.is_set()
    assert any("3.1 MB of the bundle page-locked in 2 copy helpers" in m for m in marlin_log)
    assert preload.take_pool(Path("/b/tp1/rank-0.safetensors")) == (pool, _plan())  # the loader takes pool and plan
    preload.stop()  # after the fill: in the background
    assert _until(lambda: "close" in pool.calls)
    assert preload.take_pool(Path("/b/tp1/rank-0.safetensors")) is None  # stopped: the loader starts its own helpers
    preload.stop()
    pl.stop()
    time.sleep(0.05)
    assert pool.calls.count("close") == 1  # once


@pytest.mark.parametrize("case", ["another parent", "no files", "not JSON", "not an object", "no plan", "not a plan",
                                  "a device that is no number"])
def test_a_plan_not_made_for_this_process_is_ignored(fake_pool: type[_FakePool], case: str) -> None:
    raw = {
        "another parent": json.dumps(_spec(parent=os.getppid() + 1)),
        "no files": json.dumps(_spec(files=[])),
        "not JSON": "{",
        "not an object": json.dumps([_spec()]),
        "no plan": json.dumps({k: v for k, v in _spec().items() if k != "plan"}),
        "not a plan": json.dumps(_spec(plan='{"mode": "processes"}')),
        "a device that is no number": json.dumps(_spec(device="cuda:0")),
    }[case]
    env = {preload.ENV: raw}
    assert preload.start_from_environment(env) is None
    assert preload.ENV not in env and preload.current() is None and fake_pool.made == []
    assert preload.take_pool(Path("/b/tp1/rank-0.safetensors")) is None


def test_one_preload_per_process(fake_pool: type[_FakePool]) -> None:
    first = preload.start_from_environment({preload.ENV: json.dumps(_spec())})
    assert first is not None and first.done.wait(timeout=10)
    env = {preload.ENV: json.dumps(_spec())}
    assert preload.start_from_environment(env) is None and preload.ENV not in env
    assert preload.current() is first and len(fake_pool.made) == 1
    assert preload.start_from_environment({}) is None
    first.stop()


def test_take_pool_only_for_its_rank_file(model: Path, fake_pool: type[_FakePool], tmp_path: Path) -> None:
    rank = Path(_files(model)[0])
    pl = preload.start_from_environment({preload.ENV: json.dumps(_spec(files=_files(model)))})
    assert pl is not None and pl.done.wait(timeout=10)
    other = model / "marlin-pack" / "tp2" / "rank-1.safetensors"
    assert other.exists() and preload.take_pool(other) is None  # another rank's file: not what they page-lock
    link = tmp_path / "rank-0.safetensors"
    link.symlink_to(rank)
    assert preload.take_pool(link) == (fake_pool.made[0], _plan())  # the same file, by another name
    assert preload.take_pool(rank) == (fake_pool.made[0], _plan())
    pl.stop()


@pytest.mark.parametrize("engine", [False, True])
def test_when_the_helpers_do_not_start_the_copy_goes_without_them(
    fake_pool: type[_FakePool], marlin_log: list[str], engine: bool, model: Path
) -> None:
    fake_pool.ready_count = 0
    if engine:
        pl = preload.start_in_worker(_worker(model))
    else:
        pl = preload.start_from_environment({preload.ENV: json.dumps(_spec(files=_files(model)))})
    assert pl is not None and pl.done.wait(timeout=10)
    assert pl.error == "a helper did not start: no CUDA driver" and pl.locked == 0
    assert pl.helpers_up.is_set()  # nothing to wait for at vLLM's snapshot
    assert preload.take_pool(Path(_files(model)[0])) is None
    role = "engine" if engine else "daemon"
    assert any(f"the {role}'s copy helpers did not start (a helper did not start: no CUDA driver); copying without them" in m
               for m in marlin_log)
    (pool,) = fake_pool.made
    assert ("retain" not in [c[0] for c in pool.calls if isinstance(c, tuple)]) and "close" not in pool.calls
    (preload.stop_after_memory_profile if engine else preload.stop)()  # their contexts go when preload says
    assert _until(lambda: "close" in pool.calls)


def test_a_pool_that_cannot_be_made_is_an_error_not_a_crash(fake_pool: type[_FakePool]) -> None:
    fake_pool.fail = RuntimeError("no libcuda.so.1")
    pl = preload.start_from_environment({preload.ENV: json.dumps(_spec())})
    assert pl is not None and pl.done.wait(timeout=10)
    assert pl.error == "RuntimeError: no libcuda.so.1" and pl.pool is None and pl.helpers_up.is_set()
    assert pl.seconds is not None
    assert preload.take_pool(Path("/b/tp1/rank-0.safetensors")) is None
    pl.stop()
    assert pl.stopped


def test_a_stop_before_the_start_starts_no_helper(fake_pool: type[_FakePool]) -> None:
    pl = preload.Preload(["/b/tp1/rank-0.safetensors"], 0, _plan())
    pl.stop(wait_s=0)
    pl.run()  # the thread's start came late: no helper is left behind
    assert fake_pool.made == [] and pl.pool is None and pl.done.is_set()


def test_the_patched_get_draft_daemon_config_plans_the_preload(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin.patches import weight_cache

    monkeypatch.setenv(preload.ENV, "left from before")
    config = _config(model)
    assert weight_cache._daemons_spawned_for(lambda c: None)(config) is None
    spec = json.loads(os.environ[preload.ENV])
    assert spec["files"][0].endswith("rank-0.safetensors") and IoPlan.from_json(spec["plan"]).mode == "helpers"
    draft = object()
    assert weight_cache._daemons_spawned_for(lambda c: draft)(config) is draft
    assert preload.ENV not in os.environ


@pytest.mark.parametrize("fails", [False, True])
def test_the_daemon_stops_the_preload_after_its_fill(fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's fill runs inside the loader's exit_in_background (the one the loader reads), then preload stops."""
    from marlin_pack.gpu.helpers import exits_in_background
    from marlin_pack.vllm_plugin.patches import weight_cache

    stopped: list[bool] = []
    monkeypatch.setattr(preload, "stop", lambda: stopped.append(True))
    inside: list[bool] = []

    def get_model(self: object) -> str:
        inside.append(exits_in_background())
        if fails:
            raise RuntimeError("the fill failed")
        return "model"

    fake = SimpleNamespace(role="target", global_rank=0, vllm_config=SimpleNamespace(load_config=SimpleNamespace(load_format="x"),
                           kernel_config=None), model_config=SimpleNamespace(quantization=None))
    wrapped = weight_cache._daemon_get_model(get_model)
    if fails:
        with pytest.raises(RuntimeError, match="the fill failed"):
            wrapped(fake)
    else:
        assert wrapped(fake) == "model"
    assert stopped == [True] and inside == [True] and not exits_in_background()


def test_the_loader_takes_the_preloads_pool_and_plan(model: Path, fake_pool: type[_FakePool], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    import marlin_pack.vllm_plugin.loader as loader_mod

    started: list[object] = []
    monkeypatch.setattr(loader_mod, "HelperPool", lambda *a, **k: started.append(a) or "the loader's own")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    planned: list[object] = []
    monkeypatch.setattr(loader_mod, "plan_for", lambda *a, **k: planned.append(a))
    pl = preload.start_from_environment({preload.ENV: json.dumps(_spec(files=_files(model)))})
    assert pl is not None and pl.done.wait(timeout=10)
    config = _config(model)
    bundle = SimpleNamespace(rank_file=model / "marlin-pack" / "tp1" / "rank-0.safetensors")
    loader = loader_mod.MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={}))
    assert loader._plan_and_helpers(config, config.model_config, bundle) == (_plan(), fake_pool.made[0], True)  # type: ignore[arg-type]
    assert started == [] and planned == []  # no plan made anew, no helpers started
    pl.stop()


_PROBE = """
import json, sys
m = sys.modules.get("marlin_pack.vllm_plugin.preload")
open({path!r}, "w").write(json.dumps({{"started": m is not None and m.current() is not None}}))
"""


class _Probe:
    """Unpickled in the spawned process after the target (a Process's attributes in order): notes whether the
    page-locking had begun by then."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (exec, (_PROBE.format(path=str(self.path)),))


@pytest.mark.slow
def test_a_spawned_daemon_begins_page_locking_before_its_configuration_is_unpickled(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin import daemon_process

    report = tmp_path / "report.json"
    # One real helper: it cannot start without a GPU (the page-locking then fails, as the daemon's would).
    monkeypatch.setenv(preload.ENV, json.dumps(_spec(parent=os.getpid(), files=[str(tmp_path / "none")], device=0,
                                                     plan=_plan(helpers=1).to_json())))
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=daemon_process.started)  # vLLM spawns daemon_process.run_daemon: the same module
    proc.probe = _Probe(report)  # type: ignore[attr-defined]  # pickled after the target, as vLLM's config is
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert json.loads(report.read_text()) == {"started": True}


# -- engines ------------------------------------------------------------------------------------------------------------


def _worker(model: Path, extra: dict | None = None, *, tp: int = 1, utilization: float = 0.9, local_rank: int = 0) -> SimpleNamespace:
    """What start_in_worker reads of vLLM's GPU Worker."""
    return SimpleNamespace(vllm_config=_config(model, extra, tp=tp, utilization=utilization), local_rank=local_rank)


def test_an_engine_worker_page_locks_its_bundle_and_keeps_the_helpers_until_the_kv_cache_is_sized(
    model: Path, fake_pool: type[_FakePool], rooms: list[int], marlin_log: list[str]
) -> None:
    pl = preload.start_in_worker(_worker(model, utilization=0.8, local_rank=1))
    assert pl is not None and pl.engine and preload.current() is pl
    assert preload.start_in_worker(_worker(model)) is None  # one per process
    preload.await_helpers(timeout_s=10)
    assert pl.helpers_up.is_set() and pl.done.wait(timeout=10)
    assert rooms == [1]  # NVML asked about the worker's device
    (pool,) = fake_pool.made
    assert pool.args == (4, 1, False)  # an engine defers nothing: vLLM measures its memory after the copy
    assert pool.calls == ["ready", ("retain", _files(model), 256 * MIB)]
    assert pl.plan.mode == "helpers" and not pl.plan.common_during_build and pl.plan.preload
    assert any("while vLLM sets up its GPU worker" in m for m in marlin_log)
    assert preload.take_pool(Path(_files(model)[0])) == (pool, pl.plan)
    preload.stop()  # not after the memory profile: it is the daemon's stop, and stops an engine's too
    assert _until(lambda: "close" in pool.calls)


def test_an_engines_helpers_live_until_the_memory_profile(model: Path, fake_pool: type[_FakePool]) -> None:
    """They were in vLLM's memory snapshot: stopping them before the profile run's measurement would size the KV cache
    as if their memory were the engine's to use. The loader only has them let go of its memory (see test_plugin_loader)."""
    pl = preload.start_in_worker(_worker(model))
    assert pl is not None and pl.done.wait(timeout=10)
    (pool,) = fake_pool.made
    time.sleep(0.05)
    assert "close" not in pool.calls
    preload.stop_after_memory_profile()
    assert _until(lambda: "close" in pool.calls)
    preload.stop_after_memory_profile()
    time.sleep(0.05)
    assert pool.calls.count("close") == 1


def test_a_daemons_helpers_are_not_stopped_by_a_memory_profile(fake_pool: type[_FakePool]) -> None:
    pl = preload.start_from_environment({preload.ENV: json.dumps(_spec())})
    assert pl is not None and pl.done.wait(timeout=10)
    (pool,) = fake_pool.made
    preload.stop_after_memory_profile()
    time.sleep(0.05)
    assert "close" not in pool.calls and not pl.stopped
    preload.stop()
    assert _until(lambda: "close" in pool.calls)


@pytest.mark.parametrize("case", ["tp 2", "preload off", "another load format", "no GPU room"])
def test_no_engine_preload_where_the_loader_would_not_use_it(model: Path, case: str, fake_pool: type[_FakePool]) -> None:
    worker = _worker(model, {"preload": False} if case == "preload off" else None, tp=2 if case == "tp 2" else 1)
    if case == "another load format":
        worker.vllm_config.load_config.load_format = "auto"
    if case == "no GPU room":
        _set_room(GpuRoom(free=24 * GIB, total=141 * GIB))
    assert preload.start_in_worker(worker) is None
    assert preload.current() is None and fake_pool.made == []
    preload.await_helpers(timeout_s=10)  # nothing to wait for
    preload.stop_after_memory_profile()


@pytest.mark.parametrize(("free_gib", "utilization", "planned"), [(140, 0.9, True), (128, 0.9, False), (128, 0.8, True), (24, 0.5, False)])
def test_room_for_the_helpers_is_measured_against_the_memory_utilization(
    model: Path, fake_pool: type[_FakePool], free_gib: int, utilization: float, planned: bool
) -> None:
    """0.9 of 141 GiB is 126.9 GiB, which 4 helpers and the engine's own context (5 GiB) do not fit beside in 128 GiB."""
    _set_room(GpuRoom(free=free_gib * GIB, total=141 * GIB))
    pl = preload.start_in_worker(_worker(model, utilization=utilization))
    assert (pl is not None) is planned
    if pl is not None:
        assert pl.done.wait(timeout=10)
        pl.stop()


def test_the_worker_patches_start_before_init_device_and_stop_before_the_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin.patches import worker_preload

    events: list[str] = []
    monkeypatch.setattr(preload, "start_in_worker", lambda worker: events.append(f"start {worker}"))
    monkeypatch.setattr(preload, "stop_after_memory_profile", lambda: events.append("stop"))
    init_device = worker_preload._init_device(lambda self: events.append("init_device") or "ok")
    initialize = worker_preload._initialize_from_config(lambda self, config: events.append(f"kv {config}"))
    assert init_device("w") == "ok"
    initialize("w", "cfg")
    assert events == ["start w", "init_device", "stop", "kv cfg"]
    from marlin_pack.vllm_plugin import patches

    targets = {p.target for p in patches.PATCHES}
    assert {"vllm.v1.worker.gpu_worker:Worker.init_device", "vllm.v1.worker.gpu_worker:Worker.initialize_from_config"} <= targets


def test_the_loader_waits_for_the_helpers_before_the_memory_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    import marlin_pack.vllm_plugin.loader as loader_mod

    waited: list[bool] = []
    monkeypatch.setattr(preload, "await_helpers", lambda: waited.append(True))
    loader = loader_mod.MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT))
    assert loader.get_external_weight_memory(None) == 0  # type: ignore[arg-type]
    assert waited == [True]


def test_a_slow_helper_start_is_waited_for(model: Path, fake_pool: type[_FakePool], marlin_log: list[str]) -> None:
    fake_pool.gate = threading.Event()
    threading.Timer(0.3, fake_pool.gate.set).start()
    pl = preload.start_in_worker(_worker(model))
    assert pl is not None
    preload.await_helpers(timeout_s=10)
    assert fake_pool.gate.is_set() and pl.helpers_up.is_set()  # the contexts exist when vLLM takes its snapshot
    assert any("for the copy helpers' CUDA contexts before vLLM's memory snapshot" in m for m in marlin_log)
    assert pl.done.wait(timeout=10)
    preload.stop_after_memory_profile()


def test_helpers_not_up_in_time_are_said_so(model: Path, fake_pool: type[_FakePool], marlin_log: list[str]) -> None:
    fake_pool.gate = threading.Event()
    pl = preload.start_in_worker(_worker(model))
    assert pl is not None
    try:
        preload.await_helpers(timeout_s=0.1)
        assert any("the copy helpers were not up after 0 s, before vLLM's memory snapshot" in m for m in marlin_log)
    finally:
        fake_pool.gate.set()
    assert pl.done.wait(timeout=10)
    preload.stop_after_memory_profile()


def test_await_helpers_waits_only_for_an_engines_running_preload(fake_pool: type[_FakePool], model: Path) -> None:
    preload.await_helpers(timeout_s=10)  # none: at once
    fake_pool.gate = threading.Event()
    try:
        pl = preload.start_from_environment({preload.ENV: json.dumps(_spec())})  # a daemon's: nothing measured
        assert pl is not None
        t0 = time.perf_counter()
        preload.await_helpers(timeout_s=10)
        assert time.perf_counter() - t0 < 1 and not pl.helpers_up.is_set()
    finally:
        fake_pool.gate.set()
    assert pl.done.wait(timeout=10)
    pl.stop()
