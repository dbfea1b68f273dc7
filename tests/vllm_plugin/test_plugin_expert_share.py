"""Expert parallelism and experts at data parallelism (:mod:`marlin_pack.vllm_plugin.expert_share`), on the CPU.

The placement functions are checked against vLLM's own (``determine_expert_map``,
``FusedMoEParallelConfig.make``, ``determine_expert_placement_strategy``). The loader is checked against vLLM's own
Mixtral and Qwen3-MoE (and DeepSeek-V3, the one whose grouped routing keeps round-robin placement) built by the MoE
oracle with stand-in TP, DP and EP groups and ``--enable-expert-parallel``: after the loader and vLLM's
post-processing every parameter equals what stock vLLM holds on that GPU after loading the checkpoint itself, and
the bytes read (every ``pread`` of each rank file) are exactly the GPU's dense layers of its TP rank file plus its
experts of the experts file.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bundle_reads import BundleReads, file_key, merged_spans
from torch import nn

from marlin_pack.errors import BundleMismatchError, LoadRefusedError
from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.decision import EngineFacts, decide
from marlin_pack.vllm_plugin.expert_share import check_experts_source, local_experts, moe_ranks, placement
from marlin_pack.vllm_plugin.options import LoaderOptions
from marlin_pack.vllm_plugin.patches import scope

vmr = pytest.importorskip("oracles.vllm_moe_reference")

_AG_RS = "allgather_reducescatter"


# --- the placement, as vLLM's own functions decide it -------------------------------------------------------------


def test_local_experts_are_vllms_expert_map() -> None:
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for num, ep, strategy in itertools.product((4, 7, 8, 10, 64), (2, 3, 4, 8), ("linear", "round_robin")):
        for rank in range(min(ep, num)):  # (vLLM's round robin fails on an EP rank past the last expert)
            count, expert_map, _ = determine_expert_map(ep, rank, num, strategy)
            held = sorted((g for g in range(num) if expert_map[g] >= 0), key=lambda g: int(expert_map[g]))
            assert local_experts(num, ep, rank, strategy) == tuple(held) and len(held) == count, (num, ep, rank, strategy)


def test_moe_ranks_are_vllms_parallel_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    for tp, dp, pcp, ep in itertools.product((1, 2, 4), (1, 2, 3), (1, 2), (False, True)):
        for dp_rank, pcp_rank, tp_rank in itertools.product(range(dp), range(pcp), range(tp)):
            monkeypatch.setattr(moe_config, "get_dp_group", lambda r=dp_rank: SimpleNamespace(rank_in_group=r))
            monkeypatch.setattr(moe_config, "get_pcp_group", lambda r=pcp_rank: SimpleNamespace(rank_in_group=r))
            monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda r=tp_rank: r)
            vllm_config = SimpleNamespace(enable_expert_parallel=ep, all2all_backend=_AG_RS, enable_eplb=False, mori_ep_v2=False)
            c = FusedMoEParallelConfig.make(tp_size_=tp, pcp_size_=pcp, dp_size_=dp, sp_size_=1, vllm_parallel_config=vllm_config)
            want = (c.tp_size, c.tp_rank, c.ep_size, c.ep_rank) if c.use_ep else (c.tp_size, c.tp_rank, 1, 0)
            got = moe_ranks(tp, tp_rank, dp, dp_rank, ep, pcp, pcp_rank)
            assert (got.tp_size, got.tp_rank, got.ep_size, got.ep_rank) == want, (tp, dp, pcp, ep, dp_rank, pcp_rank, tp_rank)


def test_placement_is_vllms() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager, determine_expert_placement_strategy

    backends = (_AG_RS, "deepep_low_latency", "deepep_high_throughput", "nixl_ep")
    for requested, groups, dp, pcp, backend, ep in itertools.product(("linear", "round_robin"), (None, 1, 2, 8), (1, 2), (1, 2),
                                                                     backends, (2, 4)):
        c = FusedMoEParallelConfig(tp_size=1, pcp_size=pcp, dp_size=dp, ep_size=ep, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0,
                                   sp_size=1, use_ep=True, all2all_backend=backend, enable_eplb=False)
        first = determine_expert_placement_strategy(requested, c, groups, 0, False)
        want = ExpertMapManager._determine_placement_strategy(SimpleNamespace(ep_size=ep, moe_parallel_config=c), first)
        got = placement(requested, ep_size=ep, num_expert_group=groups, dp_size=dp, all2all_backend=backend, pcp_size=pcp)
        assert got == want, (requested, groups, dp, pcp, backend)


# --- the decision ---------------------------------------------------------------------------------------------------


def _facts(model_dir: Path, **kw: Any) -> EngineFacts:
    return EngineFacts(model=str(model_dir), vllm_version="0.33.0", quantization="auto_awq", **kw)


def test_the_decision_takes_the_experts_from_the_tp_size_vllm_shards_them_at(moe_bundle: Any) -> None:
    model_dir = moe_bundle("MixtralForCausalLM", "awq", torch.float16)
    sel = decide(LoaderOptions(), _facts(model_dir, tp_size=2, tp_rank=1, expert_parallel=True)).bundle
    assert sel is not None and sel.experts is not None
    assert sel.rank_file.parts[-2:] == ("tp2", "rank-1.safetensors") and sel.experts.rank_file.parts[-2:] == ("tp1", "rank-0.safetensors")
    assert sel.experts.experts == (2, 3) and {e.num_experts for e in sel.tp_set.moe_layers} == {2}
    assert not [n for n in sel.rank_header.tensors if ".experts." in n]  # the rank file's own experts are not read
    assert sel.experts.text() == "experts 2-3 of 4 (ep rank 1/2, linear) from tp1/rank-0"
    # EP over two replicas of TP 2: EP rank dp_rank * 2 + tp_rank of 4
    sel = decide(LoaderOptions(), _facts(model_dir, tp_size=2, tp_rank=0, dp_size=2, dp_rank=1, expert_parallel=True)).bundle
    assert sel is not None and sel.experts is not None and sel.experts.experts == (2,)
    assert (sel.experts.ranks.ep_size, sel.experts.ranks.ep_rank) == (4, 2)
    # DP without EP: the experts of the flattened TP rank of tp x dp
    sel = decide(LoaderOptions(), _facts(model_dir, tp_size=1, dp_size=2, dp_rank=1)).bundle
    assert sel is not None and sel.experts is not None and sel.experts.rank_file.parts[-2:] == ("tp2", "rank-1.safetensors")
    assert sel.rank_file.parts[-2:] == ("tp1", "rank-0.safetensors") and sel.experts.experts == (0, 1, 2, 3)
    # prefill context parallelism is flattened with DP as well (flatten_tp_across_dp_and_pcp)
    sel = decide(LoaderOptions(), _facts(model_dir, tp_size=1, pcp_size=2, pcp_rank=1)).bundle
    assert sel is not None and sel.experts is not None and sel.experts.rank_file.parts[-2:] == ("tp2", "rank-1.safetensors")
    # nothing changes where the experts are the rank's own: EP over one GPU, or neither EP nor DP
    for facts in (_facts(model_dir, expert_parallel=True), _facts(model_dir, tp_size=2, tp_rank=1)):
        sel = decide(LoaderOptions(), facts).bundle
        assert sel is not None and sel.experts is None and any(".experts." in n for n in sel.rank_header.tensors)


def test_a_bundle_without_the_tp_size_is_refused_naming_the_convert_to_run(moe_bundle: Any) -> None:
    model_dir = moe_bundle("MixtralForCausalLM", "awq", torch.float16, tps=(2,))
    with pytest.raises(LoadRefusedError, match=r"\[ep_size\] --enable-expert-parallel over 2 GPUs: vLLM gives each whole "
                                               rf"experts, which the tp1 rank file holds; the bundle has tp 2: run `marlin-pack "
                                               rf"convert {model_dir} --tp 1,2`") as e:
        decide(LoaderOptions(), _facts(model_dir, tp_size=2, expert_parallel=True))
    assert "\n" not in str(e.value)
    with pytest.raises(LoadRefusedError, match=r"\[dp_size\] --data-parallel-size 2: vLLM shards each experts layer "
                                               r"over the 2 x 2 tensor x data parallel ranks, which the tp4 rank files hold; "
                                               r"the bundle has tp 2: run `marlin-pack convert .* --tp 2,4`"):
        decide(LoaderOptions(), _facts(model_dir, tp_size=2, dp_size=2))
    assert decide(LoaderOptions(fallback=True), _facts(model_dir, tp_size=2, dp_size=2)).field == "dp_size"
    # a TP size convert cannot write (g128 over 512 / 8 = 64 intermediate features a rank) is not suggested
    with pytest.raises(LoadRefusedError, match=r"\[dp_size\] .* which the tp8 rank files hold, and this checkpoint cannot be "
                                               r"split into tp 8 \(marlin-pack convert accepts --tp 1,2,4\); serve it with "
                                               r"--enable-expert-parallel \(whole experts, from tp1\) or a smaller "
                                               r"--data-parallel-size"):
        decide(LoaderOptions(), _facts(model_dir, tp_size=2, dp_size=4))


def test_deepseek_with_sequence_parallel_moe_is_refused(moe_bundle: Any) -> None:
    """DeepSeek at EP with TP > 1 and DP > 1: vLLM builds its shared experts unsharded (use_sequence_parallel_moe)."""
    from marlin_pack.vllm_plugin.decision import load_manifest

    manifest = load_manifest(moe_bundle("MixtralForCausalLM", "awq", torch.float16) / "marlin-pack")
    kw = {"tp_size": 2, "dp_size": 2, "expert_parallel": True}
    with pytest.raises(BundleMismatchError, match=r"DeepseekV3ForCausalLM with --enable-expert-parallel at "
                                                  r"--tensor-parallel-size 2 x --data-parallel-size 2: .*disable_tp"):
        check_experts_source(manifest, "m", architecture="DeepseekV3ForCausalLM", **kw)
    assert check_experts_source(manifest, "m", architecture="MixtralForCausalLM", **kw) == 1


# --- the loader, against stock vLLM ---------------------------------------------------------------------------------


def _load(model_dir: Path, quantization: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tp: int, tp_rank: int,
          dp: int, dp_rank: int, parallel: dict[str, Any], daemon: bool = False,
          pp: tuple[int, int] = (1, 0), extra: dict[str, Any] | None = None,
          io_plan: str | None = '{"threads": 2, "window_mib": 1}') -> tuple[dict[str, torch.Tensor], BundleReads, Any]:
    """Load GPU (dp_rank, tp_rank) of pipeline stage ``pp`` (size, stage) with the loader into vLLM's model built with
    ``parallel`` and stand-in groups, and post-process it, as an engine does (``daemon``: as vLLM's weight-cache
    daemon's ``get_model``). ``extra``: the loader's options; ``io_plan``: ``$MARLIN_PACK_IO`` (None: as set)."""
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.protocol import check_ipc_quant_support

    from marlin_pack.gpu.helpers import exit_in_background
    from marlin_pack.vllm_plugin import preload
    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    monkeypatch.setattr(preload, "_CURRENT", None)
    if io_plan is not None:
        monkeypatch.setenv("MARLIN_PACK_IO", io_plan)
    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(), speculative_config=None, cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        device_config=SimpleNamespace(device=torch.device("cpu")),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp[0], world_size_across_dp=tp * dp * pp[0],
                                        data_parallel_size=dp, data_parallel_rank=dp_rank, all2all_backend=_AG_RS,
                                        enable_expert_parallel=parallel.get("enable_expert_parallel", False),
                                        expert_placement_strategy=parallel.get("expert_placement_strategy", "linear")),
    )
    model_config = SimpleNamespace(model=str(model_dir), dtype=dtype, quantization=quantization,
                                   word_embeddings_untied_by_checkpoint=False, enable_sleep_mode=False)

    def create_model(self: object, vllm_config: Any, model_config: object, prefix: str = "") -> nn.Module:
        m = vmr._moe_vllm()
        model, real = vmr._build(model_dir, tp, dtype, m, str(vllm_config.kernel_config.moe_backend), parallel)
        model._real_model_config = real
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    from vllm.config.load import LoadConfig

    loader = MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=dict(extra or {})))
    with monkeypatch.context() as io:
        reads = BundleReads(io)
        with vmr.vr._LOCK, vmr._moe_patched(tp, tp_rank, dp=(dp, dp_rank), pp=pp) as m, m.base.set_default_torch_dtype(dtype), \
                exit_in_background() if daemon else contextlib.nullcontext(), \
                scope.in_use() if daemon else contextlib.nullcontext():  # as the patched daemon get_model enters it
            model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
            if daemon:
                check_ipc_quant_support(model)  # vLLM's daemon: every layer can be shared as loaded
            loader.load_weights(model, model_config)  # type: ignore[arg-type]
            process_weights_after_loading(model, model._real_model_config, torch.device("cpu"))
    got = {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}
    return got, reads, next(iter(loader._decisions.values()))


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], reads: BundleReads, decision: Any) -> None:
    for name, t in want.items():
        if name.endswith(".qzeros") and t.numel() == 0:
            continue
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
    sel = decision.bundle
    share = sel.experts
    rank_key, experts_key = (file_key(p) for p in (sel.rank_file, share.rank_file))
    want_reads: dict[str, list[tuple[int, int]]] = defaultdict(list)
    want_reads[rank_key] += [(i.start, i.nbytes) for i in sel.rank_header.tensors.values()]
    want_reads[experts_key] += [p for i in share.header.tensors.values() for p in share.pieces(i)]
    assert {k: merged_spans(v) for k, v in reads.ranges.items()} == {k: merged_spans(v) for k, v in want_reads.items()}
    if experts_key != rank_key:
        assert sum(n for _, n in reads.ranges[experts_key]) == share.read_bytes


EP_CASES = {
    # architecture, format, dtype, tp, dp, placement asked for, EP
    "mixtral-awq-tp2-ep2": ("MixtralForCausalLM", "awq", torch.float16, 2, 1, "linear", True),
    "mixtral-awq-dp4-ep4-rr": ("MixtralForCausalLM", "awq", torch.float16, 1, 4, "round_robin", True),
    "qwen3moe-gptq-dp2-ep2": ("Qwen3MoeForCausalLM", "gptq", torch.bfloat16, 1, 2, "linear", True),
    "qwen3moe-gptq-tp2xdp2-ep4-rr": ("Qwen3MoeForCausalLM", "gptq", torch.bfloat16, 2, 2, "round_robin", True),
    "mixtral-awq-dp2-no-ep": ("MixtralForCausalLM", "awq", torch.float16, 1, 2, "linear", False),
    "qwen3moe-ct-asym-tp2-ep2": ("Qwen3MoeForCausalLM", "ct-asym", torch.bfloat16, 2, 1, "linear", True),
    "mixtral-ct-dp2-no-ep": ("MixtralForCausalLM", "ct", torch.float16, 1, 2, "linear", False),
}
QUANTIZATION = {"awq": "auto_awq", "gptq": "auto_gptq", "ct": "compressed-tensors", "ct-asym": "compressed-tensors"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EP_CASES))
def test_each_gpu_loads_what_stock_vllm_holds_reading_only_its_experts(
    moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    """Every (replica, TP rank): the loader's tensors after vLLM's post-processing equal stock vLLM's, placed by vLLM
    (round robin falls back to linear for these classes, as marlin-pack says), reading exactly the GPU's share."""
    arch, fmt, dtype, tp, dp, strategy, ep = EP_CASES[case]
    model_dir = moe_bundle(arch, fmt, dtype, tps=(1, 2, 4))
    parallel = {"enable_expert_parallel": ep, "expert_placement_strategy": strategy}
    quantization = QUANTIZATION[fmt]
    seen: list[tuple[int, ...]] = []
    for dp_rank, tp_rank in itertools.product(range(dp), range(tp)):
        info: dict[str, Any] = {}
        want = vmr.reference_moe_rank_tensors(model_dir, tp, tp_rank, dtype, info=info, dp=(dp, dp_rank), parallel=parallel)
        got, reads, decision = _load(model_dir, quantization, dtype, monkeypatch, tp, tp_rank, dp, dp_rank, parallel)
        share = decision.bundle.experts
        for layer in info["layers"].values():
            assert layer["placement"] == share.placement == "linear"
            if ep:
                assert [g for g in share.experts] == sorted((g for g, i in enumerate(layer["expert_map"]) if i >= 0),
                                                            key=lambda g: layer["expert_map"][g])
        _check(got, want, reads, decision)
        seen.append(share.experts)
    if ep:  # the EP ranks hold every expert once
        assert sorted(e for ids in seen for e in ids) == list(range(4))


def test_round_robin_placement_of_grouped_routing(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 (n_group 2, 8 experts): vLLM keeps round-robin placement at EP over TP ranks; each GPU's experts
    are every second expert, gathered from the tp1 file."""
    model_dir = moe_bundle("DeepseekV3ForCausalLM", "gptq", torch.float16, tps=(1, 2))
    parallel = {"enable_expert_parallel": True, "expert_placement_strategy": "round_robin"}
    for tp_rank in range(2):
        info: dict[str, Any] = {}
        want = vmr.reference_moe_rank_tensors(model_dir, 2, tp_rank, torch.float16, info=info, parallel=parallel)
        got, reads, decision = _load(model_dir, "auto_gptq", torch.float16, monkeypatch, 2, tp_rank, 1, 0, parallel)
        share = decision.bundle.experts
        assert {layer["placement"] for layer in info["layers"].values()} == {"round_robin"} == {share.placement}
        assert share.experts == tuple(range(tp_rank, 8, 2))
        _check(got, want, reads, decision)


def test_a_pipeline_stage_at_expert_parallelism_reads_its_layers_and_its_experts(
    moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PP 2 x TP 2 with EP: each (stage, rank) holds every parameter stock vLLM's stage model holds, reading its
    stage's dense layers of its TP rank file and its experts of its stage's layers of the tp1 file, nothing else."""
    model_dir = moe_bundle("Qwen3MoeForCausalLM", "gptq", torch.bfloat16, tps=(1, 2, 4))
    parallel = {"enable_expert_parallel": True}
    dtype = torch.bfloat16
    for stage, tp_rank in itertools.product(range(2), range(2)):
        with vmr.vr._LOCK, vmr._moe_patched(2, tp_rank, pp=(2, stage)) as m, m.base.set_default_torch_dtype(dtype):
            ref, real = vmr._build(model_dir, 2, dtype, m, "marlin", parallel)
            ref.load_weights(vmr.vr._all_tensors(model_dir))
            m.base.process_weights_after_loading(ref, real, torch.device("cpu"))
            want = {n: p.data.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        got, reads, decision = _load(model_dir, "auto_gptq", dtype, monkeypatch, 2, tp_rank, 1, 0, parallel, pp=(2, stage))
        share = decision.bundle.experts
        assert decision.bundle.stage is not None and share.experts == ((0, 1), (2, 3))[tp_rank]
        assert {n.split(".")[2] for n in share.header.tensors} == {str(stage)}  # model.layers.<stage>: one layer a stage
        assert got.keys() == want.keys()
        _check(got, want, reads, decision)


def test_a_weight_cache_daemon_fills_its_experts(moe_bundle: Any, patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's daemon (0.31+) builds its model with the engine's TP/DP/EP groups and the loader's create_model and
    load_weights (weight_cache/daemon.py): a daemon of EP rank 3 of 4 holds what that engine GPU holds."""
    model_dir = moe_bundle("MixtralForCausalLM", "awq", torch.float16, tps=(1, 2, 4))
    parallel = {"enable_expert_parallel": True}
    want = vmr.reference_moe_rank_tensors(model_dir, 2, 1, torch.float16, dp=(2, 1), parallel=parallel)
    got, reads, decision = _load(model_dir, "auto_awq", torch.float16, monkeypatch, 2, 1, 2, 1, parallel, daemon=True)
    assert decision.bundle.experts.experts == (3,)
    _check(got, want, reads, decision)
