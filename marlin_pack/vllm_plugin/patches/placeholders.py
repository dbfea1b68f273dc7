"""``create_weights`` of the AWQ/GPTQ/compressed-tensors linear methods: placeholders without memory.

vLLM builds every quantized linear layer with checkpoint-shaped placeholder tensors on the
device (``torch.empty``/``torch.zeros``), which the ``marlin_prepacked`` loader then rebinds to
views of its arena (one allocation holding the bundle's final tensors). For a 70B model that is
~35 GB in hundreds of allocations made only to be freed. While :func:`stub_quantized_placeholders`
is active (the loader builds a model it fills from a bundle), the tensors these methods create
are *stubs*: one element of the right dtype on the right device, broadcast to the placeholder's
shape (stride 0). No memory, so the loader can allocate the arena and start copying the bundle
into it *before* vLLM builds the model, and the copy runs beside the construction.

Why not ``meta``: a parameter's ``.data`` cannot be rebound from a meta tensor to a device
tensor (``set_data``: incompatible tensor type), and the loader keeps vLLM's parameter objects
(their classes and loader attributes), as vLLM's own ``replace_parameter`` does. A stub holds
the value its factory would have written (``zeros``: 0), so
:func:`~marlin_pack.vllm_plugin.stubs.materialize_stubs` turns one that outlives finishing into an
ordinary tensor with the same contents as vLLM's.

With ``embeddings=True`` (the loader copies the bundle's large common tensors beside the construction,
option ``common_during_build``) vLLM's unquantized embedding method, which builds the embedding and an
untied output head, makes stubs too; the loader binds its copies to them, and gives memory to any it
does not replace before vLLM's weight loaders write into them.

compressed-tensors' linear method also records its layer here (see
:func:`~marlin_pack.vllm_plugin.patches.post_processing.supports_pre_processed`, which the weight cache's
checks read in a daemon's fill and an ``ipc_cache`` engine's build): one patch per target, so that
method's wrapper does both, and it records only inside marlin-pack's scope (:mod:`.scope`, entered by both).

Inert outside marlin-pack's paths: with no stub context (only the loader enters one) and outside the
scope, each wrapper calls vLLM's ``create_weights`` with the same arguments and does nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from marlin_pack.vllm_plugin.patches import catalog, scope
from marlin_pack.vllm_plugin.patches.post_processing import LAYER_REF, QUANT_METHODS

__all__ = ["EMBEDDING_METHOD", "PATCHES", "stub_quantized_placeholders"]

_STUBS: contextvars.ContextVar[bool] = contextvars.ContextVar("marlin_pack_stub_placeholders", default=False)
_STUB_EMBEDDINGS: contextvars.ContextVar[bool] = contextvars.ContextVar("marlin_pack_stub_embeddings", default=False)
EMBEDDING_METHOD = catalog.EMBEDDING_METHOD
_CT_METHOD = QUANT_METHODS[2]
# The factories vLLM's linear methods and the WNA16 scheme create placeholders with.
_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones})


@contextlib.contextmanager
def stub_quantized_placeholders(enabled: bool = True, embeddings: bool = False) -> Iterator[None]:
    """While active (and ``enabled``), the patched linear methods create stub placeholders; with
    ``embeddings`` also the unquantized embedding method (embedding, untied head)."""
    token = _STUBS.set(enabled)
    token_embeddings = _STUB_EMBEDDINGS.set(enabled and embeddings)
    try:
        yield
    finally:
        _STUB_EMBEDDINGS.reset(token_embeddings)
        _STUBS.reset(token)


class _StubFactories(TorchFunctionMode):
    """``torch.empty/zeros/ones`` of more than one element: one element broadcast to the shape."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _FACTORIES or kwargs.get("out") is not None or kwargs.get("requires_grad"):
            return func(*args, **kwargs)
        # The shape and dtype the call asks for, without memory (this mode is off inside its handler).
        shape_of = func(*args, **{**kwargs, "device": "meta"})
        if shape_of.numel() <= 1 or shape_of.dim() == 0:
            return func(*args, **kwargs)
        one = {k: v for k, v in kwargs.items() if k not in ("size", "memory_format")}
        one["dtype"] = shape_of.dtype
        return func(1, **one).expand(shape_of.shape)  # on kwargs' device, else the default one


def _create_weights(record: bool, active: contextvars.ContextVar[bool] = _STUBS) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def make(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def create_weights(self: Any, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
            if record and scope.active():  # for the weight cache's checks (a daemon's fill, an ipc_cache build)
                self.__dict__[LAYER_REF] = weakref.ref(layer)
            if not active.get():
                original(self, layer, *args, **kwargs)
                return
            with _StubFactories():
                original(self, layer, *args, **kwargs)

        return create_weights

    return make


PATCHES = catalog.patches(
    __name__,
    {
        **{f"{target}.create_weights": _create_weights(record=target == _CT_METHOD) for target in QUANT_METHODS},
        f"{EMBEDDING_METHOD}.create_weights": _create_weights(record=False, active=_STUB_EMBEDDINGS),
    },
)
