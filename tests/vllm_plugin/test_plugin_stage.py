"""The loader at ``pipeline_parallel_size > 1``, on the CPU, with vLLM's own model classes and stand-in TP/PP groups.

Each (stage, TP rank) is built by vLLM's real model class for the checkpoint (``vllm_stage_reference``: its
``make_layers`` over ``get_pp_indices``, its ``PPMissingLayer`` placeholders); the loader places the bundle
into it and vLLM's ``process_weights_after_loading`` runs with marlin-pack's patches. Then every parameter
of the stage model must equal what stock vLLM holds on that stage after loading the checkpoint itself, and
the loader must have read exactly the stage's share of the rank file and of the common file
(:mod:`marlin_pack.vllm_plugin.stage`): measured at the reads themselves (``pread`` of the rank file, the
common file's tensors taken from its map).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bundle_reads import BundleReads, merged_spans
from torch import nn

from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.patches import scope

sr = pytest.importorskip("oracles.vllm_stage_reference")
from stage_checkpoints import dtype_of, write_stage_bundle  # noqa: E402

# kind -> (decoder layers, [(pp, tp), ...]): PP 2/3/4 x TP 1/2, uneven splits (5 layers over 2, 3 or 4 stages).
CASES: dict[str, tuple[int, list[tuple[int, int]]]] = {
    "llama": (5, [(2, 1), (3, 2), (4, 1), (2, 2)]),
    "qwen2": (5, [(3, 1), (2, 2)]),
    "qwen3": (5, [(2, 1), (4, 2)]),
    "llama-tied": (5, [(2, 1)]),
    "Gemma2ForCausalLM": (5, [(3, 1), (2, 2)]),
    "MixtralForCausalLM": (5, [(2, 1), (3, 2), (4, 1)]),
}
PARAMS = [(kind, pp, tp) for kind, (_, shapes) in CASES.items() for pp, tp in shapes]


@pytest.fixture(scope="module")
def stage_bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = write_stage_bundle(tmp_path_factory.mktemp("stage") / "m", kind, CASES[kind][0])
        return cache[kind]

    return make


@pytest.fixture(autouse=True)
def _no_preload_no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin import preload

    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.setenv("MARLIN_PACK_IO", '{"threads": 2, "window_mib": 1}')
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


def _engine(model_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tp: int, pp: int) -> tuple[Any, Any]:
    """What the loader reads of an engine of ``pp`` stages x ``tp`` ranks; its create_model builds vLLM's real model
    for the stage and rank the oracle's stand-in groups say (distributed counts as up: they are set)."""
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size_across_dp=tp * pp),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model_config = SimpleNamespace(model=str(model_dir), dtype=dtype, quantization="auto_gptq",
                                   word_embeddings_untied_by_checkpoint=False, enable_sleep_mode=False)

    def create_model(self: object, vllm_config: Any, model_config: object, prefix: str = "") -> nn.Module:
        from vllm.distributed import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        if sr.is_moe(model_dir):
            m = sr.vmr._moe_vllm()
            model, real = sr.vmr._build(model_dir, tp, dtype, m, str(vllm_config.kernel_config.moe_backend))
        else:
            model, real = sr.vr.vllm_model(model_dir, tp, tp_rank, dtype, sr.vr._vllm())
        model._real_model_config = real
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    return vllm_config, model_config


