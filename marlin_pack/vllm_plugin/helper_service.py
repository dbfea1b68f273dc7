"""``marlin-pack helpers``: copy helpers that outlive engines, so that an engine's copy starts at once.

An engine's own copy helpers (:mod:`.copy_helpers`) are started by its loader and need ~0.25 s (four
CUDA contexts, which the driver creates one after another) before they copy anything; the engine then
waits for them to exit (their contexts hold GPU memory) before vLLM measures the memory left for the
KV cache. Both sit inside every start, and vLLM 0.33.0 leaves no earlier point to start them at (see
docs/performance.md). A *helper service* starts the same helpers (:mod:`.copy_helper_main` with
``--listen``) once, for every GPU it is given, each listening on a Unix socket
``DIR/<GPU UUID>.<K>.sock``; an engine's loader finds the sockets of its GPU and hands its jobs to
those helpers, which are ready already and go on living after it.

Their CUDA contexts stay on the GPU meanwhile (an engine's memory snapshot counts them as another
process's memory, before and after loading alike, so the KV cache is sized as without them).

With ``retain_mib`` (``marlin-pack helpers --retain-gib N``) the helpers also keep the bundle pages
they page-locked for one engine registered for the next ones, up to that budget: a later start of the
same bundle skips page-locking, what keeps a copy below pinned speed. Those page-cache pages stay pinned in host
memory while they are retained (see ``--retain-mib`` in :mod:`.copy_helper_main`).

``DIR`` is ``$MARLIN_PACK_HELPERS_DIR``, else ``$XDG_RUNTIME_DIR/marlin-pack-helpers``, else
``/tmp/marlin-pack-helpers-<uid>``; it must belong to the user and be closed to others (0700): a
helper writes into the GPU memory of whoever it serves, so engines only talk to helpers in such a
directory, and helpers only serve processes of their own user.

No torch, no vLLM: the CLI imports this.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from marlin_pack.errors import MarlinPackError
from marlin_pack.vllm_plugin.copy_helper_main import HELPER_ENV, PROTOCOL, LineReader, LineTooLong, format_uuid, parse_line, peer_uid

__all__ = [
    "HELPER_CONTEXT_BYTES", "HelperService", "HelperState", "ServiceError", "ServiceHelper", "ServiceSession", "device_count",
    "find_sockets", "gpu_uuid", "preload_shares", "probe", "read_reply", "service_status", "socket_dir", "trusted_dir",
]

_HELPER = Path(__file__).with_name("copy_helper_main.py")
_READY_TIMEOUT_S = 60.0
_CLOSE_TIMEOUT_S = 10.0  # a service helper closing its IPC mappings of an engine's memory
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_RESTARTS = 3  # a helper that died is restarted at most this many times; after that the service says so


class ServiceError(MarlinPackError):
    """The helper service cannot start (no GPU, an unsafe socket directory, helpers that fail)."""


def socket_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the service's sockets live: ``$MARLIN_PACK_HELPERS_DIR``, ``$XDG_RUNTIME_DIR/marlin-pack-helpers``
    or ``/tmp/marlin-pack-helpers-<uid>``."""
    env = os.environ if environ is None else environ
    if env.get("MARLIN_PACK_HELPERS_DIR"):
        return Path(env["MARLIN_PACK_HELPERS_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "marlin-pack-helpers"
    return Path(f"/tmp/marlin-pack-helpers-{os.getuid()}")


def trusted_dir(path: Path, create: bool = False) -> Path:
    """``path`` if it is a real directory of this user that no one else may enter or write; raises otherwise.

    ``create``: make it (mode 0700) when missing.
    """
    if create:
        try:
            path.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError as e:
            raise ServiceError(f"cannot create the helpers' socket directory {path}: {e.strerror}; set MARLIN_PACK_HELPERS_DIR") from e
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise ServiceError(
            f"no helpers' socket directory at {path}: no copy helpers run there; start them with `marlin-pack helpers`"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ServiceError(f"{path} is not a directory (a link or a file); expected the helpers' socket directory")
    if st.st_uid != os.getuid():
        raise ServiceError(
            f"{path} belongs to user {st.st_uid}, not to you ({os.getuid()}); set MARLIN_PACK_HELPERS_DIR to a directory of your own"
        )
    if st.st_mode & 0o077:
        raise ServiceError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); expected 700: chmod 700 {path}")
    return path


def find_sockets(uuid: str, directory: Path | None = None) -> list[Path]:
    """The service helpers' sockets for the GPU ``uuid``, in slot order; none when the directory is not trusted."""
    directory = socket_dir() if directory is None else directory
    try:
        trusted_dir(directory)
    except ServiceError:
        return []
    found = []
    for p in directory.glob(f"{uuid}.*.sock"):
        slot = p.name[len(uuid) + 1 : -len(".sock")]
        if slot.isdigit():
            found.append((int(slot), p))
    return [p for _, p in sorted(found)]


def read_reply(reader: LineReader, deadline: float | None, gone_why: Callable[[], str]) -> dict:
    """A helper's next line of the protocol as a dict; ``{"error": ...}`` when the whole line has not come by
    ``deadline`` (None: wait), it is too long or not a JSON object, or its output ended (``gone_why()`` says why).

    ``deadline`` bounds every read until the newline: a peer that sends half a line is given up on then.
    """
    try:
        line = reader.readline(deadline)
    except TimeoutError:
        return {"error": "no answer in time"}
    except LineTooLong as e:
        return {"error": f"unreadable answer: {e}"}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not line:
        return {"error": gone_why()}
    try:
        return parse_line(line)
    except ValueError:
        return {"error": f"unreadable answer {line[:80]!r}"}


def _ranges(said: object) -> dict[str, list[tuple[int, int]]]:
    """A ready line's ``"retained"`` (``[[FILE, [[LO, HI], ...]], ...]``) as a dict; what does not parse is left out."""
    found: dict[str, list[tuple[int, int]]] = {}
    for entry in said if isinstance(said, list) else []:
        try:
            file, ranges = entry
            found[str(file)] = [(int(lo), int(hi)) for lo, hi in ranges]
        except (TypeError, ValueError):
            continue
    return found


def preload_shares(files: Sequence[tuple[str, int]], window: int, helpers: int) -> list[list[dict]]:
    """The ``retain`` lines that page-lock ``files`` (``(path, size)``) in ``window``-byte blocks, cut into at
    most ``helpers`` contiguous shares of about equal bytes (one per helper, in order).

    Blocks at multiples of ``window``: a loader reading with windows of that size (``chunk_mb``, 256 MiB
    by default in the ``processes`` mode) cuts each of its windows inside one block, which is what a
    copy from a retained registration needs.
    """
    blocks = [(path, lo, min(lo + window, size)) for path, size in files for lo in range(0, size, window)]
    total = sum(hi - lo for _, lo, hi in blocks)
    shares: list[list[tuple[str, int, int]]] = [[]]
    done = 0
    for block in blocks:
        if shares[-1] and len(shares) < helpers and done >= total * len(shares) / helpers:
            shares.append([])
        shares[-1].append(block)
        done += block[2] - block[1]
    lines = []
    for share in shares:
        by_file: dict[str, list[list[int]]] = {}
        for path, lo, hi in share:
            by_file.setdefault(path, []).append([lo, hi])
        lines.append([{"file": path, "ranges": ranges} for path, ranges in by_file.items()])
    return [line for line in lines if line]


class ServiceSession:
    """A session with the service helper at ``path`` (its client side): the connection, checked to be of
    this user, then the protocol's lines. The helper goes on living after the session.

    Raises :class:`OSError` when nobody listens there (a stale socket), :class:`PermissionError` when
    the helper runs as another user (it would write into this process's GPU memory).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(str(path))
            uid = peer_uid(self.sock)
            if uid != os.getuid():  # our GPU memory is written by whoever answers here
                raise PermissionError(f"the helper at {path} runs as user {uid}, not as this process's user {os.getuid()}")
        except BaseException:
            self.sock.close()
            raise
        self.reader = LineReader(self.sock.fileno())  # replies, each read under one deadline (read_reply)
        self.wfile = self.sock.makefile("w", encoding="utf-8")
        self.ended = False
        self.retained_bytes: int | None = None  # said by a ready helper that retains pages between engines
        self.retained: dict[str, list[tuple[int, int]]] = {}  # and where: file -> registered page ranges

    def hello(self, deadline: float | None) -> str:
        """The helper's first answer: ``ready`` (speaking this protocol), ``busy``, ``protocol N`` or why not."""
        reply = read_reply(self.reader, deadline, self.gone_why)
        if reply.get("ready") is True:
            retained = reply.get("retained_bytes")
            self.retained_bytes = retained if isinstance(retained, int) and not isinstance(retained, bool) else None
            self.retained = _ranges(reply.get("retained"))
            return "ready" if reply.get("protocol") == PROTOCOL else f"protocol {reply.get('protocol')!r}"
        return str(reply.get("error") or f"unexpected answer {reply!r}")

    def send(self, obj: dict) -> None:
        self.wfile.write(json.dumps(obj) + "\n")
        self.wfile.flush()

    def end(self) -> None:
        """No more jobs: the helper closes its IPC mappings of this process's memory and answers."""
        try:
            self.send({"end": True})
            self.ended = True
        except OSError:
            self.close()

    def wait_gone(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """After :meth:`end`: wait (at most ``timeout_s``) for that answer, then close the connection."""
        try:
            if self.ended:
                read_reply(self.reader, time.monotonic() + timeout_s, self.gone_why)
        finally:
            self.close()

    def hang_up(self, timeout_s: float) -> None:
        """Without :meth:`end`: say no more and wait (at most ``timeout_s``) until the helper has closed its
        side, so that it is free for the next connection when this returns; then close ours."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + timeout_s
            while "error" not in read_reply(self.reader, deadline, self.gone_why):
                pass  # lines a helper still had to say; its end of output (or the deadline) says "error"
        except OSError:
            pass
        finally:
            self.close()

    def close(self) -> None:
        for f in (self.wfile, self.sock):
            with contextlib.suppress(OSError):
                f.close()

    kill = close  # the pool's name for giving up on a helper

    def gone_why(self) -> str:
        return f"the service helper at {self.path} closed the connection"


class HelperState(NamedTuple):
    """One service socket as :func:`service_status` found it."""

    uuid: str  # the GPU's
    slot: int
    state: str  # as :func:`probe` says
    retained_bytes: int | None = None  # bundle pages it keeps registered between engines (a ready helper with a budget)


def probe(path: Path, timeout_s: float = 2.0) -> tuple[str, int | None]:
    """What answers at the service socket ``path``: ``ready``, ``busy`` (serving an engine), ``stale`` (nobody:
    its helper died), ``another user's``, ``protocol N`` (a helper of another marlin-pack) or ``no answer``;
    and, for a ready helper that retains pages between engines, how many bytes it holds.

    A ready helper is asked for an empty session, ended at once.
    """
    try:
        session = ServiceSession(path)
    except PermissionError:
        return "another user's", None
    except OSError:
        return "stale", None
    state = session.hello(time.monotonic() + timeout_s)
    if state == "ready":
        session.end()
        session.wait_gone(timeout_s)
    else:  # a helper of another protocol, or one answering busy: wait until it has let this connection go
        session.hang_up(timeout_s)
    return (state if state in ("ready", "busy") or state.startswith("protocol ") else "no answer"), session.retained_bytes


def service_status(directory: Path | None = None) -> list[HelperState]:
    """A :class:`HelperState` for every service socket in ``directory`` (default :func:`socket_dir`), in order.

    Raises :class:`ServiceError` when the directory is missing or not trusted.
    """
    directory = trusted_dir(socket_dir() if directory is None else directory)
    rows = []
    for p in directory.glob("*.*.sock"):
        uuid, _, slot = p.name[: -len(".sock")].rpartition(".")
        if slot.isdigit():
            rows.append((uuid, int(slot), p))
    return [HelperState(uuid, slot, *probe(p)) for uuid, slot, p in sorted(rows)]


# GPU memory set aside per copy helper's CUDA context (a driver-API context without torch; nvidia-smi showed
# 518 MiB each on an H200).
HELPER_CONTEXT_BYTES = 512 << 20


def gpu_uuid(ordinal: int, lib: ctypes.CDLL | None = None) -> str:
    """The UUID of the CUDA device ``ordinal`` as service helpers name their sockets (``lib``: ``libcuda.so.1``).

    Raises :class:`RuntimeError` when the driver cannot say (no driver, no such device)."""
    try:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"no CUDA driver here ({e})") from None
    dev = ctypes.c_int()
    raw = (ctypes.c_char * 16)()
    # cuInit first: harmless where torch has initialised the driver, needed where nothing has yet.
    err = lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal) or lib.cuDeviceGetUuid_v2(raw, dev)
    if err != 0:
        raise RuntimeError(f"cuDeviceGetUuid failed with CUDA error {err}")
    return format_uuid(bytes(raw))


def device_count() -> int:
    """CUDA devices the driver sees (honouring ``CUDA_VISIBLE_DEVICES``); raises :class:`ServiceError` without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise ServiceError(f"no CUDA driver here ({e}); the helper service needs a GPU") from None
    err = lib.cuInit(0)
    count = ctypes.c_int()
    if err == 0:
        err = lib.cuDeviceGetCount(ctypes.byref(count))
    if err != 0 or count.value == 0:
        raise ServiceError(
            f"no CUDA device here (cuInit / cuDeviceGetCount: error {err}, {count.value} devices); the helper service needs a GPU"
        )
    return count.value


@dataclass
class ServiceHelper:
    """One running service helper."""

    device: int
    slot: int
    args: list[str]
    proc: subprocess.Popen[str]
    socket: Path | None = None
    uuid: str | None = None
    restarts: int = 0
    given_up: bool = False  # died again after its last restart: said once, not restarted


@dataclass
class HelperService:
    """The service's helpers: ``processes`` per device in ``devices``, listening in ``directory``.

    ``defer_unregister`` is on by default here: a helper unregisters a job's pages after its answer,
    and no engine waits for that. ``staged`` / ``stage_mib`` / ``nice`` as for an engine's own
    helpers (:class:`.copy_helpers.HelperPool`). ``retain_mib``: what *each* helper keeps registered
    between engines (0: nothing).

    Example:
        >>> service = HelperService([0], processes=4)
        >>> service.start()          # raises ServiceError if no helper could start
        >>> service.wait()           # until SIGINT / SIGTERM; then service.stop()
    """

    devices: Sequence[int]
    processes: int = 4
    directory: Path = field(default_factory=socket_dir)
    staged: int = 0
    stage_mib: int = 64
    defer_unregister: bool = True
    nice: int = 0
    retain_mib: int = 0
    script: Path = _HELPER
    helpers: list[ServiceHelper] = field(default_factory=list)
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)

    def preload(self, files: Sequence[str | Path], window_mib: int = 256) -> dict[int, int]:
        """Page-lock ``files`` in every served GPU's helpers now (``retain_mib`` must be set), so that even the
        first engine of that bundle copies without page-locking; GPU -> bytes retained. The files' pages are
        read into the page cache on the way. Raises :class:`ServiceError` when nothing could be retained."""
        if not self.retain_mib:
            raise ServiceError("preloading needs helpers that retain pages: give a budget (--retain-gib)")
        sizes = []
        for f in files:
            try:
                sizes.append((str(Path(f).resolve()), Path(f).stat().st_size))
            except OSError as e:
                raise ServiceError(f"cannot preload {f}: {e.strerror or e}") from None
        done: dict[int, int] = {}
        problems: list[str] = []
        lock = threading.Lock()

        def one(h: ServiceHelper, line: list[dict]) -> None:
            try:
                session = ServiceSession(h.socket)  # type: ignore[arg-type]
            except OSError as e:
                with lock:
                    problems.append(f"GPU {h.device} helper {h.slot}: {e}")
                return
            try:
                state = session.hello(time.monotonic() + _READY_TIMEOUT_S)
                reply = {"error": state} if state != "ready" else None
                if reply is None:
                    session.send({"retain": line})
                    reply = read_reply(session.reader, None, session.gone_why)
                    session.end()
                with lock:
                    if "ok" in reply:
                        done[h.device] = done.get(h.device, 0) + int(reply["ok"])
                    else:
                        problems.append(f"GPU {h.device} helper {h.slot}: {reply.get('error')}")
            finally:
                session.wait_gone()

        threads = []
        for device in self.devices:
            mine = [h for h in self.helpers if h.device == device and h.socket is not None and h.proc.poll() is None]
            for h, line in zip(mine, preload_shares(sizes, window_mib << 20, len(mine)), strict=False):
                threads.append(threading.Thread(target=one, args=(h, line), name="preload"))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for line in problems:
            self.log(f"marlin-pack helpers: preload: {line}")
        if not any(done.values()):
            raise ServiceError(f"nothing preloaded ({problems[0] if problems else 'no helper ready'})")
        return done

    def _argv(self, device: int, slot: int) -> list[str]:
        return [
            str(device), "--listen", str(self.directory), "--slot", str(slot),
            *(["--staged", str(self.staged), "--stage-mib", str(self.stage_mib)] if self.staged else []),
            *(["--defer-unregister"] if self.defer_unregister else []), *(["--nice", str(self.nice)] if self.nice else []),
            *(["--retain-mib", str(self.retain_mib)] if self.retain_mib else []),
        ]

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-S", str(self.script), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env={**os.environ, **HELPER_ENV}, start_new_session=True,  # Ctrl-C reaches the service, which ends them
        )

    def start(self) -> None:
        """Start every helper and wait until each listens; raises :class:`ServiceError` if none could."""
        trusted_dir(self.directory, create=True)
        longest = len(str(self.directory / "GPU-00000000-0000-0000-0000-000000000000.00.sock"))
        if longest > _SOCKET_PATH_MAX:
            raise ServiceError(
                f"the helpers' socket directory {self.directory} is too long for a Unix socket path ({longest} > "
                f"{_SOCKET_PATH_MAX} bytes); set MARLIN_PACK_HELPERS_DIR to a shorter one"
            )
        for device in self.devices:
            for slot in range(self.processes):
                args = self._argv(device, slot)
                self.helpers.append(ServiceHelper(device, slot, args, self._spawn(args)))
        failures = [f"GPU {h.device} helper {h.slot}: {why}" for h in self.helpers if (why := self._await_ready(h)) is not None]
        if len(failures) == len(self.helpers):
            self.stop()
            raise ServiceError(f"no copy helper started ({failures[0]})")
        for line in failures:
            self.log(f"marlin-pack helpers: {line}")

    def _await_ready(self, h: ServiceHelper) -> str | None:
        """None once ``h`` listens (its socket and UUID noted), else why not: its whole ready line must come
        within ``_READY_TIMEOUT_S`` (a helper that says half a line is killed then)."""
        assert h.proc.stdout is not None
        reply = read_reply(LineReader(h.proc.stdout.fileno()), time.monotonic() + _READY_TIMEOUT_S, lambda: "no answer")
        if reply.get("ready") is not True or not isinstance(reply.get("socket"), str) or not isinstance(reply.get("uuid"), str):
            h.proc.kill()
            h.proc.wait()
            return str(reply.get("error") or f"unexpected answer {str(reply)[:80]!r}")
        h.socket, h.uuid = Path(reply["socket"]), str(reply["uuid"])
        return None

    def check(self) -> None:
        """Restart helpers that died (each at most ``_RESTARTS`` times), so that engines keep finding them; one
        that dies again after that is reported once (:meth:`_give_up`), not dropped in silence."""
        for h in self.helpers:
            if h.proc.poll() is None or h.given_up:
                continue
            if h.restarts >= _RESTARTS:
                self._give_up(h)
                continue
            self.log(f"marlin-pack helpers: GPU {h.device} helper {h.slot} exited with status {h.proc.returncode}; restarting it")
            h.restarts += 1
            _close_pipes(h.proc)
            h.proc = self._spawn(h.args)
            why = self._await_ready(h)
            if why is not None:
                self.log(f"marlin-pack helpers: GPU {h.device} helper {h.slot} did not restart: {why}")

    def _give_up(self, h: ServiceHelper) -> None:
        """Say (a warning, once) that ``h`` died again after its last restart and is left dead: its GPU has a helper fewer."""
        h.given_up = True
        mine = [o for o in self.helpers if o.device == h.device]
        alive = sum(o.proc.poll() is None for o in mine)
        self.log(
            f"marlin-pack helpers: warning: GPU {h.device} helper {h.slot} exited with status {h.proc.returncode} again after "
            f"{h.restarts} restarts; not restarting it: GPU {h.device} is served by {alive} of {len(mine)} helpers "
            "(restart `marlin-pack helpers` to get them all back)"
        )
        _close_pipes(h.proc)

    def wait(self, poll_s: float = 2.0) -> None:
        """Serve until SIGINT or SIGTERM, restarting helpers that die."""
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop.wait(poll_s):
                self.check()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every helper (each unlinks its socket as it exits)."""
        for h in self.helpers:
            if h.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    h.proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        for h in self.helpers:
            try:
                h.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()
            if h.socket is not None and h.proc.returncode != 0:
                with contextlib.suppress(OSError):
                    h.socket.unlink()
            _close_pipes(h.proc)


def _close_pipes(proc: subprocess.Popen[str]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
