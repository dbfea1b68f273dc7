"""``--retain-mib`` (``marlin-pack helpers --retain-gib``): a service helper keeps the windows it page-locked
registered for the next engine. Checked on the host with the helper's CUDA calls faked (helper_fakes):
what is registered once and copied again, the budget, and what lets retained pages go (a rewritten or
deleted file, windows cut otherwise, a newer bundle that needs the room). Copies on a GPU:
tests/gpu/test_gpu_reader_gpu.py."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helper_fakes import fake_helper
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.vllm_plugin import copy_helper_main, helper_service
from marlin_pack.vllm_plugin.copy_helper_main import PROTOCOL, Helper, Settings, bind_listener, serve
from marlin_pack.vllm_plugin.helper_service import HelperService, HelperState, service_status

PAGE = mmap.PAGESIZE


def _data(seed: int, size: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


def _job(path: Path, size: int, pages_per_window: int, at: int = 0) -> dict:
    """The reader's cut: page-aligned windows (the last one ending inside a page), one piece each, at ``at``."""
    step = pages_per_window * PAGE
    windows = [[lo, min(lo + step, size), [[lo, min(lo + step, size) - lo, 0, at + lo]]] for lo in range(0, size, step)]
    return {"parts": [{"file": str(path), "windows": windows}], "handles": ["00" * 64], "threads": 2}


def _run(helper: Helper, job: dict) -> int:
    """One job as a session runs it: the reply, then deferred unregistering (waited for here)."""
    copied = helper.job(job)
    thread = helper.unregister_kept()
    if thread is not None:
        thread.join()
    return copied


def _registers(helper: Helper) -> int:
    return helper.cu.calls.count("cuMemHostRegister")  # type: ignore[attr-defined]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "settings",
    [
        Settings(0, defer_unregister=True, retain_bytes=1 << 30),
        Settings(0, retain_bytes=1 << 30),
        Settings(0, staged=2, stage_bytes=PAGE, defer_unregister=True, retain_bytes=1 << 30),
    ],
    ids=["deferred", "at-once", "with-staging-threads"],
)
def test_retained_windows_are_registered_once_and_copied_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    size = 11 * PAGE + 123
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(1, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, settings, destination)
    job = _job(path, size, 3)
    fds = _open_fds()
    assert _run(helper, job) == size and destination.raw == data
    windows = len(job["parts"][0]["windows"])
    if settings.staged:  # windows a staging thread took were not page-locked: a later job's registered threads retain them
        for _ in range(3 * windows):
            if len(helper.retained[str(path)].ranges) == windows:
                break
            assert _run(helper, job) == size
    first = _registers(helper)
    assert first == windows == len(helper.retained[str(path)].ranges)  # every window page-locked once, and retained
    assert helper.retained_bytes() == sum(helper.cu.registered.values())  # type: ignore[attr-defined]
    for _ in range(2):  # later engines: copied again, nothing page-locked anew
        ctypes.memset(destination, 0, size)
        assert _run(helper, job) == size and destination.raw == data
    assert _registers(helper) == first
    assert helper.let_go() == 0  # unchanged: stays
    # The bundle is rewritten (a new file renamed over it): its old pages are let go, the new ones copied.
    new = tmp_path / "new.bin"
    new.write_bytes(data := _data(2, size))
    os.replace(new, path)
    ctypes.memset(destination, 0, size)
    assert _run(helper, job) == size and destination.raw == data
    assert _registers(helper) > first
    assert helper.cu.calls.count("cuMemHostUnregister") >= first  # type: ignore[attr-defined]
    assert helper.retained_bytes() == sum(helper.cu.registered.values())  # type: ignore[attr-defined]
    path.unlink()  # deleted: let go as the session ends
    assert helper.let_go() == 1
    assert helper.retained == {} and helper.cu.registered == {} and _open_fds() == fds  # type: ignore[attr-defined]


def test_windows_past_the_budget_are_released_as_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 10 * PAGE
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(3, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=4 * PAGE), destination)
    job = _job(path, size, 2)  # five windows of two pages: two fit
    assert _run(helper, job) == size and destination.raw == data
    assert helper.retained_bytes() == 4 * PAGE == sum(helper.cu.registered.values())  # type: ignore[attr-defined]
    assert helper.overflowed
    ctypes.memset(destination, 0, size)
    assert _run(helper, job) == size and destination.raw == data
    assert _registers(helper) == 5 + 3  # only the three that did not fit were page-locked again
    assert helper.let_go(since=0.0) == 0  # the one file was used by the session: it keeps its room


