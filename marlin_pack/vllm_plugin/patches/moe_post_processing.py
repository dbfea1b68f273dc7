"""Post-processing of AWQ/GPTQ/compressed-tensors (WNA16) Marlin MoE experts layers whose tensors are already final.

The mixture-of-experts counterpart of :mod:`.post_processing` (same mark, same order of
decisions): ``AutoAWQMoEMethod`` / ``AutoGPTQMoEMethod`` / ``CompressedTensorsWNA16MoEMethod``'s ``process_weights_after_loading``

1. for a layer the ``marlin_prepacked`` loader marked: consumes the mark and finishes the layer;
2. for final tensors from vLLM's weight cache (``weights_already_processed()`` inside marlin-pack's scope, allowed
   only when ``supports_pre_processed_weights`` is True: the Marlin MoE backend with 16-bit
   activations): checks the layout, then finishes the layer;
3. otherwise: runs vLLM's own post-processing.

"Finish" (``moe_engine.finish_marlin_moe_layer``) is what vLLM's post-processing does besides
the tensor transforms: drop unloaded bias placeholders, alias ``w13_weight``/``w2_weight``,
build the layer's fused-MoE kernel. ``apply()`` is never touched.

Inert outside marlin-pack's paths, as :mod:`.post_processing`: an unmarked layer outside the weight cache's build
(:func:`.scope.pre_processed_here`) gets vLLM's own post-processing, called with the same arguments, and
``supports_pre_processed_weights`` is the release's own value there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from marlin_pack.vllm_plugin.patches import catalog, scope
from marlin_pack.vllm_plugin.patches.post_processing import take_prepacked_mark

__all__ = ["MOE_QUANT_METHODS", "PATCHES", "supports_pre_processed_moe"]

MOE_QUANT_METHODS = catalog.MOE_QUANT_METHODS


def supports_pre_processed_moe(quant_method: Any) -> bool:
    """The weight cache may hand this experts layer final tensors: Marlin MoE backend, 16-bit activations."""
    from marlin_pack.vllm_plugin.moe_engine import is_marlin_moe_16bit

    return is_marlin_moe_16bit(quant_method)


def _process_weights_after_loading(original: Callable[[Any, nn.Module], None]) -> Callable[[Any, nn.Module], None]:
    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        from marlin_pack.vllm_plugin.moe_engine import check_marlin_moe_layout, finish_marlin_moe_layer

        if take_prepacked_mark(layer):
            finish_marlin_moe_layer(self, layer, pre_processed=False)
        elif scope.pre_processed_here():
            if not supports_pre_processed_moe(self):  # vLLM checks the flag first; keep the promise anyway
                raise RuntimeError(f"{type(self).__name__} on {getattr(self, 'wna16_moe_backend', None)} cannot use pre-processed weights")
            check_marlin_moe_layout(self, layer)
            finish_marlin_moe_layer(self, layer, pre_processed=True)
        else:
            original(self, layer)

    return process_weights_after_loading



PATCHES = catalog.patches(
    __name__,
    {
        **{f"{target}.process_weights_after_loading": _process_weights_after_loading for target in MOE_QUANT_METHODS},
        **{f"{target}.supports_pre_processed_weights": functools.partial(scope.supports_in_scope, supports_pre_processed_moe)
           for target in MOE_QUANT_METHODS},
    },
)
