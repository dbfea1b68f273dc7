"""``gpu.plan``: how a bundle reaches the GPU, decided once from plain facts (no torch, no vLLM, no GPU here).

``plan_io`` over :class:`IoFacts`: staged for a tmpfs of 4 KiB pages, registered where copy helpers do not pay or
cannot work (the reason in ``why``), helpers otherwise; ``$MARLIN_PACK_IO`` overrides the plan (benchmarks, tests).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest

from marlin_pack.gpu import plan as plan_mod
from marlin_pack.gpu.plan import ENV, HELPER_CONTEXT_BYTES, GpuRoom, IoFacts, IoPlan, helpers_fit, plan_io, usable_cores

MIB, GIB = 1 << 20, 1 << 30
BASELINE = plan_mod._PROCESS_BASELINE_BYTES  # what a vLLM process holds besides its weights, with a margin
# A machine where copy helpers pay and work: one process, 16 cores, legacy IPC, an almost empty 141 GiB GPU.
HELPERS_HERE = IoFacts(role="engine", processes=1, cores=16, legacy_ipc=True, base_pages=False, experts=False,
                       bundle_bytes=40 * GIB, gpu=GpuRoom(free=140 * GIB, total=141 * GIB), utilization=0.9, preload=True)


def plan(facts: IoFacts = HELPERS_HERE, **changes: object) -> IoPlan:
    """The plan for ``facts`` with ``changes``, without ``$MARLIN_PACK_IO``."""
    return plan_io(dataclasses.replace(facts, **changes), environ={})


# -- the three ways -----------------------------------------------------------------------------------------------


def test_helpers_where_they_pay_and_work() -> None:
    p = plan()
    assert (p.mode, p.threads, p.window, p.helpers) == ("helpers", 4, 256 * MIB, 4)
    assert (p.during_build, p.common_during_build, p.defer_unregister, p.preload) == (True, False, False, True)
    assert p.why == "4 copy helpers (16 cores, one process, room on the GPU); they page-lock the bundle ahead of the copy"


def test_a_daemon_copies_its_common_tensors_beside_and_defers_unregistering() -> None:
    """A weight-cache daemon's fill: nothing is measured after it, its helpers exit in the background."""
    p = plan(role="daemon")
    assert (p.mode, p.helpers, p.during_build, p.common_during_build, p.defer_unregister, p.preload) == (
        "helpers", 4, True, True, True, True)


@pytest.mark.parametrize("role", ["engine", "daemon"])
def test_tmpfs_of_base_pages_is_staged(role: str) -> None:
    """Page-locking a tmpfs of 4 KiB pages walks every page: a CPU copy is faster, whatever else holds."""
    for facts in (dataclasses.replace(HELPERS_HERE, role=role), IoFacts(role=role)):  # helpers would fit; or not
        p = plan(facts, base_pages=True)
        assert (p.mode, p.threads, p.window, p.helpers, p.preload) == ("staged", 8, 64 * MIB, 0, False)
        assert (p.during_build, p.common_during_build, p.defer_unregister) == (True, False, False)
        assert p.why == "the bundle is on a tmpfs of 4 KiB pages"


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"processes": 2}, "2 vLLM processes on this host"),  # TP x PP x DP: each would start helpers
        ({"processes": 8}, "8 vLLM processes on this host"),
        ({"cores": 7}, "7 cores (helpers from 8)"),
        ({"cores": 1}, "1 cores (helpers from 8)"),
        ({"legacy_ipc": False}, "GPU memory from sleep mode or expandable segments (no legacy CUDA IPC)"),
        ({"gpu": GpuRoom(free=24 * GIB, total=141 * GIB)}, "no room on the GPU for their CUDA contexts"),
        ({"gpu": None}, "the GPU's free memory is unknown"),  # no NVML, an unknown GPU
        ({"role": "daemon", "gpu": None}, "the GPU's free memory is unknown"),
        ({"role": "daemon", "gpu": GpuRoom(free=40 * GIB, total=141 * GIB)}, "no room on the GPU for their CUDA contexts"),
    ],
)
def test_registered_where_helpers_do_not_pay_or_cannot_work(changes: dict, why: str) -> None:
    p = plan(**changes)
    assert (p.mode, p.threads, p.window, p.helpers, p.preload) == ("registered", 16, 256 * MIB, 0, False)
    assert (p.common_during_build, p.defer_unregister, p.during_build) == (False, False, True)
    assert p.why == f"no copy helpers: {why}"


