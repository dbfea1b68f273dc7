"""``patches.weight_cache`` (compressed-tensors KV cache): an ipc_cache engine post-processes compressed-tensors
attention layers built on ``meta``; outside ``weights_already_processed()`` the method is vLLM's.

vLLM's ``CompressedTensorsKVCacheMethod`` reads its scale placeholders with ``.item()``; in
an engine filled from the weight-cache daemon they stay on ``meta`` (the daemon consumed them and
exported the ``_k_scale``... buffers). The patch routes pre-processed mode to the base class's
branch. Seen failing on the H200 (``Tensor.item() cannot be called on meta tensors``) before it.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")


def _attention_like(device: str) -> nn.Module:
    layer = nn.Module()
    for name in ("q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point"):
        setattr(layer, name, nn.Parameter(torch.ones((), device=device), requires_grad=False))
    for name, value in (("_k_scale", 0.5), ("_v_scale", 0.25), ("_q_scale", 1.0)):
        layer.register_buffer(name, torch.tensor(value))
    layer._k_scale_cpu = torch.zeros(())
    layer._v_scale_cpu = torch.zeros(())
    return layer


def _method() -> object:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )

    return object.__new__(CompressedTensorsKVCacheMethod)  # its state is not read by this step


def test_stock_method_fails_on_meta_placeholders_in_pre_processed_mode() -> None:
    from vllm.model_executor.utils import weights_already_processed

    with weights_already_processed(), pytest.raises(RuntimeError, match="meta"):
        _method().process_weights_after_loading(_attention_like("meta"))


@pytest.mark.usefixtures("weight_cache_scope")
def test_patched_method_uses_the_exported_buffers(patched: ModuleType) -> None:
    from vllm.model_executor.utils import weights_already_processed

    layer = _attention_like("meta")
    with weights_already_processed():
        _method().process_weights_after_loading(layer)
    assert (layer._k_scale_float, layer._v_scale_float, layer._q_scale_float) == (0.5, 0.25, 1.0)
    assert not any(hasattr(layer, n) for n in ("k_scale", "q_scale", "k_zero_point", "v_zero_point", "q_zero_point"))


def _state(layer: nn.Module) -> dict[str, object]:
    """The layer's tensors (values) and plain attributes (module bookkeeping dicts left out)."""
    tensors = {n: t.tolist() for n, t in [*layer.named_parameters(), *layer.named_buffers()]}
    attrs = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(layer).items() if not isinstance(v, dict)}
    return {**tensors, **attrs}


def test_patched_method_is_unchanged_outside_the_weight_cache() -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )

    from marlin_pack.vllm_plugin.patches.weight_cache import PATCHES

    patch = next(p for p in PATCHES if p.target.endswith("CompressedTensorsKVCacheMethod.process_weights_after_loading"))
    stock_fn = CompressedTensorsKVCacheMethod.process_weights_after_loading
    stock, ours = _attention_like("cpu"), _attention_like("cpu")
    stock_fn(_method(), stock)  # vLLM's own path: placeholders copied, then dropped
    patch.make(stock_fn)(_method(), ours)
    assert ours._k_scale_float == 1.0  # (0.33 drops the placeholders, 0.34 keeps them: as stock, either way)
    assert _state(ours) == _state(stock)
