"""The copy helpers' protocol under hostile or broken peers, without a GPU: the real ``Helper`` / ``serve`` on
pipes with its CUDA calls faked (helper_fakes). Every request a helper reads is untrusted: bounded, validated
before any file or driver call, answered with an ``{"error": ...}`` line, never fatal; every reply a parent
reads is read whole under one deadline.

A wait that should take milliseconds is given up on after a generous timeout, so that a test fails rather than hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import mmap
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helper_fakes import WAIT_S, Served, fake_helper, served_helper

from marlin_pack.gpu import helper_main, helper_protocol, helpers
from marlin_pack.gpu.helper_main import PROTOCOL, Settings
from marlin_pack.gpu.helpers import HelperPool

PAGE = mmap.PAGESIZE
DATA = bytes(range(256)) * (4 * PAGE // 256)  # four pages
HANDLE = "00" * 64
READY = {"ready": True, "protocol": PROTOCOL}


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A helper on pipes (CUDA faked: its "device memory" is ``destination``, one allocation), ready said."""
    with served_helper(tmp_path, monkeypatch, Settings(0, defer_unregister=True), DATA) as s:
        assert s.pipes.hear() == READY
        yield s


def _job(file: Path | str, windows: list | None = None, handles: list | None = None, threads: object = 2) -> dict:
    if windows is None:
        windows = [[lo, lo + PAGE, [[lo, PAGE, 0, lo]]] for lo in range(0, len(DATA), PAGE)]
    return {"parts": [{"file": str(file), "windows": windows}], "handles": [HANDLE] if handles is None else handles, "threads": threads}


def _copies(served: Served) -> None:
    """A good job is copied (the helper still serves), then ``end`` is answered once it let go of everything."""
    ctypes.memset(served.destination, 0, len(DATA))
    served.pipes.say(_job(served.file))
    assert served.pipes.hear() == {"ok": len(DATA)}
    assert served.destination.raw == DATA
    served.pipes.say({"end": True})
    assert served.pipes.hear() == {"closed": True}
    assert served.helper.opened == {} and served.helper.retained == {}


def _in_thread(fn: Callable[[], object], timeout: float = WAIT_S) -> object:
    """``fn()`` on a thread, its result; fails (instead of hanging) when it has not returned after ``timeout``."""
    out: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still waiting after {timeout} s"
    if errors:
        raise errors[0]
    return out[0]


# -- a line that is not UTF-8 (nor JSON, nor an object) --------------------------------------------


@pytest.mark.parametrize(
    "line",
    [b"\xff\xfe{}\n", b'{"parts": "\xc3"}\n', b"not json\n", b"[1, 2]\n", b'"a string"\n', b"[" * 100_000 + b"\n"],
    ids=["invalid-utf8", "invalid-utf8-in-json", "not-json", "an-array", "a-string", "nested-deep"],
)
def test_a_line_that_is_no_request_is_answered_and_never_ends_the_helper(served: Served, line: bytes) -> None:
    for _ in range(5):
        served.pipes.send(line)
        reply = served.pipes.hear()
        assert reply is not None and "RequestError" in reply.get("error", ""), reply
        served.pipes.say(_job(served.file))
        assert served.pipes.hear() == {"ok": len(DATA)}
    _copies(served)
    assert served.finish() == 1  # it answered errors: its exit status says so


def test_main_answers_a_line_that_is_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``main`` on its own stdin and stdout: the line is answered, the next job copied, the status 1."""
    destination = ctypes.create_string_buffer(len(DATA))
    fake_helper(monkeypatch, Settings(0), destination)  # main()'s Helper gets the faked driver too
    file = tmp_path / "rank.bin"
    file.write_bytes(DATA)
    r, w = os.pipe()
    os.write(w, b"\xff\xfe\n" + json.dumps(_job(file)).encode() + b"\n")
    os.close(w)
    stdin = io.TextIOWrapper(io.FileIO(r, "r"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        status = helper_main.main(["helper_main.py", "0"])
    finally:
        stdin.close()
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert replies[0] == READY
    assert "not UTF-8" in replies[1]["error"] and replies[2] == {"ok": len(DATA)} and len(replies) == 3
    assert status == 1 and destination.raw == DATA


def test_a_driver_error_is_that_jobs_and_the_next_job_is_copied(served: Served) -> None:
    """An IPC handle the driver refuses (a stale or forged one) is answered as that job's error."""
    driver = served.helper.cu

    def refusing(name: str, *args: object) -> None:
        if name == "cuIpcOpenMemHandle":
            raise helper_main.CudaError("cuIpcOpenMemHandle failed with CUDA error 1")
        driver(name, *args)

    served.helper.cu = refusing  # type: ignore[assignment]
    served.pipes.say(_job(served.file))
    reply = served.pipes.hear()
    assert reply is not None and "CUDA error 1" in reply["error"]
    served.helper.cu = driver  # type: ignore[assignment]
    _copies(served)


