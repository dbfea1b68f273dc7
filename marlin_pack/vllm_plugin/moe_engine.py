"""Every read (and the few writes) of vLLM's mixture-of-experts internals the loader and the patches need.

vLLM runs AWQ / GPTQ experts through ``AutoAWQMoEMethod`` / ``AutoGPTQMoEMethod``, and
compressed-tensors pack-quantized ones through ``CompressedTensorsWNA16MoEMethod`` (its backend is
``wna16_backend``, its parameters are named ``w13_weight_packed`` ...: ``marlin.moe.CT_MOE_NAMES``), on a
WNA16 MoE backend chosen per layer (``select_wna16_moe_backend``): ``--moe-backend auto`` picks
Humming on SM90 when the optional ``humming`` package is installed, else Marlin. A bundle holds
the Marlin MoE layout, so the loader makes ``auto`` resolve to Marlin (:func:`force_marlin_moe`)
and checks what each layer got (:func:`moe_layer_facts`). Facts are the plain dataclasses of
``layer_check.py``. Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_moe_padded_intermediate

from marlin_pack.marlin.moe import AUTO_MOE_NAMES, CT_MOE_NAMES, MoeParamNames
from marlin_pack.vllm_plugin.layer_check import MoeLayerFacts

__all__ = [
    "MOE_METHODS",
    "is_moe_layer",
    "moe_backend_setting",
    "force_marlin_moe",
    "moe_layer_facts",
    "is_marlin_moe_16bit",
    "check_marlin_moe_layout",
    "finish_marlin_moe_layer",
]

# The AWQ/GPTQ/compressed-tensors MoE quant methods whose Marlin tensors a bundle (or the weight cache) can provide.
CT_MOE_METHOD = "CompressedTensorsWNA16MoEMethod"
MOE_METHODS = ("AutoAWQMoEMethod", "AutoGPTQMoEMethod", CT_MOE_METHOD)
_BIASES = ("w13_bias", "w2_bias")


def _names(method: Any) -> MoeParamNames:
    """The experts' parameter names under ``method``."""
    return CT_MOE_NAMES if type(method).__name__ == CT_MOE_METHOD else AUTO_MOE_NAMES


def is_moe_layer(module: nn.Module) -> bool:
    """A routed-experts module (vLLM's ``RoutedExperts``) with a fused-MoE quant method."""
    return isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase)


def moe_backend_setting(kernel_config: Any) -> str:
    """``--moe-backend`` as configured (``auto`` when unset)."""
    return str(getattr(kernel_config, "moe_backend", None) or "auto")


def force_marlin_moe(kernel_config: Any) -> bool:
    """Resolve ``--moe-backend auto`` to ``marlin``, as ``--moe-backend marlin`` would; True if changed.

    On SM90 ``auto`` would pick Humming when the ``humming`` package is installed. An explicit
    backend is kept (the layer check then refuses a non-Marlin one).
    """
    if moe_backend_setting(kernel_config) != "auto":
        return False
    kernel_config.moe_backend = "marlin"
    return True


def _backend(method: Any) -> str | None:
    backend = getattr(method, "wna16_moe_backend", None) or getattr(method, "wna16_backend", None)
    return backend.value if isinstance(backend, WNA16MoEBackend) else None


def _quant(method: Any) -> tuple[str | None, int | None, bool | None]:
    """(weight type, group size, zero points) as the method's config says."""
    if type(method).__name__ == CT_MOE_METHOD:  # its scalar type (uint4b8 / uint8b128 / uint4), -1 when channel-wise
        return str(method.quant_type), int(method.group_size), not bool(method.symmetric)
    qc = getattr(method, "quant_config", None)
    if qc is None:
        return None, None, None
    if type(method).__name__ == "AutoAWQMoEMethod":
        return str(method.quant_type), int(qc.group_size), bool(qc.zero_point)
    return str(qc.quant_type), int(qc.group_size), False


