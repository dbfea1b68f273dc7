"""``marlin_pack.pipeline``: each stage's decoder layers, as vLLM 0.33.0's own ``get_pp_indices`` decides them."""

from __future__ import annotations

import pytest

from marlin_pack.pipeline import PARTITION_ENV, stage_layers, stage_partition


def _vllm_indices(monkeypatch: pytest.MonkeyPatch, layers: int, rank: int, size: int, partition: str | None) -> tuple[int, int]:
    from vllm import envs
    from vllm.distributed.utils import get_pp_indices

    if partition is None:
        monkeypatch.delenv(PARTITION_ENV, raising=False)
    else:
        monkeypatch.setenv(PARTITION_ENV, partition)
    assert partition == envs.VLLM_PP_LAYER_PARTITION  # read from the environment at each use
    return tuple(get_pp_indices(layers, rank, size))  # type: ignore[return-value]


def test_even_and_uneven_splits_equal_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    for layers in (1, 2, 3, 5, 7, 16, 22, 28, 32, 36, 48, 61, 80):
        for size in range(1, 9):
            if size > layers:
                continue
            for rank in range(size):
                want = _vllm_indices(monkeypatch, layers, rank, size, None)
                assert stage_layers(layers, size, rank) == want, (layers, size, rank)


@pytest.mark.parametrize("partition", ["10,12,10", "1,30,1", "32,0,0"])
def test_a_named_partition_equals_vllms(monkeypatch: pytest.MonkeyPatch, partition: str) -> None:
    pytest.importorskip("vllm")
    for rank in range(3):
        assert stage_layers(32, 3, rank, partition) == _vllm_indices(monkeypatch, 32, rank, 3, partition)


def test_uneven_split_spares_the_last_stage() -> None:
    assert stage_partition(7, 3) == [2, 3, 2] and stage_partition(8, 3) == [3, 3, 2] and stage_partition(9, 4) == [2, 2, 3, 2]


@pytest.mark.parametrize(
    ("partition", "match"), [("a,b", "not comma-separated"), ("16,16", "names 2 stages"), ("10,10,10", "sums to 30")]
)
def test_bad_partitions_are_refused_in_one_line(partition: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stage_partition(32, 3, partition)
    with pytest.raises(ValueError, match="outside pipeline_parallel_size"):
        stage_layers(32, 3, 3, "10,11,11")
