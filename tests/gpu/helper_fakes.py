"""A copy helper (``helper_main.Helper``) whose CUDA driver calls are done on the host, for tests without a GPU.

* :class:`FakeDriver`: the driver calls, done on the host ("device memory" is one host buffer).
* :func:`fake_helper`: a ``Helper`` in this process using it; :func:`served_helper`: one serving its
  protocol on pipes (on a thread), spoken to through :class:`Pipes`.
* :func:`fake_helper_script`: a helper *process* (the real ``helper_main`` run as a script) using it, its
  "device memory" a file both processes map: a :class:`.helpers.HelperPool` drives it end to end.

Standard library only at import: the fake helper process imports this under ``python -S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

    from marlin_pack.gpu.helper_main import Helper

WAIT_S = 30.0  # a generous bound on what should take milliseconds: a test given up on rather than hung


class FakeDriver:
    """The helper's CUDA driver calls, done on the host: a "device pointer" is a host address (an IPC handle
    opens ``destination``, the one allocation there is), copies are ``memmove`` at once, streams and events are
    tokens. Records every call (in :attr:`calls` and, with ``log``, one line each in that file as it is made)
    and what is registered, so a test can check every registration is undone."""

    def __init__(self, destination: ctypes.Array, log: str | None = None) -> None:
        self.destination = destination
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.log = log

    def __call__(self, name: str, *args: object) -> None:
        with self.lock:
            self.calls.append(name)
            if self.log is not None:
                with open(self.log, "a") as f:
                    f.write(name + "\n")
        if name in ("cuStreamCreate", "cuEventCreate"):
            args[0]._obj.value = 1  # type: ignore[attr-defined]
        elif name == "cuIpcOpenMemHandle":
            args[0]._obj.value = ctypes.addressof(self.destination)  # type: ignore[attr-defined]
        elif name == "cuMemGetAddressRange":  # the one allocation there is: the destination buffer
            args[0]._obj.value = ctypes.addressof(self.destination)  # type: ignore[attr-defined]
            args[1]._obj.value = len(self.destination)  # type: ignore[attr-defined]
        elif name == "cuMemHostRegister":
            time.sleep(0.002)  # pinning is the slow step: the threads of a job interleave
            with self.lock:
                ptr = args[0].value  # type: ignore[attr-defined]
                assert ptr not in self.registered, "a range registered twice"
                self.registered[ptr] = args[1].value  # type: ignore[attr-defined]
        elif name == "cuMemHostUnregister":
            with self.lock:
                del self.registered[args[0].value]  # type: ignore[attr-defined]
        elif name == "cuMemcpyHtoDAsync":
            ctypes.memmove(args[0].value, args[1].value, args[2].value)  # type: ignore[attr-defined]


def fake_helper(monkeypatch: pytest.MonkeyPatch, settings: object, destination: ctypes.Array) -> Helper:
    """A Helper whose CUDA calls go to a :class:`FakeDriver` of ``destination`` (``helper.cu``)."""
    from marlin_pack.gpu import helper_main

    driver = FakeDriver(destination)
    monkeypatch.setattr(helper_main, "_Driver", lambda: driver)
    return helper_main.Helper(settings)  # type: ignore[arg-type]


class Pipes:
    """The parent's side of a helper's pipes, line by line; every read given up on after ``WAIT_S``."""

    def __init__(self, to_helper: int, from_helper: int) -> None:
        from marlin_pack.gpu.helper_protocol import LineReader

        self.to_helper = to_helper
        self.reader = LineReader(from_helper)

    def say(self, obj: dict) -> None:
        self.send((json.dumps(obj) + "\n").encode())

    def send(self, raw: bytes) -> None:
        view = memoryview(raw)
        while view:
            view = view[os.write(self.to_helper, view) :]

    def hear(self) -> dict | None:
        """The helper's next line; None once its output ended."""
        line = self.reader.readline(time.monotonic() + WAIT_S)
        return json.loads(line) if line else None

    def end_input(self) -> None:
        """Close the helper's input (once: the descriptor's number may be another file's afterwards)."""
        if self.to_helper >= 0:
            fd, self.to_helper = self.to_helper, -1
            os.close(fd)


