"""Mixture-of-experts bundles from a bucket, on the CPU against a real S3 server (moto's, ``conftest.s3``): at plain
tensor parallelism, with expert parallelism (whole experts of the tp1 file, linear and round-robin placement, its own
file at TP 1), at data parallelism without it (the experts of tp<tp x dp>), and a pipeline stage at EP. Each GPU's
parameters after the loader and vLLM's post-processing equal those of the same load from the local bundle and stock
vLLM's (the MoE oracle's groups and layers, ``test_plugin_expert_share``'s ``_load``), bit for bit; it streams its TP
rank file without the experts tensors, and of the experts' file only the blocks holding its experts."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_plugin"))  # the loader tests' helpers

from marlin_pack.remote.push import push  # noqa: E402

vmr = pytest.importorskip("oracles.vllm_moe_reference")
from test_plugin_expert_share import QUANTIZATION, _load  # noqa: E402

BLOCK = 64 << 10


@pytest.fixture(autouse=True)
def _patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from marlin_pack.vllm_plugin import patches, preload, register

    register()
    patches.uninstall_all()
    monkeypatch.setattr(preload, "_CURRENT", None)
    assert patches.install()
    yield
    patches.uninstall_all()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``make(arch, fmt, dtype, tps)``: a tiny MoE checkpoint converted for ``tps`` (as tests/vllm_plugin's moe_bundle)."""
    from moe_checkpoints import write_moe_checkpoint

    from marlin_pack import convert

    cache: dict[tuple, Path] = {}

    def make(arch: str, fmt: str, dtype: torch.dtype, tps: tuple[int, ...]) -> Path:
        key = (arch, fmt, dtype, tps)
        if key not in cache:
            ct = {"fmt": "compressed-tensors", "symmetric": fmt == "ct"} if fmt.startswith("ct") else {"fmt": fmt}
            cache[key] = write_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", arch, dtype=dtype, **ct)
            convert(cache[key], tp=tps)
        return cache[key]

    return make



