"""``retain``: a helper page-locks files ahead of the copy and keeps them registered until ``end`` or the end of its
input; a later job's windows inside a retained block are copied without page-locking. Checked on the host with
the helper's CUDA calls faked (helper_fakes), in this process and as helper processes a :class:`HelperPool`
drives over their pipes. Copies on a GPU: tests/on_gpu/test_reader_gpu.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest
import torch
from helper_fakes import WAIT_S, device_memory, fake_helper, fake_helper_script, logged_calls, served_helper

from marlin_pack.gpu.helper_main import Helper, Settings
from marlin_pack.gpu.helper_protocol import retain_shares
from marlin_pack.gpu.helpers import HelperPool, shares_by_affinity

PAGE = mmap.PAGESIZE


def _data(seed: int, size: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


def _windows(size: int, pages_per_window: int, at: int = 0) -> list[list]:
    """The reader's cut: page-aligned windows (the last one ending inside a page), one piece each, at ``at``."""
    step = pages_per_window * PAGE
    return [[lo, min(lo + step, size), [[lo, min(lo + step, size) - lo, 0, at + lo]]] for lo in range(0, size, step)]


def _job(path: Path, size: int, pages_per_window: int, at: int = 0) -> dict:
    return {"parts": [{"file": str(path), "windows": _windows(size, pages_per_window, at)}], "handles": ["00" * 64], "threads": 2}


def _retain(path: Path, size: int, pages_per_block: int) -> list[dict]:
    return [{"file": str(path), "ranges": [[lo, hi] for lo, hi, _ in _windows(size, pages_per_block)]}]


def _run(helper: Helper, job: dict) -> int:
    """One job as ``serve`` runs it: the reply, then deferred unregistering (waited for here)."""
    copied = helper.job(job)
    thread = helper.unregister_kept()
    if thread is not None:
        thread.join()
    return copied


def _registers(helper: Helper) -> int:
    return helper.cu.calls.count("cuMemHostRegister")  # type: ignore[attr-defined]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-once"])
def test_retained_blocks_are_copied_from_without_page_locking_until_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        defer: bool) -> None:
    size = 11 * PAGE + 123
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(1, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=defer), destination)
    fds = _open_fds()
    blocks = len(_windows(size, 3))
    assert helper.retain(_retain(path, size, 3)) == 12 * PAGE  # the last page whole
    assert helper.retain(_retain(path, size, 3)) == 0  # held already
    assert _registers(helper) == blocks == len(helper.retained[str(path)].ranges)
    assert helper.retained_bytes() == sum(helper.cu.registered.values()) == 12 * PAGE  # type: ignore[attr-defined]
    for pages in (3, 1):  # windows of the block's size, and narrower ones inside the blocks
        ctypes.memset(destination, 0, size)
        assert _run(helper, _job(path, size, pages)) == size and destination.raw == data
    assert _registers(helper) == blocks  # nothing page-locked anew
    assert helper.retained_bytes() == 12 * PAGE
    helper.end()  # the parent lets go: mappings closed, retained pages unregistered, files closed
    assert helper.opened == {} and helper.retained == {} and helper.cu.registered == {}  # type: ignore[attr-defined]
    assert _open_fds() == fds
    ctypes.memset(destination, 0, size)
    assert _run(helper, _job(path, size, 3)) == size and destination.raw == data  # serves on, page-locking again
    assert _registers(helper) == 2 * blocks and helper.cu.registered == {}  # type: ignore[attr-defined]


def test_windows_narrower_than_their_blocks_are_copied_from_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks as the pool retains them; an engine's windows cut inside them (a header before, nothing after)."""
    size = 13 * PAGE + 50
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(9, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True), destination)
    assert helper.retain(_retain(path, size, 4)) == 14 * PAGE
    registered = _registers(helper)
    job = _job(path, size, 4)
    for w in job["parts"][0]["windows"]:
        w[0] = w[0] + 100
        w[2] = [[w[0], w[1] - w[0], 0, w[0]]]
    assert _run(helper, job) == sum(w[1] - w[0] for w in job["parts"][0]["windows"])
    assert destination.raw[100 : 4 * PAGE] == data[100 : 4 * PAGE] and destination.raw[-50:] == data[-50:]
    assert _registers(helper) == registered


