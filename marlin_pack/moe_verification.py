"""``verify`` of a bundle's experts layers: rebuilt from the checkpoint and compared byte for byte.

The dense layers' round trip lays the checkpoint's codes out by the index-based definition of
Marlin's layout (``repack.pack_marlin_weights``); for experts the layout is re-derived from the
source by the converter's own code (``moe_conversion``, the code the oracle tests pin to vLLM)
and each stored tensor must equal it, padding included.
"""

from __future__ import annotations

from typing import Any

import torch

from marlin_pack.errors import MarlinPackError
from marlin_pack.moe_conversion import MoePlan, build_moe_layer, read_moe_layer
from marlin_pack.schemas import Manifest, torch_dtype
from marlin_pack.sources import Checkpoint, QuantSource

__all__ = ["check_moe_layers"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_moe_layers(m: Manifest, ckpt: Checkpoint, plan: MoePlan, source: QuantSource, handles: dict[tuple[int, int], Any]) -> int:
    """Compare every experts tensor of every rank file with its rebuild; the number of layer shards checked.

    Raises:
        MarlinPackError: naming the first tensor that differs.
    """
    dtype = torch_dtype(m.serving_dtype)
    checked = 0
    for layer in plan.layers:
        experts = read_moe_layer(plan, source, ckpt, layer, torch.device("cpu"))
        for tp_set in m.tensor_parallel:
            for rank in range(tp_set.tp_size):
                f = handles[(tp_set.tp_size, rank)]
                for name, want in build_moe_layer(plan, m.quant, dtype, tp_set.tp_size, rank, layer, experts).items():
                    got = f.get_tensor(name)
                    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(_bytes(got), _bytes(want)):
                        raise MarlinPackError(
                            f"{name} (tp {tp_set.tp_size} rank {rank}) differs from the experts rebuilt from the checkpoint"
                        )
                checked += 1
    return checked