def test_a_request_of_end_other_than_true_is_no_end(served: Served) -> None:
    served.pipes.say({"end": 1})
    reply = served.pipes.hear()
    assert reply is not None and "RequestError" in reply["error"]
    _copies(served)


# -- a file that is not a regular one ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["job", "retain"])
def test_a_request_naming_a_fifo_is_refused_at_once(served: Served, tmp_path: Path, kind: str) -> None:
    """Opening a FIFO for reading waits for a writer forever: the helper would hang on its parent."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    try:
        served.pipes.say(_job(fifo) if kind == "job" else {"retain": [{"file": str(fifo), "ranges": [[0, PAGE]]}]})
        reply = served.pipes.hear()  # given up on after WAIT_S where the helper hangs
        assert reply is not None and "not a regular file" in reply["error"], reply
        _copies(served)
    finally:
        with contextlib.suppress(OSError):  # were it blocked in open(), let it return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("name", ["/dev/zero", "dir", "empty", "missing"])
def test_a_job_naming_no_regular_file_with_bytes_is_refused(served: Served, tmp_path: Path, name: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty").touch()
    served.pipes.say(_job(name if name.startswith("/") else tmp_path / name))
    reply = served.pipes.hear()
    assert reply is not None and ("RequestError" in reply["error"] or "No such file" in reply["error"]), reply
    _copies(served)


# -- pieces and windows outside the file or the protocol ---------------------------------------------

_END = len(DATA)
_BAD_JOBS = {
    "piece-past-eof": dict(windows=[[0, PAGE, [[_END + PAGE, PAGE, 0, 0]]]]),
    "window-past-eof": dict(windows=[[_END, _END + PAGE, [[_END, PAGE, 0, 0]]]]),
    "window-across-eof": dict(windows=[[_END - PAGE, _END + PAGE, [[_END - PAGE, 2 * PAGE, 0, 0]]]]),
    "piece-before-its-window": dict(windows=[[PAGE, 2 * PAGE, [[0, PAGE, 0, 0]]]]),
    "piece-past-its-window": dict(windows=[[0, PAGE, [[0, 2 * PAGE, 0, 0]]]]),
    "negative-offset": dict(windows=[[0, PAGE, [[-PAGE, PAGE, 0, 0]]]]),
    "negative-window": dict(windows=[[-PAGE, PAGE, [[0, PAGE, 0, 0]]]]),
    "negative-length": dict(windows=[[0, PAGE, [[PAGE, -PAGE, 0, 0]]]]),
    "empty-window": dict(windows=[[PAGE, PAGE, []]]),
    "negative-dest": dict(windows=[[0, PAGE, [[0, PAGE, 0, -PAGE]]]]),
    "dest-past-the-allocation": dict(windows=[[0, PAGE, [[0, PAGE, 0, _END - 1]]]]),
    "handle-index-past-the-handles": dict(windows=[[0, PAGE, [[0, PAGE, 1, 0]]]]),
    "negative-handle-index": dict(windows=[[0, PAGE, [[0, PAGE, -1, 0]]]]),
    "float-offset": dict(windows=[[0, PAGE, [[0.5, PAGE, 0, 0]]]]),
    "bool-length": dict(windows=[[0, PAGE, [[0, True, 0, 0]]]]),
    "string-window": dict(windows=[["0", PAGE, [[0, PAGE, 0, 0]]]]),
    "short-piece": dict(windows=[[0, PAGE, [[0, PAGE, 0]]]]),
    "windows-sharing-a-page": dict(windows=[[0, PAGE + 1, [[0, PAGE + 1, 0, 0]]],
                                            [PAGE + 1, 2 * PAGE, [[PAGE + 1, PAGE - 1, 0, PAGE + 1]]]]),
    "overlapping-windows": dict(windows=[[0, 2 * PAGE, [[0, 2 * PAGE, 0, 0]]], [PAGE, 3 * PAGE, [[PAGE, 2 * PAGE, 0, 0]]]]),
    "short-handle": dict(handles=["00" * 10]),
    "not-hex-handle": dict(handles=["zz" * 64]),
    "no-handles": dict(handles=[]),
    "threads-huge": dict(threads=1000),
    "threads-negative": dict(threads=-1),
    "threads-string": dict(threads="2"),
}


def _guarded(served: Served) -> list[str]:
    """Record (and skip) the driver calls that touch host or device memory; the list of those reached."""
    driver = served.helper.cu
    reached: list[str] = []

    def guard(name: str, *args: object) -> None:
        if name in ("cuMemHostRegister", "cuMemHostUnregister", "cuMemcpyHtoDAsync"):
            reached.append(name)
            return
        driver(name, *args)

    served.helper.cu = guard  # type: ignore[assignment]
    return reached


@pytest.mark.parametrize("bad", list(_BAD_JOBS.values()), ids=list(_BAD_JOBS))
def test_a_job_outside_its_file_or_the_protocol_is_refused_before_the_driver(served: Served, bad: dict) -> None:
    """No page-locking and no copy reaches the driver (an offset past the file's end would be copied from: a
    SIGSEGV on a stub driver); the job is answered with an error and the next one copied."""
    driver = served.helper.cu
    reached = _guarded(served)
    served.pipes.say(_job(served.file, **bad))
    reply = served.pipes.hear()
    served.helper.cu = driver  # type: ignore[assignment]
    assert reply is not None and "RequestError" in reply.get("error", ""), reply
    assert reached == []
    _copies(served)


def test_a_job_naming_one_file_twice_is_refused(served: Served, tmp_path: Path) -> None:
    """Two parts of one file (here under two names) would page-lock its pages twice: the driver refuses that."""
    link = tmp_path / "again.bin"
    os.link(served.file, link)
    job = _job(served.file)
    job["parts"].append({"file": str(link), "windows": job["parts"][0]["windows"]})
    driver = served.helper.cu
    reached = _guarded(served)
    served.pipes.say(job)
    reply = served.pipes.hear()
    served.helper.cu = driver  # type: ignore[assignment]
    assert reply is not None and "named by two parts" in reply.get("error", ""), reply
    assert reached == []
    _copies(served)


# -- retain ranges outside the file or the protocol --------------------------------------------------


@pytest.mark.parametrize(
    "ranges",
    [[[-PAGE, PAGE]], [[0, _END + PAGE]], [[_END, _END + PAGE]], [[PAGE, PAGE]], [["0", PAGE]],
     [[0, 2 * PAGE], [PAGE, 3 * PAGE]], [[0]], "x"],
    ids=["negative-offset", "past-eof", "after-eof", "empty", "string", "overlapping", "short", "not-a-list"],
)
def test_a_retain_range_outside_the_file_is_refused_before_any_page_locking(served: Served, ranges: object) -> None:
    served.pipes.say({"retain": [{"file": str(served.file), "ranges": ranges}]})
    reply = served.pipes.hear()
    assert reply is not None and "RequestError" in reply.get("error", ""), reply
    assert served.helper.cu.registered == {}  # type: ignore[attr-defined]
    assert served.helper.retained == {} and served.helper.retained_bytes() == 0
    served.pipes.say({"retain": [{"file": str(served.file), "ranges": [[0, _END]]}]})
    assert served.pipes.hear() == {"ok": _END}
    _copies(served)
    assert served.helper.cu.registered == {}  # type: ignore[attr-defined]


def test_a_retain_line_with_one_bad_part_locks_none_of_the_others(served: Served, tmp_path: Path) -> None:
    """Every part is checked before any page is locked: the good first part is not retained either."""
    other = tmp_path / "other.bin"
    other.write_bytes(DATA)
    fds = len(os.listdir("/proc/self/fd"))
    served.pipes.say({"retain": [{"file": str(other), "ranges": [[0, _END]]}, {"file": str(served.file), "ranges": [[0, _END + PAGE]]}]})
    reply = served.pipes.hear()
    assert reply is not None and "lie outside" in reply["error"], reply
    assert served.helper.retained == {} and served.helper.cu.registered == {}  # type: ignore[attr-defined]
    assert len(os.listdir("/proc/self/fd")) == fds  # the first part's file closed again
    served.pipes.say({"retain": [{"file": str(other), "ranges": [[0, _END]]}, {"file": str(other), "ranges": [[0, PAGE]]}]})
    reply = served.pipes.hear()
    assert reply is not None and "named by two parts" in reply["error"], reply
    assert served.helper.retained == {}


# -- a line that never ends --------------------------------------------------------------------------


def test_a_line_past_the_limit_is_refused_and_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB without a newline against a 1 MiB limit: answered as too long (read whole, a line of 2000 MiB would
    grow a helper to 2 GB), its rest skipped up to its newline, the next job copied."""
    monkeypatch.setattr(helper_protocol, "MAX_LINE", 1 << 20)  # before the helper's reader is made
    with served_helper(tmp_path, monkeypatch, Settings(0), DATA) as served:
        assert served.pipes.hear() == READY
        served.pipes.send(b'{"parts": "' + b"x" * (8 << 20) + b'"}\n')
        reply = served.pipes.hear()
        assert reply is not None and "longer than" in reply.get("error", ""), reply
        _copies(served)


