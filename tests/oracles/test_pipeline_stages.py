"""Pipeline parallelism needs no new files: what stock vLLM holds on stage ``s``, TP rank ``r`` is exactly the
bundle's TP rank file restricted to the decoder layers :func:`marlin_pack.pipeline.stage_layers` gives the stage.

vLLM's own model classes are built with stand-in TP and PP groups (``vllm_reference``, ``pp=(size, stage)``), so
the layers each stage builds (``make_layers`` over ``get_pp_indices``) and loads are vLLM's. Groundwork of issue 51:
the loader's per-stage loading builds on this.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from marlin_pack import convert
from marlin_pack.pipeline import stage_layers

pytest.importorskip("vllm")
from oracles.vllm_reference import reference_rank_tensors  # noqa: E402

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.int32, torch.int64) else t.view(torch.int16)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize(("layers", "pp", "tp"), [(5, 2, 1), (5, 3, 2), (7, 4, 1), (4, 2, 2)])
def test_a_stage_holds_its_layers_of_the_tp_rank_file(tmp_path: Path, preset: str, layers: int, pp: int, tp: int) -> None:
    from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint

    shape = dataclasses.replace(PRESETS[preset], num_hidden_layers=layers)
    model = write_gptq_checkpoint(tmp_path / "m", shape, group_size=64, tokenizer=False)
    convert(model, tp=(tp,), kernel="marlin")
    for rank in range(tp):
        got = load_file(str(model / "marlin-pack" / f"tp{tp}" / f"rank-{rank}.safetensors"))
        for stage in range(pp):
            want = reference_rank_tensors(model, tp, rank, torch.float16, pp=(pp, stage))
            start, end = stage_layers(layers, pp, stage)
            held = {int(_LAYER.search(n).group(1)) for n in want}  # type: ignore[union-attr]
            assert held == set(range(start, end)), (stage, held)
            subset = {n: t for n, t in got.items() if start <= int(_LAYER.search(n).group(1)) < end}  # type: ignore[union-attr]
            empty = {n for n, t in want.items() if t.numel() == 0}  # GPTQ's empty zero points: not in bundles
            assert subset.keys() == want.keys() - empty, (stage, rank)
            for name, t in subset.items():
                assert t.dtype == want[name].dtype and torch.equal(_bits(t), _bits(want[name])), name


def test_a_named_partition_moves_the_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_PP_LAYER_PARTITION=4,1`` instead of the default 3,2 of five layers: vLLM and stage_layers agree."""
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint

    model = write_awq_checkpoint(tmp_path / "m", dataclasses.replace(PRESETS["tiny"], num_hidden_layers=5), tokenizer=False)
    assert stage_layers(5, 2, 1, partition="3,2") == (3, 5)  # the default split, for contrast
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,1")
    for stage, expected in ((0, (0, 4)), (1, (4, 5))):
        want = reference_rank_tensors(model, 1, 0, torch.float16, pp=(2, stage))
        assert {int(_LAYER.search(n).group(1)) for n in want} == set(range(*expected))  # type: ignore[union-attr]
        assert stage_layers(5, 2, stage) == expected


# Architectures whose stage rules (marlin_pack.pipeline.stage_common) are checked against vLLM's stage models:
# the first/last-stage classes (tied embeddings too: Granite) and the every-stage ones (Gemma 2, the MoE classes).
_COMMON_KINDS = ["llama", "llama-tied", "qwen2", "qwen3", "GraniteForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM"]
# Multimodal (Qwen2.5-VL tied, Qwen2-VL untied): the language model exactly; the vision tower and projector go to
# every stage, where vLLM builds them unless its V2 model runner leaves them to the first stage (as here).
_MULTIMODAL_KINDS = ["Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration", "Gemma3ForConditionalGeneration",
                     "Mistral3ForConditionalGeneration"]