def test_a_rewritten_file_lets_its_retained_blocks_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path names another file now (a new bundle renamed over it): the old pages are let go, the new copied."""
    size = 6 * PAGE
    path = tmp_path / "rank.bin"
    path.write_bytes(_data(2, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0), destination)
    helper.retain(_retain(path, size, 2))
    new = tmp_path / "new.bin"
    new.write_bytes(data := _data(3, size))
    os.replace(new, path)
    assert _run(helper, _job(path, size, 2)) == size and destination.raw == data
    assert helper.retained == {} and helper.cu.registered == {}  # type: ignore[attr-defined]
    assert _registers(helper) == 3 + 3


def test_windows_cut_otherwise_let_the_retained_blocks_go_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy may not cross two registrations (CUDA refuses it): a job whose windows straddle retained blocks
    (another io window size) has the file's blocks released before it starts; a retain line likewise."""
    size = 12 * PAGE
    path = tmp_path / "rank.bin"
    path.write_bytes(data := _data(4, size))
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True), destination)
    helper.retain(_retain(path, size, 3))
    assert _run(helper, _job(path, size, 2)) == size and destination.raw == data
    assert helper.retained == {} and helper.cu.registered == {}  # type: ignore[attr-defined]
    assert helper.retain(_retain(path, size, 3)) == size
    assert helper.retain(_retain(path, size, 2)) == size  # retained anew, as asked
    assert sorted(helper.retained[str(path)].ranges) == [(lo, lo + 2 * PAGE) for lo in range(0, size, 2 * PAGE)]
    assert sum(helper.cu.registered.values()) == size  # type: ignore[attr-defined]  # the 3-page blocks are gone


def test_a_file_named_through_a_link_is_one_retained_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retained files are keyed by their real path: a job naming the bundle through a link uses the blocks, and
    its windows outside them (deferred, unregistering on a slow thread) are released before ``end`` unmaps them."""
    size = 8 * PAGE
    real = tmp_path / "real.bin"
    real.write_bytes(data := _data(12, size))
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    destination = ctypes.create_string_buffer(size)
    helper = fake_helper(monkeypatch, Settings(0, defer_unregister=True), destination)
    assert helper.retain([{"file": str(link), "ranges": [[0, 2 * PAGE], [2 * PAGE, 4 * PAGE]]}]) == 4 * PAGE
    driver = helper.cu

    def slow(name: str, *args: object) -> None:
        if name == "cuMemHostUnregister":
            time.sleep(0.05)
        driver(name, *args)

    helper.cu = slow  # type: ignore[assignment]
    for path in (link, real, link):
        ctypes.memset(destination, 0, size)
        assert helper.job(_job(path, size, 2)) == size and destination.raw == data
        helper.unregister_kept()  # not waited for: the next job (and end) must wait for it itself
    assert list(helper.retained) == [os.path.realpath(real)] and helper.retained_bytes() == 4 * PAGE
    assert driver.calls.count("cuMemHostRegister") == 2 + 3 * 2  # type: ignore[attr-defined]  # the 2 blocks, then 2 windows a job
    helper.end()
    assert driver.registered == {} and helper.retained == {}  # type: ignore[attr-defined]


def test_end_of_input_lets_go_of_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over pipes: retain, a job copied from the blocks, ``end`` answered once all is let go (the helper serves
    on), a new retain, then the end of input: the helper closes everything and returns."""
    size = 8 * PAGE
    data = _data(7, size)
    with served_helper(tmp_path, monkeypatch, Settings(0, defer_unregister=True), data) as served:
        pipes, helper = served.pipes, served.helper
        assert pipes.hear() == {"ready": True, "protocol": 2}
        pipes.say({"retain": _retain(served.file, size, 2)})
        assert pipes.hear() == {"ok": size}
        pipes.say(_job(served.file, size, 2))
        assert pipes.hear() == {"ok": size} and served.destination.raw == data
        assert _registers(helper) == 4  # the blocks only
        pipes.say({"end": True})
        assert pipes.hear() == {"closed": True}
        assert helper.opened == {} and helper.retained == {} and helper.cu.registered == {}  # type: ignore[attr-defined]
        pipes.say({"retain": _retain(served.file, size, 4)})
        assert pipes.hear() == {"ok": size}
        pipes.say(_job(served.file, size, 4))
        assert pipes.hear() == {"ok": size}
        assert served.finish() == 0
        assert pipes.hear() is None  # its output ended
        assert helper.opened == {} and helper.retained == {} and helper.cu.registered == {}  # type: ignore[attr-defined]
        assert helper.cu.calls.count("cuIpcCloseMemHandle") == 2  # type: ignore[attr-defined]