def test_the_first_reason_is_given() -> None:
    assert plan(processes=2, cores=2, legacy_ipc=False, gpu=None).why == "no copy helpers: 2 vLLM processes on this host"
    assert plan(cores=2, gpu=None).why == "no copy helpers: 2 cores (helpers from 8)"


def test_eight_cores_are_enough() -> None:
    assert plan(cores=8).mode == "helpers" and plan(cores=8).why.startswith("4 copy helpers (8 cores, ")


def test_the_default_facts_get_no_helpers() -> None:
    """IoFacts() says nothing about the machine (one core, no GPU): the safe way."""
    assert plan_io(IoFacts(), environ={}).mode == "registered"


@pytest.mark.parametrize("role", ["engine", "daemon"])
@pytest.mark.parametrize("changes", [{}, {"base_pages": True}, {"processes": 2}])
def test_experts_wait_for_the_construction_and_have_nothing_page_locked_ahead(role: str, changes: dict) -> None:
    """vLLM's Marlin MoE methods keep their own device placeholders: the copy waits for the model's construction."""
    p = plan(role=role, experts=True, **changes)
    assert p.during_build is False and p.common_during_build is False and p.preload is False
    assert "page-lock" not in p.why
    if not changes:
        assert p.mode == "helpers" and p.defer_unregister is (role == "daemon")


@pytest.mark.parametrize("role", ["engine", "daemon"])
def test_preload_option_off_has_nothing_page_locked_ahead(role: str) -> None:
    p = plan(role=role, preload=False)
    assert (p.mode, p.preload) == ("helpers", False)
    assert p.why == "4 copy helpers (16 cores, one process, room on the GPU)"
    assert p.common_during_build is (role == "daemon") and p.defer_unregister is (role == "daemon")


# -- room on the GPU: one rule --------------------------------------------------------------------------------------


def test_helpers_fit_an_engine_at_the_edge_of_its_utilization_share() -> None:
    """An engine needs --gpu-memory-utilization of the GPU free at vLLM's snapshot, beside the helpers and itself."""
    total = 141 * GIB
    for utilization in (0.9, 0.5, 0.95):
        edge = math.ceil(utilization * total) + 4 * HELPER_CONTEXT_BYTES + BASELINE
        facts = dataclasses.replace(HELPERS_HERE, utilization=utilization, gpu=GpuRoom(free=edge, total=total), bundle_bytes=0)
        assert helpers_fit(facts, 4)
        assert plan(facts).mode == "helpers"
        short = dataclasses.replace(facts, gpu=GpuRoom(free=edge - 1, total=total))
        assert not helpers_fit(short, 4)
        assert plan(short).why == "no copy helpers: no room on the GPU for their CUDA contexts"
        assert helpers_fit(short, 3)  # one context fewer fits
    # the bundle's size does not count for an engine (its memory is within its share)
    assert helpers_fit(dataclasses.replace(HELPERS_HERE, bundle_bytes=1 << 50), 4)


@pytest.mark.parametrize("changes", [{"preload": False}, {"experts": True}], ids=["loader's plan", "experts"])
def test_helpers_fit_an_engine_whose_helpers_start_after_vllms_snapshot_at_the_edge_of_its_bundle(changes: dict) -> None:
    """Helpers the loader starts (its own plan, or a MoE engine's: never ahead) come after vLLM's memory snapshot
    and are joined before vLLM measures again: they need room beside the bundle, not the utilization share.
    (A Qwen3-30B-A3B-shaped engine on an 80 GB H100 at 0.92 was refused them and copied at 16-23 GB/s.)"""
    total, bundle = 79 * GIB, 16 * GIB
    edge = bundle + 4 * HELPER_CONTEXT_BYTES + BASELINE
    facts = dataclasses.replace(HELPERS_HERE, bundle_bytes=bundle, utilization=0.92, gpu=GpuRoom(free=edge, total=total), **changes)
    assert facts.gpu.free < 0.92 * total  # the share would refuse them
    assert helpers_fit(facts, 4) and plan(facts).mode == "helpers"
    short = dataclasses.replace(facts, gpu=GpuRoom(free=edge - 1, total=total))
    assert not helpers_fit(short, 4)
    assert plan(short).why == "no copy helpers: no room on the GPU for their CUDA contexts"
    # ahead of the snapshot (preload, no experts) the share counts, whatever the bundle
    assert not helpers_fit(dataclasses.replace(facts, preload=True, experts=False), 4)