CASES = {
    # architecture, format, dtype, tp, dp, placement, EP, pipeline stages
    "qwen3moe-gptq-tp2": ("Qwen3MoeForCausalLM", "gptq", torch.bfloat16, 2, 1, "linear", False, 1),
    "mixtral-awq-tp2-ep2": ("MixtralForCausalLM", "awq", torch.float16, 2, 1, "linear", True, 1),
    "qwen3moe-gptq-dp2-ep2-own-file": ("Qwen3MoeForCausalLM", "gptq", torch.bfloat16, 1, 2, "linear", True, 1),
    "mixtral-ct-dp2-no-ep": ("MixtralForCausalLM", "ct", torch.float16, 1, 2, "linear", False, 1),
    "deepseek-gptq-tp2-ep2-round-robin": ("DeepseekV3ForCausalLM", "gptq", torch.float16, 2, 1, "round_robin", True, 1),
    "qwen3moe-ct-asym-pp2-tp2-ep": ("Qwen3MoeForCausalLM", "ct-asym", torch.bfloat16, 2, 1, "linear", True, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_gpu_streams_its_experts_into_what_a_local_load_places(
    moe_model: Any, s3: Any, monkeypatch: pytest.MonkeyPatch, streamed: list[Any], case: str,
) -> None:
    arch, fmt, dtype, tp, dp, strategy, ep, pp = CASES[case]
    model_dir = moe_model(arch, fmt, dtype, (1, 2))
    url = s3.url(case)
    push(model_dir / "marlin-pack", url, block_size=BLOCK)
    parallel = {"enable_expert_parallel": ep, "expert_placement_strategy": strategy}
    for stage, dp_rank, tp_rank in itertools.product(range(pp), range(dp), range(tp)):
        args = (model_dir, QUANTIZATION[fmt], dtype, monkeypatch, tp, tp_rank, dp, dp_rank, parallel)
        local, _, local_decision = _load(*args, pp=(pp, stage))
        if pp == 1:  # stock vLLM after loading the checkpoint itself
            want = vmr.reference_moe_rank_tensors(model_dir, tp, tp_rank, dtype, dp=(dp, dp_rank), parallel=parallel)
            assert all(torch.equal(local[n], t) for n, t in want.items() if not (n.endswith(".qzeros") and not t.numel()))
        streamed.clear()
        remote, _, decision = _load(*args, pp=(pp, stage), extra={"bundle": url})
        assert remote.keys() == local.keys()
        for name, t in local.items():
            assert remote[name].dtype == t.dtype and remote[name].shape == t.shape, name
            assert torch.equal(remote[name].view(-1).view(torch.uint8) if t.numel() else remote[name],
                               t.view(-1).view(torch.uint8) if t.numel() else t), name
        sel, here = decision.bundle, local_decision.bundle
        [(plan, done)] = streamed
        rank_path = f"tp{tp}/rank-{tp_rank}.safetensors"
        if here.experts is None:  # plain TP: no share, the rank file's experts as they are
            assert sel.experts is None and set(done.bytes_read) == {rank_path, "common.safetensors"}
            continue
        share = sel.experts
        assert (share.experts, share.placement, share.num_experts) == (here.experts.experts, here.experts.placement,
                                                                       here.experts.num_experts)
        assert share.read_bytes == here.experts.read_bytes and share.text() == here.experts.text()
        experts_path = f"tp{here.experts.tp_size}/rank-{here.experts.rank}.safetensors"
        assert set(done.bytes_read) == {rank_path, "common.safetensors", experts_path}
        rank_read = plan.files[0]
        assert not set(here.experts.header.tensors) & set(rank_read.header.tensors)  # experts not read whole
        pieces = [p for info in here.experts.header.tensors.values() for p in here.experts.pieces(info)]
        source = next(f for f in plan.files if f.entry.path == experts_path)
        assert sorted(source.pieces) == sorted(pieces)
        for lo, n in pieces:  # each piece inside the blocks streamed of its file
            assert any(a <= lo and lo + n <= b for a, b in source.spans)
        if experts_path != rank_path:
            assert done.bytes_read[experts_path] == source.span_bytes < source.entry.size
            assert source.span_bytes <= share.read_bytes + 2 * BLOCK * len(source.pieces)  # whole blocks around each piece
        if ep and dp * tp > 1 and experts_path != rank_path:
            assert len(share.experts) < share.num_experts


def test_check_says_which_experts_each_gpu_streams(moe_model: Any, s3: Any, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``check --bundle s3://... -tp 2 -ep``: each rank loads, naming its experts and where they come from."""
    from test_remote_check import _check

    model_dir = moe_model("MixtralForCausalLM", "awq", torch.float16, (1, 2))
    url = s3.url("ep")
    push(model_dir / "marlin-pack", url, block_size=BLOCK)
    code, out, _ = _check(monkeypatch, capsys, str(model_dir), "--bundle", url, "-tp", "2", "-ep", "--compute-capability", "8.0")
    assert code == 0, out
    assert "experts 0-1 of 4 (ep rank 0/2, linear) from tp1/rank-0" in out
    assert "experts 2-3 of 4 (ep rank 1/2, linear) from tp1/rank-0" in out
    assert out.count("every block verified against the publication record") == 2


def test_an_experts_file_missing_from_the_bucket_is_refused(moe_model: Any, s3: Any) -> None:
    """The experts come from tp1: its object missing is refused before the GPU, naming it (not the rank's own file)."""
    from marlin_pack.errors import BundleMismatchError
    from marlin_pack.remote.decision import select_remote
    from marlin_pack.vllm_plugin.decision import EngineFacts

    model_dir = moe_model("MixtralForCausalLM", "awq", torch.float16, (1, 2))
    url = s3.url("ep-missing")
    push(model_dir / "marlin-pack", url, block_size=BLOCK)
    s3.client().delete_object(Bucket=s3.bucket, Key="ep-missing/tp1/rank-0.safetensors")
    facts = EngineFacts(model=str(model_dir), vllm_version=_vllm(), tp_size=2, tp_rank=1, expert_parallel=True,
                        quantization="awq", dtype="float16")
    with pytest.raises(BundleMismatchError, match=r"ep-missing/tp1/rank-0.safetensors is missing; publish it again"):
        select_remote(url, facts)


def _vllm() -> str:
    import vllm

    return vllm.__version__


def test_a_weight_cache_daemon_fills_its_experts_from_the_bucket(moe_model: Any, s3: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 streamed: list[Any]) -> None:
    """vLLM's weight-cache daemon of EP rank 1 of 2 (its fill is the loader's, in marlin-pack's scope, every layer
    shareable as loaded): from the bucket, what the same daemon holds filled from the local bundle."""
    model_dir = moe_model("MixtralForCausalLM", "awq", torch.float16, (1, 2))
    url = s3.url("daemon")
    push(model_dir / "marlin-pack", url, block_size=BLOCK)
    parallel = {"enable_expert_parallel": True}
    args = (model_dir, "auto_awq", torch.float16, monkeypatch, 2, 1, 1, 0, parallel)
    local, _, _ = _load(*args, daemon=True)
    remote, _, decision = _load(*args, daemon=True, extra={"bundle": url})
    assert remote.keys() == local.keys() and all(torch.equal(remote[n], t) for n, t in local.items())
    assert decision.bundle.experts.experts == (2, 3)
    [(_, done)] = streamed
    assert set(done.bytes_read) == {"tp2/rank-1.safetensors", "common.safetensors", "tp1/rank-0.safetensors"}