def test_retain_shares_cut_files_into_blocks_and_contiguous_equal_shares() -> None:
    mib = 1 << 20
    lines = retain_shares([("/b/rank-0", 10 * mib + 5), ("/b/common", 3 * mib)], 4 * mib, 2)
    assert lines == [
        [{"file": "/b/rank-0", "ranges": [[0, 4 * mib], [4 * mib, 8 * mib]]}],
        [{"file": "/b/rank-0", "ranges": [[8 * mib, 10 * mib + 5]]}, {"file": "/b/common", "ranges": [[0, 3 * mib]]}],
    ]
    assert len(retain_shares([("/f", mib)], 4 * mib, 4)) == 1  # fewer blocks than helpers: fewer lines
    assert retain_shares([], 4 * mib, 2) == []
    assert retain_shares([("/f", 3 * PAGE)], PAGE + 1, 1) == [[{"file": "/f", "ranges": [[0, 2 * PAGE], [2 * PAGE, 3 * PAGE]]}]]


class _W:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.pieces = lo, hi, [(lo, hi - lo, None)]


def test_windows_go_to_the_helper_that_holds_them() -> None:
    windows = [_W(k * 4 * PAGE, (k + 1) * 4 * PAGE) for k in range(8)]
    files = ["/b/rank-0"] * 8
    assert shares_by_affinity(windows, files, [{}, {}], 2) == [windows[:4], windows[4:]]  # nothing held: by bytes
    # Helper 1 holds windows 0-3 (in one block), helper 0 holds 6: each gets its own, and the rest (4, 5, 7)
    # tops up the one holding less, towards equal bytes, in file order.
    held = [{"/b/rank-0": [(6 * 4 * PAGE, 7 * 4 * PAGE)]}, {"/b/rank-0": [(0, 16 * PAGE)], "/other": [(0, 1 << 30)]}]
    assert shares_by_affinity(windows, files, held, 2) == [[windows[4], windows[5], windows[6], windows[7]], windows[:4]]
    # Two held by each of three helpers but none by the fourth: it gets the rest.
    held = [{"/b/rank-0": [(lo, lo + 8 * PAGE)]} for lo in (0, 8 * PAGE, 16 * PAGE)] + [{}]
    assert shares_by_affinity(windows, files, held, 4) == [windows[0:2], windows[2:4], windows[4:6], windows[6:8]]
    # A window only partly inside a held range is not held; one of another file neither.
    assert shares_by_affinity(windows[:1], files[:1], [{"/b/rank-0": [(0, 2 * PAGE)]}], 1) == [windows[:1]]
    assert shares_by_affinity(windows[:1], ["/b/other"], [{"/b/rank-0": [(0, 1 << 30)]}], 1) == [windows[:1]]


# -- a pool driving fake helper processes over their pipes ------------------------------------------


