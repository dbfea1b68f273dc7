"""``gpu.gpu_room``: the GPU's free and total memory from NVML (no CUDA context), and NVML's name for a CUDA ordinal.

NVML is stood in for by a fake library (``ctypes.CDLL`` monkeypatched): the real one needs a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from marlin_pack.gpu import gpu_room as gpu_room_mod
from marlin_pack.gpu.gpu_room import gpu_room, physical_device
from marlin_pack.gpu.plan import GpuRoom


@pytest.mark.parametrize(
    ("visible", "ordinal", "device"),
    [
        (None, 0, 0),  # not set: the ordinal itself
        (None, 3, 3),
        ("3,1", 0, 3),  # indexes
        ("3,1", 1, 1),
        (" 2 , 5 ", 1, 5),  # spaces around entries
        ("4,,6", 1, 6),  # an empty entry is no device
        ("GPU-8f1c2a3b-0000-1111-2222-333344445555", 0, "GPU-8f1c2a3b-0000-1111-2222-333344445555"),  # UUIDs
        ("0,MIG-5d3e9a70-aaaa-bbbb-cccc-ddddeeeeffff", 1, "MIG-5d3e9a70-aaaa-bbbb-cccc-ddddeeeeffff"),
    ],
)
def test_physical_device(visible: str | None, ordinal: int, device: int | str) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert physical_device(ordinal, environ) == device


@pytest.mark.parametrize(("visible", "ordinal"), [("0,1", 2), ("", 0), ("7", 1), (" , ", 0)])
def test_physical_device_with_too_few_visible_devices(visible: str, ordinal: int) -> None:
    with pytest.raises(ValueError, match=rf"^CUDA_VISIBLE_DEVICES={visible!r} has no device {ordinal}$"):
        physical_device(ordinal, {"CUDA_VISIBLE_DEVICES": visible})


def test_physical_device_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert physical_device(1) == 7
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_device(1) == 1


class _FakeNvml:
    """What gpu_room calls of libnvidia-ml, writing through the ctypes pointers it is given."""

    def __init__(self, free: int = 140 << 30, total: int = 141 << 30, init: int = 0, handle: int = 0, memory: int = 0) -> None:
        self.free, self.total, self.errors = free, total, {"init": init, "handle": handle, "memory": memory}
        self.calls: list[Any] = []

    def nvmlInit_v2(self) -> int:
        self.calls.append("init")
        return self.errors["init"]

    def nvmlShutdown(self) -> int:
        self.calls.append("shutdown")
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: ctypes.c_uint, handle: Any) -> int:
        self.calls.append(("index", index.value))
        return self.errors["handle"]

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes, handle: Any) -> int:
        self.calls.append(("uuid", uuid))
        return self.errors["handle"]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, memory: Any) -> int:
        self.calls.append("memory")
        memory._obj.free, memory._obj.total, memory._obj.used = self.free, self.total, self.total - self.free
        return self.errors["memory"]


def _with_nvml(monkeypatch: pytest.MonkeyPatch, nvml: _FakeNvml) -> list[str]:
    opened: list[str] = []
    monkeypatch.setattr(gpu_room_mod.ctypes, "CDLL", lambda name: opened.append(name) or nvml)
    return opened


def test_gpu_room_asks_nvml_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml(free=100 << 30, total=141 << 30)
    opened = _with_nvml(monkeypatch, nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_room(1) == GpuRoom(free=100 << 30, total=141 << 30)
    assert opened == ["libnvidia-ml.so.1"] and nvml.calls == ["init", ("index", 3), "memory", "shutdown"]


def test_gpu_room_asks_nvml_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml()
    _with_nvml(monkeypatch, nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert gpu_room(0) == GpuRoom(free=140 << 30, total=141 << 30)
    assert nvml.calls == ["init", ("uuid", b"GPU-abc"), "memory", "shutdown"]


@pytest.mark.parametrize("failing", ["handle", "memory"])
def test_gpu_room_is_none_where_nvml_cannot_say(monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """An unknown GPU (a handle NVML does not find, a MIG instance it will not measure): None, and NVML shut down."""
    nvml = _FakeNvml(**{failing: 999})
    _with_nvml(monkeypatch, nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_room(0) is None
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"


def test_gpu_room_is_none_where_nvml_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml(init=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    _with_nvml(monkeypatch, nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_room(0) is None and nvml.calls == ["init"]


def test_gpu_room_is_none_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_room(0) is None


def test_gpu_room_is_none_for_a_device_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml()
    opened = _with_nvml(monkeypatch, nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_room(1) is None and opened == [] and nvml.calls == []
