"""``preload``: copy helpers page-lock the bundle before the loader copies it, in a weight-cache daemon as it
starts (``daemon_preload``) and in an engine as its GPU worker sets up (``engine_preload``).

The plan is made in the ``vllm preload`` process from a real bundle and a stand-in configuration;
the daemon side runs with a stand-in helper service (the real one needs a GPU: the GPU suite runs
it), except for the spawned-process test, which checks the premise the design rests on: a spawned
daemon imports the spawn target's module before it unpickles its configuration.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from marlin_pack.vllm_plugin import LOAD_FORMAT, preload
from marlin_pack.vllm_plugin.helper_service import ServiceError


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No page-locking left from another test; no real service socket directory; 16 usable cores."""
    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.delenv(preload.ENV, raising=False)
    empty = tmp_path / "no-service"
    empty.mkdir(mode=0o700)
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(empty))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


def _config(model: Path, extra: dict | None = None, *, load_format: str = LOAD_FORMAT, tp: int = 1, dp: int = 1,
            sleep: bool = False) -> SimpleNamespace:
    """What plan() and export() read of a VllmConfig."""
    from vllm.config.kernel import KernelConfig

    return SimpleNamespace(
        load_config=SimpleNamespace(load_format=load_format, model_loader_extra_config=extra or {}),
        kernel_config=KernelConfig(),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=dp,
                                        world_size_across_dp=tp * dp),
        model_config=SimpleNamespace(model=str(model), dtype=torch.float16, quantization="auto_awq", enable_sleep_mode=sleep,
                                     revision=None),
    )


@pytest.fixture
def model(make_bundle) -> Path:  # type: ignore[no-untyped-def]
    return make_bundle("awq", "tiny")


def test_plan_names_the_files_the_daemons_fill_copies(model: Path) -> None:
    found = preload.plan(_config(model, {"chunk_mb": 64, "io_processes": 3, "io_staged": 1, "io_helper_nice": 5}))
    assert found is not None
    bundle = model / "marlin-pack"
    rank_file, common = bundle / "tp1" / "rank-0.safetensors", bundle / "common.safetensors"
    assert found["files"] == [str(rank_file.resolve()), str(common.resolve())]
    assert found["bytes"] == rank_file.stat().st_size + common.stat().st_size
    assert found["parent"] == os.getpid() and found["device"] == 0
    assert (found["processes"], found["window_mib"], found["staged"], found["nice"]) == (3, 64, 1, 5)
    defaults = preload.plan(_config(model))
    assert defaults is not None and (defaults["processes"], defaults["window_mib"], defaults["staged"]) == (4, 256, 0)


