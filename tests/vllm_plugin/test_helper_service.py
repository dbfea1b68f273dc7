"""``marlin-pack helpers`` without a GPU: the service helpers' sessions (their CUDA calls faked), an
engine's pool taking them or starting its own, the socket directory's trust rules and the service's
life. The copies themselves are checked on a GPU (tests/on_gpu/test_gpu_reader_gpu.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helper_fakes import Conn, Served, serve_fake_helper
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.vllm_plugin import copy_helper_main, copy_helpers, helper_service
from marlin_pack.vllm_plugin.copy_helper_main import PROTOCOL, Settings, bind_listener
from marlin_pack.vllm_plugin.copy_helpers import HelperPool
from marlin_pack.vllm_plugin.helper_service import (
    HelperService,
    ServiceError,
    find_sockets,
    probe,
    service_status,
    socket_dir,
    trusted_dir,
)
from marlin_pack.vllm_plugin.options import parse_extra_config

DATA = bytes(range(256)) * 64  # 16 KiB: four pages


@pytest.fixture
def served(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A service helper (CUDA faked: its "device memory" is ``destination``) listening in ``sock_dir``."""
    yield from serve_fake_helper(sock_dir, tmp_path, monkeypatch, Settings(0, defer_unregister=True), DATA)


def _job(file: Path) -> dict:
    windows = [[lo, lo + 4096, [[lo, 4096, 0, lo]]] for lo in range(0, len(DATA), 4096)]
    return {"parts": [{"file": str(file), "windows": windows}], "handles": ["00" * 64], "threads": 2}


