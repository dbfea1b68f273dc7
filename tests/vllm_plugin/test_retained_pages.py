"""``--retain-mib`` (``marlin-pack helpers --retain-gib``): a service helper keeps the windows it page-locked
registered for the next engine. Checked on the host with the helper's CUDA calls faked (helper_fakes):
what is registered once and copied again, the budget, and what lets retained pages go (a rewritten or
deleted file, windows cut otherwise, a newer bundle that needs the room). Copies on a GPU:
tests/on_gpu/test_gpu_reader_gpu.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helper_fakes import Conn, fake_helper
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.vllm_plugin import copy_helper_main, helper_service
from marlin_pack.vllm_plugin.copy_helper_main import PROTOCOL, Helper, Settings, bind_listener, serve
from marlin_pack.vllm_plugin.copy_helpers import shares_by_affinity
from marlin_pack.vllm_plugin.helper_service import HelperService, HelperState, ServiceHelper, preload_shares, service_status

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


@dataclass
class _Served:
    helper: Helper
    path: Path  # its socket
    destination: ctypes.Array
    file: Path
    data: bytes


@pytest.fixture
def served(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Served]:
    """A retaining service helper (CUDA faked) listening in ``sock_dir``, and an 8-page file for it to copy."""
    size = 8 * PAGE
    file = tmp_path / "rank.bin"
    file.write_bytes(data := _data(7, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=1 << 30), destination)
    path = sock_dir / f"{helper.uuid()}.0.sock"
    listener = bind_listener(str(path))
    threading.Thread(target=serve, args=(helper, listener), daemon=True).start()
    try:
        yield _Served(helper, path, destination, file, data)
    finally:
        listener.close()


def test_a_retaining_service_helper_says_what_it_holds(served: _Served, sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    helper, file, size = served.helper, served.file, len(served.data)
    where = [[os.path.realpath(file), [[lo, lo + 2 * PAGE] for lo in range(0, size, 2 * PAGE)]]]
    for retained, ranges in ((0, []), (size, where)):
        conn = Conn(served.path)
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL, "retained_bytes": retained, "retained": ranges}
        ctypes.memset(served.destination, 0, size)
        conn.say(_job(file, size, 2))
        assert conn.hear() == {"ok": size}
        assert served.destination.raw == served.data
        conn.say({"end": True})
        assert conn.hear() == {"closed": True}
        conn.close()
    assert _registers(helper) == 4  # the second engine's copy page-locked nothing
    assert service_status(sock_dir) == [HelperState(helper.uuid(), 0, "ready", size)]
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(sock_dir))
    r = CliRunner().invoke(app, ["helpers", "--status"])
    assert r.exit_code == 0 and f"{size / 2**30:.2f} GiB" in r.output, r.output


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


def test_preloaded_blocks_hold_every_window_cut_inside_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``retain`` (what ``--preload`` sends): blocks page-locked before any engine; an engine's windows of the
    same size (cut inside them, whatever tensors they hold) are then copied without page-locking."""
    size = 13 * PAGE + 50
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(9, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=1 << 30), destination)
    blocks = [[lo, min(lo + 4 * PAGE, size)] for lo in range(0, size, 4 * PAGE)]
    assert helper.retain([{"file": str(path), "ranges": blocks}]) == 13 * PAGE + PAGE  # the last page whole
    assert helper.retain([{"file": str(path), "ranges": blocks}]) == 0  # held already
    registered = _registers(helper)
    job = _job(path, size, 4)
    for w in job["parts"][0]["windows"]:  # windows narrower than their block: a header before, nothing after
        w[0] = w[0] + 100
        w[2] = [[w[0], w[1] - w[0], 0, w[0]]]
    ctypes.memset(destination, 0, size)
    assert _run(helper, job) == sum(w[1] - w[0] for w in job["parts"][0]["windows"])
    assert destination.raw[100 : 4 * PAGE] == data[100 : 4 * PAGE] and destination.raw[-50:] == data[-50:]
    assert _registers(helper) == registered


def test_preload_stops_at_the_budget_and_needs_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rank.bin"
    path.write_bytes(_data(10, 8 * PAGE))
    helper = fake_helper(monkeypatch, Settings(0, retain_bytes=3 * PAGE), ctypes.create_string_buffer(1))
    assert helper.retain([{"file": str(path), "ranges": [[0, 2 * PAGE], [2 * PAGE, 4 * PAGE], [4 * PAGE, 8 * PAGE]]}]) == 2 * PAGE
    assert helper.retained_bytes() == 2 * PAGE == sum(helper.cu.registered.values())  # type: ignore[attr-defined]
    plain = fake_helper(monkeypatch, Settings(0), ctypes.create_string_buffer(1))
    with pytest.raises(ValueError, match="retains nothing"):
        plain.retain([{"file": str(path), "ranges": [[0, PAGE]]}])