def test_a_line_reader_never_holds_more_than_its_limit() -> None:
    """20 MiB of one line through a 1 MiB reader: refused once, the buffer bounded all along, the next line read."""
    limit = 1 << 20
    r, w = os.pipe()
    reader = helper_protocol.LineReader(r, limit)

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            for _ in range(20):
                f.write(b"y" * (1 << 20))
            f.write(b"\nnext\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    biggest = 0
    fill = reader._fill

    def watched(deadline: float | None) -> None:
        nonlocal biggest
        fill(deadline)
        biggest = max(biggest, len(reader.buf))

    reader._fill = watched  # type: ignore[method-assign]
    with pytest.raises(helper_protocol.LineTooLong):
        reader.readline(time.monotonic() + WAIT_S)
    assert reader.readline(time.monotonic() + WAIT_S) == b"next\n"
    assert reader.readline(time.monotonic() + WAIT_S) == b""
    writer.join(WAIT_S)
    os.close(r)
    assert biggest <= limit + helper_protocol.READ_CHUNK


def test_the_line_limit_is_a_few_mib() -> None:
    """Bounded, yet far above the longest job line a real bundle gives (see MAX_LINE's comment)."""
    assert 4 << 20 <= helper_protocol.MAX_LINE <= 64 << 20


# -- deadlines over whole replies --------------------------------------------------------------------


def test_a_reply_of_half_a_line_is_given_up_on_at_its_deadline() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b'{"ok": 1')
        reader = helper_protocol.LineReader(r)
        began = time.monotonic()
        assert helper_protocol.read_reply(reader, began + 0.3, lambda: "gone") == {"error": "no answer in time"}
        assert time.monotonic() - began < 10
        os.write(w, b"}\n")  # what came is kept: the rest completes the line
        assert helper_protocol.read_reply(reader, time.monotonic() + WAIT_S, lambda: "gone") == {"ok": 1}
        os.write(w, b"[1]\n")
        assert "unreadable answer" in helper_protocol.read_reply(reader, None, lambda: "gone")["error"]
    finally:
        os.close(w)
    assert helper_protocol.read_reply(reader, None, lambda: "gone") == {"error": "gone"}
    os.close(r)


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_a_helper_saying_half_a_ready_line_is_given_up_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "_READY_TIMEOUT_S", 0.5)
    script = _script(tmp_path, 'import sys; sys.stdout.write(\'{"ready": tr\'); sys.stdout.flush(); sys.stdin.read()')
    pool = HelperPool(1, 0, script=script)
    try:
        assert _in_thread(pool.ready) == 0
        assert pool.failures == ["a helper did not start: no answer in time"]
    finally:
        pool.close()


def test_a_helper_that_never_says_closed_is_killed_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``let_go`` waits for ``{"closed": true}`` under one deadline; a helper that does not say it is killed (its
    exit frees what it held) and the pool says so."""
    monkeypatch.setattr(helpers, "_CLOSE_TIMEOUT_S", 0.5)
    script = _script(tmp_path, """
        import json, sys
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            sys.stdout.write('{"clo'); sys.stdout.flush()
    """)
    pool = HelperPool(1, 0, script=script)
    try:
        assert pool.ready() == 1
        _in_thread(pool.let_go)
        assert pool.failures == ["a helper did not let go: no answer in time"]
        assert pool._procs[0].proc.wait(WAIT_S) != 0
    finally:
        pool.close()