def _wait_until(condition, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_service_helper_serves_one_engine_at_a_time_and_unmaps_it_at_the_end(served: Served) -> None:
    first = Conn(served.path)
    assert first.hear() == {"ready": True, "protocol": PROTOCOL}
    second = Conn(served.path)
    assert second.hear() == {"error": "busy"}  # a session runs: told at once, not kept waiting
    assert second.hear() is None
    second.close()
    first.say(_job(served.file))
    assert first.hear() == {"ok": len(DATA)}
    assert served.destination.raw == DATA
    assert served.helper.opened  # the engine's memory is mapped while its session lasts
    first.say({"end": True})
    assert first.hear() == {"closed": True}
    assert served.helper.opened == {} and "cuIpcCloseMemHandle" in served.helper.cu.calls  # type: ignore[attr-defined]
    first.close()
    # The next engine: a session of its own; this one goes away without "end" (its process died).
    ctypes.memset(served.destination, 0, len(DATA))
    third = Conn(served.path)
    assert third.hear() == {"ready": True, "protocol": PROTOCOL}
    third.say(_job(served.file))
    assert third.hear() == {"ok": len(DATA)}
    assert served.destination.raw == DATA
    third.close()
    assert _wait_until(lambda: not served.helper.opened)
    assert _wait_until(lambda: not served.helper.cu.registered)  # type: ignore[attr-defined]  # deferred unregistering ran


def test_a_service_helper_answers_a_bad_job_and_goes_on(served: Served, tmp_path: Path) -> None:
    conn = Conn(served.path)
    assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
    conn.say(_job(tmp_path / "missing.bin"))
    reply = conn.hear()
    assert reply is not None and "missing.bin" in reply["error"]
    conn.say(_job(served.file))
    assert conn.hear() == {"ok": len(DATA)}
    conn.close()
    assert _wait_until(lambda: not served.helper.opened)
    assert served.unhealthy == []  # a missing file is the engine's problem, not the helper's context


def test_a_failed_cuda_call_ends_the_service_helper_after_its_session(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA error that leaves the helper's context unusable (an illegal address sticks: every later call,
    cuCtxSynchronize too, reports it): the session goes on (the engine reads what is left), and once it ends
    the helper is ended too (its service starts a fresh one)."""
    driver = served.helper.cu

    def failing(name: str, *args: object) -> None:
        if name in ("cuMemcpyHtoDAsync", "cuCtxSynchronize"):
            raise copy_helper_main.CudaError(f"{name} failed with CUDA error 700")
        driver(name, *args)

    conn = Conn(served.path)
    assert conn.hear() == {"ready": True, "protocol": PROTOCOL}
    served.helper.cu = failing  # type: ignore[assignment]
    conn.say(_job(served.file))
    reply = conn.hear()
    assert reply is not None and "CudaError" in reply["error"] and "700" in reply["error"]
    assert served.unhealthy == []  # not while the engine is still in its session
    conn.say({"end": True})
    assert conn.hear() == {"closed": True}
    conn.close()
    assert _wait_until(lambda: served.unhealthy == ["exit"])


def test_a_service_helper_serves_no_other_user(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_helper_main, "peer_uid", lambda conn: os.getuid() + 1)
    conn = Conn(served.path)
    assert conn.hear() is None  # closed without a word: no session, no job
    conn.close()


def test_bind_listener_replaces_a_stale_socket_only(sock_dir: Path) -> None:
    path = sock_dir / "x.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # its file stays: a helper that died
    live = bind_listener(str(path))
    try:
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        with pytest.raises(FileExistsError, match="already listens"):
            bind_listener(str(path))
    finally:
        live.close()
    plain = sock_dir / "plain"
    plain.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        bind_listener(str(plain))
    assert plain.read_text() == "not a socket"


# -- an engine's pool ---------------------------------------------------------------------------


@dataclass
class _W:
    lo: int
    hi: int
    pieces: list = field(default_factory=list)


class _Stream:
    def synchronize(self) -> None:
        pass


class _Driver:
    def uuid(self, ordinal: int) -> str:
        return "GPU-00000000-0000-0000-0000-000000000000"  # what the faked helper reports


def _pool(monkeypatch: pytest.MonkeyPatch, sock_dir: Path, destination: ctypes.Array, **kw: object) -> HelperPool:
    """A pool whose device is faked: destinations are views of ``destination``, the service sockets in ``sock_dir``."""
    monkeypatch.setattr(copy_helpers, "_CudaDriver", _Driver)
    monkeypatch.setattr(copy_helpers, "find_sockets", lambda uuid, directory=None: find_sockets(uuid, directory or sock_dir))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    pool = HelperPool(2, 0, **kw)  # type: ignore[arg-type]
    base = ctypes.addressof(destination)
    monkeypatch.setattr(pool, "_handle", lambda ptr: ("00" * 64, ptr - base))
    return pool


def _windows(destination: ctypes.Array) -> list[_W]:
    view = torch.frombuffer(destination, dtype=torch.uint8)
    return [_W(lo, lo + 4096, [(lo, 4096, view[lo : lo + 4096])]) for lo in range(0, len(DATA), 4096)]


def test_a_pool_takes_the_service_helpers_and_leaves_them_serving(served: Served, sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool's destinations: views of the buffer the faked helper writes to.
    with _pool(monkeypatch, sock_dir, served.destination, script=Path("/nonexistent")) as pool:
        assert pool.copy(served.file, _windows(served.destination), threads=2) == []
        assert pool.source == "service" and pool.failures == []
        assert pool.ready() == 1  # the service's one helper, whatever count said
    assert served.destination.raw == DATA
    assert served.helper.opened == {}  # closed before close() returned
    again = Conn(served.path)
    assert again.hear() == {"ready": True, "protocol": PROTOCOL}  # still serving
    again.close()


def test_a_pool_asks_for_its_service_directory_on_its_starting_thread(
    served: Served, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A page-locking still under way (preload): the caller (vLLM building the model) must not wait for it.
    released, asked = threading.Event(), []

    def service_dir() -> Path:
        asked.append(threading.current_thread().name)
        assert released.wait(10)
        return sock_dir

    looked_in: list[Path | None] = []
    with _pool(monkeypatch, sock_dir, served.destination, script=Path("/nonexistent"), service_dir=service_dir) as pool:
        def look(uuid: str, directory: Path | None = None) -> list[Path]:
            looked_in.append(directory)
            return find_sockets(uuid, directory)

        monkeypatch.setattr(copy_helpers, "find_sockets", look)
        time.sleep(0.05)
        assert asked == ["marlin-pack-helpers"] and looked_in == []  # constructed; the thread still waits
        released.set()
        assert pool.copy(served.file, _windows(served.destination), threads=2) == []
        assert pool.source == "service" and looked_in == [sock_dir]
    assert served.destination.raw == DATA


def _own_helper_script(tmp_path: Path) -> Path:
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"ok": 0}), flush=True)
    """))
    return script


def test_a_pool_starts_its_own_helpers_past_a_stale_busy_or_older_service(
    served: Served, sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "GPU-00000000-0000-0000-0000-000000000000.1.sock"))
    stale.close()
    busy = Conn(served.path)  # another engine holds the one live helper
    assert busy.hear() == {"ready": True, "protocol": PROTOCOL}
    with caplog.at_level(logging.WARNING, logger="vllm.marlin_pack"):
        pool = _pool(monkeypatch, sock_dir, served.destination, script=_own_helper_script(tmp_path))
        with pool:
            assert pool.ready() == 2
            assert pool.source == "own"
    assert "busy" in caplog.text and ".1.sock" in caplog.text
    busy.say({"end": True})
    assert busy.hear() == {"closed": True}  # free again once this is heard
    busy.close()
    monkeypatch.setattr(helper_service, "PROTOCOL", PROTOCOL + 1)  # an engine newer than the service
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.marlin_pack"), _pool(monkeypatch, sock_dir, served.destination,
                                                                            script=_own_helper_script(tmp_path)) as pool:
        assert pool.ready() == 2 and pool.source == "own"
    assert "restart `marlin-pack helpers`" in caplog.text


