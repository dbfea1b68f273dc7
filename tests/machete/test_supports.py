"""``machete_supports`` against vLLM's own kernel choice, run on the CPU with a faked CUDA device.

Every rule is checked by calling vLLM: ``MacheteLinearKernel.can_implement`` on a grid of layer
configs and capabilities, and ``choose_mp_linear_kernel`` (selection order, min capability,
``VLLM_DISABLED_KERNELS``, ``--linear-backend`` and its per-quant override) on a smaller grid.
The tables ``machete_supports`` is built from are compared with vLLM's too. Skipped without vLLM.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from marlin_pack.machete import supports as S

WEIGHT_TYPES = ["uint4b8", "uint8b128", "uint4", "uint8", "int4", "uint2b2", "uint3b4", "int8"]
ACTS = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
GROUPS = [-1, 32, 64, 128, 256]
# (per-rank K, per-rank N): aligned; N % 128 != 0 (e.g. a qkv of 4096 + 2*32 ...); K % 64 != 0;
# Qwen2.5-72B down_proj at TP 8 (3696 = 57*64 + 48); its gate_up fused width at TP 8 (7392 % 128)
SHAPES = [(4096, 4096), (4096, 4160), (4032, 4096), (4000, 4096), (64, 128), (3696, 8192), (8192, 7392), (128, 192)]
CAPS = [90, 89, 80, 100, 103, 120, 91]


def _scalar(name: str):
    from vllm.scalar_type import scalar_types

    return getattr(scalar_types, name)


def _config(wt: str, zp: bool, group: int, act: torch.dtype, K: int, N: int, out_type=None):
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig

    return MPLinearLayerConfig((K, N), (K, N), _scalar(wt), act, group, zp, out_type)


def _ours(cc, wt, zp, group, act, K, N, **kw) -> tuple[bool, str]:
    ok, reason = S.machete_supports(
        capability=cc, weight_type=wt, zero_points=zp, group_size=group, act_dtype=act, in_features=K, out_features=N, **kw
    )
    assert isinstance(reason, str) and reason
    return ok, reason


def test_tables_match_vllm(vllm_linear) -> None:
    from vllm.model_executor.layers.quantization.utils import machete_utils as mu
    from vllm.platforms import PlatformEnum

    for zp in (False, True):
        assert [str(t) for t in mu.query_machete_supported_quant_types(zp)] == list(S.QUANT_TYPES[zp])
    for act in ACTS:
        assert list(mu.query_machete_supported_group_sizes(act)) == list(S.group_sizes(act))
    assert mu.MACHETE_PREPACKED_BLOCK_SHAPE == [S.PREPACKED_BLOCK_K, S.PREPACKED_BLOCK_N]
    cuda = vllm_linear._POSSIBLE_KERNELS[PlatformEnum.CUDA]
    names = [k.__name__ for k in cuda]
    assert names.index(S.KERNEL_NAME) == 1 and names[0] == "CutlassW4A8LinearKernel"
    derived = {}
    for backend, kernels in vllm_linear._LINEAR_BACKEND_KERNEL_MAP.items():
        hit = [k.__name__ for k in cuda if k in kernels]
        assert len(hit) <= 1
        if hit:
            derived[backend] = hit[0]
    assert derived == S.BACKEND_KERNELS
    machete = next(k for k in cuda if k.__name__ == S.KERNEL_NAME)
    assert machete.get_min_capability() == 90


def test_can_implement_grid(vllm_linear, fake_cuda) -> None:
    from vllm.model_executor.kernels.linear.mixed_precision.machete import MacheteLinearKernel

    n = 0
    for cc in CAPS:
        fake_cuda(cc)
        for wt, zp, group, act, (K, N) in itertools.product(WEIGHT_TYPES, (False, True), GROUPS, ACTS, SHAPES):
            want, _ = MacheteLinearKernel.can_implement(_config(wt, zp, group, act, K, N))
            got, reason = _ours(cc, wt, zp, group, act, K, N)
            assert got == want, (cc, wt, zp, group, act, K, N, reason)
            n += want
    assert n > 100  # the grid holds plenty of layers Machete takes


def _vllm_picks(vllm_linear, cfg) -> bool:
    try:
        return vllm_linear.choose_mp_linear_kernel(cfg).__name__ == S.KERNEL_NAME
    except ValueError:  # no kernel at all (e.g. --linear-backend machete on a layer Machete rejects)
        return False


SELECT_GRID = list(
    itertools.product(
        ["uint4b8", "uint8b128", "uint4", "uint8", "int4"],
        (False, True),
        [-1, 32, 128],
        [torch.float16, torch.bfloat16, torch.float8_e4m3fn],
        [(4096, 4096), (4096, 4160), (4000, 4096)],
    )
)


@pytest.mark.parametrize("cc", [90, 89, 100, None])
def test_choose_mp_linear_kernel(vllm_linear, fake_cuda, cc) -> None:
    fake_cuda(cc)
    picked = 0
    for wt, zp, group, act, (K, N) in SELECT_GRID:
        want = _vllm_picks(vllm_linear, _config(wt, zp, group, act, K, N, out_type=torch.bfloat16))
        got, reason = _ours(cc, wt, zp, group, act, K, N)
        assert got == want, (cc, wt, zp, group, act, K, N, reason)
        picked += want
    assert (picked > 0) == (cc == 90)


@pytest.mark.parametrize(
    "env, disabled",
    [("MacheteLinearKernel", True), ("MarlinLinearKernel,MacheteLinearKernel", True), ("MarlinLinearKernel, MacheteLinearKernel", False),
     ("MacheteLinearKernel ", False), ("", False)],
)  # fmt: skip
def test_disabled_kernels(vllm_linear, fake_cuda, monkeypatch, env: str, disabled: bool) -> None:
    fake_cuda(90)
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", env)
    cfg = ("uint4b8", False, 128, torch.float16, 4096, 4096)
    want = _vllm_picks(vllm_linear, _config(*cfg))
    got, _ = _ours(90, *cfg, disabled_kernels=env)
    assert got == want == (not disabled)
    got_list, _ = _ours(90, *cfg, disabled_kernels=env.split(","))
    assert got_list == want


def _backends(vllm_linear):
    return ["auto", *sorted(vllm_linear._LINEAR_BACKEND_KERNEL_MAP)]


@pytest.mark.parametrize("per_quant", [False, True])
def test_linear_backend(vllm_linear, fake_cuda, monkeypatch, per_quant: bool) -> None:
    import vllm.config

    fake_cuda(90)
    layers = [("uint4b8", False, 128, torch.float16, 4096, 4096), ("uint4", True, 64, torch.bfloat16, 4096, 4160)]
    for backend in _backends(vllm_linear):
        if per_quant:  # the "mixed_precision" override wins over the global value
            kc = SimpleNamespace(linear_backend="marlin", linear_backend_per_quant={"mixed_precision": backend})
            kw = {"linear_backend": "marlin", "linear_backend_per_quant": {"mixed_precision": backend}}
        else:
            kc = SimpleNamespace(linear_backend=backend, linear_backend_per_quant={"fp8": "marlin"})
            kw = {"linear_backend": backend, "linear_backend_per_quant": {"fp8": "marlin"}}
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda kc=kc: SimpleNamespace(kernel_config=kc))
        for layer in layers:
            want = _vllm_picks(vllm_linear, _config(*layer))
            got, reason = _ours(90, *layer, **kw)
            assert got == want, (backend, layer, reason)
    # sanity: the override is really read (auto picks Machete for the first layer, marlin does not)
    assert _ours(90, *layers[0], linear_backend="auto")[0]
    assert not _ours(90, *layers[0], linear_backend="marlin")[0]


def test_fused_partition_width_is_checked_as_one() -> None:
    # Llama-3-8B qkv at TP 8: q 512 + k 128 + v 128 = 768 per rank, 768 % 128 == 0 -> Machete,
    # although the k/v parts alone (128 each) would also pass; a fused 4096+64 (4160) fails as one
    assert _ours(90, "uint4b8", False, 128, torch.float16, 4096, 768)[0]
    assert not _ours(90, "uint4b8", False, 128, torch.float16, 4096, 4160)[0]


def test_non_16bit_activation_pick_is_flagged() -> None:
    ok, reason = _ours(90, "uint4b8", False, 128, torch.int8, 4096, 4096)
    assert ok and "no variant" in reason
    ok, reason = _ours(90, "uint4b8", False, 64, torch.int8, 4096, 4096)
    assert not ok
