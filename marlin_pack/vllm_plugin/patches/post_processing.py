"""Post-processing of AWQ/GPTQ/compressed-tensors (WNA16) Marlin layers whose tensors are already final.

Two sources deliver final tensors: the ``marlin_prepacked`` loader (which *marks* the layers
it filled from a bundle) and vLLM's weight cache (``weights_already_processed()``, which
vLLM allows only for quant methods declaring ``supports_pre_processed_weights``).
One wrapper of ``process_weights_after_loading`` per quant method takes its decisions in
order:

1. the layer carries the prepacked mark: consume it, finish the layer, give memory to the stub
   placeholders (see ``stubs.py``) finishing kept;
2. the weight cache handed over final tensors: check the kernel and layout, finish the layer;
3. otherwise: vLLM's own post-processing.

"Finish" (``engine.finish_layer``: Marlin's, or Machete's on SM90) sets only what the kernel's post-processing sets
besides the transformed tensors. The mark is one-shot: a later reload of checkpoint-format
weights into the same layer is post-processed normally. ``apply()`` is never touched.

Inert outside marlin-pack's paths: only the loader marks layers, and the weight cache's final tensors are taken
only inside marlin-pack's scope (:func:`.scope.pre_processed_here`: an ``ipc_cache`` engine's build, a daemon's
fill); any other layer gets vLLM's own post-processing, called with the same arguments, and
``supports_pre_processed_weights`` is the release's own value outside that scope (vLLM 0.34's
``reload_weights(is_checkpoint_format=False)`` post-processes under ``weights_already_processed()`` in any engine:
there a Machete or compressed-tensors layer is refused as without the plugin). Purposes: the post-processing
is ``correctness``, the opt-in ``weight_cache`` (:mod:`.catalog`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from marlin_pack.vllm_plugin.patches import catalog, scope
from marlin_pack.vllm_plugin.patches.registry import is_replacement
from marlin_pack.vllm_plugin.stubs import materialize_stubs

__all__ = [
    "LAYER_REF",
    "QUANT_METHODS",
    "PATCHES",
    "mark_prepacked",
    "is_prepacked",
    "take_prepacked_mark",
    "is_patched",
    "supports_pre_processed",
]

_MARK = "_marlin_pack_prepacked"
# The dense AWQ/GPTQ/compressed-tensors quant methods served by MarlinLinearKernel, as "module:Class"
# (compressed-tensors delegates to the layer's scheme; only CompressedTensorsWNA16 on Marlin is finished here).
QUANT_METHODS = catalog.QUANT_METHODS

# compressed-tensors' linear method holds no kernel and does not know its layer (the kernel is on
# layer.scheme; vLLM makes one method object per layer): create_weights records the layer here inside
# marlin-pack's scope, where the weight cache's checks read it (patched in .placeholders, which owns the
# create_weights patches).
LAYER_REF = "_marlin_pack_layer"


def mark_prepacked(layer: nn.Module) -> None:
    """Mark ``layer``: its tensors are final, its next post-processing only finishes it."""
    layer.__dict__[_MARK] = True


def is_prepacked(layer: nn.Module) -> bool:
    """Whether ``layer`` carries a pending mark."""
    return layer.__dict__.get(_MARK, False) is True


def take_prepacked_mark(layer: nn.Module) -> bool:
    """Consume the mark; True if there was one."""
    return layer.__dict__.pop(_MARK, False) is True


def is_patched(quant_method: object) -> bool:
    """Whether ``quant_method``'s post-processing (as resolved on its class) is the wrapper below."""
    return is_replacement(getattr(type(quant_method), "process_weights_after_loading", None))


def _recorded_layer(quant_method: Any) -> nn.Module | None:
    ref = getattr(quant_method, "__dict__", {}).get(LAYER_REF)
    return ref() if ref is not None else None


def supports_pre_processed(quant_method: Any, layer: nn.Module | None = None) -> bool:
    """The weight cache may hand this layer final tensors: MarlinLinearKernel or MacheteLinearKernel with 16-bit activations
    (compressed-tensors: the WNA16 scheme of the layer its ``create_weights`` saw)."""
    from marlin_pack.vllm_plugin.engine import is_prepackable_16bit

    if layer is None:
        layer = _recorded_layer(quant_method)
    if layer is None and getattr(quant_method, "kernel", None) is None:
        return False  # a compressed-tensors method not bound to a layer yet
    return is_prepackable_16bit(quant_method, layer)


def _process_weights_after_loading(original: Callable[[Any, nn.Module], None]) -> Callable[[Any, nn.Module], None]:
    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        from marlin_pack.vllm_plugin.engine import check_layout, finish_layer

        if take_prepacked_mark(layer):
            finish_layer(self, layer)
            materialize_stubs(layer)  # stub placeholders the bundle did not replace and finishing kept
        elif scope.pre_processed_here():
            if not supports_pre_processed(self, layer):  # vLLM checks the flag first; keep the promise anyway
                raise RuntimeError(f"{type(getattr(self, 'kernel', None)).__name__} cannot use pre-processed weights")
            check_layout(self, layer)
            finish_layer(self, layer)
        else:
            original(self, layer)

    return process_weights_after_loading


PATCHES = catalog.patches(
    __name__,
    {
        **{f"{target}.process_weights_after_loading": _process_weights_after_loading for target in QUANT_METHODS},
        **{f"{target}.supports_pre_processed_weights": functools.partial(scope.supports_in_scope, supports_pre_processed)
           for target in QUANT_METHODS},
    },
)