def _loader(**extra: object) -> Any:
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    return MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=dict(extra)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def _load_stage(model_dir: Path, kind: str, monkeypatch: pytest.MonkeyPatch, pp: int, stage: int, tp: int, rank: int,
                daemon: bool = False) -> tuple[dict[str, torch.Tensor], BundleReads, Any]:
    """Load (stage, rank) with the loader into vLLM's stage model and post-process it, as an engine does (``daemon``:
    as vLLM's weight-cache daemon's ``get_model`` does). Returns its parameters, what it read and its decision."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.protocol import check_ipc_quant_support

    from marlin_pack.gpu.helpers import exit_in_background
    from marlin_pack.vllm_plugin.engine import quantized_layers
    from marlin_pack.vllm_plugin.patches.post_processing import is_prepacked

    dtype = dtype_of(kind)
    vllm_config, model_config = _engine(model_dir, dtype, monkeypatch, tp, pp)
    loader = _loader()
    with monkeypatch.context() as io:
        reads = BundleReads(io, maps=True)
        with sr.stage_model(model_dir, tp, rank, dtype, (pp, stage), build=False), \
                exit_in_background() if daemon else contextlib.nullcontext(), \
                scope.in_use() if daemon else contextlib.nullcontext():  # as the patched daemon get_model enters it
            model = loader.create_model(vllm_config, model_config)
            if daemon:
                check_ipc_quant_support(model)  # vLLM's daemon: every layer can be shared as loaded
            loader.load_weights(model, model_config)
            layers = quantized_layers(model)
            assert all(is_prepacked(m) for m in layers.values())  # none on a stage without decoder layers
            process_weights_after_loading(model, model._real_model_config, torch.device("cpu"))
    got = {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}
    return got, reads, next(iter(loader._decisions.values()))


def _check_stage(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], reads: BundleReads, decision: Any,
                 pp: int, stage: int, part: bool = True) -> None:
    """Every parameter as stock vLLM holds it on the stage; exactly the stage's share read (each byte once), ``part``
    of each file."""
    assert got.keys() == want.keys(), (stage, sorted(got.keys() ^ want.keys())[:6])
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, (stage, name)
        assert torch.equal(_bits(got[name]), _bits(t)), (stage, name)
    share = decision.bundle.stage
    assert share is not None and (share.pp_size, share.pp_rank) == (pp, stage)
    rank_file, common_file = decision.bundle.rank_file, decision.bundle.common_file
    assert reads.bytes(rank_file) == share.rank_bytes and (share.rank_bytes < share.rank_file_bytes or not part)
    assert reads.spans(rank_file) == merged_spans([(i.start, i.nbytes) for i in share.rank_header.tensors.values()])
    assert reads.bytes(common_file) == share.common_bytes and (share.common_bytes < share.common_file_bytes or not part)
    assert reads.spans(common_file) == merged_spans([(i.start, i.nbytes) for i in share.common_header.tensors.values()])


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "pp", "tp"), PARAMS)
def test_each_stage_loads_what_stock_vllm_holds_reading_only_its_share(
    stage_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, kind: str, pp: int, tp: int,
) -> None:
    model_dir, dtype = stage_bundle(kind), dtype_of(kind)
    rank_totals = []
    for stage in range(pp):
        for rank in range(tp):
            want = sr.stage_params(model_dir, tp, rank, dtype, (pp, stage))
            got, reads, decision = _load_stage(model_dir, kind, monkeypatch, pp, stage, tp, rank)
            _check_stage(got, want, reads, decision, pp, stage)
            rank_totals.append(reads.bytes(decision.bundle.rank_file))
    # The stages of each TP rank together read its rank file once: every layer on exactly one stage.
    assert sum(rank_totals) == decision.bundle.stage.rank_file_bytes * tp, rank_totals


@pytest.mark.parametrize("partition", ["0,5", "5,0", "1,4"])
def test_a_named_partition_and_a_stage_without_decoder_layers(
    stage_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, partition: str,
) -> None:
    """``VLLM_PP_LAYER_PARTITION`` moves the layers (vLLM allows a stage none: it then holds only the ends)."""
    model_dir, dtype = stage_bundle("llama"), dtype_of("llama")
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    for stage in range(2):
        want = sr.stage_params(model_dir, 1, 0, dtype, (2, stage))
        got, reads, decision = _load_stage(model_dir, "llama", monkeypatch, 2, stage, 1, 0)
        _check_stage(got, want, reads, decision, 2, stage, part=False)
        share = decision.bundle.stage
        assert share.layers[1] - share.layers[0] == int(partition.split(",")[stage]) == len(share.tp_set.layers) // 4
        assert share.common_bytes < share.common_file_bytes  # the ends: the embedding or the norm and head


def test_a_weight_cache_daemon_fills_its_stage_share(stage_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's daemon runs one process per (stage, rank) with the engine's model-parallel groups and builds its
    model with the loader's create_model/load_weights: the daemon of stage 1 of 3, TP rank 1 of 2, holds its stage."""
    model_dir = stage_bundle("llama")
    want = sr.stage_params(model_dir, 2, 1, dtype_of("llama"), (3, 1))
    got, reads, decision = _load_stage(model_dir, "llama", monkeypatch, 3, 1, 2, 1, daemon=True)
    _check_stage(got, want, reads, decision, 3, 1)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_stage_read_past_the_page_cache_says_the_stage(
    stage_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, marlin_log: list[str], pp: int,
) -> None:
    """Direct reads of a stage's layers: the loader's line names the stage and its layers (PP=2), no stage at PP=1."""
    model_dir, dtype = stage_bundle("llama"), dtype_of("llama")
    monkeypatch.setenv("MARLIN_PACK_IO", '{"mode": "direct", "threads": 2, "window_mib": 1}')
    vllm_config, model_config = _engine(model_dir, dtype, monkeypatch, 1, pp)
    loader = _loader()
    with sr.stage_model(model_dir, 1, 0, dtype, (pp, pp - 1), build=False):
        model = loader.create_model(vllm_config, model_config)
        loader.load_weights(model, model_config)
    placed = next(m for m in marlin_log if m.startswith("marlin-pack: placed"))
    assert ("pp stage 1/2 (layers 3-4 of 5 layers)" in placed) is (pp == 2), placed


