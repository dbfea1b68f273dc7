"""Copy helper processes that copy file windows into this process's GPU memory (the ``processes`` io mode).

Page-locking page-cache pages in place (``cudaHostRegister``) is what limits an in-process registered copy,
and part of that limit is per process: on an H200 host one process plateaus at ~21-24 GB/s, four processes
of four threads reach ~32 GB/s together. :class:`HelperPool` starts a few torch-free helpers
(:mod:`.helper_main`: ``python -S`` and ``ctypes`` on the CUDA driver, ready in ~0.25 s, started while vLLM
builds the model), hands each a contiguous share of the windows with CUDA IPC handles of the destination
allocations, and waits for them. They talk to this process over their stdin/stdout pipes only
(:mod:`.helper_protocol`), so they serve no one else.

:meth:`HelperPool.retain` page-locks a bundle's files in the helpers ahead of the copy (an engine's preload):
each window is then given to the helper holding it, which copies it without page-locking.

Nothing here is needed for correctness: a helper that cannot start (no ``libcuda``, memory allocated by a
VMM allocator that has no IPC handle, a sandbox) or fails mid-job only costs speed, because
:meth:`HelperPool.copy` returns the windows it did not finish and the caller reads those itself. A window
copied twice holds the same bytes.

Torch, never vLLM.
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from marlin_pack.gpu.helper_protocol import HELPER_ENV, PAGE, LineReader, read_reply, retain_shares
from marlin_pack.gpu.plan import HELPER_CONTEXT_BYTES

__all__ = [
    "DEFAULT_PROCESSES", "HELPER_CONTEXT_BYTES", "HelperPool", "exit_in_background", "exits_in_background",
    "shares_by_affinity", "split_by_bytes",
]

logger = logging.getLogger("vllm.marlin_pack")

_HELPER = Path(__file__).with_name("helper_main.py")
_READY_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 10.0  # a helper closing its IPC mappings and unregistering its retained pages
# Helpers when the caller does not say (4 processes x 4 threads measured best on a 16-core H200 host).
DEFAULT_PROCESSES = 4


class WindowLike(Protocol):
    lo: int
    hi: int
    pieces: list[tuple[int, int, torch.Tensor]]


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


def shares_by_affinity(
    windows: Sequence[WindowLike],
    files: Sequence[str],
    held: Sequence[Mapping[str, Iterable[tuple[int, int]]]],
    helpers: int,
) -> list[list[WindowLike]]:
    """Each helper's windows (the k-th list for the k-th helper; some may be empty; ``files[i]`` is the file of
    ``windows[i]``). A window that a helper holds registered (``held[k]``: file -> page ranges it retained) goes
    to that helper, which copies it without page-locking; the others go in contiguous runs, the helpers holding
    least topped up first, towards equal bytes. Without anything held this is :func:`split_by_bytes`.
    """
    owner: list[int | None] = []
    for w, file in zip(windows, files, strict=True):
        lo, hi = w.lo - w.lo % PAGE, -(-w.hi // PAGE) * PAGE
        owner.append(next((k for k, h in enumerate(held) if any(a <= lo and hi <= b for a, b in h.get(file, ()))), None))
    if all(k is None for k in owner):
        return split_by_bytes(windows, helpers)
    position = {id(w): i for i, w in enumerate(windows)}
    size = {id(w): sum(n for _, n, _ in w.pieces) for w in windows}
    target = sum(size.values()) / helpers  # what each helper should end with
    runs = [[w for w, k in zip(windows, owner, strict=True) if k == j] for j in range(helpers)]
    rest = [w for w, k in zip(windows, owner, strict=True) if k is None]
    loads = [sum(size[id(w)] for w in run) for run in runs]
    wants = [max(0.0, target - load) for load in loads]
    scale = min(1.0, sum(size[id(w)] for w in rest) / sum(wants)) if sum(wants) > 0 else 0.0
    i = 0
    for j in sorted(range(helpers), key=lambda j: loads[j]):  # the least loaded topped up first, from the front
        got = 0
        while i < len(rest) and got + size[id(rest[i])] / 2 <= wants[j] * scale:
            runs[j].append(rest[i])
            got += size[id(rest[i])]
            i += 1
        loads[j] += got
    if i < len(rest):
        runs[min(range(helpers), key=lambda j: loads[j])].extend(rest[i:])
    for run in runs:
        run.sort(key=lambda w: position[id(w)])  # file order: each reads on sequentially
    return runs


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

    def ipc_handle(self, base: int) -> str:
        handle = (ctypes.c_char * 64)()
        err = self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(base))
        if err != 0:
            raise RuntimeError(f"cuIpcGetMemHandle failed with CUDA error {err} (memory from a VMM allocator?)")
        return bytes(handle).hex()


class _Helper:
    """One helper as the pool sees it: a child process on pipes, which exits at the end of its input."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self.reader = LineReader(proc.stdout.fileno())  # proc.stdout itself is never read: its buffer would hide lines
        self.held: dict[str, set[tuple[int, int]]] = {}  # file -> the page ranges it retained for this pool

    def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, deadline: float | None) -> dict:
        return read_reply(self.reader, deadline, self.gone_why)

    def end_input(self) -> None:
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
        try:
            return f"exited with status {self.proc.wait(timeout=5)}"
        except subprocess.TimeoutExpired:
            return "closed its output"