def test_a_pool_refuses_a_service_helper_of_another_user(
    served: Served, sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(helper_service, "peer_uid", lambda conn: os.getuid() + 1)
    with caplog.at_level(logging.WARNING, logger="vllm.marlin_pack"), _pool(monkeypatch, sock_dir, served.destination,
                                                                            script=_own_helper_script(tmp_path)) as pool:
        assert pool.source == "own" and pool.ready() == 2
    assert "runs as user" in caplog.text


def test_without_the_option_a_pool_never_looks_for_a_service(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def looked(uuid: str, directory: Path | None = None) -> list[Path]:
        raise AssertionError("looked for a service")

    destination = ctypes.create_string_buffer(16)
    pool = _pool(monkeypatch, sock_dir, destination, script=_own_helper_script(tmp_path), service=False)
    monkeypatch.setattr(copy_helpers, "find_sockets", looked)
    with pool:
        assert pool.ready() == 2 and pool.source == "own"
    assert parse_extra_config({}).io_helper_service is True
    assert parse_extra_config({"io_helper_service": False}).io_helper_service is False
    with pytest.raises(ValueError, match=r"\['io_helper_service'\] must be true or false"):
        parse_extra_config({"io_helper_service": "no"})


# -- the socket directory -----------------------------------------------------------------------


def test_socket_dir_default_order() -> None:
    assert socket_dir({"MARLIN_PACK_HELPERS_DIR": "/a", "XDG_RUNTIME_DIR": "/run/user/5"}) == Path("/a")
    assert socket_dir({"XDG_RUNTIME_DIR": "/run/user/5"}) == Path("/run/user/5/marlin-pack-helpers")
    assert socket_dir({}) == Path(f"/tmp/marlin-pack-helpers-{os.getuid()}")


def test_only_a_private_directory_of_this_user_is_trusted(sock_dir: Path) -> None:
    made = trusted_dir(sock_dir / "new" / "dir", create=True)
    assert oct(made.stat().st_mode & 0o777) == oct(0o700)
    open_dir = sock_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(ServiceError, match="open to other users.*chmod 700"):
        trusted_dir(open_dir)
    link = sock_dir / "link"
    link.symlink_to(made)
    with pytest.raises(ServiceError, match="not a directory"):
        trusted_dir(link)
    with pytest.raises(ServiceError, match="no helpers' socket directory"):
        trusted_dir(sock_dir / "missing")
    uuid = "GPU-1"
    for name in (f"{uuid}.10.sock", f"{uuid}.2.sock", f"{uuid}.x.sock", "GPU-2.0.sock", f"{uuid}.0.sock"):
        (open_dir / name).touch()
        (made / name).touch()
    assert find_sockets(uuid, open_dir) == []  # anyone could have put those there
    assert [p.name for p in find_sockets(uuid, made)] == [f"{uuid}.0.sock", f"{uuid}.2.sock", f"{uuid}.10.sock"]


# -- the service ---------------------------------------------------------------------------------


_LISTENING_FAKE = """
    import json, os, sys
    args = sys.argv[1:]
    d, slot = args[args.index("--listen") + 1], args[args.index("--slot") + 1]
    if os.environ.get("FAIL_SLOT") == slot:
        print(json.dumps({{"error": "RuntimeError: boom"}}), flush=True)
        sys.exit(1)
    path = os.path.join(d, f"GPU-{{args[0]}}.{{slot}}.sock")
    open(path, "w").close()
    print(json.dumps({{"ready": True, "protocol": {protocol}, "socket": path, "uuid": "GPU-" + args[0]}}), flush=True)
    sys.stdin.read()
    os.unlink(path)
"""


def _service(sock_dir: Path, tmp_path: Path, **kw: object) -> HelperService:
    script = tmp_path / "listening.py"
    script.write_text(textwrap.dedent(_LISTENING_FAKE.format(protocol=PROTOCOL)))
    return HelperService([0, 1], processes=2, directory=sock_dir / "s", script=script, log=lambda line: None, **kw)  # type: ignore[arg-type]


def test_the_service_starts_its_helpers_restarts_the_dead_and_stops(sock_dir: Path, tmp_path: Path) -> None:
    service = _service(sock_dir, tmp_path)
    service.start()
    try:
        assert sorted(p.name for p in (sock_dir / "s").iterdir()) == ["GPU-0.0.sock", "GPU-0.1.sock", "GPU-1.0.sock", "GPU-1.1.sock"]
        assert all(h.uuid == f"GPU-{h.device}" for h in service.helpers)
        assert service.helpers[0].args[:5] == ["0", "--listen", str(sock_dir / "s"), "--slot", "0"]
        assert "--defer-unregister" in service.helpers[0].args
        service.helpers[1].proc.kill()
        service.helpers[1].proc.wait()
        service.check()
        assert service.helpers[1].restarts == 1 and service.helpers[1].proc.poll() is None
    finally:
        service.stop()
    assert all(h.proc.returncode == 0 for h in service.helpers)
    assert list((sock_dir / "s").iterdir()) == []


def test_the_service_reports_helpers_that_fail(sock_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_SLOT", "1")
    lines: list[str] = []
    service = _service(sock_dir, tmp_path)
    service.log = lines.append
    service.start()  # half of them: it serves with the others, and says so
    service.stop()
    assert len(lines) == 2 and all("helper 1: RuntimeError: boom" in line for line in lines)
    monkeypatch.setenv("FAIL_SLOT", "0")
    with pytest.raises(ServiceError, match=r"no copy helper started \(GPU 0 helper 0: RuntimeError: boom\)"):
        HelperService([0], processes=1, directory=sock_dir / "s", script=tmp_path / "listening.py", log=lambda line: None).start()


def test_the_service_refuses_an_open_socket_directory(sock_dir: Path, tmp_path: Path) -> None:
    (sock_dir / "s").mkdir(mode=0o777)
    (sock_dir / "s").chmod(0o777)
    with pytest.raises(ServiceError, match="open to other users"):
        _service(sock_dir, tmp_path).start()


def test_helpers_command_without_a_gpu_is_one_line_and_exit_1(sock_dir: Path) -> None:
    if Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() or torch.cuda.is_available():
        pytest.skip("a CUDA driver is installed here")
    r = subprocess.run([sys.executable, "-m", "marlin_pack.cli", "helpers"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MARLIN_PACK_HELPERS_DIR": str(sock_dir)})
    assert r.returncode == 1
    assert "the helper service needs a GPU" in r.stderr and "Traceback" not in r.stderr
    assert CliRunner().invoke(app, ["helpers", "--processes", "0"]).exit_code == 2  # typer's own range check


def test_status_tells_ready_busy_and_stale_helpers_apart(served: Served, sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "GPU-00000000-0000-0000-0000-000000000000.1.sock"))
    stale.close()
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    assert service_status(sock_dir) == [(uuid, 0, "ready", None), (uuid, 1, "stale", None)]
    assert _wait_until(lambda: not served.helper.opened)  # the probe's session ended
    busy = Conn(served.path)
    assert busy.hear() == {"ready": True, "protocol": PROTOCOL}
    assert service_status(sock_dir)[0] == (uuid, 0, "busy", None)
    busy.close()
    monkeypatch.setattr(copy_helper_main, "PROTOCOL", PROTOCOL + 1)  # a helper of another marlin-pack
    assert _wait_until(lambda: service_status(sock_dir)[0] == (uuid, 0, f"protocol {PROTOCOL + 1}", None))
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(sock_dir))
    r = CliRunner().invoke(app, ["helpers", "--status"])
    assert r.exit_code == 1 and "protocol" in r.output and "stale" in r.output  # none ready
    monkeypatch.setattr(copy_helper_main, "PROTOCOL", PROTOCOL)
    r = CliRunner().invoke(app, ["helpers", "--status"])
    assert r.exit_code == 0 and "ready" in r.output, r.output


def test_a_probe_leaves_the_helper_free_for_the_next_one(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # A probe that hangs up without a goodbye (the helper speaks another protocol) returns only once the
    # helper has let it go: probes back to back never find it "busy" with the last one (seen once in CI).
    monkeypatch.setattr(copy_helper_main, "PROTOCOL", PROTOCOL + 1)
    assert [probe(served.path)[0] for _ in range(30)] == [f"protocol {PROTOCOL + 1}"] * 30
    monkeypatch.setattr(copy_helper_main, "PROTOCOL", PROTOCOL)
    assert [probe(served.path)[0] for _ in range(30)] == ["ready"] * 30


def test_status_without_helpers(sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(sock_dir))
    r = CliRunner().invoke(app, ["helpers", "--status"])
    assert r.exit_code == 1 and "no copy helpers in" in r.output
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(sock_dir / "missing"))
    r = CliRunner().invoke(app, ["helpers", "--status"])  # main() turns this into one line and exit 1
    assert isinstance(r.exception, ServiceError) and "no helpers' socket directory" in str(r.exception)
