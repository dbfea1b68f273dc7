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


@pytest.fixture
def tiny_moe(tmp_path: Path) -> Path:
    from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

    return write_moe_checkpoint(tmp_path / "moe", MOE_PRESETS["tiny-qwen3moe"], "gptq", max_shard_bytes=1 << 20)


def test_experts_layers_follow_the_dense_ones_through_the_read_ahead(tiny_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack import conversion

    readers = set()
    real_read = conversion.read_moe_layer

    def read_moe_layer(*args: object) -> object:
        readers.add(threading.current_thread().name)
        return real_read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(conversion, "read_moe_layer", read_moe_layer)
    steps: list[tuple[int, int, str]] = []
    manifest = convert(tiny_moe, tp=(1, 2), progress=lambda done, total, name: steps.append((done, total, name))).manifest
    dense = len(manifest.tensor_parallel[0].layers)
    experts = [e.name for e in manifest.tensor_parallel[0].moe_layers]
    assert experts == ["model.layers.0.mlp.experts.routed_experts", "model.layers.1.mlp.experts.routed_experts"]
    assert [s[0] for s in steps] == list(range(1, dense + 3)) and {s[1] for s in steps} == {dense + 2}
    assert [s[2] for s in steps[dense:]] == experts  # after every dense layer: the rank files' order
    assert readers == {"marlin-pack-read"}


@pytest.mark.parametrize("stage", ["read", "build"])
def test_an_experts_error_is_one_line_and_leaves_no_bundle(
    tiny_moe: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers, stage: str
) -> None:
    from marlin_pack import UnsupportedCheckpointError, conversion
    from marlin_pack.sources.checkpoint import Checkpoint

    if stage == "read":
        real_get = Checkpoint.get

        def get(self: Checkpoint, name: str) -> torch.Tensor:
            if name == "model.layers.1.mlp.experts.5.down_proj.qweight":
                raise CheckpointError(f"cannot read tensor {name} from model-00002.safetensors (boom); the file is corrupt")
            return real_get(self, name)

        monkeypatch.setattr(Checkpoint, "get", get)
        error: type[Exception] = CheckpointError
        match = r"^cannot read tensor model\.layers\.1\.mlp\.experts\.5\.down_proj\.qweight .*corrupt$"
    else:
        def build_moe_layer(*args: object) -> object:
            raise UnsupportedCheckpointError("model.layers.1.mlp.experts.routed_experts: 7 experts read, expected 8")

        monkeypatch.setattr(conversion, "build_moe_layer", build_moe_layer)
        error, match = UnsupportedCheckpointError, r"^model\.layers\.1\.mlp\.experts\.routed_experts: 7 experts read, expected 8$"
    with pytest.raises(error, match=match) as e:
        convert(tiny_moe, tp=(1, 2))
    assert "\n" not in str(e.value)
    no_leftovers(tiny_moe)
