"""What the object-storage tests share: a tiny AWQ bundle (TP 1 and 2) published to a test server's bucket, and a
byte-for-byte tensor comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from marlin_pack.remote.bundle import plan_rank
from marlin_pack.remote.push import push
from marlin_pack.remote.stream import HostSink, read_rank

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


def assert_rank_streams_its_files(bundle: Any, model: Path, url: str, tp: int, rank: int) -> None:
    """Rank ``rank`` of TP ``tp`` of the published ``bundle`` streams its own rank file and ``common.safetensors``, and
    nothing else, each tensor byte for byte the local bundle's; its plan names the URL."""
    plan = plan_rank(bundle, tp, rank)
    assert f"from {url}:" in plan.text()
    sink = HostSink(plan)
    done = read_rank(plan, sink)
    assert set(done.bytes_read) == {f"tp{tp}/rank-{rank}.safetensors", "common.safetensors"}
    for path in done.bytes_read:
        local = load_file(model / "marlin-pack" / path)
        got = sink.tensors(path)
        assert set(got) == set(local) and all(same_bytes(got[n], t) for n, t in local.items()), path
