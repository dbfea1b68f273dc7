"""The copy helpers' protocol under hostile or broken peers (issue 47, items 4-9), without a GPU: the real
``Helper`` / ``serve`` with its CUDA calls faked (helper_fakes). Every request a helper reads is untrusted:
bounded, validated before any driver call, answered with an ``{"error": ...}`` line, never fatal; every
reply a client reads is read whole under one deadline; a helper that keeps dying is reported.

Each test fails on the code before these fixes: by a reply it did not give, or by a wait that never
ended (run on a thread and given up on after a generous timeout, so that it fails rather than hangs).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import mmap
import os
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helper_fakes import Conn, Served, fake_helper, serve_fake_helper

from marlin_pack.vllm_plugin import copy_helper_main, copy_helpers, helper_service
from marlin_pack.vllm_plugin.copy_helper_main import PROTOCOL, Settings, bind_listener
from marlin_pack.vllm_plugin.copy_helpers import HelperPool
from marlin_pack.vllm_plugin.helper_service import HelperService, ServiceError, ServiceSession, find_sockets, probe

PAGE = mmap.PAGESIZE
DATA = bytes(range(256)) * (4 * PAGE // 256)  # four pages
UUID = "GPU-00000000-0000-0000-0000-000000000000"  # what the faked helper reports
HANDLE = "00" * 64
WAIT_S = 30.0  # a generous bound on what should take milliseconds: a test given up on after it fails


@pytest.fixture
def served(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A service helper (CUDA faked: its "device memory" is ``destination``, one allocation) in ``sock_dir``."""
    yield from serve_fake_helper(sock_dir, tmp_path, monkeypatch, Settings(0, defer_unregister=True), DATA)