def test_preload_shares_cut_files_into_blocks_and_contiguous_equal_shares() -> None:
    mib = 1 << 20
    lines = preload_shares([("/b/rank-0", 10 * mib + 5), ("/b/common", 3 * mib)], 4 * mib, 2)
    assert lines == [
        [{"file": "/b/rank-0", "ranges": [[0, 4 * mib], [4 * mib, 8 * mib]]}],
        [{"file": "/b/rank-0", "ranges": [[8 * mib, 10 * mib + 5]]}, {"file": "/b/common", "ranges": [[0, 3 * mib]]}],
    ]
    assert len(preload_shares([("/f", mib)], 4 * mib, 4)) == 1  # fewer blocks than helpers: fewer lines
    assert preload_shares([], 4 * mib, 2) == []


class _W:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.pieces = lo, hi, [(lo, hi - lo, None)]


def test_windows_go_to_the_helper_that_holds_them() -> None:
    windows = [_W(k * 4 * PAGE, (k + 1) * 4 * PAGE) for k in range(8)]
    files = ["/b/rank-0"] * 8
    # Nothing held: contiguous shares by bytes, the caller's the tail.
    runs, mine = shares_by_affinity(windows, files, [{}, {}], 2, own=True)
    assert (runs, mine) == ([windows[:3], windows[3:6]], windows[6:])
    # Helper 1 holds windows 0-3 (in one block), helper 0 holds 6: each gets its own; of the rest (4, 5, 7)
    # the caller takes the tail and the helper holding less the others, towards equal bytes, in file order.
    held = [{"/b/rank-0": [(6 * 4 * PAGE, 7 * 4 * PAGE)]}, {"/b/rank-0": [(0, 16 * PAGE)], "/other": [(0, 1 << 30)]}]
    runs, mine = shares_by_affinity(windows, files, held, 2, own=True)
    assert runs == [[windows[4], windows[6]], windows[:4]] and mine == [windows[5], windows[7]]
    # No caller's share, two held by each of three helpers but none by the fourth: it gets the rest.
    held = [{"/b/rank-0": [(lo, lo + 8 * PAGE)]} for lo in (0, 8 * PAGE, 16 * PAGE)] + [{}]
    runs, mine = shares_by_affinity(windows, files, held, 4, own=False)
    assert runs == [windows[0:2], windows[2:4], windows[4:6], windows[6:8]] and mine == []
    # A window only partly inside a held range is not held.
    runs, mine = shares_by_affinity(windows[:1], files[:1], [{"/b/rank-0": [(0, 2 * PAGE)]}], 1, own=False)
    assert (runs, mine) == ([windows[:1]], [])


def test_the_service_preloads_through_its_helpers_and_engines_find_the_pages(served: _Served, sock_dir: Path, tmp_path: Path) -> None:
    helper, file, size = served.helper, served.file, len(served.data)
    service = HelperService([0], processes=1, directory=sock_dir, retain_mib=1024, log=lambda line: None)
    alive = types.SimpleNamespace(poll=lambda: None)
    service.helpers = [ServiceHelper(0, 0, [], alive, socket=served.path, uuid=helper.uuid())]  # type: ignore[arg-type]
    assert service.preload([file], window_mib=1) == {0: size}
    registered = _registers(helper)
    assert registered == 1  # one block of 1 MiB holds the whole file
    conn = Conn(served.path)
    hello = conn.hear()
    assert hello is not None and hello["retained"] == [[os.path.realpath(file), [[0, size]]]]
    conn.say(_job(file, size, 2))
    assert conn.hear() == {"ok": size} and served.destination.raw == served.data
    conn.say({"end": True})
    assert conn.hear() == {"closed": True}
    conn.close()
    assert _registers(helper) == registered  # the engine's copy page-locked nothing
    with pytest.raises(helper_service.ServiceError, match="cannot preload"):
        service.preload([tmp_path / "missing.bin"])
    with pytest.raises(helper_service.ServiceError, match="--retain-gib"):
        HelperService([0]).preload([file])


def test_preload_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["helpers", "--preload", str(tmp_path / "empty")])
    assert r.exit_code == 1 and "no *.safetensors file" in str(r.exception)
    (tmp_path / "rank-0.safetensors").write_bytes(b"x")
    r = CliRunner().invoke(app, ["helpers", "--preload", str(tmp_path)])
    assert r.exit_code == 1 and "--retain-gib" in str(r.exception)


def test_a_file_named_through_a_link_is_one_retained_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retained files are keyed by their real path: an engine naming the bundle through a link shares the
    entry, and its windows past the budget (deferred, unregistering on a slow thread) are released before
    the next job registers them again in the same map."""
    size = 8 * PAGE
    real = tmp_path / "real.bin"
    real.write_bytes(data := _data(12, size))
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True, retain_bytes=4 * PAGE), destination)
    driver = helper.cu

    def slow(name: str, *args: object) -> None:
        if name == "cuMemHostUnregister":
            time.sleep(0.05)
        driver(name, *args)

    helper.cu = slow  # type: ignore[assignment]
    for path in (link, link, real):
        ctypes.memset(destination, 0, size)
        assert helper.job(_job(path, size, 2)) == size and destination.raw == data
        helper.unregister_kept()  # not waited for: the next job must wait for it itself
    assert list(helper.retained) == [os.path.realpath(real)] and helper.retained_bytes() == 4 * PAGE
    assert helper.let_go() == 0  # waits for the last unregistering
    assert sum(driver.registered.values()) == 4 * PAGE  # type: ignore[attr-defined]
