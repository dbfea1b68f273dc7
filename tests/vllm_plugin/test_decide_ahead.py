"""``decide_ahead``: the loader's decision made on a thread before the load, used only for the same options and
facts, a bundle whose files did not change since, and a decision that selected a bundle."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from marlin_pack.vllm_plugin import decide_ahead
from marlin_pack.vllm_plugin.decision import Decision, EngineFacts, decide
from marlin_pack.vllm_plugin.options import LoaderOptions


@pytest.fixture
def model(make_bundle, damaged_copy) -> Path:  # noqa: ANN001 - conftest factories
    return damaged_copy(make_bundle("awq"))  # a copy of its own: tests here touch its files


def facts(model: Path, **kw: object) -> EngineFacts:
    return EngineFacts(model=str(model), vllm_version="0.33.0", quantization="awq", **kw)  # type: ignore[arg-type]


def test_taken_once_for_the_same_options_and_facts(model: Path) -> None:
    calls: list[EngineFacts] = []

    def counting(options: LoaderOptions, f: EngineFacts) -> Decision:
        calls.append(f)
        return decide(options, f)

    decide_ahead.start(LoaderOptions(), facts(model), counting)
    taken = decide_ahead.take(LoaderOptions(), facts(model))
    assert taken is not None and calls == [facts(model)]
    decision, seconds = taken
    assert decision.bundle is not None and decision.bundle.rank_file.is_file() and seconds >= 0
    assert decision.bundle.manifest == decide(LoaderOptions(), facts(model)).bundle.manifest  # type: ignore[union-attr]
    assert decide_ahead.take(LoaderOptions(), facts(model)) is None  # taken: the loader decides a second model itself


@pytest.mark.parametrize(
    "options, engine",
    [
        (LoaderOptions(fallback=True), {}),  # other options
        (LoaderOptions(), {"tp_rank": 1, "tp_size": 2}),  # the rank guessed before distributed was up, wrong
        (LoaderOptions(), {"dtype": "bfloat16"}),
    ],
)
def test_other_options_or_facts_are_decided_again(model: Path, options: LoaderOptions, engine: dict) -> None:
    decide_ahead.start(LoaderOptions(), facts(model))
    assert decide_ahead.take(options, facts(model, **engine)) is None


@pytest.mark.parametrize("which", ["manifest.json", "rank", "common"])
def test_a_file_changed_since_is_decided_again(model: Path, which: str) -> None:
    ahead = decide_ahead.start(LoaderOptions(), facts(model))
    assert ahead.done.wait(30) and ahead.decision is not None
    bundle = ahead.decision.bundle
    path = {"manifest.json": bundle.bundle_dir / "manifest.json", "rank": bundle.rank_file, "common": bundle.common_file}[which]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # an edit in between: a new mtime
    assert decide_ahead.take(LoaderOptions(), facts(model)) is None


def test_refusals_and_fallbacks_are_left_to_the_loader(model: Path, tmp_path: Path) -> None:
    decide_ahead.start(LoaderOptions(), facts(model, tp_size=8))  # refused: the bundle holds TP 1
    assert decide_ahead.take(LoaderOptions(), facts(model, tp_size=8)) is None
    decide_ahead.start(LoaderOptions(fallback=True), facts(tmp_path))  # no bundle: a fallback decision
    assert decide_ahead.take(LoaderOptions(fallback=True), facts(tmp_path)) is None


def test_other_load_formats_are_left_alone() -> None:
    worker = SimpleNamespace(vllm_config=SimpleNamespace(load_config=SimpleNamespace(load_format="auto")))
    assert decide_ahead.start_in_worker(worker) is None
    assert decide_ahead.start_in_worker(SimpleNamespace()) is None  # never raises


def test_a_decision_still_running_is_waited_for_not_made_again(model: Path) -> None:
    """Deciding again would read and hash the same files from the start: the loader waits for the one under way."""
    import threading

    gate = threading.Event()
    calls: list[EngineFacts] = []

    def slow(options: LoaderOptions, f: EngineFacts) -> Decision:
        calls.append(f)
        assert gate.wait(30)
        return decide(options, f)

    decide_ahead.start(LoaderOptions(), facts(model), slow)
    taken: list[object] = []
    taker = threading.Thread(target=lambda: taken.append(decide_ahead.take(LoaderOptions(), facts(model))))
    taker.start()
    taker.join(0.3)
    assert taker.is_alive() and taken == []  # still waiting
    gate.set()
    taker.join(30)
    assert len(calls) == 1 and taken and taken[0] is not None


@pytest.mark.parametrize(("rank", "tp_rank", "pp_rank"), [(0, 0, 0), (1, 1, 0), (4, 0, 2), (5, 1, 2)])
def test_a_worker_guesses_its_tp_rank_and_pipeline_stage_from_its_rank(
    monkeypatch: pytest.MonkeyPatch, rank: int, tp_rank: int, pp_rank: int,
) -> None:
    """vLLM lays out a replica's ranks as pp_rank * tp_size + tp_rank (tp 2 x pp 3 here): the facts decided ahead are
    the ones the loader gathers once distributed is up, so the decision is taken."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config.kernel import KernelConfig

    from marlin_pack._constants import LOAD_FORMAT

    started: list[EngineFacts] = []
    monkeypatch.setattr(decide_ahead, "start", lambda options, facts: started.append(facts))
    vllm_config = SimpleNamespace(
        load_config=SimpleNamespace(load_format=LOAD_FORMAT, model_loader_extra_config={}),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=3),
        kernel_config=KernelConfig(),
        model_config=SimpleNamespace(model="/m", dtype=torch.float16, quantization=None),
    )
    decide_ahead.start_in_worker(SimpleNamespace(vllm_config=vllm_config, rank=rank))
    assert [(f.tp_size, f.tp_rank, f.pp_size, f.pp_rank) for f in started] == [(2, tp_rank, 3, pp_rank)]