def test_helpers_fit_a_daemon_at_the_edge_of_its_bundle() -> None:
    """A daemon needs room for the bundle; --gpu-memory-utilization does not apply to it."""
    bundle = 37 * GIB + 12345
    edge = bundle + 4 * HELPER_CONTEXT_BYTES + BASELINE
    facts = dataclasses.replace(HELPERS_HERE, role="daemon", bundle_bytes=bundle, gpu=GpuRoom(free=edge, total=141 * GIB))
    assert helpers_fit(facts, 4) and plan(facts).mode == "helpers"
    short = dataclasses.replace(facts, gpu=GpuRoom(free=edge - 1, total=141 * GIB))
    assert not helpers_fit(short, 4) and plan(short).mode == "registered"
    assert helpers_fit(dataclasses.replace(facts, utilization=1.0), 4)  # not an engine's share


def test_helpers_never_fit_an_unknown_gpu() -> None:
    assert not helpers_fit(dataclasses.replace(HELPERS_HERE, gpu=None), 0)


def test_the_context_size_is_the_pools() -> None:
    from marlin_pack.gpu import helpers

    assert HELPER_CONTEXT_BYTES == helpers.HELPER_CONTEXT_BYTES
    assert plan().helpers == helpers.DEFAULT_PROCESSES


# -- $MARLIN_PACK_IO overrides ---------------------------------------------------------------------------------------


def overridden(value: str, facts: IoFacts = HELPERS_HERE) -> IoPlan:
    return plan_io(facts, environ={ENV: value})


def test_overrides_threads_and_window() -> None:
    p = overridden('{"threads": 2, "window_mib": 1}')
    assert (p.mode, p.threads, p.window, p.helpers, p.preload) == ("helpers", 2, MIB, 4, True)
    assert p.why == f"{plan().why} (overridden by MARLIN_PACK_IO)"
    assert overridden('{"window": 65536}').window == 65536
    assert overridden('{"window": 1073741824}').window == GIB


def test_overrides_the_mode() -> None:
    registered = IoFacts(cores=2)
    p = overridden('{"mode": "helpers"}', registered)
    assert (p.mode, p.helpers, p.threads, p.window) == ("helpers", 4, 16, 256 * MIB)  # the helpers' default count
    assert p.why == "no copy helpers: 2 cores (helpers from 8) (overridden by MARLIN_PACK_IO)"
    assert overridden('{"mode": "helpers", "helpers": 2}', registered).helpers == 2
    assert overridden('{"mode": "helpers", "helpers": 0}', registered).helpers == 4
    p = overridden('{"mode": "registered"}')  # from a helpers plan: no helpers, nothing page-locked ahead
    assert (p.mode, p.helpers, p.preload, p.threads) == ("registered", 0, False, 4)
    p = overridden('{"mode": "staged", "threads": 3, "preload": true}')
    assert (p.mode, p.helpers, p.preload, p.threads) == ("staged", 0, False, 3)


def test_overrides_the_copy_beside_the_construction() -> None:
    assert overridden('{"during_build": false}').during_build is False
    p = overridden('{"common_during_build": true, "defer_unregister": true}')
    assert (p.common_during_build, p.defer_unregister) == (True, True)
    assert overridden('{"preload": false}').preload is False