@pytest.mark.parametrize("fallback", [False, True])
def test_a_stage_rule_that_leaves_out_what_vllm_built_is_refused(
    stage_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, fallback: bool,
) -> None:
    """Llama with tied embeddings builds the embedding on the last stage too (its head is it): a stage rule saying
    otherwise would leave that parameter unloaded. The loader compares the rule with the model vLLM built and
    refuses in one line naming it (with fallback: loads the checkpoint the ordinary way)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from marlin_pack import pipeline
    from marlin_pack.errors import LoadRefusedError

    monkeypatch.setitem(pipeline.FIRST_LAST_STAGE, "LlamaForCausalLM", False)  # as deepseek_v2.py: not on the last stage
    ordinary: list[bool] = []
    monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: ordinary.append(True))
    model_dir, dtype = stage_bundle("llama-tied"), dtype_of("llama-tied")
    vllm_config, model_config = _engine(model_dir, dtype, monkeypatch, 1, 2)
    loader = _loader(fallback=fallback)
    with sr.stage_model(model_dir, 1, 0, dtype, (2, 1), build=False):
        if not fallback:
            with pytest.raises(LoadRefusedError, match=r"\[pp_size\] vLLM's model for pipeline stage 1/2 holds "
                                                         r"model\.embed_tokens\.weight, which marlin-pack's stage rules") as e:
                loader.create_model(vllm_config, model_config)
            assert "\n" not in str(e.value)
            return
        model = loader.create_model(vllm_config, model_config)
        loader.load_weights(model, model_config)
    assert ordinary == [True]




def test_a_stage_does_not_stage_on_the_gpu_a_large_common_tensor_its_model_lacks(
    stage_bundle: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At TP=1 on a GPU the loader reads large common tensors itself (into their parameter, or a GPU tensor for
    vLLM's weight loader). A tensor of the stage's share that vLLM did not build there (a class left on every
    stage) is handed over as a view of the file's map instead: vLLM's loader skips it without reading it."""
    from marlin_pack.gpu.host_map import HostMap
    from marlin_pack.vllm_plugin import common_tensors
    from marlin_pack.vllm_plugin.decision import EngineFacts, select_bundle
    from marlin_pack.vllm_plugin.options import LoaderOptions

    monkeypatch.setattr(common_tensors, "LARGE_COMMON", 1)  # every common tensor counts as large
    model_dir = stage_bundle("llama")

    empty = torch.empty

    def on_gpu(*shape: Any, device: Any = None, **kw: Any) -> torch.Tensor:  # a GPU tensor, as far as this test goes
        return empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", on_gpu)

    def fed(pp: int) -> tuple[list[str], list[int]]:
        """The names fed to vLLM as views of the map, and the bytes the loader read itself (staged on the GPU)."""
        facts = EngineFacts(model=str(model_dir), vllm_version="0.33.0", quantization="auto_gptq", pp_size=pp, pp_rank=pp - 1)
        bundle = select_bundle(LoaderOptions(), facts)
        staged: list[int] = []
        reader = SimpleNamespace(copy=lambda path, items: staged.extend(it.nbytes for it in items))
        with HostMap(bundle.common_file) as host:  # a model that holds none of them, on a GPU
            weights = common_tensors.common_weights(reader, host, bundle, nn.Module(), torch.device("cuda"))
            lo = host._mapping.base  # type: ignore[union-attr]
            viewed = [name for name, t in weights if lo <= t.data_ptr() < lo + host.size]
        return viewed, staged

    viewed, staged = fed(2)
    assert set(viewed) == {"model.norm.weight", "lm_head.weight", "model.layers.3.input_layernorm.weight",
                           "model.layers.3.post_attention_layernorm.weight", "model.layers.4.input_layernorm.weight",
                           "model.layers.4.post_attention_layernorm.weight"} and staged == []
    viewed, staged = fed(1)  # PP=1, as before: every large tensor staged on the GPU by the loader
    assert viewed == [] and len(staged) == 13

