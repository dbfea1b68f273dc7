"""Helper processes that copy file windows into this process's GPU memory (the ``processes`` io mode).

Page-locking page-cache pages in place (``cudaHostRegister``) is what limits the ``registered``
reader, and part of that limit is per process: on an H200 host one process plateaus at ~21-24 GB/s
(16 threads), four processes of four threads reach ~32 GB/s together
(``benchmarks/bench_h2d_procs.py``), and 36-37 GB/s with the caller copying a share too
(``benchmarks/bench_h2d.py``, ``processes/4``). :class:`HelperPool` starts a few torch-free helpers
(:mod:`.copy_helper_main`: ``python -S`` and ``ctypes`` on the CUDA driver, ready in ~0.25 s,
started while vLLM builds the model), hands each a contiguous share of the windows with CUDA IPC
handles of the destination allocations, and waits for them. The calling process may take a share
too (``own``), copying it while the helpers copy theirs.

Where ``marlin-pack helpers`` runs for the device (:mod:`.helper_service`), the pool takes its helpers
instead of starting its own: they are ready at once, and the engine does not wait for them to exit.

Nothing here is needed for correctness: a helper that cannot start (no ``libcuda``, memory
allocated by a VMM allocator that has no IPC handle, a sandbox) or fails mid-job only costs
speed, because :meth:`HelperPool.copy` returns the windows it did not finish and the caller
reads those itself. A window copied twice holds the same bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from marlin_pack.vllm_plugin.copy_helper_main import HELPER_ENV, PROTOCOL, LineReader
from marlin_pack.vllm_plugin.helper_service import ServiceSession, find_sockets, gpu_uuid, read_reply

_PAGE = os.sysconf("SC_PAGE_SIZE")

__all__ = ["HelperPool", "split_by_bytes"]

logger = logging.getLogger("vllm.marlin_pack")

_HELPER = Path(__file__).with_name("copy_helper_main.py")
_READY_TIMEOUT_S = 30.0
_SERVICE_READY_TIMEOUT_S = 2.0  # service helpers answer at once; a slower one is left out
# Helpers when the caller does not say (bench_h2d_procs: 4 processes x 4 threads measured best).
DEFAULT_PROCESSES = 4


class WindowLike(Protocol):
    lo: int
    hi: int
    pieces: list[tuple[int, int, torch.Tensor]]


def shares_by_affinity(
    windows: Sequence[WindowLike],
    files: Sequence[str],
    held: Sequence[dict[str, list[tuple[int, int]]]],
    helpers: int,
    own: bool,
) -> tuple[list[list[WindowLike]], list[WindowLike]]:
    """Each helper's windows (the k-th list for the k-th helper; some may be empty), and the caller's (with
    ``own``): a window that a service helper holds registered
    (``held[k]``: file -> page ranges, see ``--retain-mib``) goes to that helper, which copies it without
    page-locking; the others go in contiguous runs, the caller taking the tail and the helpers holding
    least topped up first, towards equal bytes. Without anything held this is :func:`split_by_bytes`.
    """
    owner: list[int | None] = []
    for w, file in zip(windows, files, strict=True):
        lo, hi = w.lo - w.lo % _PAGE, -(-w.hi // _PAGE) * _PAGE
        owner.append(next((k for k, h in enumerate(held) if any(a <= lo and hi <= b for a, b in h.get(file, ()))), None))
    if all(k is None for k in owner):
        runs = split_by_bytes(windows, helpers + own)
        return runs, (runs.pop() if own else [])
    position = {id(w): i for i, w in enumerate(windows)}
    size = {id(w): sum(n for _, n, _ in w.pieces) for w in windows}
    target = sum(size.values()) / (helpers + own)  # what each copier should end with
    runs = [[w for w, k in zip(windows, owner, strict=True) if k == j] for j in range(helpers)]
    rest = [w for w, k in zip(windows, owner, strict=True) if k is None]
    loads = [sum(size[id(w)] for w in run) for run in runs]
    wants = [max(0.0, target - load) for load in loads] + ([target] if own else [])
    scale = min(1.0, sum(size[id(w)] for w in rest) / sum(wants)) if sum(wants) > 0 else 0.0
    i = 0
    for j in sorted(range(helpers), key=lambda j: loads[j]):  # the least loaded topped up first, from the front
        got = 0
        while i < len(rest) and got + size[id(rest[i])] / 2 <= wants[j] * scale:
            runs[j].append(rest[i])
            got += size[id(rest[i])]
            i += 1
        loads[j] += got
    mine = rest[i:] if own else []  # the caller: the tail, as without anything held
    if not own and i < len(rest):
        runs[min(range(helpers), key=lambda j: loads[j])].extend(rest[i:])
    for run in runs:
        run.sort(key=lambda w: position[id(w)])  # file order: each reads on sequentially
    return runs, mine


def split_by_bytes(windows: Sequence[WindowLike], parts: int) -> list[list[WindowLike]]:
    """``windows`` (in file order) cut into at most ``parts`` contiguous runs of about equal bytes.

    Contiguous, so each helper reads its share of the file sequentially (the kernel's read-ahead
    of a cold file works per stream of reads).
    """
    sizes = [sum(n for _, n, _ in w.pieces) for w in windows]
    total = sum(sizes)
    runs: list[list[WindowLike]] = [[]]
    done = 0
    for w, n in zip(windows, sizes, strict=True):
        # Start the next run once this one holds its share (the share measured from the start, so rounding does not drift).
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(w)
        done += n
    return [r for r in runs if r]


class _CudaDriver:
    """The parent's two driver calls: a device pointer's allocation and its IPC handle."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def allocation(self, ptr: int) -> int:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        err = self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if err != 0:
            raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {err}")
        return base.value

    def uuid(self, ordinal: int) -> str:
        """The UUID of the device ``ordinal`` as the service helpers name their sockets."""
        return gpu_uuid(ordinal, self.lib)

    def ipc_handle(self, base: int) -> str:
        handle = (ctypes.c_char * 64)()
        err = self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(base))
        if err != 0:
            raise RuntimeError(f"cuIpcGetMemHandle failed with CUDA error {err} (memory from a VMM allocator?)")
        return bytes(handle).hex()


