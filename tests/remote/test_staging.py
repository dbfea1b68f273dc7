"""The ring of page-locked buffers between the streamer and the GPU (:mod:`marlin_pack.remote.staging`), on the CPU.

A stand-in device (:class:`LateCopies`) applies each queued copy only when the event recorded after it completes, and
reads the staged buffer then, as a DMA engine does: a buffer reused before its copies finished would land the next
block's bytes. So these tests prove, without timing anything, that the copies of one block are left running while the
next blocks are staged (overlap), that a buffer is reused only once its copies completed, that completed copies free
their buffers without waiting, that ``finish`` waits for every copy (also after a failed read), and that the loader's
streamed copy through the ring places exactly what the direct copy places.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from marlin_pack.remote.staging import RING_BYTES, StagedCopy, ring_buffers


class LateEvent:
    def __init__(self, device: LateCopies, copies: list[tuple[torch.Tensor, torch.Tensor]], index: int) -> None:
        self._device, self._copies, self.index = device, copies, index
        self.done = False

    def complete(self) -> None:
        if not self.done:
            for dst, src in self._copies:
                dst.copy_(src)  # the staged buffer as it is now
            self.done = True
            self._device.completed.append(self.index)

    def query(self) -> bool:
        if not self.done and self.index in self._device.finish_on_query:
            self.complete()
        return self.done

    def synchronize(self) -> None:
        # copies complete in order on one stream
        for event in self._device.events[: self.index + 1]:
            event.complete()
        self._device.waited.append(self.index)


class LateCopies:
    """Copies queued in order, landing when their event completes (``synchronize``, or a query the test allows)."""

    def __init__(self, finish_on_query: set[int] | None = None) -> None:
        self.events: list[LateEvent] = []
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.completed: list[int] = []
        self.waited: list[int] = []
        self.finish_on_query = finish_on_query or set()
        self.buffers = 0
        self.finished = False

    def buffer(self, nbytes: int) -> torch.Tensor:
        self.buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pending.append((dst, src))

    def record(self) -> LateEvent:
        event = LateEvent(self, self.pending, len(self.events))
        self.pending = []
        self.events.append(event)
        return event

    def finish(self) -> None:
        self.finished = True
        for event in self.events:
            event.complete()


def _blocks(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_copies_run_behind_the_reads_and_a_buffer_waits_only_for_its_own_copies() -> None:
    block, n = 4096, 10
    device = LateCopies()
    ring = StagedCopy(device, block, buffers=4)
    dst = torch.zeros(n * block, dtype=torch.uint8)
    blocks = _blocks(n, block)
    for i, data in enumerate(blocks):
        lent = data.clone()
        # each block split over two destinations, as a block spanning two tensors is
        ring.put(lent, [(dst[i * block:i * block + 1000], 0, 1000), (dst[i * block + 1000:(i + 1) * block], 1000, block)])
        lent.fill_(0xEE)  # the streamer reuses its buffer once put returns
        if i < 4:  # the first four blocks: nothing waited for, all four copies in flight at once (overlap)
            assert device.waited == [] and device.completed == []
        else:  # from then on each block waits for exactly the oldest copy: the one whose buffer it takes
            assert device.waited == list(range(i - 3)) and device.completed == list(range(i - 3))
    assert ring.most_in_flight == 4 and ring.waits == n - 4 and device.buffers == 4
    ring.finish()
    assert device.finished and device.completed == list(range(n))
    assert torch.equal(dst, torch.cat(blocks))  # no buffer was overwritten before its copies landed
    assert ring.bytes == n * block


def test_completed_copies_free_their_buffers_without_waiting() -> None:
    block, n = 1024, 12
    device = LateCopies(finish_on_query=set(range(100)))  # every copy done by the time it is asked about
    ring = StagedCopy(device, block, buffers=3)
    dst = torch.zeros(n * block, dtype=torch.uint8)
    blocks = _blocks(n, block)
    for i, data in enumerate(blocks):
        ring.put(data, [(dst[i * block:(i + 1) * block], 0, block)])
    assert ring.waits == 0 and device.waited == [] and device.buffers == 1  # one buffer, always found free again
    ring.finish()
    assert torch.equal(dst, torch.cat(blocks))


def test_finish_waits_for_every_copy_and_ends_the_ring() -> None:
    device = LateCopies()
    ring = StagedCopy(device, 256, buffers=2)
    dst = torch.zeros(256, dtype=torch.uint8)
    ring.put(torch.full((256,), 7, dtype=torch.uint8), [(dst, 0, 256)])
    assert not dst.any()  # still queued
    ring.finish()
    assert bool((dst == 7).all()) and device.finished
    ring.finish()  # once only
    with pytest.raises(RuntimeError, match="after the copies were finished"):
        ring.put(torch.zeros(256, dtype=torch.uint8), [(dst, 0, 256)])
    with pytest.raises(ValueError, match="for staging buffers of 256"):
        StagedCopy(LateCopies(), 256).put(torch.zeros(512, dtype=torch.uint8), [(torch.zeros(512, dtype=torch.uint8), 0, 512)])


def test_the_ring_stays_within_its_bytes() -> None:
    assert ring_buffers(8 << 20) == 4 and ring_buffers(64 << 10) == 4
    assert ring_buffers(32 << 20) == 2 and ring_buffers(1 << 30) == 2  # at least two: one filled while one copies
    assert ring_buffers(8 << 20) * (8 << 20) <= RING_BYTES


# --- the loader's streamed copy through the ring ---------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_plugin"))


@pytest.fixture
def ringed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The loader's CPU arena copied through the ring (a late-copy device), as a GPU arena is; the rings made."""
    from marlin_pack.vllm_plugin import remote_load

    rings: list[Any] = []
    staging = remote_load._staging

    def through_the_ring(items: list[Any], block: int) -> StagedCopy:
        assert staging(items, block) is None  # (a CPU arena: copied directly unless made to go through the ring)
        ring = StagedCopy(LateCopies(), block, buffers=2)
        rings.append(ring)
        return ring

    monkeypatch.setattr(remote_load, "_staging", through_the_ring)
    return rings


def test_the_loader_places_the_same_bytes_through_the_ring(make_bundle: Any, s3: Any, monkeypatch: pytest.MonkeyPatch,
                                                           ringed: list[Any]) -> None:
    """TP 2 rank 1 from the bucket, its rank file's blocks through a two-buffer ring whose copies land late: every
    quantized parameter as the local load places it; the ring waited for buffers and finished."""
    from marlin_pack.remote.push import push
    from marlin_pack.vllm_plugin import patches, register

    pytest.importorskip("oracles.vllm_reference")
    from test_remote_loader import BLOCK, _placed

    register()
    patches.uninstall_all()
    assert patches.install()
    try:
        model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
        push(model / "marlin-pack", s3.url("ring"), block_size=BLOCK)
        local = _placed(model, monkeypatch, 2, 1)
        remote = _placed(model, monkeypatch, 2, 1, bundle=s3.url("ring"))
    finally:
        patches.uninstall_all()
    [ring] = ringed
    assert ring.most_in_flight == 2 and ring.waits > 0 and ring._finished
    assert remote.pop("__common__") == local.pop("__common__")
    for name, want in local.items():
        assert torch.equal(remote[name].contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
