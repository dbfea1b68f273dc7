"""Sanity tests of the MoE oracle (tests/oracles/vllm_moe_reference.py) itself, independent of marlin-pack.

* The CUDA-op stand-ins: the AWQ repack stand-in equals the GPTQ one applied after vLLM's own
  dense AWQ-to-GPTQ conversion (``auto_awq._convert_awq_to_standard_format``), and vLLM's
  real per-expert wrappers run on them.
* The oracle on tiny Mixtral / Qwen3-MoE checkpoints (AWQ, GPTQ 4/8-bit; TP 1/2/4; fp16/bf16):
  names, dtypes and shapes per rank computed here from the config, and contents checked
  against the checkpoint without knowing the Marlin permutations: Marlin permutes codes only
  inside 16x64 tiles and scales / zero points only inside 64-column chunks, so each tile's
  (chunk's) multiset of values must equal that of the expert's per-rank slice, gate before
  up, zero padding last. A wrong expert, rank slice, gate/up order, padding or unloaded
  (garbage) tensor shows up as a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from moe_checkpoints import MOE_CONFIGS, write_moe_checkpoint  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from oracles.vllm_moe_reference import VllmRefusedError, reference_moe_rank_tensors  # noqa: E402

# Checkpoint tensor names of gate / up / down per architecture, and the experts module vLLM builds.
_PROJ = {"MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
         "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple, Path] = {}

    def make(arch: str, fmt: str, **kw) -> Path:
        key = (arch, fmt, repr(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            cache[key] = write_moe_checkpoint(d, arch, fmt, **kw)
        return cache[key]

    return make


# ---------------------------------------------------------------------------------------
# Stand-ins
# ---------------------------------------------------------------------------------------


def _random_words(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32)


@pytest.mark.parametrize("k,n", [(128, 64), (256, 192), (64, 320)])
def test_awq_repack_stand_in_matches_vllm_awq_conversion(k: int, n: int) -> None:
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format

    from oracles import vllm_moe_reference as moe
    from oracles import vllm_reference as vr

    awq = _random_words((k, n // 8), seed=k + n)
    layer = torch.nn.Module()
    layer.register_parameter("qweight", torch.nn.Parameter(awq.clone(), requires_grad=False))
    # AWQ zero points (groups of 32) beside the weight, as an AWQ layer holds them: every release converts them with
    # the weight, and 0.30's conversion requires them (a zero-point name; 0.31+ also take None, symmetric).
    zeros = _random_words((k // 32, n // 8), seed=k * n)
    layer.register_parameter("qzeros", torch.nn.Parameter(zeros, requires_grad=False))
    with vr._LOCK, vr._patched(1, 0):  # its new parameters ask for the TP rank
        _convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)  # vLLM's dense AWQ path
    want = vr._reference_gptq_marlin_repack(layer.qweight.data, k, n, 4)
    got = moe.reference_awq_marlin_repack(awq, k, n, 4)
    assert got.dtype == torch.int32 and got.shape == (k // 16, n * 2)
    assert torch.equal(got, want)
    # and it is not the identity on the nibble order: a GPTQ repack of the raw words differs
    assert not torch.equal(moe.reference_awq_marlin_repack(awq.roll(1, 0), k, n, 4), want)


def test_moe_wrappers_are_vllms_own_code_with_stand_in_ops() -> None:
    import vllm._custom_ops as ops

    from oracles import vllm_moe_reference as moe
    from oracles import vllm_reference as vr

    proxy = moe._MoEOpsProxy(ops)
    assert proxy.gptq_marlin_moe_repack.__code__ is ops.gptq_marlin_moe_repack.__code__
    assert proxy.awq_marlin_moe_repack.__code__ is ops.awq_marlin_moe_repack.__code__
    w = _random_words((3, 16, 128), seed=1)  # 3 experts, GPTQ [K/8, N] with K=128, N=128
    out = proxy.gptq_marlin_moe_repack(w, 128, 128, 4)
    assert out.shape == (3, 8, 256)
    for e in range(3):
        assert torch.equal(out[e], vr._reference_gptq_marlin_repack(w[e], 128, 128, 4))
    with pytest.raises(vr._OracleBug, match="no stand-in"):
        moe._TorchView().ops._C.marlin_gemm  # noqa: B018


# ---------------------------------------------------------------------------------------
# The oracle on tiny MoE checkpoints
# ---------------------------------------------------------------------------------------


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _tiles_out(marlin: torch.Tensor) -> torch.Tensor:
    """Marlin-packed 4-bit ``[K/16, N*2]`` -> per 16x64 tile sorted codes ``[K/16, N/64, 1024]``."""
    kt, cols = marlin.shape
    return _nibbles(marlin.reshape(kt, cols // 128, 128)).sort(-1).values


def _tiles_gptq(words: torch.Tensor) -> torch.Tensor:
    """GPTQ ``[K/8, N]`` (packed along K) -> per 16x64 tile sorted codes."""
    k8, n = words.shape
    t = words.reshape(k8 // 2, 2, n // 64, 64).permute(0, 2, 1, 3).reshape(k8 // 2, n // 64, 128)
    return _nibbles(t).sort(-1).values


def _tiles_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ ``[K, N/8]`` (packed along N) -> per 16x64 tile sorted codes."""
    k, n8 = words.shape
    t = words.reshape(k // 16, 16, n8 // 8, 8).permute(0, 2, 1, 3).reshape(k // 16, n8 // 8, 128)
    return _nibbles(t).sort(-1).values


def _chunks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1, 64).sort(-1).values