@dataclass
class Served:
    """A fake helper serving its protocol on pipes (``helper_main.serve`` on a thread), its "device memory"
    ``destination`` (one allocation of ``len(data)`` bytes), its parent's side ``pipes`` and a ``file`` of data."""

    helper: Helper
    destination: ctypes.Array
    pipes: Pipes
    file: Path
    thread: threading.Thread
    status: list[int]  # serve()'s exit status, once the input ended

    def finish(self) -> int:
        """End the helper's input and wait for it to let go of everything; its exit status."""
        self.pipes.end_input()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the helper did not end with its input"
        return self.status[0]


@contextlib.contextmanager
def served_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: object, data: bytes) -> Iterator[Served]:
    """A :func:`fake_helper` serving on pipes, with ``data`` in ``tmp_path/rank.bin``; its input ended afterwards."""
    from marlin_pack.gpu import helper_main

    destination = ctypes.create_string_buffer(len(data))
    helper = fake_helper(monkeypatch, settings, destination)
    file = tmp_path / "rank.bin"
    file.write_bytes(data)
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    out = os.fdopen(reply_w, "w", encoding="utf-8")
    status: list[int] = []

    def run() -> None:
        try:
            status.append(helper_main.serve(helper, request_r, out))
        finally:
            out.close()
            os.close(request_r)

    thread = threading.Thread(target=run, name="fake-helper", daemon=True)
    thread.start()
    served = Served(helper, destination, Pipes(request_w, reply_r), file, thread, status)
    try:
        yield served
    finally:
        served.pipes.end_input()
        thread.join(WAIT_S)
        os.close(reply_r)


# -- a fake helper process ------------------------------------------------------------------------

_GPU_DIR = Path(__file__).resolve().parents[2] / "marlin_pack" / "gpu"

_SCRIPT = """
import ctypes, mmap, os, sys
sys.path[:0] = [{gpu!r}, {here!r}]
import helper_main  # as when run as a script: helper_protocol is its sibling
import helper_fakes

fd = os.open(os.environ["FAKE_DEVICE_MEMORY"], os.O_RDWR)
memory = mmap.mmap(fd, os.fstat(fd).st_size)
destination = (ctypes.c_char * len(memory)).from_buffer(memory)
log = os.path.join(os.environ["FAKE_DRIVER_LOGS"], f"calls-{{os.getpid()}}.log")
helper_main._Driver = lambda: helper_fakes.FakeDriver(destination, log)
sys.exit(helper_main.main(sys.argv))
"""


def fake_helper_script(directory: Path) -> Path:
    """A helper script for :class:`HelperPool` (``script=``): the real ``helper_main`` under ``python -S`` whose
    driver is a :class:`FakeDriver` of the file ``$FAKE_DEVICE_MEMORY`` (mapped shared: the parent maps it too,
    see :func:`device_memory`), each helper logging its calls to ``$FAKE_DRIVER_LOGS/calls-PID.log``."""
    script = directory / "fake_helper_main.py"
    script.write_text(_SCRIPT.format(gpu=str(_GPU_DIR), here=str(Path(__file__).resolve().parent)))
    return script


def device_memory(path: Path, size: int) -> mmap.mmap:
    """The fake helpers' "device memory": ``size`` zero bytes in the file ``path``, mapped shared here."""
    path.write_bytes(bytes(size))
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), size)


def logged_calls(logs: Path) -> dict[int, list[str]]:
    """Each fake helper process's driver calls so far, by its pid."""
    return {int(p.stem.split("-")[1]): p.read_text().split() for p in sorted(logs.glob("calls-*.log"))}