def test_an_experts_file_changed_since_is_decided_again(tmp_path: Path) -> None:
    """At expert parallelism a GPU also reads its experts from the tp1 rank file (expert_share.py): an edit of it in
    between is decided again too."""
    import torch
    from moe_checkpoints import write_moe_checkpoint

    from marlin_pack import convert

    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq", dtype=torch.float16)
    convert(model, tp=(1, 2), kernel="marlin")
    ep = facts(model, tp_size=2, tp_rank=1, expert_parallel=True)
    ahead = decide_ahead.start(LoaderOptions(), ep)
    assert ahead.done.wait(30) and ahead.decision is not None
    path = ahead.decision.bundle.experts.rank_file
    assert path.parts[-2:] == ("tp1", "rank-0.safetensors") and path != ahead.decision.bundle.rank_file
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert decide_ahead.take(LoaderOptions(), ep) is None


def test_a_worker_takes_its_replica_and_expert_parallelism_from_vllms_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM sets data_parallel_rank on each replica's parallel config before its workers start: the facts decided ahead
    carry it and the EP settings, as the loader's (engine_facts) will."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config.kernel import KernelConfig

    from marlin_pack._constants import LOAD_FORMAT

    started: list[EngineFacts] = []
    monkeypatch.setattr(decide_ahead, "start", lambda options, facts: started.append(facts))
    vllm_config = SimpleNamespace(
        load_config=SimpleNamespace(load_format=LOAD_FORMAT, model_loader_extra_config={}),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=2,
                                        data_parallel_rank=1, enable_expert_parallel=True, expert_placement_strategy="round_robin",
                                        all2all_backend="deepep_low_latency"),
        kernel_config=KernelConfig(),
        model_config=SimpleNamespace(model="/m", dtype=torch.float16, quantization=None),
    )
    decide_ahead.start_in_worker(SimpleNamespace(vllm_config=vllm_config, rank=1))
    assert [(f.tp_rank, f.dp_size, f.dp_rank, f.expert_parallel, f.expert_placement, f.all2all_backend) for f in started] == [
        (1, 2, 1, True, "round_robin", "deepep_low_latency")]