def test_windows_cut_otherwise_let_the_retained_ones_go_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy may not cross two registrations (CUDA refuses it): a job whose windows straddle retained ones
    (another io window size) has the file's retained registrations released before it starts."""
    size = 12 * PAGE
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(4, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=1 << 30), destination)
    assert _run(helper, _job(path, size, 3)) == size
    ctypes.memset(destination, 0, size)
    assert _run(helper, _job(path, size, 2)) == size and destination.raw == data
    assert sorted(helper.retained[str(path)].ranges) == [(lo, lo + 2 * PAGE) for lo in range(0, size, 2 * PAGE)]
    assert sum(helper.cu.registered.values()) == size  # type: ignore[attr-defined]  # the 3-page ones are gone
    ctypes.memset(destination, 0, size)
    assert _run(helper, _job(path, size, 6)) == size and destination.raw == data  # windows holding several: cut otherwise too


def test_a_newer_bundle_that_does_not_fit_takes_the_room_after_its_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 6 * PAGE
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    old.write_bytes(_data(5, size))
    new.write_bytes(data := _data(6, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=size), destination)
    assert _run(helper, _job(old, size, 2)) == size
    assert helper.let_go(since=0.0) == 0 and list(helper.retained) == [str(old)]
    began = _later_than_every_use(helper)
    assert _run(helper, _job(new, size, 2)) == size and destination.raw == data  # no room: copied the usual way
    assert helper.retained_bytes() == size and helper.overflowed
    assert helper.let_go(since=began) == 1  # the old bundle, unused by this session, goes
    assert _run(helper, _job(new, size, 2)) == size
    assert list(helper.retained) == [str(new)] and helper.retained_bytes() == size
    assert helper.let_go(since=began) == 0


def _later_than_every_use(helper: Helper) -> float:
    """A session's start after every use so far (the monotonic clock may tick coarsely)."""
    stamp = time.monotonic()
    while stamp <= max(r.used for r in helper.retained.values()):
        stamp = time.monotonic()
    return stamp


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="mpr-", dir="/tmp"))  # short: a Unix socket path holds 107 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class _Conn:
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


def test_a_retaining_service_helper_says_what_it_holds(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 8 * PAGE
    file = tmp_path / "rank.bin"
    file.write_bytes(data := _data(7, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=1 << 30), destination)
    path = sock_dir / f"{helper.uuid()}.0.sock"
    listener = bind_listener(str(path))
    threading.Thread(target=serve, args=(helper, listener), daemon=True).start()
    try:
        for retained in (0, size):
            conn = _Conn(path)
            assert conn.hear() == {"ready": True, "protocol": PROTOCOL, "retained_bytes": retained}
            ctypes.memset(destination, 0, size)
            conn.say(_job(file, size, 2))
            assert conn.hear() == {"ok": size}
            assert destination.raw == data
            conn.say({"end": True})
            assert conn.hear() == {"closed": True}
            conn.close()
        assert _registers(helper) == 4  # the second engine's copy page-locked nothing
        assert service_status(sock_dir) == [HelperState(helper.uuid(), 0, "ready", size)]
        monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(sock_dir))
        r = CliRunner().invoke(app, ["helpers", "--status"])
        assert r.exit_code == 0 and f"{size / 2**30:.2f} GiB" in r.output, r.output
    finally:
        listener.close()


def test_retain_reaches_each_helper_as_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--retain-gib`` is per GPU; each of its helpers gets an equal share on its command line."""
    assert Settings.parse(["0", "--retain-mib", "5"]) == Settings(0, retain_bytes=5 << 20)
    assert "--retain-mib" not in HelperService([0])._argv(0, 0)
    assert HelperService([0], retain_mib=2560)._argv(0, 1)[-2:] == ["--retain-mib", "2560"]
    made: list[dict] = []

    class Service:
        def __init__(self, devices: list[int], **kw: object) -> None:
            made.append(kw)
            raise helper_service.ServiceError("stop here")

    monkeypatch.setattr(helper_service, "HelperService", Service)
    r = CliRunner().invoke(app, ["helpers", "--device", "0", "--processes", "4", "--retain-gib", "10"])
    assert made and made[0]["retain_mib"] == 2560, r.output


def test_without_a_budget_nothing_is_retained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 4 * PAGE
    path = tmp_path / "rank.bin"
    path.write_bytes(_data(8, size))
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True), ctypes.create_string_buffer(size))
    fds = _open_fds()
    for _ in range(2):
        assert _run(helper, _job(path, size, 1)) == size
    assert helper.retained == {} and helper.cu.registered == {} and _registers(helper) == 8  # type: ignore[attr-defined]
    assert _open_fds() == fds
    assert copy_helper_main.Settings(0).retain_bytes == 0
