"""The conversion's overlapping stages: read-ahead order, bounds and errors; the CPU device's no-op copies."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from marlin_pack import CheckpointError, convert
from marlin_pack.stages import Device, ReadAhead


def test_read_ahead_yields_in_order_from_another_thread() -> None:
    threads = set()

    def read(i: int) -> int:
        threads.add(threading.current_thread().name)
        return i * i

    with ReadAhead(read, 10, depth=2) as reads:
        assert list(reads) == [i * i for i in range(10)]
    assert threads == {"marlin-pack-read"}


def test_read_ahead_stays_within_its_depth() -> None:
    started = []
    gate = threading.Event()

    def read(i: int) -> int:
        started.append(i)
        return i

    with ReadAhead(read, 100, depth=2) as reads:
        it = iter(reads)
        assert next(it) == 0
        # Without a consumer the thread stops once `depth` results wait: two queued, one in hand.
        gate.wait(0.3)
        assert len(started) <= 4
    assert len(started) < 100  # closing stopped it


def test_read_ahead_raises_the_readers_exception_unchanged_and_stops() -> None:
    error = CheckpointError("tensor x is missing from the checkpoint; the checkpoint is incomplete")
    done = []

    def read(i: int) -> int:
        if i == 3:
            raise error
        done.append(i)
        return i

    got = []
    with pytest.raises(CheckpointError) as e, ReadAhead(read, 10) as reads:
        for x in reads:
            got.append(x)
    assert e.value is error and got == [0, 1, 2] and done == [0, 1, 2]


def test_cpu_device_copies_nothing() -> None:
    device = Device(torch.device("cpu"))
    t = torch.arange(6)
    with device.reading():
        done = device.read_done()
    assert done is None and not device.cuda
    device.receive(done, [t])
    host, ready = device.to_host(t, lambda: pytest.fail("no buffer is needed on the CPU"))
    assert host is t and ready is None


def test_a_read_error_on_the_read_thread_is_the_same_one_line_error(awq_copy: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers) -> None:
    from marlin_pack.sources.checkpoint import Checkpoint

    real_get = Checkpoint.get
    readers = set()

    def get(self: Checkpoint, name: str) -> torch.Tensor:
        if ".layers.1." in name and name.endswith("qweight"):
            readers.add(threading.current_thread().name)
            raise CheckpointError(f"cannot read tensor {name} from model.safetensors (boom); the file is corrupt, download it again")
        return real_get(self, name)

    monkeypatch.setattr(Checkpoint, "get", get)
    with pytest.raises(CheckpointError, match=r"^cannot read tensor model\.layers\.1\..*qweight .*download it again$"):
        convert(awq_copy)
    assert readers == {"marlin-pack-read"}
    no_leftovers(awq_copy)