def _pad_cols(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, n - x.shape[1]))


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[0]))


def _expected_shapes(arch: str, fmt: str, bits: int, g: int, tp: int, dtype: torch.dtype,
                     inter: int | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    c = MOE_CONFIGS[arch]
    e, h = c.get("num_local_experts", c.get("num_experts")), c["hidden_size"]
    i = (inter or c.get("moe_intermediate_size", c["intermediate_size"])) // tp
    ip = -(-i // max(64, g)) * max(64, g)  # the Marlin MoE tile (64), kept a multiple of the group
    g13, g2 = (1, 1) if g == -1 else (h // g, ip // g)
    p = 32 // bits
    return {"w13_qweight": (torch.int32, (e, h // 16, 2 * ip * bits // 2)),
            "w2_qweight": (torch.int32, (e, ip // 16, h * bits // 2)),
            "w13_scales": (dtype, (e, g13, 2 * ip)), "w2_scales": (dtype, (e, g2, h)),
            "w13_qzeros": (torch.int32, (e, g13, 2 * ip // p)), "w2_qzeros": (torch.int32, (e, g2, h // p))}


def _experts_prefix(arch: str, layer: int) -> str:
    return f"model.layers.{layer}.{_PROJ[arch][0]}.experts.routed_experts"


def _check_contents(arch: str, fmt: str, g: int, tp: int, rank: int, dtype: torch.dtype, ref: dict, sd: dict) -> int:
    """Per-tile / per-chunk multisets of every expert tensor equal those of the checkpoint's rank slice."""
    block, gate, up, down = _PROJ[arch]
    checked = 0
    for layer in range(MOE_CONFIGS[arch]["num_hidden_layers"]):
        pre = _experts_prefix(arch, layer)
        w13, w2 = ref[f"{pre}.w13_qweight"], ref[f"{pre}.w2_qweight"]
        ip = w2.shape[1] * 16
        for e in range(w13.shape[0]):
            src = f"model.layers.{layer}.{block}.experts.{e}"

            def t(proj: str, leaf: str, src: str = src) -> torch.Tensor:
                return sd[f"{src}.{proj}.{leaf}"]

            i = t(gate, "scales").shape[1] // tp
            cols, rows = slice(rank * i, (rank + 1) * i), slice(rank * i, (rank + 1) * i)
            wcols = slice(rank * i // 8, (rank + 1) * i // 8)
            if fmt == "gptq":
                w13_src = torch.cat([_pad_cols(t(p, "qweight")[:, cols], ip) for p in (gate, up)], 1)
                w2_src = _pad_rows(t(down, "qweight")[rank * i // 8:(rank + 1) * i // 8], ip // 8)
                tiles = _tiles_gptq
            else:
                w13_src = torch.cat([_pad_cols(t(p, "qweight")[:, wcols], ip // 8) for p in (gate, up)], 1)
                w2_src = _pad_rows(t(down, "qweight")[rows], ip)
                tiles = _tiles_awq
            assert torch.equal(_tiles_out(w13[e]), tiles(w13_src)), f"{pre}.w13_qweight[{e}]"
            assert torch.equal(_tiles_out(w2[e]), tiles(w2_src)), f"{pre}.w2_qweight[{e}]"
            grows = slice(None) if g == -1 else slice(rank * i // g, (rank + 1) * i // g)
            g2 = ref[f"{pre}.w2_scales"].shape[1]
            s13 = torch.cat([_pad_cols(t(p, "scales")[:, cols].to(dtype), ip) for p in (gate, up)], 1)
            s2 = _pad_rows(t(down, "scales")[grows].to(dtype), g2)
            assert torch.equal(_chunks(ref[f"{pre}.w13_scales"][e]), _chunks(s13)), f"{pre}.w13_scales[{e}]"
            assert torch.equal(_chunks(ref[f"{pre}.w2_scales"][e]), _chunks(s2)), f"{pre}.w2_scales[{e}]"
            z13 = torch.cat([_pad_cols(t(p, "qzeros")[:, wcols], ip // 8) for p in (gate, up)], 1)
            z2 = _pad_rows(t(down, "qzeros")[grows], g2)
            for name, src_z in (("w13_qzeros", z13), ("w2_qzeros", z2)):
                got = ref[f"{pre}.{name}"][e]
                assert torch.equal(_chunks(_nibbles(got)), _chunks(_nibbles(src_z))), f"{pre}.{name}[{e}]"
            checked += 1
    return checked


CASES = [  # arch, fmt, checkpoint kwargs, serving dtype
    ("MixtralForCausalLM", "gptq", {"random_gptq_zeros": True}, torch.float16),
    ("MixtralForCausalLM", "awq", {}, torch.bfloat16),
    ("Qwen3MoeForCausalLM", "gptq", {"random_gptq_zeros": True}, torch.bfloat16),
    ("Qwen3MoeForCausalLM", "awq", {}, torch.float16),
    ("Qwen2MoeForCausalLM", "gptq", {"random_gptq_zeros": True}, torch.float16),
    ("Qwen2MoeForCausalLM", "awq", {}, torch.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch,fmt,kw,dtype", CASES, ids=[f"{a[:7]}-{f}-{str(d)[6:]}" for a, f, _, d in CASES])
def test_oracle_stacks_experts_per_rank(ckpt, arch: str, fmt: str, kw: dict, dtype: torch.dtype, tp: int) -> None:
    model = ckpt(arch, fmt, **kw)
    sd = load_file(str(model / "model.safetensors"))
    want = _expected_shapes(arch, fmt, 4, 128, tp, dtype)
    method = {"awq": "AutoAWQMoEMethod", "gptq": "AutoGPTQMoEMethod"}[fmt]
    for rank in range(tp):
        info: dict = {}
        ref = reference_moe_rank_tensors(model, tp, rank, dtype, info=info)
        assert info["model_class"] == arch
        for layer in range(2):
            pre = _experts_prefix(arch, layer)
            assert info["layers"][pre]["method"] == method
            assert info["layers"][pre]["backend"] == "MARLIN" and info["layers"][pre]["experts_class"] == "MarlinExperts"
            got = {k.removeprefix(pre + "."): (v.dtype, tuple(v.shape)) for k, v in ref.items() if k.startswith(pre + ".")}
            assert got == want, (tp, rank, layer)
            assert info["aliases"][f"{pre}.w13_weight"] == f"{pre}.w13_qweight"
            dense = ["self_attn.qkv_proj", "self_attn.o_proj"]
            if arch == "Qwen2MoeForCausalLM":  # the shared expert is a dense Marlin MLP beside the routed experts
                dense += ["mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"]
            for name in dense:
                assert f"model.layers.{layer}.{name}.qweight" in ref, name
        # nothing else quantized: the router stays 16-bit (not a Marlin layer)
        assert not [k for k in ref if ".gate." in k or k.endswith(".gate")]
        assert _check_contents(arch, fmt, 128, tp, rank, dtype, ref, sd) == 2 * 4


@pytest.mark.slow
@pytest.mark.parametrize("fmt,kw", [("gptq", {"group_size": 32, "random_gptq_zeros": True}), ("awq", {"group_size": 32})])
def test_oracle_pads_the_intermediate_size(ckpt, fmt: str, kw: dict) -> None:
    """moe_intermediate_size 192 at TP 2: 96 per rank, padded to the 64-tile (128) on each of gate and up."""
    arch = "Qwen3MoeForCausalLM"
    model = ckpt(arch, fmt, moe_intermediate_size=192, **kw)
    sd = load_file(str(model / "model.safetensors"))
    for tp in (1, 2):
        want = _expected_shapes(arch, fmt, 4, 32, tp, torch.float16, inter=192)
        for rank in range(tp):
            info: dict = {}
            ref = reference_moe_rank_tensors(model, tp, rank, torch.float16, info=info)
            pre = _experts_prefix(arch, 0)
            assert info["layers"][pre]["intermediate_size_per_partition"] == 192 // tp
            got = {k.removeprefix(pre + "."): (v.dtype, tuple(v.shape)) for k, v in ref.items() if k.startswith(pre + ".")}
            assert got == want
            assert _check_contents(arch, fmt, 32, tp, rank, torch.float16, ref, sd) == 2 * 4
    w13 = ref[f"{_experts_prefix(arch, 0)}.w13_scales"]
    assert w13.shape[-1] == 256  # 2 x 128 at TP 2


@pytest.mark.slow
def test_oracle_gptq_8bit_and_channelwise_shapes(ckpt) -> None:
    arch = "MixtralForCausalLM"
    for bits, g in ((8, 128), (4, -1)):
        model = ckpt(arch, "gptq", bits=bits, group_size=g)
        for tp in (1, 4):
            ref = reference_moe_rank_tensors(model, tp, tp - 1, torch.float16)
            pre = _experts_prefix(arch, 1)
            got = {k.removeprefix(pre + "."): (v.dtype, tuple(v.shape)) for k, v in ref.items() if k.startswith(pre + ".")}
            assert got == _expected_shapes(arch, "gptq", bits, g, tp, torch.float16), (bits, g, tp)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_oracle_refuses_a_group_straddling_the_rank_intermediate(ckpt, fmt: str) -> None:
    # 192 / 4 = 48 per rank, not a multiple of the group (32): vLLM hands the layer to MoeWNA16,
    # which the Marlin MoE backend cannot run.
    model = ckpt("Qwen3MoeForCausalLM", fmt, group_size=32, moe_intermediate_size=192)
    with pytest.raises(VllmRefusedError, match="MoeWNA16"):
        reference_moe_rank_tensors(model, 4, 0, torch.float16)


@pytest.mark.parametrize("arch,loads", [("MixtralForCausalLM", True), ("Qwen2MoeForCausalLM", False)])
def test_awq_modules_to_not_convert_gate_is_a_substring_rule(ckpt, arch: str, loads: bool) -> None:
    """AutoAWQ-style ``modules_to_not_convert: ["gate"]``: vLLM matches it as a substring of layer names.

    Mixtral's layers hold no "gate" besides the router, so it loads; Qwen2-MoE's shared expert
    ``mlp.shared_expert.gate_up_proj`` becomes unquantized and its quantized tensors fail to load.
    """
    model = ckpt(arch, "awq", quant_overrides={"modules_to_not_convert": ["gate"]})
    if loads:
        ref = reference_moe_rank_tensors(model, 1, 0, torch.float16)
        assert f"{_experts_prefix(arch, 0)}.w13_qweight" in ref
    else:
        with pytest.raises(VllmRefusedError, match="weight loading fails"):
            reference_moe_rank_tensors(model, 1, 0, torch.float16)


@pytest.mark.parametrize("arch,loads", [("MixtralForCausalLM", True), ("Qwen2MoeForCausalLM", False)])
def test_convert_predicts_the_substring_rule(ckpt, tmp_path: Path, arch: str, loads: bool) -> None:
    """marlin-pack converts exactly the ``modules_to_not_convert: ["gate"]`` checkpoints vLLM can load
    (see the test above), and refuses the others at convert time, naming the entry and the layer."""
    from marlin_pack import convert
    from marlin_pack.errors import UnsupportedCheckpointError

    model = ckpt(arch, "awq", quant_overrides={"modules_to_not_convert": ["gate"]})
    if loads:
        convert(model, tmp_path / "bundle", tp=(1,))
        assert (tmp_path / "bundle").is_dir()
    else:
        layer = r"model\.layers\.0\.mlp\.shared_expert\.gate_up_proj"
        with pytest.raises(UnsupportedCheckpointError, match=rf"entry 'gate' is a substring of {layer}"):
            convert(model, tmp_path / "bundle", tp=(1,))
        assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("humming", [False, True])
def test_what_auto_picks_on_sm90(ckpt, humming: bool) -> None:
    """``--moe-backend auto`` on SM90: FLASHINFER_TRTLLM is skipped (AWQ/GPTQ may carry zero points
    and bias). Where the backend selection moves Humming ahead of Marlin (its ``prioritize_humming``,
    0.32+), Humming needs the optional ``humming`` package: without it vLLM runs the experts on Marlin,
    with it on Humming (which the oracle refuses). Where it does not (0.30, 0.31: Humming listed after
    Marlin), the experts run on Marlin either way."""
    from oracles.vllm_moe_reference import _moe_vllm

    model = ckpt("MixtralForCausalLM", "gptq")
    if not humming or not hasattr(_moe_vllm().int_wna16, "prioritize_humming"):
        info: dict = {}
        reference_moe_rank_tensors(model, 1, 0, torch.float16, info=info, moe_backend="auto")
        assert {v["backend"] for v in info["layers"].values()} == {"MARLIN"}
    else:
        with pytest.raises(VllmRefusedError, match="backend is WNA16MoEBackend.HUMMING"):
            reference_moe_rank_tensors(model, 1, 0, torch.float16, moe_backend="auto", humming_installed=True)