def test_the_environment_is_read_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, '{"threads": 2, "window_mib": 1}')
    assert (plan_io(HELPERS_HERE).threads, plan_io(HELPERS_HERE).window) == (2, MIB)
    assert plan_io(HELPERS_HERE, environ={}) == plan()  # a given environment only
    monkeypatch.setenv(ENV, "")  # set but empty: no overrides
    assert plan_io(HELPERS_HERE) == plan()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "MARLIN_PACK_IO='{' is not JSON; expected an object of I/O plan fields, or unset it"),
        ("threads=2", "MARLIN_PACK_IO='threads=2' is not JSON; expected an object of I/O plan fields, or unset it"),
        ("[1]", "MARLIN_PACK_IO must be a JSON object of I/O plan fields, got list"),
        ('"registered"', "MARLIN_PACK_IO must be a JSON object of I/O plan fields, got str"),
        ('{"thread": 2}', ("MARLIN_PACK_IO: unknown field 'thread'; expected some of ['common_during_build', 'defer_unregister', "
                           "'during_build', 'helpers', 'mode', 'preload', 'threads', 'why', 'window'] (or window_mib)")),
        ('{"mode": "hybrid"}', "MARLIN_PACK_IO: mode 'hybrid'; expected one of staged, registered, helpers, direct"),
        ('{"mode": "processes"}', "MARLIN_PACK_IO: mode 'processes'; expected one of staged, registered, helpers, direct"),
        ('{"threads": 0}', "MARLIN_PACK_IO: threads must be an integer in 1..64, got 0"),
        ('{"threads": 65}', "MARLIN_PACK_IO: threads must be an integer in 1..64, got 65"),
        ('{"threads": true}', "MARLIN_PACK_IO: threads must be an integer in 1..64, got True"),
        ('{"threads": "2"}', "MARLIN_PACK_IO: threads must be an integer in 1..64, got '2'"),
        ('{"threads": 2.0}', "MARLIN_PACK_IO: threads must be an integer in 1..64, got 2.0"),
        ('{"helpers": 33}', "MARLIN_PACK_IO: helpers must be an integer in 0..32, got 33"),
        ('{"helpers": -1}', "MARLIN_PACK_IO: helpers must be an integer in 0..32, got -1"),
        ('{"window": 4096}', "MARLIN_PACK_IO: window must be an integer in 65536..1073741824, got 4096"),
        ('{"window_mib": 0}', "MARLIN_PACK_IO: window must be an integer in 65536..1073741824, got 0"),
        ('{"window_mib": 2048}', "MARLIN_PACK_IO: window must be an integer in 65536..1073741824, got 2147483648"),
        ('{"window": 65537}', "MARLIN_PACK_IO: window must be a multiple of 4096 bytes, got 65537"),
        ('{"window": 100000}', "MARLIN_PACK_IO: window must be a multiple of 4096 bytes, got 100000"),
        ('{"preload": 1}', "MARLIN_PACK_IO: preload must be true or false, got 1"),
        ('{"during_build": "false"}', "MARLIN_PACK_IO: during_build must be true or false, got 'false'"),
    ],
)
def test_override_errors_are_one_line(value: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        overridden(value)
    assert str(e.value) == message


@pytest.mark.parametrize("value", ['"1"', "1.5", "true", "null"])
def test_a_window_mib_that_is_no_integer_is_refused_by_its_name(value: str) -> None:
    with pytest.raises(ValueError) as e:
        overridden(f'{{"window_mib": {value}}}')
    assert str(e.value) == f"MARLIN_PACK_IO: window_mib must be an integer (MiB), got {json.loads(value)!r}"


# -- the plan as a value ----------------------------------------------------------------------------------------------


def test_local_is_what_this_process_reads_beside_its_helpers() -> None:
    for role in ("engine", "daemon"):
        helpers = plan(role=role)
        local = helpers.local()
        assert (local.mode, local.threads, local.window, local.helpers, local.preload) == ("registered", 16, 256 * MIB, 0, False)
        # the rest of the plan is the plan's
        assert (local.during_build, local.common_during_build, local.defer_unregister, local.why) == (
            helpers.during_build, helpers.common_during_build, helpers.defer_unregister, helpers.why)
        assert local.local() is local
    for other in (plan(base_pages=True), plan(cores=2), overridden('{"mode": "registered", "threads": 3}')):
        assert other.local() is other  # staged stays staged; registered as it is (its threads, its window)


@pytest.mark.parametrize(
    "p",
    [
        IoPlan(),
        plan(),
        plan(role="daemon"),
        plan(base_pages=True),
        plan(cores=2),
        plan(experts=True, preload=False),
        overridden('{"threads": 2, "window_mib": 1, "helpers": 3}'),
        IoPlan("helpers", 4, 1 << 16, 1, why="a \"quoted\" why; ünïcode"),
    ],
    ids=["default", "helpers", "daemon", "staged", "registered", "experts", "overridden", "odd why"],
)
def test_to_json_from_json_round_trip(p: IoPlan) -> None:
    text = p.to_json()
    assert json.loads(text) == dataclasses.asdict(p)
    assert IoPlan.from_json(text) == p


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[]", r"^a carried I/O plan must be a JSON object of I/O plan fields, got list$"),
        ('{"mode": "x"}', r"^a carried I/O plan: mode 'x'"),
        ('{"threads": 0}', r"^a carried I/O plan: threads must be an integer in 1\.\.64, got 0$"),
        ('{"colour": 1}', r"^a carried I/O plan: unknown field 'colour'"),
        ("not json", r"Expecting value"),  # json's own ValueError
    ],
)
def test_from_json_refuses_what_is_not_a_plan(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IoPlan.from_json(text)


def test_from_json_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A carried plan is the other process's, overrides included: this process's $MARLIN_PACK_IO does not apply again."""
    monkeypatch.setenv(ENV, '{"threads": 7}')
    assert IoPlan.from_json(plan().to_json()) == plan()


def test_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # not Linux
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cores() == 1


# -- the facts, from vLLM's configuration (duck-typed) ----------------------------------------------------------------


def _configs(world: int = 1, sleep: bool = False, utilization: float = 0.9) -> tuple[SimpleNamespace, SimpleNamespace]:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=world),
                                  cache_config=SimpleNamespace(gpu_memory_utilization=utilization))
    return vllm_config, SimpleNamespace(enable_sleep_mode=sleep)


def test_io_facts_from_vllm_configs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from marlin_pack.vllm_plugin import io_facts as io_facts_mod

    rank, common = tmp_path / "rank-0.safetensors", tmp_path / "common.safetensors"
    rank.write_bytes(bytes(3000))
    common.write_bytes(bytes(500))
    rooms: list[int] = []
    monkeypatch.setattr(io_facts_mod, "gpu_room", lambda device: rooms.append(device) or GpuRoom(140 * GIB, 141 * GIB))
    monkeypatch.setattr(io_facts_mod, "in_base_memory_pages", lambda path: path == rank)
    monkeypatch.setattr(io_facts_mod, "cached_fraction", lambda path: 0.25 if path == rank else None)
    monkeypatch.setattr(io_facts_mod, "takes_direct_reads", lambda path: path == rank)
    monkeypatch.setattr(io_facts_mod, "available_memory", lambda: 3000 + (8 << 30) - 1)  # one byte short of the headroom
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv(ENV, raising=False)
    vllm_config, model_config = _configs(world=4, utilization=0.8)
    facts = io_facts_mod.io_facts(vllm_config, model_config, (rank, common), experts=True, role="daemon", preload=False, device=2)
    assert facts == IoFacts(role="daemon", processes=4, cores=12, legacy_ipc=True, base_pages=True, experts=True,
                            bundle_bytes=3500, gpu=GpuRoom(140 * GIB, 141 * GIB), utilization=0.8, preload=False,
                            cached=0.25, direct_reads=True, cache_room=False)  # the rank file's, not the common file's
    assert rooms == [2]
    no_gpu = io_facts_mod.io_facts(*_configs(), (rank, common), experts=False, role="engine", preload=True, device=0, gpu=False)
    assert no_gpu.gpu is None and rooms == [2]  # NVML not asked
    assert not io_facts_mod.io_facts(*_configs(sleep=True), (rank, common), experts=False, role="engine", preload=True,
                                     device=0, gpu=False).legacy_ipc
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6, Expandable_Segments: True")
    assert not io_facts_mod.io_facts(*_configs(), (rank, common), experts=False, role="engine", preload=True, device=0,
                                     gpu=False).legacy_ipc
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert io_facts_mod.io_facts(*_configs(), (rank, common), experts=False, role="engine", preload=True, device=0,
                                 gpu=False).legacy_ipc
    # plan_for: the plan of those facts (a rank file a quarter in the page cache, memory short of keeping it: read directly)
    assert io_facts_mod.plan_for(vllm_config, model_config, (rank, common), experts=False, role="engine", preload=True,
                                 device=0).mode == "direct"
    monkeypatch.setattr(io_facts_mod, "available_memory", lambda: 3000 + (8 << 30))  # the rank file and the headroom
    roomy = io_facts_mod.io_facts(*_configs(), (rank, common), experts=False, role="engine", preload=True, device=0, gpu=False)
    assert roomy.cache_room and io_facts_mod.plan_for(vllm_config, model_config, (rank, common), experts=False,
                                                      role="engine", preload=True, device=0).mode == "staged"
    monkeypatch.setattr(io_facts_mod, "cached_fraction", lambda path: 1.0)  # cached: the tmpfs of base pages wins
    assert io_facts_mod.plan_for(vllm_config, model_config, (rank, common), experts=False, role="engine", preload=True,
                                 device=0).mode == "staged"


# --- the cold path: a rank file mostly not in the page cache is read directly ---------------------------------


@pytest.mark.parametrize("base_pages", [False, True])
def test_a_cold_rank_file_is_read_directly(base_pages: bool) -> None:
    p = plan(cached=0.0, direct_reads=True, base_pages=base_pages)
    assert (p.mode, p.helpers, p.preload) == ("direct", 0, False)  # page-locking a cold map ran at 1.2 GB/s
    assert p.window % 4096 == 0 and p.threads >= 4
    assert "0% of the rank file is in the page cache and memory would not keep it there" in p.why


@pytest.mark.parametrize("role", ["engine", "daemon"])
def test_a_cold_rank_file_that_memory_keeps_is_read_through_the_page_cache(role: str) -> None:
    """One read of the disk either way; through the page cache (``pread`` into the staging buffers, the direct way's
    threads and windows) the file is left cached, so the next start is warm without reading it again."""
    p = plan(role=role, cached=0.0, direct_reads=True, cache_room=True)
    direct = plan(role=role, cached=0.0, direct_reads=True)
    assert (p.mode, p.helpers, p.preload) == ("staged", 0, False)
    assert (p.threads, p.window, p.during_build) == (direct.threads, direct.window, direct.during_build)
    assert p.hashing() is p  # the copy stages every byte: it can hash the file on the way (one read)
    assert "read through it at the disk's speed, left cached for the next start" in p.why
    assert plan(cached=0.9, direct_reads=True, cache_room=True) == plan()  # warm: the room changes nothing


@pytest.mark.parametrize(
    "changes",
    [
        dict(cached=plan_mod.COLD_BELOW, direct_reads=True),  # warm enough: the warm plan
        dict(cached=1.0, direct_reads=True),
        dict(cached=0.0, direct_reads=False),  # the file system refuses O_DIRECT: the warm plan, page by page
        dict(cached=None, direct_reads=True),  # unknown: taken as cached
    ],
    ids=["half-cached", "cached", "no-direct-reads", "unknown"],
)
def test_otherwise_the_warm_plan(changes: dict) -> None:
    assert plan(**changes) == plan()


def test_a_cold_daemon_fill_and_a_cold_mixture_of_experts_read_directly() -> None:
    assert plan(role="daemon", cached=0.1, direct_reads=True).mode == "direct"
    p = plan(experts=True, cached=0.1, direct_reads=True)
    assert p.mode == "direct" and not p.during_build  # experts: the copy waits for the construction, as before


def test_the_direct_mode_can_be_forced_for_benchmarks() -> None:
    p = plan_io(HELPERS_HERE, environ={ENV: json.dumps({"mode": "direct"})})
    assert (p.mode, p.helpers, p.preload) == ("direct", 0, False)
