"""Per-layer "already prepacked" marks, and the patch that makes vLLM honour them.

A layer whose ``qweight``/``scales``/``qzeros``/``bias`` already hold the tensors
``MarlinLinearKernel.process_weights_after_loading`` would produce is *marked*. vLLM's
``process_weights_after_loading`` of ``AutoAWQMarlinLinearMethod`` and
``AutoGPTQLinearMethod`` is wrapped (once per process, by :func:`install_patches`, which
``register()`` calls) so that, for a marked layer, it only restores the Python-side state
the kernel's post-processing would set (``input_global_scale = None``) and skips every
tensor transform (AWQ conversion, repack, permutations). The mark is *one-shot*: the
first (skipped) post-processing consumes it, so later reloads of checkpoint-format
weights into the same layer are post-processed normally, and ``apply()`` is untouched.

Why a per-layer mark and not a temporary swap of ``layer.quant_method``: the weight-cache
daemon runs vLLM's ``process_weights_after_loading`` itself, in normal mode, after the
loader's ``load_weights`` returned; a mark set by ``load_weights`` still works there.

API:
    mark_prepacked(layer)       mark a layer whose tensors are final
    is_prepacked(layer)         whether the mark is still pending
    clear_prepacked(layer)      drop the mark
    install_patches()           wrap the quant methods (idempotent); returns their names
    is_patched(quant_method)    whether a method's post-processing honours the mark

Extending (e.g. for the IPC weight cache's ``weights_already_processed()``): add the
condition to :func:`_skip_post_processing`; :func:`finish_prepacked` is the state to
restore in every skipped case.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "mark_prepacked",
    "is_prepacked",
    "clear_prepacked",
    "finish_prepacked",
    "install_patches",
    "uninstall_patches",
    "is_patched",
    "PATCH_TARGETS",
]

_MARK = "_marlin_pack_prepacked"
_ORIGINAL = "__marlin_pack_original__"
# (module, class) pairs whose process_weights_after_loading honours the mark.
PATCH_TARGETS: tuple[tuple[str, str], ...] = (
    ("vllm.model_executor.layers.quantization.auto_awq", "AutoAWQMarlinLinearMethod"),
    ("vllm.model_executor.layers.quantization.auto_gptq", "AutoGPTQLinearMethod"),
)


def mark_prepacked(layer: nn.Module) -> None:
    """Mark ``layer``: its next ``process_weights_after_loading`` is a no-op."""
    layer.__dict__[_MARK] = True


def is_prepacked(layer: nn.Module) -> bool:
    """Whether ``layer`` carries a pending mark."""
    return layer.__dict__.get(_MARK, False) is True


def clear_prepacked(layer: nn.Module) -> None:
    layer.__dict__.pop(_MARK, None)


def finish_prepacked(layer: nn.Module) -> None:
    """The Python-side state MarlinLinearKernel's post-processing sets with 16-bit activations."""
    if "input_global_scale" not in layer._parameters:
        layer.input_global_scale = None


def _skip_post_processing(quant_method: Any, layer: nn.Module) -> bool:
    """Consume the mark; True when the layer's tensors are already final."""
    if is_prepacked(layer):
        clear_prepacked(layer)
        return True
    return False


def _wrap(original: Callable[[Any, nn.Module], None]) -> Callable[[Any, nn.Module], None]:
    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        if _skip_post_processing(self, layer):
            finish_prepacked(layer)
            return
        original(self, layer)

    setattr(process_weights_after_loading, _ORIGINAL, original)
    return process_weights_after_loading


def _targets() -> list[type]:
    import importlib

    return [getattr(importlib.import_module(mod), cls) for mod, cls in PATCH_TARGETS]


def install_patches() -> list[str]:
    """Wrap the targets' ``process_weights_after_loading`` (idempotent); returns the class names.

    Imports vLLM; call it from vLLM processes only (``register()`` does).
    """
    names = []
    for cls in _targets():
        current = cls.__dict__["process_weights_after_loading"]
        if getattr(current, _ORIGINAL, None) is None:
            cls.process_weights_after_loading = _wrap(current)
        names.append(cls.__name__)
    return names


def uninstall_patches() -> None:
    """Restore the original methods (for tests)."""
    for cls in _targets():
        original = getattr(cls.__dict__["process_weights_after_loading"], _ORIGINAL, None)
        if original is not None:
            cls.process_weights_after_loading = original


def is_patched(quant_method: object) -> bool:
    """Whether ``quant_method``'s post-processing (as resolved on its class) honours the mark."""
    method = getattr(type(quant_method), "process_weights_after_loading", None)
    return getattr(method, _ORIGINAL, None) is not None