class _Channel:
    """One helper as the pool sees it: lines of JSON both ways. :class:`_OwnHelper` or a service's
    :class:`.helper_service.ServiceSession` (the same methods)."""

    reader: LineReader  # its lines, each read whole under one deadline (helper_service.read_reply)

    def send(self, obj: dict) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """No more jobs."""
        raise NotImplementedError

    def wait_gone(self) -> None:
        """After :meth:`end`: wait until the helper holds nothing of this process (its IPC mappings closed)."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def gone_why(self) -> str:
        """Why its output ended."""
        raise NotImplementedError


class _OwnHelper(_Channel):
    """A helper this pool started: a child process on pipes, which exits at the end of its input."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self.reader = LineReader(proc.stdout.fileno())  # proc.stdout itself is never read: its buffer would hide lines

    def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def wait_gone(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.kill()

    def gone_why(self) -> str:
        return f"exited with status {self.proc.wait()}"


class HelperPool:
    """``count`` (default :data:`DEFAULT_PROCESSES`) helper processes for the CUDA device ``device_index``,
    started now, ready later; or, with ``service`` (the default) and ``marlin-pack helpers`` serving
    the device, that service's helpers (``source`` says which), ready already, whatever ``count``.

    ``staged``: staging threads per helper beside its registered ones (two pinned buffers of
    ``stage_mib`` MiB each, allocated as the helper starts); ``defer_unregister``: windows stay
    page-locked until the helper has answered; ``nice``: added to the helpers' niceness (see
    :mod:`.copy_helper_main`); ``service_dir``: where to look for the service's sockets (default
    :func:`.helper_service.socket_dir`; a daemon's or an engine's own service started early, :mod:`.preload`),
    or a callable giving it (or None), called on the pool's starting thread: the caller goes on meanwhile.

    Example:
        >>> with HelperPool(4, torch.cuda.current_device()) as pool:
        ...     left = pool.copy(path, windows, threads=4)   # windows the helpers did not copy
    """

    def __init__(
        self,
        count: int | None,
        device_index: int,
        script: Path = _HELPER,
        env: Mapping[str, str] | None = None,
        *,
        staged: int = 0,
        stage_mib: int = 64,
        defer_unregister: bool = False,
        nice: int = 0,
        service: bool = True,
        service_dir: Path | Callable[[], Path | None] | None = None,
    ) -> None:
        self.device_index = device_index
        self._service_dir = service_dir  # where the service's sockets are (None: helper_service.socket_dir())
        self._args = [str(device_index), *(["--staged", str(staged), "--stage-mib", str(stage_mib)] if staged else []),
                      *(["--defer-unregister"] if defer_unregister else []), *(["--nice", str(nice)] if nice else [])]
        self._env = {**os.environ, **HELPER_ENV, **(env or {})}  # CUDA_* settings for the helpers only
        self._procs: list[_Channel] = []
        self.source = "own"  # or "service": helpers of marlin-pack helpers (their settings are the service's)
        self._reapers: list[threading.Thread] = []
        self._closed = False
        self._ready: list[bool] | None = None
        self._driver: _CudaDriver | None = None
        self._handles: dict[int, str] = {}  # allocation base -> IPC handle
        self._one_job = threading.Lock()  # a job per helper at a time: callers on two threads take turns
        self.failures: list[str] = []
        self._started = time.perf_counter()
        self.ready_after: float | None = None  # seconds from the pool's start until the first job found its helpers ready
        self.retained_bytes: int | None = None  # service helpers that retain pages: what they held registered as they were taken
        self._held: list[dict[str, list[tuple[int, int]]]] = []  # per service helper taken: file -> its retained page ranges
        # Started from a thread: the caller (vLLM building the model) goes on meanwhile.
        count = max(1, count or DEFAULT_PROCESSES)
        self._spawner = threading.Thread(target=self._start, args=(count, script, service), name="marlin-pack-helpers", daemon=True)
        self._spawner.start()

    def _start(self, count: int, script: Path, service: bool) -> None:
        if service:
            if callable(self._service_dir):  # e.g. waits for a page-locking still under way (preload), beside the caller's work
                self._service_dir = self._service_dir()
            self._procs = self._from_service()
            if self._procs:
                self.source = "service"
                return
        self._spawn(count, script)

    def _from_service(self) -> list[_Channel]:
        """The service helpers of this device that answer ready (none without a service).

        What keeps one out (a stale socket, a busy or older helper) is logged, not counted among
        :attr:`failures`: the pool then starts helpers of its own.
        """
        try:
            sockets = find_sockets(_CudaDriver().uuid(self.device_index), self._service_dir)
        except Exception:  # noqa: BLE001 - no driver here: no service either
            return []
        usable: list[_Channel] = []
        deadline = time.monotonic() + _SERVICE_READY_TIMEOUT_S
        for path in sockets:
            try:
                helper = ServiceSession(path)
            except OSError as e:  # a stale socket (its service died), or another user's helper
                logger.warning("marlin-pack: not using the service helper at %s: %s", path, e)
                continue
            state = helper.hello(deadline)
            if state == "ready":
                usable.append(helper)  # type: ignore[arg-type]  # a _Channel by its methods
                if helper.retained_bytes is not None:
                    self.retained_bytes = (self.retained_bytes or 0) + helper.retained_bytes
                self._held.append(helper.retained)
                continue
            why = f"{state}, expected {PROTOCOL}: restart `marlin-pack helpers`" if state.startswith("protocol ") else state
            logger.warning("marlin-pack: not using the service helper at %s: %s", path, why)
            helper.kill()
        return usable

    def _spawn(self, count: int, script: Path) -> None:
        for _ in range(count):
            try:
                self._procs.append(_OwnHelper(
                    subprocess.Popen(
                        [sys.executable, "-S", str(script), *self._args],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                        bufsize=1,
                        env=self._env,
                    )
                ))
            except OSError as e:
                self.failures.append(f"could not start a helper: {e}")
                break

    def __enter__(self) -> HelperPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ready(self) -> int:
        """Wait until every helper has started (or failed to); the number ready."""
        return len(self._wait_ready())

    def _wait_ready(self) -> list[_Channel]:
        """The helpers that said they are ready (each gets ``_READY_TIMEOUT_S`` from now at most)."""
        if self._closed:
            return []
        if self._ready is None:
            self._spawner.join()
            deadline = time.monotonic() + _READY_TIMEOUT_S
            self._ready = []
            for p in self._procs:
                if self.source == "service":  # answered ready as they were connected to
                    self._ready.append(True)
                    continue
                reply = self._read(p, deadline)
                ok = reply.get("ready") is True
                if not ok:
                    self.failures.append(f"a helper did not start: {reply.get('error', 'no answer')}")
                    p.kill()
                self._ready.append(ok)
            self.ready_after = time.perf_counter() - self._started
        return [p for p, ok in zip(self._procs, self._ready, strict=True) if ok]

    @staticmethod
    def _read(p: _Channel, deadline: float | None) -> dict:
        return read_reply(p.reader, deadline, p.gone_why)

    def _handle(self, ptr: int) -> tuple[str, int]:
        """The IPC handle of the allocation holding device pointer ``ptr``, and ``ptr``'s offset in it."""
        if self._driver is None:
            self._driver = _CudaDriver()
        base = self._driver.allocation(ptr)
        handle = self._handles.get(base)
        if handle is None:
            handle = self._handles[base] = self._driver.ipc_handle(base)
        return handle, ptr - base

    def copy(
        self,
        path: str | Path,
        windows: Sequence[WindowLike],
        threads: int,
        own: Callable[[list[WindowLike]], None] | None = None,
    ) -> list[WindowLike]:
        """Copy ``windows`` of the file ``path`` into their CUDA destinations with the helpers.

        With ``own``, the windows are shared among the helpers *and* the caller: ``own(share)``
        is called with the caller's share once the helpers have theirs, and runs while they copy.

        Returns the windows not known to be copied (all of them when no helper is usable),
        for the caller to read itself. The destinations' pending work on the current stream
        is waited for first: the helpers write from other processes, outside its order.
        Calls from several threads run one after the other.
        """
        with self._one_job:
            return self._copy([(path, windows)], threads, own)[0]

    def copy_files(self, parts: Sequence[tuple[str | Path, Sequence[WindowLike]]], threads: int) -> list[list[WindowLike]]:
        """:meth:`copy` of several files at once: each helper gets one job holding its share of all of them.

        The shares are cut from the files' windows in the order given, so no helper waits at the
        end of one file for the others to finish theirs, and deferred unregistering runs once,
        after every file. Returns, per part, the windows not known to be copied.
        """
        with self._one_job:
            return self._copy(parts, threads, None)

    def _copy(
        self,
        parts: Sequence[tuple[str | Path, Sequence[WindowLike]]],
        threads: int,
        own: Callable[[list[WindowLike]], None] | None,
    ) -> list[list[WindowLike]]:
        everything = [w for _, windows in parts for w in windows]
        part_of = {id(w): k for k, (_, windows) in enumerate(parts) for w in windows}
        lefts: list[list[WindowLike]] = [[] for _ in parts]

        def leave(windows: Sequence[WindowLike]) -> list[list[WindowLike]]:
            for w in windows:
                lefts[part_of[id(w)]].append(w)
            return [sorted(left, key=lambda w: w.lo) for left in lefts]

        helpers = self._wait_ready()
        if not helpers or not everything:
            if everything and self.failures:
                logger.warning("marlin-pack: no copy helper started (%s); this process reads the bundle itself", self.failures[-1])
            return leave(everything)
        held = self._held if self.source == "service" and len(self._held) == len(helpers) else []
        files = [os.path.realpath(path) for path, _ in parts]
        runs, mine = shares_by_affinity(everything, [files[part_of[id(w)]] for w in everything], held, len(helpers),
                                        own is not None)
        try:
            torch.cuda.current_stream(everything[0].pieces[0][2].device).synchronize()
            handles: dict[str, int] = {}
            jobs = []
            paired = [(p, run) for p, run in zip(helpers, runs, strict=False) if run]
            for _, run in paired:
                encoded: dict[int, list] = {}  # part -> its windows in this run
                for w in run:
                    pieces = []
                    for offset, n, dst in w.pieces:
                        handle, dest = self._handle(dst.data_ptr())
                        pieces.append([offset, n, handles.setdefault(handle, len(handles)), dest])
                    encoded.setdefault(part_of[id(w)], []).append([w.lo, w.hi, pieces])
                # The resolved path: a service helper runs elsewhere (its own working directory) and keys its retained files so.
                jobs.append((run, [{"file": files[k], "windows": ws} for k, ws in encoded.items()]))
        except Exception as e:  # noqa: BLE001 - no driver, no IPC handle (VMM memory): the caller reads everything
            self.failures.append(f"{type(e).__name__}: {e}")
            logger.warning("marlin-pack: copy helpers not usable (%s); this process reads the bundle itself", self.failures[-1])
            return leave(everything)
        order = list(handles)
        known = len(self.failures)
        left: list[WindowLike] = []
        sent: list[tuple[_Channel, list[WindowLike]]] = []
        for (p, _), (run, encoded_parts) in zip(paired, jobs, strict=True):
            try:
                # threads 0: the helper's staging threads only (a helper without any still registers on one)
                p.send({"parts": encoded_parts, "handles": order, "threads": threads})
                sent.append((p, run))
            except OSError as e:
                self.failures.append(f"a helper stopped: {e}")
                left.extend(run)
        try:
            if mine:
                own(mine)  # type: ignore[misc]
        finally:
            # Even when our share failed: the helpers are still writing into the destinations.
            for p, run in sent:
                reply = self._read(p, None)
                if "ok" not in reply:
                    self.failures.append(f"a helper failed: {reply.get('error')}")
                    left.extend(run)
        if len(self.failures) > known:
            logger.warning("marlin-pack: copy helpers: %s; this process reads what they left", self.failures[-1])
        return leave(left)

    def close(self, wait: bool = True) -> None:
        """End the helpers: each exits (closing its IPC mappings and CUDA context) when its input ends;
        a service helper closes its mappings of this process's memory and goes on serving.

        ``wait=False`` returns at once and a thread reaps them (:meth:`join` waits for it):
        tearing a CUDA context down takes a while, and the loader has other work meanwhile.
        After ``close`` the pool copies nothing: :meth:`copy` leaves every window to the caller.
        """
        self._spawner.join()
        self._closed = True
        procs, self._procs = self._procs, []
        for p in procs:
            p.end()
        if wait:
            _reap(procs)
            self.join()
        elif procs:
            reaper = threading.Thread(target=_reap, args=(procs,), name="marlin-pack-helpers-reap", daemon=True)
            reaper.start()
            self._reapers.append(reaper)

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) for helpers ended by ``close(wait=False)`` to have exited.

        Their CUDA contexts hold GPU memory until then; vLLM measures the memory left for its
        KV cache right after loading, so the loader joins before it returns.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for reaper in self._reapers:
            reaper.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._reapers = [r for r in self._reapers if r.is_alive()]


# Whether loading may leave its helpers to exit on their own (exit_in_background).
_EXIT_IN_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("marlin_pack_helpers_exit_in_background", default=False)


@contextlib.contextmanager
def exit_in_background() -> Iterator[None]:
    """Within this, a loader ends its copy helpers without waiting for them to exit (:func:`exits_in_background`).

    For vLLM's weight-cache daemon: an engine must wait (vLLM measures the GPU memory left for the
    KV cache right after loading, and the helpers' CUDA contexts hold some until they exit), a
    daemon measures nothing after its fill, and the helpers' exit (tearing down their contexts and,
    with ``io_defer_unregister``, unregistering every window) took 0.09-0.38 s on the H200.
    """
    token = _EXIT_IN_BACKGROUND.set(True)
    try:
        yield
    finally:
        _EXIT_IN_BACKGROUND.reset(token)


def exits_in_background() -> bool:
    """True inside :func:`exit_in_background`."""
    return _EXIT_IN_BACKGROUND.get()


def _reap(procs: list[_Channel]) -> None:
    for p in procs:
        p.wait_gone()