@pytest.mark.parametrize(
    "case",
    ["another load format", "daemon_preload off", "no helper service", "registered mode", "too few cores", "sleep mode",
     "a 4 KiB-page tmpfs", "an unknown option", "no bundle", "a bundle for another dtype"],
)
def test_no_plan_where_the_fill_would_not_copy_with_helpers(model: Path, case: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    extra: dict[str, Any] = {
        "daemon_preload off": {"daemon_preload": False},
        "no helper service": {"io_helper_service": False},
        "registered mode": {"io_mode": "registered"},
        "an unknown option": {"no_such_option": 1},
        "no bundle": {"bundle": str(tmp_path / "missing")},
    }.get(case, {})
    config = _config(model, extra, load_format="auto" if case == "another load format" else LOAD_FORMAT, sleep=case == "sleep mode")
    if case == "too few cores":
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    if case == "a 4 KiB-page tmpfs":  # auto stages such files in the daemon's own process: no helpers
        from marlin_pack.vllm_plugin import gpu_reader

        monkeypatch.setattr(gpu_reader, "in_base_memory_pages", lambda path: True)
    if case == "a bundle for another dtype":
        config.model_config.dtype = torch.bfloat16
    assert preload.plan(config) is None  # never raises: the daemon's loader reports a bad bundle


@pytest.mark.parametrize("case", ["one daemon", "tp 2", "dp 2", "a draft daemon"])
def test_export_plans_only_a_single_daemon(model: Path, case: str) -> None:
    env = {preload.ENV: "left from before"}
    config = _config(model, tp=2 if case == "tp 2" else 1, dp=2 if case == "dp 2" else 1)
    found = preload.export(config, draft=case == "a draft daemon", environ=env)
    if case == "one daemon":
        assert found is not None and json.loads(env[preload.ENV]) == found
    else:
        assert found is None and preload.ENV not in env


class _FakeService:
    """Stands in for HelperService: records what the daemon asked of it."""

    made: list[_FakeService] = []
    fail: str | None = None

    def __init__(self, devices: list[int], **settings: Any) -> None:
        self.devices, self.settings, self.calls = devices, settings, []
        _FakeService.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def preload(self, files: list[str], window_mib: int) -> dict[int, int]:
        self.calls.append(("preload", files, window_mib))
        if _FakeService.fail:
            raise ServiceError(_FakeService.fail)
        return {self.devices[0]: 3 << 20}

    def stop(self) -> None:
        self.calls.append("stop")


def _spec(**changes: Any) -> dict:
    spec = {"parent": os.getppid(), "files": ["/b/tp1/rank-0.safetensors", "/b/common.safetensors"], "bytes": 3 << 20,
            "device": 1, "processes": 2, "window_mib": 256, "staged": 0, "stage_mib": 64, "nice": 0}
    return {**spec, **changes}


@pytest.fixture
def fake_service(monkeypatch: pytest.MonkeyPatch) -> type[_FakeService]:
    _FakeService.made, _FakeService.fail = [], None
    monkeypatch.setattr(preload, "HelperService", _FakeService)
    return _FakeService


def test_a_daemon_page_locks_its_bundle_in_a_private_service_then_stops_it(
    fake_service: type[_FakeService], marlin_log: list[str]
) -> None:
    env = {preload.ENV: json.dumps(_spec())}
    pl = preload.start_from_environment(env)
    assert pl is not None and preload.current() is pl
    assert preload.ENV not in env  # the daemon's own children never see the plan
    directory = preload.ready_service_dir(timeout_s=10)
    assert directory == pl.directory and directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    (service,) = fake_service.made
    assert service.devices == [1]
    assert service.settings["directory"] == directory and service.settings["processes"] == 2
    assert service.settings["retain_mib"] == 3  # room for every byte in each helper
    assert service.calls == ["start", ("preload", ["/b/tp1/rank-0.safetensors", "/b/common.safetensors"], 256)]
    assert any("page-locked in 2 copy helpers" in m for m in marlin_log)
    preload.stop()  # after the fill: in the background
    deadline = time.monotonic() + 10
    while (service.calls[-1] != "stop" or directory.exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.calls[-1] == "stop" and not directory.exists()
    assert preload.ready_service_dir() is None  # stopped: the loader starts its own helpers
    preload.stop()
    assert service.calls.count("stop") == 1  # once


@pytest.mark.parametrize("case", ["another parent", "no files", "not JSON"])
def test_a_plan_not_made_for_this_process_is_ignored(fake_service: type[_FakeService], case: str) -> None:
    raw = {"another parent": json.dumps(_spec(parent=os.getppid() + 1)), "no files": json.dumps(_spec(files=[])),
           "not JSON": "{"}[case]
    env = {preload.ENV: raw}
    assert preload.start_from_environment(env) is None
    assert preload.ENV not in env and preload.current() is None and fake_service.made == []
    assert preload.ready_service_dir() is None


def test_when_page_locking_fails_the_fill_copies_as_usual(fake_service: type[_FakeService], marlin_log: list[str]) -> None:
    fake_service.fail = "no copy helper started (no CUDA driver)"
    pl = preload.start_from_environment({preload.ENV: json.dumps(_spec())})
    assert pl is not None
    assert preload.ready_service_dir(timeout_s=10) is None
    assert any("not page-locked ahead of its copy" in m and "no copy helper started" in m for m in marlin_log)
    deadline = time.monotonic() + 10
    while fake_service.made[0].calls[-1] != "stop" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_service.made[0].calls[-1] == "stop"


def test_a_running_helper_service_for_the_gpu_wins(fake_service: type[_FakeService], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]) -> None:
    served = tmp_path / "served"
    served.mkdir(mode=0o700)
    (served / "GPU-7.0.sock").touch()
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(served))
    monkeypatch.setattr(preload, "gpu_uuid", lambda device: f"GPU-{device + 6}")
    assert preload.start_from_environment({preload.ENV: json.dumps(_spec(device=1))}) is not None
    assert preload.ready_service_dir(timeout_s=10) is None
    assert fake_service.made == []  # nothing started: the loader takes marlin-pack helpers' own
    assert any("serves this GPU already" in m for m in marlin_log)


