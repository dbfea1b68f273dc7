"""Sanity tests of the vLLM oracle (tests/oracles/vllm_reference.py) itself, independent of marlin-pack.

The checkpoints are written here by a minimal AutoAWQ-GEMM / AutoGPTQ-v1 writer that keeps the
unpacked codes, so every expected tensor is rebuilt from the *logical* per-rank slice (computed
by hand below, not by vLLM's loaders) with vLLM's own Marlin helpers. A wrong rank, fusion
order, KV replication, padding or AWQ conversion in the oracle's harness shows up as a mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

from oracles.vllm_reference import VllmRefusedError, reference_rank_tensors  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ---------------------------------------------------------------------------------------
# A tiny checkpoint writer that remembers the logical contents
# ---------------------------------------------------------------------------------------


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_last(codes: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    p = 32 // bits
    r, n = codes.shape
    c = codes.to(torch.int64).reshape(r, n // p, p)
    if order is not None:
        c = c[:, :, order]
    out = torch.zeros(r, n // p, dtype=torch.int64)
    for i in range(p):
        out |= c[:, :, i] << (bits * i)
    return _to_i32(out)


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return _pack_last(codes.t().contiguous(), bits).t().contiguous()


@dataclass
class Ckpt:
    path: Path
    fmt: str
    bits: int
    group: int
    hidden: int
    inter: int
    heads: int
    kv: int
    head_dim: int
    codes: dict[str, torch.Tensor] = field(default_factory=dict)  # [K, N]
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # [G, N] fp16
    zeros: dict[str, torch.Tensor] = field(default_factory=dict)  # [G, N] (AWQ)
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # [N] fp16


def write_ckpt(
    path: Path,
    *,
    fmt: str = "gptq",
    bits: int = 4,
    group: int = 128,
    hidden: int = 256,
    inter: int = 512,
    heads: int = 4,
    kv: int = 2,
    head_dim: int = 64,
    qkv_bias: bool = False,
    sharded: bool = False,
    seed: int = 0,
) -> Ckpt:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    ck = Ckpt(path, fmt, bits, group, hidden, inter, heads, kv, head_dim)
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv * head_dim),
        "self_attn.v_proj": (hidden, kv * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    t: dict[str, torch.Tensor] = {}
    for m, (k, n) in shapes.items():
        name = f"model.layers.0.{m}"
        gs = k if group == -1 else group
        ng = k // gs
        codes = torch.randint(0, 1 << bits, (k, n), generator=g)
        scales = (torch.rand(ng, n, generator=g) * 0.02 + 0.001).half()
        ck.codes[name], ck.scales[name] = codes, scales
        t[f"{name}.scales"] = scales
        if fmt == "awq":
            zeros = torch.randint(0, 1 << bits, (ng, n), generator=g)
            ck.zeros[name] = zeros
            t[f"{name}.qweight"] = _pack_last(codes, bits, AWQ_ORDER)
            t[f"{name}.qzeros"] = _pack_last(zeros, bits, AWQ_ORDER)
        else:
            t[f"{name}.qweight"] = _pack_rows(codes, bits)
            t[f"{name}.qzeros"] = _pack_last(torch.full((ng, n), (1 << (bits - 1)) - 1), bits)
            t[f"{name}.g_idx"] = (torch.arange(k) // gs).to(torch.int32)
        if qkv_bias and m.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            ck.bias[name] = t[f"{name}.bias"] = torch.randn(n, generator=g).half()
    t["model.embed_tokens.weight"] = torch.randn(32, hidden, generator=g).half()
    t["model.layers.0.input_layernorm.weight"] = torch.ones(hidden).half()
    t["model.norm.weight"] = torch.ones(hidden).half()
    t["lm_head.weight"] = torch.randn(32, hidden, generator=g).half()
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": True}
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if qkv_bias else "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "torch_dtype": "float16",
        "quantization_config": qc,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    if sharded:
        names = sorted(t)
        files = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        for fn, ns in files.items():
            save_file({n: t[n].contiguous() for n in ns}, str(path / fn))
        wm = {n: fn for fn, ns in files.items() for n in ns}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return ck


# ---------------------------------------------------------------------------------------
# Expected per-rank tensors from the logical slices + vLLM's Marlin helpers
# ---------------------------------------------------------------------------------------


def _rank_parts(ck: Ckpt, layer: str, tp: int, r: int):
    """(codes [K_r, N_r], scales [G_r, N_r], zeros, bias) of one fused layer on rank r, by hand."""
    pre = "model.layers.0."
    hd = ck.head_dim

    def cols(name: str, lo: int, hi: int):
        z = ck.zeros[pre + name][:, lo:hi] if ck.zeros else None
        b = ck.bias[pre + name][lo:hi] if pre + name in ck.bias else None
        return ck.codes[pre + name][:, lo:hi], ck.scales[pre + name][:, lo:hi], z, b

    if layer == "self_attn.qkv_proj":
        hq = ck.heads // tp
        nkv = max(1, ck.kv // tp)
        kv_rank = r // max(1, tp // ck.kv)
        parts = [
            cols("self_attn.q_proj", r * hq * hd, (r + 1) * hq * hd),
            cols("self_attn.k_proj", kv_rank * nkv * hd, (kv_rank + 1) * nkv * hd),
            cols("self_attn.v_proj", kv_rank * nkv * hd, (kv_rank + 1) * nkv * hd),
        ]
    elif layer == "mlp.gate_up_proj":
        w = ck.inter // tp
        parts = [cols("mlp.gate_proj", r * w, (r + 1) * w), cols("mlp.up_proj", r * w, (r + 1) * w)]
    else:  # row-parallel
        codes = ck.codes[pre + layer]
        k = codes.shape[0] // tp
        scales = ck.scales[pre + layer]
        zeros = ck.zeros.get(pre + layer)
        if ck.group != -1:
            gr = scales.shape[0] // tp
            scales = scales[r * gr : (r + 1) * gr]
            zeros = zeros[r * gr : (r + 1) * gr] if zeros is not None else None
        return codes[r * k : (r + 1) * k], scales, zeros, None

    def cat(i: int) -> torch.Tensor | None:
        return None if parts[0][i] is None else torch.cat([p[i] for p in parts], dim=-1)

    return cat(0), cat(1), cat(2), cat(3)


def expected_rank(ck: Ckpt, tp: int, r: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_padded_nk,
        marlin_permute_bias,
        marlin_permute_scales,
        marlin_zero_points,
    )
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    out = {}
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        codes, scales, zeros, bias = _rank_parts(ck, layer, tp, r)
        k, n = codes.shape
        np_, kp = marlin_padded_nk(n, k, ck.group)
        gp = 1 if ck.group == -1 else kp // ck.group
        pad = torch.nn.functional.pad
        codes = pad(codes, (0, np_ - n, 0, kp - k))
        scales = pad(scales.to(dtype), (0, np_ - n, 0, gp - scales.shape[0]))
        name = f"model.layers.0.{layer}"
        out[f"{name}.qweight"] = marlin_weights(codes, kp, np_, ck.bits, get_weight_perm(ck.bits))
        out[f"{name}.scales"] = marlin_permute_scales(scales, kp, np_, ck.group)
        if ck.fmt == "awq":
            zeros = pad(zeros, (0, np_ - n, 0, gp - zeros.shape[0]))
            out[f"{name}.qzeros"] = marlin_zero_points(zeros, gp, np_, ck.bits)
        else:  # Marlin's empty zero points: the kernel's qzeros up to vLLM 0.33, w_zp from 0.34 (qzeros retired)
            out[f"{name}.{_empty_zero_point_name()}"] = torch.empty(0, dtype=torch.int32)
        if bias is not None:
            out[f"{name}.bias"] = marlin_permute_bias(pad(bias.to(dtype), (0, np_ - n)))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        assert torch.equal(got[k], want[k]), f"mismatch in {k}"


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 128), (4, -1), (8, 128), (8, 64)])
def test_gptq_tp1_plumbing(tmp_path: Path, bits: int, group: int) -> None:
    """TP=1, no padding: qweight is marlin_weights of the fused codes, scales are permuted."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    ck = write_ckpt(tmp_path, bits=bits, group=group)
    got = reference_rank_tensors(tmp_path, 1, 0, torch.float16)
    qkv = "model.layers.0.self_attn.qkv_proj"
    parts = ["q_proj", "k_proj", "v_proj"]
    codes = torch.cat([ck.codes[f"model.layers.0.self_attn.{p}"] for p in parts], 1)
    scales = torch.cat([ck.scales[f"model.layers.0.self_attn.{p}"] for p in parts], 1)
    k, n = codes.shape
    assert torch.equal(got[f"{qkv}.qweight"], marlin_weights(codes, k, n, bits, get_weight_perm(bits)))
    assert torch.equal(got[f"{qkv}.scales"], marlin_permute_scales(scales, k, n, group))
    assert got[f"{qkv}.qweight"].shape == (k // 16, n * bits // 2)
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        qz = got[f"model.layers.0.{layer}.{_empty_zero_point_name()}"]
        assert qz.dtype == torch.int32 and qz.shape == (0,)
    assert_same(got, expected_rank(ck, 1, 0, torch.float16))


def test_tp2_qkv_per_rank_size(tmp_path: Path) -> None:
    ck = write_ckpt(tmp_path, heads=4, kv=2, head_dim=64)
    for r in range(2):
        got = reference_rank_tensors(tmp_path, 2, r, torch.float16)
        n = (ck.heads // 2 + 2 * ck.kv // 2) * ck.head_dim
        assert got["model.layers.0.self_attn.qkv_proj.scales"].shape == (ck.hidden // 128, n)
        assert got["model.layers.0.self_attn.qkv_proj.qweight"].shape == (ck.hidden // 16, n * 2)
        # o_proj is row-parallel: K halves, N stays hidden
        o_proj = got["model.layers.0.self_attn.o_proj.qweight"]
        assert o_proj.shape == (ck.heads * ck.head_dim // 2 // 16, ck.hidden * 2)


def _empty_zero_point_name() -> str:
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    return "w_zp" if releases.release(vllm_version()).finish == "w_zp" else "qzeros"  # type: ignore[union-attr]


def test_kv_replication(tmp_path: Path) -> None:
    """tp=4 > kv=2: ranks {0,1} share KV head 0 and {2,3} KV head 1; q differs everywhere."""
    ck = write_ckpt(tmp_path, heads=8, kv=2, head_dim=64, inter=512, group=64)
    outs = [reference_rank_tensors(tmp_path, 4, r, torch.bfloat16) for r in range(4)]
    name = "model.layers.0.self_attn.qkv_proj"
    q_tiles = ck.heads // 4  # 64-column tiles per rank's q (head_dim 64)

    def tiles(o: dict[str, torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        qw = o[f"{name}.qweight"]
        qw = qw.view(qw.shape[0], -1, 64 * 16 // 8)  # [K/16, N/64, 128]: tile-major Marlin layout
        return qw[:, lo:hi], o[f"{name}.scales"][:, lo * 64 : hi * 64]

    for a, b in ((0, 1), (2, 3)):
        for x, y in zip(tiles(outs[a], q_tiles, q_tiles + 2), tiles(outs[b], q_tiles, q_tiles + 2), strict=False):
            assert torch.equal(x, y)
        assert not torch.equal(tiles(outs[a], 0, q_tiles)[0], tiles(outs[b], 0, q_tiles)[0])
    assert not torch.equal(tiles(outs[0], q_tiles, q_tiles + 2)[0], tiles(outs[2], q_tiles, q_tiles + 2)[0])
    for r in range(4):
        assert_same(outs[r], expected_rank(ck, 4, r, torch.bfloat16))


@pytest.mark.parametrize(
    "fmt,bits,group,tp,kw",
    [
        ("gptq", 4, 128, 2, {}),
        ("gptq", 4, 32, 4, {"heads": 8, "kv": 2}),
        ("gptq", 8, -1, 4, {"heads": 8, "kv": 2}),
        ("gptq", 4, 32, 2, {"inter": 320}),  # down_proj K=160 per rank -> padded to 192
        ("gptq", 4, 64, 1, {"hidden": 320, "heads": 5, "kv": 1, "inter": 704}),  # padded N and K
        ("awq", 4, 128, 1, {}),
        ("awq", 4, 64, 2, {}),
        ("awq", 4, 32, 4, {"heads": 8, "kv": 2}),
        ("awq", 4, -1, 1, {"hidden": 320, "heads": 5, "kv": 1, "inter": 704}),
        ("awq", 4, 32, 2, {"inter": 320}),
    ],
)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_hand_sharded_reference(tmp_path: Path, fmt, bits, group, tp, kw, dtype) -> None:
    ck = write_ckpt(tmp_path, fmt=fmt, bits=bits, group=group, **kw)
    for r in range(tp):
        assert_same(reference_rank_tensors(tmp_path, tp, r, dtype), expected_rank(ck, tp, r, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_qkv_bias_is_loaded_and_permuted(tmp_path: Path, fmt: str) -> None:
    # Qwen2 (the architecture of a qkv-bias checkpoint here) derives head_dim = hidden / heads.
    ck = write_ckpt(tmp_path, fmt=fmt, qkv_bias=True, heads=8, kv=2, head_dim=32, group=64)
    for tp in (1, 4):
        for r in range(tp):
            got = reference_rank_tensors(tmp_path, tp, r, torch.bfloat16)
            assert got["model.layers.0.self_attn.qkv_proj.bias"].dtype == torch.bfloat16
            assert "model.layers.0.self_attn.o_proj.bias" not in got
            assert_same(got, expected_rank(ck, tp, r, torch.bfloat16))


def test_sharded_checkpoint_same_as_single_file(tmp_path: Path) -> None:
    write_ckpt(tmp_path / "one", fmt="awq", group=64, seed=3)
    write_ckpt(tmp_path / "two", fmt="awq", group=64, seed=3, sharded=True)
    assert_same(
        reference_rank_tensors(tmp_path / "two", 2, 1, torch.float16),
        reference_rank_tensors(tmp_path / "one", 2, 1, torch.float16),
    )


def test_awq_zero_points_shape(tmp_path: Path) -> None:
    write_ckpt(tmp_path, fmt="awq", group=32)
    got = reference_rank_tensors(tmp_path, 2, 0, torch.float16)
    qz = got["model.layers.0.mlp.gate_up_proj.qzeros"]
    assert qz.dtype == torch.int32 and qz.shape == (256 // 32, 512 // 8)


@pytest.mark.parametrize(
    "fmt,group,tp,kw,match",
    [
        # o_proj K per rank = 64 < g = 128: a quantization group straddles the TP shard
        ("gptq", 128, 4, {}, "not divisible by group_size"),
        # AWQ: the straddling layer falls back to the Triton AWQ method, which refuses the shape
        ("awq", 128, 4, {}, "not aligned"),
        # AWQ g=-1 on row-parallel layers at TP>1: vLLM allocates 0 scale groups and fails
        ("awq", -1, 2, {}, "process_weights_after_loading"),
        # 4 heads are not divisible by TP 8: the model class's own assertion
        ("gptq", 128, 8, {}, "tp_size=8: AssertionError"),
    ],
)
def test_vllm_refusals(tmp_path: Path, fmt, group, tp, kw, match) -> None:
    write_ckpt(tmp_path, fmt=fmt, group=group, **kw)
    with pytest.raises(VllmRefusedError, match=match):
        reference_rank_tensors(tmp_path, tp, 0, torch.float16)


def test_patches_are_undone(tmp_path: Path) -> None:
    import vllm.model_executor.kernels.linear.mixed_precision.marlin as marlin_mod
    import vllm.model_executor.layers.attention.attention as attention_mod
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq
    from vllm.distributed import parallel_state as ps

    write_ckpt(tmp_path)
    watched = [(ps, "_TP"), (ps, "_PP"), (auto_awq, "current_platform"), (auto_awq, "choose_mp_linear_kernel"),
               (marlin_mod, "ops"), (marlin_mod, "current_platform"), (attention_mod, "get_attn_backend")]
    before = [getattr(obj, name) for obj, name in watched]
    reference_rank_tensors(tmp_path, 2, 1, torch.float16)
    assert [getattr(obj, name) for obj, name in watched] == before
    assert not auto_awq.current_platform.is_cuda() or torch.cuda.is_available()
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    "fmt,update,match",
    [
        ("gptq", {"desc_act": True}, "desc_act"),
        ("gptq", {"sym": False}, "Unsupported quantization config"),
        ("awq", {"zero_point": False}, "AutoAWQLinearMethod, not MarlinLinearKernel"),
    ],
)
def test_vllm_rejects_quant_config(tmp_path: Path, fmt: str, update: dict, match: str) -> None:
    write_ckpt(tmp_path, fmt=fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"].update(update)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VllmRefusedError, match=match):
        reference_rank_tensors(tmp_path, 1, 0, torch.float16)