def moe_layer_facts(module: nn.Module, skips_when_marked: bool) -> MoeLayerFacts:
    """The configuration vLLM chose for one routed-experts layer (read before weights are placed)."""
    method = module.quant_method
    weight_type, group_size, zero_points = _quant(method)
    scales = getattr(module, _names(method).scales13, None)
    act = getattr(method, "input_dtype", None) or (scales.dtype if isinstance(scales, torch.Tensor) else None)
    inter = getattr(module, "intermediate_size_per_partition", None)
    padded = marlin_moe_padded_intermediate(inter, group_size) if inter is not None and group_size is not None else None
    biases = set(getattr(module, "_loaded_expert_biases", ()) or ())
    return MoeLayerFacts(
        method=type(method).__name__,
        backend=_backend(method),
        num_experts=getattr(module, "local_num_experts", None),
        global_num_experts=getattr(module, "global_num_experts", None),
        hidden_size=getattr(module, "hidden_size", None),
        intermediate_size=inter,
        padded_intermediate=padded,
        group_size=group_size,
        weight_type=weight_type,
        act_dtype=str(act).removeprefix("torch.") if act is not None else None,
        zero_points=zero_points,
        has_bias=bool(biases),
        skips_when_marked=skips_when_marked,
    )


def is_marlin_moe_16bit(method: Any) -> bool:
    """True when an AWQ/GPTQ/compressed-tensors MoE method runs the Marlin MoE backend with 16-bit activations."""
    if type(method).__name__ not in MOE_METHODS or _backend(method) != WNA16MoEBackend.MARLIN.value:
        return False
    return getattr(method, "input_dtype", None) is None  # None: activations in the model's fp16/bf16


def check_marlin_moe_layout(method: Any, layer: nn.Module) -> None:
    """Check that an experts layer's tensors already have the Marlin MoE shapes vLLM's post-processing gives.

    Raises:
        RuntimeError: a tensor is missing (still on ``meta``) or not in the Marlin MoE layout.
    """
    weight_type, group_size, zero_points = _quant(method)
    bits = 8 if weight_type == "uint8b128" else 4
    e, h = layer.local_num_experts, layer.hidden_size
    ip = marlin_moe_padded_intermediate(layer.intermediate_size_per_partition, group_size or -1)
    g13, g2 = (1, 1) if group_size == -1 else (h // group_size, ip // group_size)
    pn = _names(method)
    want = {
        pn.w13: (e, h // 16, 2 * ip * bits // 2),
        pn.w2: (e, ip // 16, h * bits // 2),
        pn.scales13: (e, g13, 2 * ip),
        pn.scales2: (e, g2, h),
    }
    if pn.zeros_always or zero_points:
        want |= {pn.zeros13: (e, g13, 2 * ip * bits // 32), pn.zeros2: (e, g2, h * bits // 32)}
    want |= {name: (e, 2) for name in pn.shapes}
    where = f"experts layer {getattr(layer, 'layer_name', '') or type(layer).__name__} ({type(method).__name__})"
    for name, shape in want.items():
        t = getattr(layer, name, None)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            raise RuntimeError(f"{where}: the weight cache did not provide {name}")
        if tuple(t.shape) != shape:
            raise RuntimeError(
                f"{where}: pre-processed {name} has shape {list(t.shape)}, Marlin MoE holds {list(shape)}; "
                "the weight cache holds another layout"
            )


def finish_marlin_moe_layer(method: Any, layer: nn.Module, pre_processed: bool) -> None:
    """Do what AutoAWQMoEMethod / AutoGPTQMoEMethod / CompressedTensorsWNA16MoEMethod's post-processing does
    besides transforming tensors (compressed-tensors registers no bias placeholder unless the model has biases,
    and its w13/w2 input global scales exist only for int8 activations, never with a bundle or the cache).

    That is: drop the expert-bias placeholders no tensor was given for (GPTQ registers them
    unconditionally; a kernel handed an empty bias would add garbage), alias ``w13_weight`` /
    ``w2_weight`` to the quantized weights (the modular kernel reads those names), and build the
    layer's fused-MoE kernel (``_setup_kernel``: Python-side state no tensor carries).
    ``pre_processed``: the tensors came from the weight cache (a bias it provided is real), else
    from a bundle (which never holds expert biases).
    """
    loaded = set(getattr(layer, "_loaded_expert_biases", ()) or ())
    for name in _BIASES:
        bias = layer._parameters.get(name)
        if bias is None:
            continue
        unused = bias.is_meta if pre_processed else name not in loaded
        if unused:
            layer.register_parameter(name, None)
    pn = _names(method)
    layer.w13_weight = getattr(layer, pn.w13)
    layer.w2_weight = getattr(layer, pn.w2)
    method._setup_kernel(layer)
