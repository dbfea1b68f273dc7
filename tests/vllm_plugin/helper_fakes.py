"""A copy helper (``copy_helper_main.Helper``) whose CUDA driver calls are done on the host, for tests without a GPU."""

from __future__ import annotations

import ctypes
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from marlin_pack.vllm_plugin import copy_helper_main


class FakeDriver:
    """The helper's CUDA driver calls, done on the host: a "device pointer" is a host address (an IPC
    handle opens the destination buffer, the one allocation there is), copies are ``memmove`` at once,
    streams and events are tokens. Records what is registered, so a test can check every registration is undone."""

    def __init__(self, destination: ctypes.Array) -> None:
        self.destination = destination
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, *args: object) -> None:
        with self.lock:
            self.calls.append(name)
        if name in ("cuStreamCreate", "cuEventCreate"):
            args[0]._obj.value = 1  # type: ignore[attr-defined]
        elif name == "cuIpcOpenMemHandle":
            args[0]._obj.value = ctypes.addressof(self.destination)  # type: ignore[attr-defined]
        elif name == "cuMemGetAddressRange":  # the one allocation there is: the destination buffer
            args[0]._obj.value = ctypes.addressof(self.destination)  # type: ignore[attr-defined]
            args[1]._obj.value = len(self.destination)  # type: ignore[attr-defined]
        elif name == "cuMemHostRegister":
            time.sleep(0.005)  # pinning is the slow step: staging threads beside take windows too
            with self.lock:
                ptr = args[0].value  # type: ignore[attr-defined]
                assert ptr not in self.registered, "a range registered twice"
                self.registered[ptr] = args[1].value  # type: ignore[attr-defined]
        elif name == "cuMemHostUnregister":
            with self.lock:
                del self.registered[args[0].value]  # type: ignore[attr-defined]
        elif name == "cuMemcpyHtoDAsync":
            ctypes.memmove(args[0].value, args[1].value, args[2].value)  # type: ignore[attr-defined]


def fake_helper(monkeypatch: pytest.MonkeyPatch, settings: object, destination: ctypes.Array) -> copy_helper_main.Helper:
    """A Helper whose CUDA calls go to :class:`FakeDriver` (its staging buffers plain host memory)."""
    driver = FakeDriver(destination)
    buffers: list[ctypes.Array] = []

    def alloc(name: str, *args: object) -> None:
        if name == "cuMemHostAlloc":
            buffers.append(ctypes.create_string_buffer(args[1].value))  # type: ignore[attr-defined]
            args[0]._obj.value = ctypes.addressof(buffers[-1])  # type: ignore[attr-defined]
        else:
            driver(name, *args)

    monkeypatch.setattr(copy_helper_main, "_Driver", lambda: alloc)
    helper = copy_helper_main.Helper(settings)  # type: ignore[arg-type]
    helper.cu = driver  # type: ignore[assignment]
    helper._keep = buffers  # type: ignore[attr-defined]
    return helper


class Conn:
    """An engine's side of a service helper's socket, line by line (for tests that speak the protocol)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(10)
        self.r, self.w = self.sock.makefile("r"), self.sock.makefile("w")

    def say(self, obj: dict) -> None:
        self.w.write(json.dumps(obj) + "\n")
        self.w.flush()

    def hear(self) -> dict | None:
        line = self.r.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        for f in (self.r, self.w, self.sock):
            f.close()


@dataclass
class Served:
    """A service helper serving on a socket in a test's directory, with its faked device memory and its file."""

    helper: copy_helper_main.Helper
    destination: ctypes.Array
    path: Path
    listener: socket.socket
    file: Path
    unhealthy: list[str]  # one entry per session after which the helper would have exited
    before: set[threading.Thread]  # threads alive before this helper served: other tests' sessions are not waited for


def serve_fake_helper(
    sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: object, data: bytes
) -> Iterator[Served]:
    """For a fixture (``yield from``): a :func:`fake_helper` (its "device memory" one allocation of ``len(data)``
    bytes) bound in ``sock_dir`` and serving sessions on a thread, with ``data`` in ``tmp_path/rank.bin``."""
    destination = ctypes.create_string_buffer(len(data))
    helper = fake_helper(monkeypatch, settings, destination)
    path = sock_dir / f"{helper.uuid()}.0.sock"
    listener = copy_helper_main.bind_listener(str(path))
    unhealthy: list[str] = []
    before = set(threading.enumerate())
    threading.Thread(target=copy_helper_main.serve, args=(helper, listener, lambda: unhealthy.append("exit")), daemon=True).start()
    file = tmp_path / "rank.bin"
    file.write_bytes(data)
    try:
        yield Served(helper, destination, path, listener, file, unhealthy, before)
    finally:
        listener.close()
