"""Real vLLM quant-method and kernel objects without a model around them, for the plugin tests.

Kernels are created without their ``__init__`` (whose checks need a GPU) but with the
attributes it sets; quant methods likewise. Layers hold tensors of exactly the shapes
``MarlinLinearKernel.process_weights_after_loading`` leaves (arbitrary contents).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn


def mp_config(weight: str = "uint4", act: torch.dtype = torch.float16, k: int = 256, n: int = 512, g: int = 128) -> Any:
    """An ``MPLinearLayerConfig`` (``uint4``: AWQ with zero points; ``uint4b8``/``uint8b128``: GPTQ)."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    return MPLinearLayerConfig(
        full_weight_shape=(k, n),
        partition_weight_shape=(k, n),
        weight_type=getattr(scalar_types, weight),
        act_type=act,
        group_size=g,
        zero_points=weight == "uint4",
    )


def kernel_cls(name: str) -> type:
    """``Marlin`` / ``Machete`` / ``Exllama`` / ``Conch`` -> vLLM's ``<name>LinearKernel``."""
    module = {"Marlin": "marlin", "Machete": "machete", "Exllama": "exllama", "Conch": "conch"}[name]
    mod = importlib.import_module(f"vllm.model_executor.kernels.linear.mixed_precision.{module}")
    return getattr(mod, f"{name}LinearKernel")  # type: ignore[no-any-return]


def fake_kernel(cls: type, config: Any) -> Any:
    """A kernel as its ``__init__`` would leave it (AWQ and GPTQ both name the zero points ``qzeros``)."""
    kernel = object.__new__(cls)
    kernel.config, kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name = config, "qweight", "scales", "qzeros"
    return kernel


def quant_method(kind: str, kernel: Any) -> Any:
    """An ``AutoAWQMarlinLinearMethod`` (``awq``) or ``AutoGPTQLinearMethod`` (``gptq``) using ``kernel``."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMarlinLinearMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    cls = AutoAWQMarlinLinearMethod if kind == "awq" else AutoGPTQLinearMethod
    method = cls.__new__(cls)
    method.kernel = kernel
    method.use_batch_invariant = False  # read by GPTQ's post-processing from vLLM 0.34.0
    return method


def running_release() -> Any:
    """The installed vLLM's entry in marlin-pack's release table."""
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    entry = releases.release(vllm_version())
    assert entry is not None, f"vLLM {vllm_version()} is not a release marlin-pack supports"
    return entry


def assert_empty_zero_points(layer: nn.Module, method: Any) -> None:
    """The kernel's zero-point parameter is Marlin's empty int32[0] on the weights' device (``qzeros`` up to vLLM 0.33,
    ``w_zp`` from 0.34, where an unused loaded ``qzeros`` is retired instead); no ``input_global_scale`` but None."""
    zp = getattr(layer, method.kernel.w_zp_name)
    assert isinstance(zp, nn.Parameter) and zp.numel() == 0 and zp.dtype == torch.int32 and zp.device == layer.qweight.device
    if running_release().finish == "w_zp":
        assert method.kernel.w_zp_name == "w_zp" and getattr(layer.qzeros, "retired", False)
    assert getattr(layer, "input_global_scale", None) is None


def marlin_method(kind: str, config: Any) -> Any:
    return quant_method(kind, fake_kernel(kernel_cls("Marlin"), config))


def marlin_layer(weight: str, k: int, n: int, g: int, bias: bool) -> tuple[nn.Module, Any]:
    """A layer holding tensors of the shapes MarlinLinearKernel leaves, and its kernel config."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_padded_nk

    config = mp_config(weight, torch.float16, k, n, g)
    pn, pk = marlin_padded_nk(n, k, g)
    bits = config.weight_type.size_bits
    groups = 1 if g == -1 else pk // g
    layer = nn.Module()
    layer.prefix = "model.layers.0.mlp.gate_up_proj"

    def p(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=False)

    layer.qweight = p(torch.randint(-(2**31), 2**31 - 1, (pk // 16, pn * bits // 2), dtype=torch.int32))
    layer.scales = p(torch.randn(groups, pn, dtype=torch.float16))
    if config.zero_points:
        layer.qzeros = p(torch.randint(0, 2**31 - 1, (groups, pn * bits // 32), dtype=torch.int32))
    else:
        layer.qzeros = p(torch.empty(0, dtype=torch.int32))
    layer.bias = p(torch.randn(pn, dtype=torch.float16)) if bias else None
    return layer, config


def forbid_stock_post_processing(monkeypatch: pytest.MonkeyPatch, method: Any) -> None:
    """Every tensor transform of stock post-processing (AWQ conversion, the kernel's) raises."""
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("stock post-processing ran")

    monkeypatch.setattr(auto_awq, "_convert_awq_to_standard_format", boom)
    monkeypatch.setattr(method.kernel, "process_weights_after_loading", boom, raising=False)


def weight_cache_key(model_config: Any, tp_size: int, tp_rank: int, **settings: Any) -> Any:
    """vLLM's ``WeightCacheKey.from_model_config`` with those of ``settings`` (``cache_config``, ``kernel_config``) the
    running release takes: 0.30-0.32 take neither, 0.33+ both."""
    import inspect

    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    takes = inspect.signature(WeightCacheKey.from_model_config).parameters
    return WeightCacheKey.from_model_config(model_config, tp_size, tp_rank, **{k: v for k, v in settings.items() if k in takes})