class HelperPool:
    """``count`` helper processes (0 or None: :data:`DEFAULT_PROCESSES`) for the CUDA device ``device_index``,
    started now (on a thread), ready later.

    ``defer_unregister``: a job's windows stay page-locked until the helper has answered (see
    :mod:`.helper_main`); ``script``: the helper to run; ``env``: added to the helpers' environment.

    :attr:`failures` says what went wrong (each also logged); :attr:`ready_after` the seconds from the pool's
    start until it found its helpers ready; :attr:`retained_bytes` what :meth:`retain` page-locked (None: never
    called).

    Example:
        >>> with HelperPool(4, torch.cuda.current_device()) as pool:
        ...     pool.retain(files, window=256 << 20)            # optional: page-locked ahead
        ...     left = pool.copy(path, windows, threads=4)      # windows the helpers did not copy
        ...     pool.let_go()                                   # nothing of ours held; helpers alive until close
    """

    def __init__(
        self,
        count: int = DEFAULT_PROCESSES,
        device_index: int = 0,
        *,
        defer_unregister: bool = False,
        script: Path = _HELPER,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.device_index = device_index
        self._args = [str(device_index), *(["--defer-unregister"] if defer_unregister else [])]
        self._env = {**os.environ, **HELPER_ENV, **(env or {})}  # CUDA_* settings for the helpers only
        self._procs: list[_Helper] = []
        self._reapers: list[threading.Thread] = []
        self._closed = False
        self._let_go = False
        self._ready: list[bool] | None = None
        self._driver: _CudaDriver | None = None
        self._handles: dict[int, str] = {}  # allocation base -> IPC handle
        self._one_job = threading.Lock()  # a request per helper at a time: callers on two threads take turns
        self._ready_lock = threading.Lock()
        self.failures: list[str] = []
        self._started = time.perf_counter()
        self.ready_after: float | None = None
        self.retained_bytes: int | None = None
        # Started from a thread: the caller (vLLM building the model) goes on meanwhile.
        count = max(1, count or DEFAULT_PROCESSES)
        self._spawner = threading.Thread(target=self._spawn, args=(count, script), name="marlin-pack-helpers", daemon=True)
        self._spawner.start()

    def _spawn(self, count: int, script: Path) -> None:
        for _ in range(count):
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-S", str(script), *self._args],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, env=self._env,
                )
            except OSError as e:
                self.failures.append(f"could not start a helper: {e}")
                break
            self._procs.append(_Helper(proc))

    def __enter__(self) -> HelperPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ready(self) -> int:
        """Wait until every helper has started (or failed to); the number ready."""
        return len(self._wait_ready())

    def _wait_ready(self) -> list[_Helper]:
        """The helpers that said they are ready (each gets ``_READY_TIMEOUT_S`` from now at most)."""
        with self._ready_lock:  # ready() on one thread, a copy on another: each ready line is read once
            if self._closed:
                return []
            if self._ready is None:
                self._spawner.join()
                deadline = time.monotonic() + _READY_TIMEOUT_S
                ready = []
                for p in self._procs:
                    reply = p.read(deadline)
                    ok = reply.get("ready") is True
                    if not ok:
                        self.failures.append(f"a helper did not start: {reply.get('error', 'no answer')}")
                        p.kill()
                    ready.append(ok)
                self._ready = ready
                self.ready_after = time.perf_counter() - self._started
            return [p for p, ok in zip(self._procs, self._ready, strict=True) if ok]

    def _handle(self, ptr: int) -> tuple[str, int]:
        """The IPC handle of the allocation holding device pointer ``ptr``, and ``ptr``'s offset in it."""
        if self._driver is None:
            self._driver = _CudaDriver()
        base = self._driver.allocation(ptr)
        handle = self._handles.get(base)
        if handle is None:
            handle = self._handles[base] = self._driver.ipc_handle(base)
        return handle, ptr - base

    def _warn(self, known: int, what: str) -> None:
        """Log the latest failure when there are more than ``known``."""
        if len(self.failures) > known:
            logger.warning("marlin-pack: copy helpers: %s; %s", self.failures[-1], what)

    def retain(self, files: Sequence[str | Path], window: int) -> int:
        """Page-lock every file of ``files`` whole in the helpers (in blocks at multiples of ``window`` bytes, see
        :func:`.helper_protocol.retain_shares`), one contiguous share of about equal bytes per helper, and keep
        them so until :meth:`let_go`; a later window inside a block goes to the helper holding it.

        Blocks until the helpers have answered; returns the bytes retained. Never raises: a file that is not
        there or a helper that fails is recorded in :attr:`failures` (and logged), and what was retained counts.
        """
        with self._one_job:
            known = len(self.failures)
            done = 0
            helpers = [] if self._let_go else self._wait_ready()
            sizes = []
            for f in files if helpers else ():
                try:
                    real = os.path.realpath(f)
                    size = os.stat(real).st_size
                except OSError as e:
                    self.failures.append(f"cannot retain {f}: {e.strerror or e}")
                    continue
                if size:
                    sizes.append((real, size))
            sent = []
            for p, line in zip(helpers, retain_shares(sizes, window, len(helpers)), strict=False):
                try:
                    p.send({"retain": line})
                    sent.append((p, line))
                except OSError as e:
                    self.failures.append(f"a helper stopped: {e}")
            for p, line in sent:
                reply = p.read(None)
                if type(reply.get("ok")) is not int:  # what it did retain is not counted as held: copied the usual way
                    self.failures.append(f"a helper did not retain its share: {reply.get('error')}")
                    continue
                done += reply["ok"]
                for part in line:  # as the helper registered them: widened to whole pages
                    p.held.setdefault(part["file"], set()).update((lo - lo % PAGE, -(-hi // PAGE) * PAGE) for lo, hi in part["ranges"])
            self.retained_bytes = (self.retained_bytes or 0) + done
            self._warn(known, "what they did not page-lock is page-locked as it is copied")
            return done

    def copy(self, path: str | Path, windows: Sequence[WindowLike], threads: int) -> list[WindowLike]:
        """Copy ``windows`` of the file ``path`` into their CUDA destinations with the helpers (``threads`` each).

        Returns the windows not known to be copied (all of them when no helper is usable, or after
        :meth:`let_go` or :meth:`close`), for the caller to read itself. The destinations' pending work on the
        current stream is waited for first: the helpers write from other processes, outside its order.
        Calls from several threads run one after the other.
        """
        with self._one_job:
            return self._copy([(path, windows)], threads)[0]

    def copy_files(self, parts: Sequence[tuple[str | Path, Sequence[WindowLike]]], threads: int) -> list[list[WindowLike]]:
        """:meth:`copy` of several files at once: each helper gets one job holding its share of all of them.

        The shares are cut from the files' windows in the order given, so no helper waits at the end of one
        file for the others to finish theirs, and deferred unregistering runs once, after every file.
        Returns, per part, the windows not known to be copied.
        """
        with self._one_job:
            return self._copy(parts, threads)

    def _copy(self, parts: Sequence[tuple[str | Path, Sequence[WindowLike]]], threads: int) -> list[list[WindowLike]]:
        everything = [w for _, windows in parts for w in windows]
        part_of = {id(w): k for k, (_, windows) in enumerate(parts) for w in windows}
        lefts: list[list[WindowLike]] = [[] for _ in parts]

        def leave(windows: Sequence[WindowLike]) -> list[list[WindowLike]]:
            for w in windows:
                lefts[part_of[id(w)]].append(w)
            return [sorted(left, key=lambda w: w.lo) for left in lefts]

        helpers = [] if self._let_go else self._wait_ready()
        if not helpers or not everything:
            if everything and self.failures and not self._let_go and not self._closed:
                logger.warning("marlin-pack: no copy helper started (%s); this process reads the bundle itself", self.failures[-1])
            return leave(everything)
        files = [os.path.realpath(path) for path, _ in parts]  # as retain named them
        runs = shares_by_affinity(everything, [files[part_of[id(w)]] for w in everything], [p.held for p in helpers],  # type: ignore[misc]
                                  len(helpers))
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
                jobs.append((run, [{"file": files[k], "windows": ws} for k, ws in encoded.items()]))
        except Exception as e:  # noqa: BLE001 - no driver, no IPC handle (VMM memory): the caller reads everything
            self.failures.append(f"{type(e).__name__}: {e}")
            logger.warning("marlin-pack: copy helpers not usable (%s); this process reads the bundle itself", self.failures[-1])
            return leave(everything)
        order = list(handles)
        known = len(self.failures)
        left: list[WindowLike] = []
        sent: list[tuple[_Helper, list[WindowLike]]] = []
        for (p, _), (run, encoded_parts) in zip(paired, jobs, strict=True):
            try:
                p.send({"parts": encoded_parts, "handles": order, "threads": threads})
                sent.append((p, run))
            except OSError as e:
                self.failures.append(f"a helper stopped: {e}")
                left.extend(run)
        for p, run in sent:  # every one waited for: they write into the destinations
            reply = p.read(None)
            if "ok" not in reply:
                self.failures.append(f"a helper failed: {reply.get('error')}")
                left.extend(run)
        self._warn(known, "this process reads what they left")
        return leave(left)

    def let_go(self, wait: bool = True) -> None:
        """Have every helper let go of this process: its IPC mappings of our memory closed and its retained pages
        unregistered (``{"end": true}``, answered ``{"closed": true}``). The helpers stay alive, their CUDA
        contexts too, until :meth:`close` (an engine's preload keeps them until vLLM has measured its memory
        again). A helper that does not say so in time is killed: its exit frees what it held.

        ``wait=False`` sends the requests and leaves the answers to a thread (:meth:`join` and :meth:`close`
        wait for it): unregistering a 70B bundle's pages took the helpers 0.2 s, and the copy they did is
        complete already (every job was answered), so nothing of this process needs to wait for it.

        Idempotent; afterwards :meth:`copy` and :meth:`retain` leave everything to the caller.
        """
        with self._one_job:
            if self._let_go:
                return
            self._let_go = True
            with self._ready_lock:
                used = self._ready is not None
            if not used:
                return  # no request was ever sent: they hold nothing of ours
            known = len(self.failures)
            helpers = self._wait_ready()
            sent = []
            for p in helpers:
                p.held.clear()
                try:
                    p.send({"end": True})
                    sent.append(p)
                except OSError as e:
                    self.failures.append(f"a helper stopped: {e}")
        if wait:
            self._await_closed(sent, known)
            return
        waiter = threading.Thread(target=self._await_closed, args=(sent, known), name="marlin-pack-helpers-let-go", daemon=True)
        waiter.start()
        self._reapers.append(waiter)

    def _await_closed(self, sent: list[_Helper], known: int) -> None:
        """Read each helper's ``{"closed": true}`` under one deadline; kill one that does not say it."""
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for p in sent:
            reply = p.read(deadline)
            if reply.get("closed") is not True:
                self.failures.append(f"a helper did not let go: {reply.get('error', reply)}")
                p.kill()
        self._warn(known, "ended it")

    def close(self, wait: bool = True) -> None:
        """End the helpers: each exits (closing its IPC mappings, its retained pages and its CUDA context) when
        its input ends.

        ``wait=False`` returns at once and a thread reaps them (:meth:`join` waits for it): tearing a CUDA
        context down takes a while, and the loader has other work meanwhile. After ``close`` the pool copies
        nothing: :meth:`copy` leaves every window to the caller.
        """
        self._spawner.join()
        self.join()  # a let go still reading its answers (let_go(wait=False)) reads them before the input ends
        self._closed = True
        procs, self._procs = self._procs, []
        for p in procs:
            p.end_input()
        if wait:
            _reap(procs)
            self.join()
        elif procs:
            reaper = threading.Thread(target=_reap, args=(procs,), name="marlin-pack-helpers-reap", daemon=True)
            reaper.start()
            self._reapers.append(reaper)

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) for helpers ended by ``close(wait=False)`` to have exited, and for the
        answers of a ``let_go(wait=False)``.

        Their CUDA contexts hold GPU memory until then; vLLM measures the memory left for its KV cache right
        after loading, so the loader joins before it returns.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for reaper in self._reapers:
            reaper.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._reapers = [r for r in self._reapers if r.is_alive()]


def _reap(procs: list[_Helper]) -> None:
    for p in procs:
        p.wait_gone()


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