def test_the_patched_get_draft_daemon_config_plans_the_preload(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin.patches import weight_cache

    monkeypatch.setenv(preload.ENV, "left from before")
    config = _config(model)
    assert weight_cache._daemons_spawned_for(lambda c: None)(config) is None
    assert json.loads(os.environ[preload.ENV])["files"][0].endswith("rank-0.safetensors")
    draft = object()
    assert weight_cache._daemons_spawned_for(lambda c: draft)(config) is draft
    assert preload.ENV not in os.environ


@pytest.mark.parametrize("fails", [False, True])
def test_the_daemon_stops_the_preload_after_its_fill(fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin.patches import weight_cache

    stopped: list[bool] = []
    monkeypatch.setattr(preload, "stop", lambda: stopped.append(True))

    def get_model(self: object) -> str:
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
    assert stopped == [True]


def test_the_loader_takes_the_daemons_service(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    import marlin_pack.vllm_plugin.loader as loader_mod

    pools: list[dict] = []
    monkeypatch.setattr(loader_mod, "HelperPool", lambda count, device, **kw: pools.append(kw) or "pool")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked: list[bool] = []
    monkeypatch.setattr(preload, "ready_service_dir", lambda: asked.append(True) or tmp_path)
    monkeypatch.setattr(preload, "current", lambda: "a preload under way")
    config = _config(model)
    bundle = SimpleNamespace(rank_file=model / "marlin-pack" / "tp1" / "rank-0.safetensors")
    for service in (True, False):
        loader = loader_mod.MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={
            "io_mode": "processes", "io_helper_service": service}))
        assert loader._start_helpers(config, config.model_config, bundle) == "pool"
    # Not waited for here: the pool calls it on its starting thread, while vLLM builds the model.
    assert asked == [] and pools[1]["service_dir"] is None  # no service asked for: not looked at
    assert pools[0]["service_dir"]() == tmp_path and asked == [True]


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


def test_a_spawned_daemon_begins_page_locking_before_its_configuration_is_unpickled(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin import daemon_process

    report = tmp_path / "report.json"
    monkeypatch.setenv(preload.ENV, json.dumps(_spec(parent=os.getpid(), files=[str(tmp_path / "none")])))
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(tmp_path / "sockets"))  # made by the child's (failing) service
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=daemon_process.started)  # vLLM spawns daemon_process.run_daemon: the same module
    proc.probe = _Probe(report)  # type: ignore[attr-defined]  # pickled after the target, as vLLM's config is
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert json.loads(report.read_text()) == {"started": True}


# -- engines (engine_preload) ----------------------------------------------------------------------------------


def _worker(model: Path, extra: dict | None = None, *, tp: int = 1, utilization: float = 0.9) -> SimpleNamespace:
    """What start_in_worker reads of vLLM's GPU Worker."""
    config = _config(model, extra, tp=tp)
    config.cache_config = SimpleNamespace(gpu_memory_utilization=utilization)
    return SimpleNamespace(vllm_config=config, local_rank=0)


@pytest.mark.parametrize("which", ["daemon_preload", "engine_preload"])
def test_each_role_has_its_own_option(model: Path, which: str) -> None:
    config = _config(model, {which: False})
    planned = {role: preload.plan(config, role=role) is not None for role in ("daemon", "engine")}
    assert planned == {"daemon": which != "daemon_preload", "engine": which != "engine_preload"}


def test_an_engine_worker_page_locks_its_bundle_and_keeps_the_helpers_until_the_kv_cache_is_sized(
    model: Path, fake_service: type[_FakeService], monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]
) -> None:
    rooms: list[tuple] = []
    monkeypatch.setattr(preload, "_no_room", lambda device, processes, utilization: rooms.append((device, processes, utilization)))
    pl = preload.start_in_worker(_worker(model, utilization=0.8))
    assert pl is not None and pl.engine and preload.current() is pl
    assert preload.start_in_worker(_worker(model)) is None  # one per process
    preload.await_helpers(timeout_s=10)
    assert pl.helpers_up.is_set()
    directory = preload.ready_service_dir(timeout_s=10)
    assert directory == pl.directory and (directory.stat().st_mode & 0o777) == 0o700
    assert rooms == [(0, 4, 0.8)]
    (service,) = fake_service.made
    assert [c if isinstance(c, str) else c[0] for c in service.calls] == ["start", "preload"]
    assert service.calls[1][1][0].endswith("rank-0.safetensors")
    assert any("while vLLM sets up its GPU worker" in m for m in marlin_log)
    preload.stop_after_memory_profile()
    deadline = time.monotonic() + 10
    while (service.calls[-1] != "stop" or directory.exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.calls[-1] == "stop" and not directory.exists()


@pytest.mark.parametrize("case", ["tp 2", "engine_preload off", "another load format"])
def test_no_engine_preload_where_the_loader_would_not_use_it(model: Path, case: str, fake_service: type[_FakeService]) -> None:
    worker = _worker(model, {"engine_preload": False} if case == "engine_preload off" else None, tp=2 if case == "tp 2" else 1)
    if case == "another load format":
        worker.vllm_config.load_config.load_format = "auto"
    assert preload.start_in_worker(worker) is None
    assert preload.current() is None and fake_service.made == []


def test_an_engine_whose_page_locking_failed_keeps_the_helpers_until_the_kv_cache_is_sized(
    model: Path, fake_service: type[_FakeService], monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]
) -> None:
    """Their contexts were in vLLM's memory snapshot: stopping them before the profile run's measurement would size
    the KV cache as if their memory were the engine's to use."""
    monkeypatch.setattr(preload, "_no_room", lambda *a: None)
    fake_service.fail = "out of pinnable memory"
    assert preload.start_in_worker(_worker(model)) is not None
    assert preload.ready_service_dir(timeout_s=10) is None
    assert any("engine's bundle was not page-locked" in m and "out of pinnable memory" in m for m in marlin_log)
    time.sleep(0.05)
    assert "stop" not in fake_service.made[0].calls
    preload.stop_after_memory_profile()
    deadline = time.monotonic() + 10
    while fake_service.made[0].calls[-1] != "stop" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_service.made[0].calls[-1] == "stop"


