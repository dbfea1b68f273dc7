"""GPU: ``marlin_pack.machete.prepack_codes`` against the real ``ops.machete_prepack_B`` of vLLM.

On the H200 (SM90), for every distinct per-rank linear shape (K_part, N_part) that Machete takes
in Llama-3-8B/70B, Qwen2.5-7B/72B, Qwen3-8B/32B, Mistral-7B and Gemma-2-9B at TP 1/2/4/8 (fused qkv
and gate_up widths), plus small shapes; 4 and 8 bit; float16 and bfloat16; with and without zero
points (uint4b8 vs uint4: the same bytes are expected): random codes go through the op exactly as
``MacheteLinearKernel`` passes them (``w.t().contiguous().t()``) and the result must equal ours
bit for bit, with the op's output shape, stride and dtype checked too. On a mismatch the
alternative ``AtomLayoutMNK`` reading is tried and named, and the probe test recovers the op's
in-block permutation outright, so one run settles the layout.

End to end (reference §7.6): ``ops.machete_mm`` on our prepacked weights, scales and zero points
equals a dequantized fp32 matmul within fp16 tolerance (uint4b8 and uint4 with zeros, 8-bit too,
group sizes -1/64/128), and the other layout reading is far off, so the check can fail.

With ``MARLIN_PACK_GOLDEN_OUT`` set (a directory), one small golden file (``machete_golden.safetensors``,
about 100 KB: a few cases' input and the op's output, and the probed block permutations) is written there for
``tests/machete/golden/`` (read by ``tests/machete/test_golden.py``). One file, because a device call brings
back at most 8 files. Run on the GPU machine::

    MARLIN_PACK_GOLDEN_OUT=$OUT bash tests/on_gpu/device.sh tests/on_gpu/test_machete_golden_gpu.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from marlin_pack.machete import layout as L
from marlin_pack.machete.supports import machete_supports

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# name -> (hidden, intermediate, attention heads, kv heads, head dim), from the models' config.json
MODELS = {
    "Llama-3-8B": (4096, 14336, 32, 8, 128),
    "Llama-3-70B": (8192, 28672, 64, 8, 128),
    "Qwen2.5-7B": (3584, 18944, 28, 4, 128),
    "Qwen2.5-72B": (8192, 29568, 64, 8, 128),
    "Qwen3-8B": (4096, 12288, 32, 8, 128),
    "Qwen3-32B": (5120, 25600, 64, 8, 128),
    "Mistral-7B": (4096, 14336, 32, 8, 128),
    "Gemma-2-9B": (3584, 14336, 16, 8, 256),
}
SMALL = [(64, 128), (128, 256), (192, 384), (256, 128), (64, 1024), (1024, 128)]


def model_shapes() -> list[tuple[int, int]]:
    """Distinct per-rank (K_part, N_part) of the models' qkv/o/gate_up/down at TP 1/2/4/8 that Machete takes."""
    shapes = set()
    for hidden, inter, heads, kv, hd in MODELS.values():
        for tp in (1, 2, 4, 8):
            if heads % tp or inter % tp:
                continue
            kv_rank = max(1, kv // tp)  # vLLM replicates KV heads when tp > kv
            layers = [
                (hidden, (heads // tp + 2 * kv_rank) * hd),  # qkv_proj (fused)
                (heads * hd // tp, hidden),  # o_proj
                (hidden, 2 * inter // tp),  # gate_up_proj (fused)
                (inter // tp, hidden),  # down_proj
            ]
            for K, N in layers:
                ok, _ = machete_supports(
                    capability=90,
                    weight_type="uint4b8",
                    zero_points=False,
                    group_size=128,
                    act_dtype=torch.float16,
                    in_features=K,
                    out_features=N,
                )
                if ok:
                    shapes.add((K, N))
    return sorted(shapes)


SHAPES = SMALL + model_shapes()
TYPES = {4: ("uint4b8", "uint4"), 8: ("uint8b128", "uint8")}
ACTS = {"f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def ops():
    from vllm import _custom_ops

    assert torch.cuda.get_device_capability() == (9, 0), "Machete runs on SM90 only"
    return _custom_ops


def _scalar(name: str):
    from vllm.scalar_type import scalar_types

    return getattr(scalar_types, name)


def _op(ops, words: torch.Tensor, act: torch.dtype, wtype: str) -> torch.Tensor:
    """The op, called as MacheteLinearKernel.process_weights_after_loading calls it."""
    return ops.machete_prepack_B(words.t().contiguous().t(), a_type=act, b_type=_scalar(wtype), group_scales_type=act)


def _explain(words: torch.Tensor, got: torch.Tensor, bits: int) -> str:
    K, N = words.shape[0] * 32 // bits, words.shape[1]
    ours = L.prepack_b(words, bits)
    bad = torch.nonzero(ours.view(-1) != got.reshape(-1)).flatten()
    alt = [a for a in L.ATOM_M_CHOICES if a != L.ATOM_M and torch.equal(L.prepack_b(words, bits, a), got.reshape(ours.shape))]
    return f"K={K} N={N} bits={bits}: {bad.numel()} of {ours.numel()} words differ (first {bad[:8].tolist()}); " + (
        f"the alternative AtomLayoutMNK ({alt[0]},1,1) MATCHES the op" if alt else "neither AtomLayoutMNK hypothesis matches"
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_prepack_matches_the_op(ops, bits: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(bits)
    print(f"\nmachete prepacked layout: {len(SHAPES)} shapes, {bits}-bit, {len(ACTS)} act dtypes x {len(TYPES[bits])} types")
    for K, N in SHAPES:
        codes = torch.randint(0, 1 << bits, (K, N), device="cuda", dtype=torch.uint8, generator=g)
        words = L.pack_k(codes, bits)
        want = L.prepack_codes(codes, bits)
        for act_name, act in ACTS.items():
            for wtype in TYPES[bits]:
                got = _op(ops, words, act, wtype)
                assert got.dtype == torch.int32 and tuple(got.shape) == tuple(words.shape), (K, N, got.dtype, got.shape)
                assert got.stride() == (N, 1) and got.is_contiguous(), (K, N, got.stride())
                assert torch.equal(got, want), f"{act_name} {wtype}: " + _explain(words, got, bits)
                del got
        del codes, words, want
    torch.cuda.empty_cache()


def _stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of a flat int32 stream in storage order (lowest bits first), int64."""
    data = words.contiguous().view(-1).view(torch.uint8).to(torch.int64)
    if bits == 8:
        return data
    return torch.stack([data & 0xF, data >> 4], dim=1).view(-1)


def _probe_block_permutation(ops, bits: int) -> torch.Tensor:
    """The op's in-block map offset -> n + 128*k, recovered digit by digit from one 128x64 block."""
    k = torch.arange(64, device="cuda").view(64, 1)
    n = torch.arange(128, device="cuda").view(1, 128)
    natural = n + 128 * k  # [K=64, N=128]
    perm = torch.zeros(8192, dtype=torch.int64, device="cuda")
    for shift in range(0, 13, bits):
        codes = ((natural >> shift) & ((1 << bits) - 1)).to(torch.uint8)
        perm |= _stream(_op(ops, L.pack_k(codes, bits), torch.float16, TYPES[bits][0]), bits) << shift
    return perm.cpu()


@pytest.mark.parametrize("bits", [4, 8])
def test_probed_block_permutation(ops, bits: int) -> None:
    perm = _probe_block_permutation(ops, bits)
    assert sorted(perm.tolist()) == list(range(8192))
    match = [a for a in L.ATOM_M_CHOICES if torch.equal(perm, L.block_permutation(bits, a))]
    print(f"\nmachete prepacked probe {bits}-bit: the op's block permutation matches AtomLayoutMNK {[(a, 1, 1) for a in match]}")
    out = os.environ.get("MARLIN_PACK_GOLDEN_OUT")
    if out:  # keep the probed map whatever it is, so the next session can build from it
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save(perm, Path(out) / f"probed_perm_{bits}.pt")
    assert match and match[0] == L.ATOM_M, f"probed permutation matches {match} (default atom_m={L.ATOM_M})"


def _dequant_case(bits: int, zp: bool, group: int, act: torch.dtype, K: int, N: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    G = 1 if group == -1 else K // group
    codes = torch.randint(0, 1 << bits, (K, N), device="cuda", dtype=torch.uint8, generator=g)
    scales = ((torch.rand(G, N, device="cuda", generator=g) + 0.5) * (0.02 if bits == 4 else 0.002)).to(act)
    zeros = torch.randint(0, 1 << bits, (G, N), device="cuda", dtype=torch.uint8, generator=g) if zp else None
    rows = torch.arange(K, device="cuda") // (K if group == -1 else group)
    bias = zeros.float()[rows] if zp else float(1 << (bits - 1))
    w = (codes.float() - bias) * scales.float()[rows]  # [K, N] fp32
    x = torch.randn(32, K, device="cuda", generator=g).to(act)
    return codes, scales, zeros, w, x


@pytest.mark.parametrize("act_name", list(ACTS))
@pytest.mark.parametrize("wtype, bits, zp", [("uint4b8", 4, False), ("uint4", 4, True), ("uint8b128", 8, False), ("uint8", 8, True)])
@pytest.mark.parametrize("group", [-1, 64, 128])
def test_machete_mm_end_to_end(ops, act_name: str, wtype: str, bits: int, zp: bool, group: int) -> None:
    act, K, N = ACTS[act_name], 512, 384
    codes, scales, zeros, w, x = _dequant_case(bits, zp, group, act, K, N, seed=bits * 1000 + group + zp)
    s = L.machete_scales(scales)
    z = L.machete_zero_points(zeros, s) if zp else None
    ref = x.float() @ w

    def rel_err(atom_m: int) -> float:
        out = ops.machete_mm(
            a=x, b_q=L.prepack_codes(codes, bits, atom_m), b_type=_scalar(wtype), b_group_scales=s, b_group_zeros=z, b_group_size=group
        )
        assert out.shape == (32, N) and out.dtype == act
        return float((out.float() - ref).norm() / ref.norm())

    err = rel_err(L.ATOM_M)
    other = rel_err(next(a for a in L.ATOM_M_CHOICES if a != L.ATOM_M))
    print(f"\nmachete_mm on our prepacked weights, {act_name} {wtype} g{group}: rel err {err:.2e} (other layout {other:.2e})")
    assert err < (1e-2 if act == torch.float16 else 2e-2)
    assert other > 0.3  # a wrong layout is caught


GOLDEN = [  # (bits, act, weight type, K, N): a few tens of KB each
    (4, "f16", "uint4b8", 128, 256),
    (4, "bf16", "uint4", 128, 384),
    (8, "f16", "uint8b128", 128, 128),
    (8, "bf16", "uint8", 64, 384),
]
GOLDEN_FILE = "machete_golden.safetensors"


@pytest.mark.skipif(not os.environ.get("MARLIN_PACK_GOLDEN_OUT"), reason="set MARLIN_PACK_GOLDEN_OUT to write golden files")
def test_write_golden(ops) -> None:
    """One file: ``case{i}.input`` / ``case{i}.output`` per GOLDEN case (metadata ``case{i}`` = bits,a_type,b_type,K,N,
    the output's stride) and ``perm_4`` / ``perm_8``, the probed in-block permutations (offset -> n + 128*k)."""
    import json

    import vllm
    from safetensors.torch import save_file

    out = Path(os.environ["MARLIN_PACK_GOLDEN_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"vllm": vllm.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for i, (bits, act_name, wtype, K, N) in enumerate(GOLDEN):
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        codes = torch.randint(0, 1 << bits, (K, N), device="cuda", dtype=torch.uint8, generator=g)
        words = L.pack_k(codes, bits)
        got = _op(ops, words, ACTS[act_name], wtype)
        tensors[f"case{i}.input"] = words.contiguous().cpu()
        tensors[f"case{i}.output"] = got.contiguous().cpu()
        meta[f"case{i}"] = json.dumps({"bits": bits, "a_type": act_name, "b_type": wtype, "K": K, "N": N,
                                       "output_stride": list(got.stride())})
    for bits in (4, 8):
        tensors[f"perm_{bits}"] = _probe_block_permutation(ops, bits).to(torch.int16)  # values < 8192
    path = out / GOLDEN_FILE
    save_file(tensors, str(path), metadata=meta)
    assert path.stat().st_size < 200_000