# Mistral 3 is left on every stage (its language model builds the embedding on the last stage even with an untied
# text config): only "nothing left out" holds, its stages also read the ends vLLM skips there.
_EVERY_STAGE_ON_PURPOSE = {"Mistral3ForConditionalGeneration"}
_TOWERS = ("visual.", "vision_tower.", "multi_modal_projector.", "model.visual.", "model.vision_tower.", "model.multi_modal_projector.")


@pytest.mark.slow
@pytest.mark.parametrize("kind", _COMMON_KINDS + _MULTIMODAL_KINDS)
def test_a_stage_loads_exactly_the_common_tensors_stage_common_gives_it(tmp_path: Path, kind: str) -> None:
    """Every name of ``common.safetensors`` fed alone to vLLM's own stage model: it loads exactly the names
    ``stage_common`` gives the stage (layers by index, embedding/norm/head as the class builds them), 5 layers
    over 2 and 3 stages (multimodal: 2 over 2)."""
    from stage_checkpoints import dtype_of, write_stage_bundle

    from marlin_pack.pipeline import layer_index, stage_common
    from marlin_pack.vllm_plugin.stage import model_facts
    from oracles.vllm_stage_reference import stage_loads

    multimodal = kind in _MULTIMODAL_KINDS  # their tiny configs have 2 layers
    model = write_stage_bundle(tmp_path / "m", kind, 2 if multimodal else 5, tp=(1,))
    common = load_file(str(model / "marlin-pack" / "common.safetensors"))
    checkpoint_layers, num_layers, tied = model_facts(json.loads((model / "config.json").read_text()), list(common))
    architecture = json.loads((model / "config.json").read_text())["architectures"][0]
    for pp in (2,) if multimodal else (2, 3):
        held: list[set[str]] = []
        for stage in range(pp):
            want = stage_loads(model, 1, 0, dtype_of(kind), (pp, stage), common.items())
            got = stage_common(common, architecture=architecture, checkpoint_layers=checkpoint_layers, num_layers=num_layers,
                               tied=tied, pp_size=pp, pp_rank=stage)
            assert want <= got, (kind, pp, stage, sorted(want - got))  # nothing vLLM loads there is left out
            held.append(got)
            if kind in _EVERY_STAGE_ON_PURPOSE:
                def decoder(names: set[str]) -> set[str]:
                    return {n for n in names if layer_index(n, checkpoint_layers) is not None}

                assert decoder(got) == decoder(want) and got - decoder(got) == set(common) - decoder(set(common)), stage
                continue
            towers = {n for n in got - want if n.startswith(_TOWERS)} if multimodal else set()
            assert got - towers == want, (kind, pp, stage, sorted(got ^ want))
        assert set().union(*held) >= {n for n in common if ".layers." in n}  # every layer's tensors somewhere


def test_each_oracle_model_gets_a_fresh_pipeline_missing_cache(tmp_path: Path) -> None:
    """vLLM caches a model's pipeline-missing layers by ``id(model)`` for the life of the process; a model built at a
    dead one's address would load with the dead one's list (seen: a DeepSeek stage model raising KeyError for a layer
    it lacks, a TP oracle leaving a weight unloaded). Each oracle context starts with an empty cache."""
    import vllm.model_executor.models.utils as model_utils
    from stage_checkpoints import dtype_of, write_stage_bundle

    from oracles.vllm_stage_reference import stage_model

    model = write_stage_bundle(tmp_path / "m", "llama", 5, tp=(1,))
    with stage_model(model, 1, 0, dtype_of("llama"), (3, 1)) as (m, _):
        assert "model.layers.4." in model_utils.get_pp_missing_layer_names(m)
        model_utils._model_to_pp_missing_layer_names[-1] = []  # what a dead model leaves behind
    with stage_model(model, 1, 0, dtype_of("llama"), (3, 2)) as (m, _):
        assert -1 not in model_utils._model_to_pp_missing_layer_names
        assert "model.layers.0." in model_utils.get_pp_missing_layer_names(m)
    assert -1 not in model_utils._model_to_pp_missing_layer_names  # the process's own cache was left as it was