def test_an_engine_without_room_for_the_helpers_starts_none(model: Path, fake_service: type[_FakeService],
                                                           monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]) -> None:
    monkeypatch.setattr(preload, "_no_room", lambda *a: "the GPU has 20.0 GiB free of 24.0 GiB")
    assert preload.start_in_worker(_worker(model)) is not None
    preload.await_helpers(timeout_s=10)  # returns at once: nothing to wait for
    assert preload.ready_service_dir(timeout_s=10) is None
    assert fake_service.made == [] and any("20.0 GiB free of 24.0 GiB" in m for m in marlin_log)


class _FakeNvml:
    def __init__(self, free: int, total: int) -> None:
        self.info = SimpleNamespace(free=free, total=total)
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.calls.append(uuid)
        return "handle"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return self.info


@pytest.mark.parametrize(("free_gib", "room"), [(140, True), (128, False), (24, False)])
def test_room_for_the_helpers_is_measured_against_the_memory_utilization(free_gib: int, room: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.utils.import_utils as import_utils

    nvml = _FakeNvml(free_gib << 30, 141 << 30)
    monkeypatch.setattr(import_utils, "import_pynvml", lambda: nvml)
    monkeypatch.setattr(preload, "gpu_uuid", lambda device: f"GPU-{device}")
    why = preload._no_room(3, 4, 0.9)  # 0.9 of 141 GiB = 126.9 GiB; 4 helpers and the engine's own need 5 GiB
    assert (why is None) is room
    if not room:
        assert f"{free_gib:.1f} GiB free of 141.0 GiB" in why and "--gpu-memory-utilization 0.9" in why
    assert nvml.calls == ["init", "GPU-3", "shutdown"]


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


def test_a_slow_helper_start_is_waited_for(model: Path, fake_service: type[_FakeService], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preload, "_no_room", lambda *a: None)
    real_start = _FakeService.start

    def slow_start(self: _FakeService) -> None:
        time.sleep(0.3)
        real_start(self)

    monkeypatch.setattr(_FakeService, "start", slow_start)
    assert preload.start_in_worker(_worker(model)) is not None
    preload.await_helpers(timeout_s=10)
    assert fake_service.made[0].calls[0] == "start"  # the contexts exist when vLLM takes its snapshot
    preload.stop_after_memory_profile()


def test_no_room_when_nvml_cannot_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU NVML does not know by that UUID (a MIG instance): no helpers ahead, said as a reason, not a failure."""
    import vllm.utils.import_utils as import_utils

    nvml = _FakeNvml(140 << 30, 141 << 30)

    def unknown(uuid: str) -> str:
        raise LookupError(f"no GPU {uuid}")

    nvml.nvmlDeviceGetHandleByUUID = unknown  # type: ignore[method-assign]
    monkeypatch.setattr(import_utils, "import_pynvml", lambda: nvml)
    monkeypatch.setattr(preload, "gpu_uuid", lambda device: "GPU-x")
    why = preload._no_room(0, 4, 0.9)
    assert why is not None and "NVML could not say" in why and "no GPU GPU-x" in why
    assert nvml.calls == ["init", "shutdown"]
