"""``marlin_pack.pipeline``: each stage's decoder layers, as vLLM's own ``get_pp_indices`` decides them."""

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


def test_layer_index_reads_only_the_decoder_prefix() -> None:
    from marlin_pack.pipeline import layer_index

    assert layer_index("model.layers.12.mlp.down_proj", "model.layers") == 12
    assert layer_index("language_model.model.layers.3.self_attn.qkv_proj", "language_model.model.layers") == 3
    assert layer_index("visual.blocks.0.attn.qkv", "model.layers") is None  # a vision tower's layers are not decoder layers
    assert layer_index("model.layers_norm.weight", "model.layers") is None and layer_index("model.norm.weight", "model.layers") is None


_NAMES = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight",
          "model.layers.2.input_layernorm.weight", "model.layers.3.input_layernorm.weight", "model.norm.weight",
          "lm_head.weight", "visual.merger.mlp.0.weight"]


def _held(architecture: str, pp: int, tied: bool = False) -> list[set[str]]:
    from marlin_pack.pipeline import stage_common

    return [stage_common(_NAMES, architecture=architecture, checkpoint_layers="model.layers", num_layers=3, tied=tied,
                         pp_size=pp, pp_rank=s, partition=None if pp > 1 else "3") for s in range(pp)]


def test_stage_common_splits_layers_and_places_the_ends_as_the_class_builds_them() -> None:
    """4 decoder layers named, 3 in the model: layer 3 (a multi-token-prediction layer) goes to no stage."""
    first, last = _held("LlamaForCausalLM", 2)
    assert first == {_NAMES[0], _NAMES[1], _NAMES[2], _NAMES[7]}  # 3 layers over 2 stages: 2 then 1
    assert last == {_NAMES[3], _NAMES[5], _NAMES[6], _NAMES[7]}  # everything unknown goes everywhere (vLLM skips)
    tied_first, tied_last = _held("LlamaForCausalLM", 2, tied=True)
    assert "model.embed_tokens.weight" in tied_first & tied_last  # llama.py builds it on the last stage too when tied
    ds_first, ds_last = _held("DeepseekV2ForCausalLM", 2, tied=True)
    assert "model.embed_tokens.weight" in ds_first - ds_last  # deepseek_v2.py: the first stage only
    for stage in _held("Gemma2ForCausalLM", 3):  # gemma2.py builds the embedding and norm on every stage
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= stage
    assert _held("LlamaForCausalLM", 1) == [set(_NAMES) - {_NAMES[4]}]