@pytest.fixture
def retaining(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The same helper with a budget for retained pages (``--retain-mib``)."""
    yield from serve_fake_helper(sock_dir, tmp_path, monkeypatch, Settings(0, defer_unregister=True, retain_bytes=1 << 30), DATA)


def _job(file: Path | str, windows: list | None = None, handles: list | None = None, threads: object = 2) -> dict:
    if windows is None:
        windows = [[lo, lo + PAGE, [[lo, PAGE, 0, lo]]] for lo in range(0, len(DATA), PAGE)]
    return {"parts": [{"file": str(file), "windows": windows}], "handles": [HANDLE] if handles is None else handles, "threads": threads}


def _sessions_done(served: Served) -> None:
    """Wait until the helper's session threads have returned (its verdict on each, healthy or not, is in then)."""
    for t in [t for t in threading.enumerate() if t.name == "session" and t not in served.before]:
        t.join(WAIT_S)
        assert not t.is_alive(), "a session never ended"


def _good_session(served: Served) -> None:
    """A whole session that copies the file: the helper is free, serving and its context in use."""
    ctypes.memset(served.destination, 0, len(DATA))
    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        conn.say(_job(served.file))
        assert conn.hear() == {"ok": len(DATA)}
        conn.say({"end": True})
        assert conn.hear() == {"closed": True}
    finally:
        conn.close()
    assert served.destination.raw == DATA


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


# -- item 4: a line that is not UTF-8 (nor JSON, nor an object) ------------------------------------


@pytest.mark.parametrize(
    "line",
    [b"\xff\xfe{}\n", b'{"parts": "\xc3"}\n', b"not json\n", b"[1, 2]\n", b'"a string"\n', b"[" * 100_000 + b"\n"],
    ids=["invalid-utf8", "invalid-utf8-in-json", "not-json", "an-array", "a-string", "nested-deep"],
)
def test_a_line_that_is_no_request_is_answered_and_never_ends_the_helper(served: Served, line: bytes) -> None:
    """Answered with an error line, the session goes on; five sessions of it and the helper still serves (it
    exited with status 3 on invalid UTF-8 before, and its service gave up on it after the fourth time)."""
    for _ in range(5):
        conn = Conn(served.path)
        try:
            assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
            conn.sock.sendall(line)
            reply = conn.hear()
            assert reply is not None and "RequestError" in reply.get("error", ""), reply
            conn.say(_job(served.file))
            assert conn.hear() == {"ok": len(DATA)}
        finally:
            conn.close()
        _sessions_done(served)
    _good_session(served)
    assert served.unhealthy == []


def test_an_engines_own_helper_answers_a_line_that_is_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A helper of its own engine (``main``, on pipes): the line is answered, the next job copied."""
    destination = ctypes.create_string_buffer(len(DATA))
    fake_helper(monkeypatch, Settings(0), destination)  # main()'s Helper gets the faked driver too
    file = tmp_path / "rank.bin"
    file.write_bytes(DATA)
    r, w = os.pipe()
    os.write(w, b"\xff\xfe\n" + json.dumps(_job(file)).encode() + b"\n")
    os.close(w)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.FileIO(r, "r"), encoding="utf-8"))
    status = copy_helper_main.main(["copy_helper_main.py", "0"])
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert replies[0] == {"ready": True, "protocol": PROTOCOL}
    assert "not UTF-8" in replies[1]["error"] and replies[2] == {"ok": len(DATA)} and len(replies) == 3
    assert status == 1 and destination.raw == DATA


def test_a_driver_error_that_does_not_stick_keeps_the_helper(served: Served) -> None:
    """An IPC handle the driver refuses (an engine's stale or forged one) is that job's error: the context still
    works, so the helper is not replaced (which cost the GPU that helper for good after four times)."""
    driver = served.helper.cu

    def refusing(name: str, *args: object) -> None:
        if name == "cuIpcOpenMemHandle":
            raise copy_helper_main.CudaError("cuIpcOpenMemHandle failed with CUDA error 1")
        driver(name, *args)

    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        served.helper.cu = refusing  # type: ignore[assignment]
        conn.say(_job(served.file))
        reply = conn.hear()
        assert reply is not None and "CUDA error 1" in reply["error"]
        served.helper.cu = driver  # type: ignore[assignment]
        conn.say({"end": True})
        assert conn.hear() == {"closed": True}
    finally:
        conn.close()
    _sessions_done(served)
    assert served.unhealthy == []
    _good_session(served)


_DYING_FAKE = """
    import json, os, sys
    args = sys.argv[1:]
    d, slot = args[args.index("--listen") + 1], args[args.index("--slot") + 1]
    path = os.path.join(d, f"GPU-{args[0]}.{slot}.sock")
    print(json.dumps({"ready": True, "protocol": 1, "socket": path, "uuid": "GPU-" + args[0]}), flush=True)
    sys.exit(3)  # dies at once, every time
"""


def test_a_helper_that_keeps_dying_is_reported_once(sock_dir: Path, tmp_path: Path) -> None:
    """After its last restart the service warns, once, naming the GPU, the helper and its exit status."""
    script = tmp_path / "dying.py"
    script.write_text(textwrap.dedent(_DYING_FAKE))
    lines: list[str] = []
    service = HelperService([0], processes=1, directory=sock_dir / "s", script=script, log=lines.append)
    service.start()
    try:
        for _ in range(6):
            service.helpers[0].proc.wait(WAIT_S)
            service.check()
    finally:
        service.stop()
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1, lines
    assert "GPU 0 helper 0" in warnings[0] and "status 3" in warnings[0] and "not restarting" in warnings[0]
    assert service.helpers[0].restarts == 3


# -- item 5: a file that is not a regular one -----------------------------------------------------


def test_a_job_naming_a_fifo_is_refused_at_once(served: Served, tmp_path: Path) -> None:
    """Opening a FIFO for reading waited for a writer forever: the helper stayed busy after its engine left."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    try:
        conn = Conn(served.path)  # its socket times out after 10 s: hear() raises where the helper hangs
        try:
            assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
            conn.say(_job(fifo))
            reply = conn.hear()
            assert reply is not None and "not a regular file" in reply["error"], reply
        finally:
            conn.close()
        _sessions_done(served)
        _good_session(served)  # free, not busy
    finally:
        with contextlib.suppress(OSError):  # before the fix: let the helper's open() return, no thread left blocked in it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("name", ["/dev/zero", "dir", "empty"])
def test_a_job_naming_no_regular_file_with_bytes_is_refused(served: Served, tmp_path: Path, name: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty").touch()
    target = name if name.startswith("/") else tmp_path / name
    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        conn.say(_job(target))
        reply = conn.hear()
        assert reply is not None and "RequestError" in reply["error"], reply
    finally:
        conn.close()
    _sessions_done(served)
    _good_session(served)


# -- item 6: pieces and windows outside the file or the protocol ----------------------------------

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


@pytest.mark.parametrize("bad", list(_BAD_JOBS.values()), ids=list(_BAD_JOBS))
def test_a_job_outside_its_file_or_the_protocol_is_refused_before_the_driver(served: Served, bad: dict) -> None:
    """No page-locking and no copy reaches the driver (an offset past the file's end was copied from before:
    SIGSEGV on a stub driver); the job is answered with an error and the next one copied."""
    driver = served.helper.cu
    reached: list[str] = []

    def guard(name: str, *args: object) -> None:  # the calls that touch host or device memory are only recorded
        if name in ("cuMemHostRegister", "cuMemHostUnregister", "cuMemcpyHtoDAsync"):
            reached.append(name)
            return
        driver(name, *args)

    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        served.helper.cu = guard  # type: ignore[assignment]
        conn.say(_job(served.file, **bad))
        reply = conn.hear()
        served.helper.cu = driver  # type: ignore[assignment]
        assert reply is not None and "RequestError" in reply.get("error", ""), reply
        assert reached == []
        conn.say(_job(served.file))
        assert conn.hear() == {"ok": len(DATA)}
    finally:
        served.helper.cu = driver  # type: ignore[assignment]
        conn.close()
    _sessions_done(served)
    assert served.unhealthy == []


def test_a_job_naming_one_file_twice_is_refused(served: Served, tmp_path: Path) -> None:
    """Two parts of one file (here under two names) would page-lock its pages twice: the driver refuses that."""
    link = tmp_path / "again.bin"
    os.link(served.file, link)
    job = _job(served.file)
    job["parts"].append({"file": str(link), "windows": job["parts"][0]["windows"]})
    driver = served.helper.cu
    reached: list[str] = []
    def guard(name: str, *args: object) -> None:
        reached.append(name) if name == "cuMemHostRegister" else driver(name, *args)

    served.helper.cu = guard  # type: ignore[assignment]
    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        conn.say(job)
        reply = conn.hear()
        assert reply is not None and "named by two parts" in reply.get("error", ""), reply
        assert reached == []
    finally:
        served.helper.cu = driver  # type: ignore[assignment]
        conn.close()
    _sessions_done(served)
    _good_session(served)


# -- item 7: a line that never ends ---------------------------------------------------------------


def test_a_line_past_the_limit_is_refused_and_skipped(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB without a newline against a 1 MiB limit: answered as too long (it was read whole, and 2000 MiB
    grew a helper to 2 GB), its rest skipped up to its newline, the next job copied."""
    monkeypatch.setattr(copy_helper_main, "MAX_LINE", 1 << 20)
    conn = Conn(served.path)
    try:
        assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
        conn.sock.sendall(b'{"parts": "' + b"x" * (8 << 20) + b'"}\n')
        reply = conn.hear()
        assert reply is not None and "longer than" in reply.get("error", ""), reply
        conn.say(_job(served.file))
        assert conn.hear() == {"ok": len(DATA)}
    finally:
        conn.close()
    _sessions_done(served)
    assert served.unhealthy == []


def test_a_line_reader_never_holds_more_than_its_limit() -> None:
    """20 MiB of one line through a 1 MiB reader: refused once, the buffer bounded all along, the next line read."""
    limit = 1 << 20
    r, w = os.pipe()
    reader = copy_helper_main.LineReader(r, limit)

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            for _ in range(20):
                f.write(b"y" * (1 << 20))
            f.write(b"\nnext\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    biggest, refused = 0, 0
    fill = reader._fill

    def watched(deadline: float | None) -> None:
        nonlocal biggest
        fill(deadline)
        biggest = max(biggest, len(reader.buf))

    reader._fill = watched  # type: ignore[method-assign]
    with pytest.raises(copy_helper_main.LineTooLong):
        reader.readline(time.monotonic() + WAIT_S)
    refused += 1
    assert reader.readline(time.monotonic() + WAIT_S) == b"next\n"
    assert reader.readline(time.monotonic() + WAIT_S) == b""
    writer.join(WAIT_S)
    os.close(r)
    assert refused == 1 and biggest <= limit + copy_helper_main._READ_CHUNK


def test_the_line_limit_is_a_few_mib() -> None:
    """Bounded, yet far above the longest job line a real bundle gives (see MAX_LINE's comment)."""
    assert 4 << 20 <= copy_helper_main.MAX_LINE <= 64 << 20


# -- item 8: deadlines over whole replies ---------------------------------------------------------


class _HalfLinePeer:
    """A socket where every connection is sent half a line, then nothing (the connection held open)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = bind_listener(str(path))
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.sendall(b'{"ready": tr')

    def close(self) -> None:
        """Hang up: before the fix, a reader blocked on the rest of the line gets its end now (and its file can be closed)."""
        self.listener.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture
def half_line_peer(sock_dir: Path) -> Iterator[_HalfLinePeer]:
    peer = _HalfLinePeer(sock_dir / f"{UUID}.0.sock")
    try:
        yield peer
    finally:
        peer.close()


def test_a_probe_of_a_peer_saying_half_a_line_gives_up_in_time(half_line_peer: _HalfLinePeer) -> None:
    """``marlin-pack helpers --status`` hung forever on it: the deadline covered only the first select."""
    began = time.monotonic()
    assert _in_thread(lambda: probe(half_line_peer.path, timeout_s=0.5)) == ("no answer", None)
    assert time.monotonic() - began < 10


def test_a_hello_of_a_peer_saying_half_a_line_gives_up_in_time(half_line_peer: _HalfLinePeer) -> None:
    session = ServiceSession(half_line_peer.path)
    try:
        assert _in_thread(lambda: session.hello(time.monotonic() + 0.5)) == "no answer in time"
    finally:
        half_line_peer.close()
        session.close()


class _Stream:
    def synchronize(self) -> None:
        pass


class _Driver:
    def uuid(self, ordinal: int) -> str:
        return UUID


def _own_helper_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(body))
    return script


_OWN_READY = """
    import json, sys
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"ok": 0}), flush=True)
"""


def test_an_engines_handshake_with_a_peer_saying_half_a_line_gives_up_in_time(
    half_line_peer: _HalfLinePeer, sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's hello to a service socket: given up on at its deadline, the pool starts helpers of its own."""
    monkeypatch.setattr(copy_helpers, "_CudaDriver", _Driver)
    monkeypatch.setattr(copy_helpers, "find_sockets", lambda uuid, directory=None: find_sockets(uuid, sock_dir))
    monkeypatch.setattr(copy_helpers, "_SERVICE_READY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    pool = HelperPool(2, 0, script=_own_helper_script(tmp_path, _OWN_READY))
    try:
        assert _in_thread(pool.ready) == 2
        assert pool.source == "own"
    finally:
        half_line_peer.close()  # before the fix: lets the pool's starting thread, still reading, end
        pool.close()


def test_an_own_helper_saying_half_a_ready_line_is_given_up_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_helpers, "_READY_TIMEOUT_S", 0.5)
    script = _own_helper_script(tmp_path, 'import sys; sys.stdout.write(\'{"ready": tr\'); sys.stdout.flush(); sys.stdin.read()')
    pool = HelperPool(1, 0, script=script, service=False)
    try:
        assert _in_thread(pool.ready) == 0
        assert pool.failures == ["a helper did not start: no answer in time"]
    finally:
        for p in pool._procs:  # before the fix: ends the read that waited for the rest of the line
            p.kill()  # type: ignore[attr-defined]
        pool.close()


def test_a_service_helper_saying_half_a_ready_line_is_given_up_in_time(
    sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(helper_service, "_READY_TIMEOUT_S", 0.5)
    script = _own_helper_script(tmp_path, 'import sys; sys.stdout.write(\'{"ready": tr\'); sys.stdout.flush(); sys.stdin.read()')
    service = HelperService([0], processes=1, directory=sock_dir / "s", script=script, log=lambda line: None)
    try:
        with pytest.raises(ServiceError, match=r"GPU 0 helper 0: no answer in time"):
            _in_thread(service.start)
    finally:
        for h in service.helpers:
            h.proc.kill()
        service.stop()


# -- item 9: retain ranges outside the file -------------------------------------------------------


@pytest.mark.parametrize(
    "ranges",
    [[[-PAGE, PAGE]], [[0, _END + PAGE]], [[_END, _END + PAGE]], [[PAGE, PAGE]], [["0", PAGE]],
     [[0, 2 * PAGE], [PAGE, 3 * PAGE]], [[0]], "x"],
    ids=["negative-offset", "past-eof", "after-eof", "empty", "string", "overlapping", "short", "not-a-list"],
)
def test_a_retain_range_outside_the_file_is_refused_before_any_page_locking(retaining: Served, ranges: object) -> None:
    """A negative offset was page-locked before the mapping and counted; nothing is registered or retained now."""
    conn = Conn(retaining.path)
    try:
        assert conn.hear()["ready"] is True  # type: ignore[index]
        conn.say({"retain": [{"file": str(retaining.file), "ranges": ranges}]})
        reply = conn.hear()
        assert reply is not None and "RequestError" in reply.get("error", ""), reply
        assert retaining.helper.cu.registered == {}  # type: ignore[attr-defined]
        assert retaining.helper.retained_bytes() == 0
        conn.say({"retain": [{"file": str(retaining.file), "ranges": [[0, _END]]}]})
        assert conn.hear() == {"ok": _END}
    finally:
        conn.close()
    _sessions_done(retaining)
    assert retaining.unhealthy == []
