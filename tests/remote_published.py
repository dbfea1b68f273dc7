"""What the object-storage tests share: a tiny AWQ bundle (TP 1 and 2) published to a test server's bucket, and a
byte-for-byte tensor comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from marlin_pack.remote.push import push

BLOCK = 64 << 10  # publication blocks of the tests: several per rank file


def publish_llama(make_bundle: Any, server: Any, block_size: int = BLOCK) -> tuple[Path, str]:
    """``make_bundle``'s AWQ g32 bundle (TP 1 and 2) pushed to ``server``'s ``llama`` prefix: (the model, the URL)."""
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    url = server.url("llama")
    pushed = push(model / "marlin-pack", url, block_size=block_size)
    assert pushed.url == url and not pushed.up_to_date
    return model, url


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (dtype and shape aside)."""
    return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))
