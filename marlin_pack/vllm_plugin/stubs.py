"""Stub placeholders: one element broadcast to a placeholder's shape (stride 0), no memory of their own.

Made by :mod:`.patches.placeholders` while vLLM builds a model the loader fills from a bundle;
the bundle's tensors replace most of them, finishing (:mod:`.patches.post_processing`) the rest,
and :func:`materialize_stubs` gives memory to any left. Torch only: both those modules use it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["is_stub", "materialize_stubs"]


def is_stub(t: torch.Tensor) -> bool:
    """Whether ``t`` is a broadcast placeholder (several elements sharing storage) rather than memory of its own."""
    return t.numel() > 1 and t.untyped_storage().nbytes() < t.numel() * t.element_size()


def materialize_stubs(module: nn.Module) -> int:
    """Give every stub parameter or buffer of ``module`` (not its children) memory of its own, same contents.

    Returns how many were materialized.
    """
    count = 0
    for t in [*module._parameters.values(), *module._buffers.values()]:
        if isinstance(t, torch.Tensor) and is_stub(t):
            t.data = t.data.contiguous()
            count += 1
    return count