class _Stream:
    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("wait", [True, False], ids=["let-go-waited", "let-go-in-the-background"])
def test_a_pool_retains_copies_without_page_locking_and_lets_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: bool) -> None:
    """The real helper_main as two processes (their driver faked, their "device memory" a file mapped by both
    sides): retain page-locks each helper's share, a copy then page-locks nothing and lands every byte, let go
    (waited for, or its answers read by a thread that ``join`` waits for) leaves the helpers alive holding
    nothing, and the end of their input ends them."""
    size, window = 16 * PAGE + 77, 4 * PAGE
    rank = tmp_path / "rank.bin"
    rank.write_bytes(data := _data(5, size))
    memory = device_memory(tmp_path / "device", size)
    logs = tmp_path / "logs"
    logs.mkdir()
    view = torch.frombuffer(memory, dtype=torch.uint8)
    base = view.data_ptr()
    pool = HelperPool(2, 0, script=fake_helper_script(tmp_path), env={"FAKE_DEVICE_MEMORY": str(tmp_path / "device"),
                                                                       "FAKE_DRIVER_LOGS": str(logs)})
    monkeypatch.setattr(pool, "_handle", lambda ptr: ("00" * 64, ptr - base))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    with pool:
        assert pool.retain([rank], window) == 17 * PAGE and pool.failures == []
        pins = {pid: calls.count("cuMemHostRegister") for pid, calls in logged_calls(logs).items()}
        assert sorted(pins.values()) == [2, 3]  # five blocks, one contiguous share each
        # The reader's windows of the same size, two tensors each (a piece per half).
        windows = []
        for lo in range(0, size, window):
            hi = min(lo + window, size)
            mid = lo + min(PAGE + 3, (hi - lo) // 2)
            windows.append(_W(lo, hi))
            windows[-1].pieces = [(lo, mid - lo, view[lo:mid]), (mid, hi - mid, view[mid:hi])]
        assert pool.copy(rank, windows, threads=2) == [] and pool.failures == []
        assert bytes(memory) == data
        assert {pid: calls.count("cuMemHostRegister") for pid, calls in logged_calls(logs).items()} == pins
        pool.let_go(wait=wait)
        if not wait:
            pool.join(WAIT_S)
            assert pool._reapers == []  # its answers were read
        calls = logged_calls(logs)
        assert all(c.count("cuMemHostUnregister") == c.count("cuMemHostRegister") for c in calls.values())
        assert all("cuIpcCloseMemHandle" in c for c in calls.values())
        assert [p.proc.poll() for p in pool._procs] == [None, None]  # alive
        assert pool.copy(rank, windows, threads=2) == windows  # after let go: everything left
        procs = list(pool._procs)
    assert [p.proc.wait(WAIT_S) for p in procs] == [0, 0]
    assert sorted(logged_calls(logs)) == sorted(p.proc.pid for p in procs)


def test_a_pools_helpers_let_go_of_retained_pages_at_the_end_of_their_input(tmp_path: Path) -> None:
    """Without let go: closing the pool ends their input; each unregisters what it retained before it exits."""
    size = 8 * PAGE
    rank = tmp_path / "rank.bin"
    rank.write_bytes(_data(6, size))
    device_memory(tmp_path / "device", PAGE)
    logs = tmp_path / "logs"
    logs.mkdir()
    with HelperPool(2, 0, script=fake_helper_script(tmp_path), env={"FAKE_DEVICE_MEMORY": str(tmp_path / "device"),
                                                                     "FAKE_DRIVER_LOGS": str(logs)}) as pool:
        assert pool.retain([rank], 2 * PAGE) == size
        procs = list(pool._procs)
    assert [p.proc.returncode for p in procs] == [0, 0]
    calls = logged_calls(logs).values()
    assert sorted(c.count("cuMemHostRegister") for c in calls) == [2, 2]
    assert all(c.count("cuMemHostUnregister") == 2 for c in calls)
