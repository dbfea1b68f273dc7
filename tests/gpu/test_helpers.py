"""``helpers`` / ``helper_main`` (the ``processes`` io mode) without a GPU: how windows are shared out, that a
helper that cannot start or fails leaves every window to the caller, the pool's requests (stand-in helper
scripts), and the helper's own copies on the host (its CUDA calls faked). Copies on a GPU:
tests/on_gpu/test_reader_gpu.py."""

from __future__ import annotations

import ast
import ctypes
import itertools
import json
import mmap
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helper_fakes import fake_helper

from marlin_pack.gpu import helper_main, helper_protocol, helpers
from marlin_pack.gpu.helpers import (
    DEFAULT_PROCESSES,
    HELPER_CONTEXT_BYTES,
    HelperPool,
    exit_in_background,
    exits_in_background,
    split_by_bytes,
)

PAGE = mmap.PAGESIZE


@dataclass
class _W:
    lo: int
    hi: int
    pieces: list = field(default_factory=list)


def _windows(sizes: list[int]) -> list[_W]:
    out, pos = [], 0
    for n in sizes:
        out.append(_W(pos, pos + n, [(pos, n, torch.empty(0))]))
        pos += n
    return out


@pytest.mark.parametrize("sizes", [[10] * 16, [1, 100, 1, 1, 50, 50, 3], [7], [5, 5], list(range(1, 40))])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_split_by_bytes_is_contiguous_complete_and_balanced(sizes: list[int], parts: int) -> None:
    windows = _windows(sizes)
    runs = split_by_bytes(windows, parts)
    assert [w for r in runs for w in r] == windows  # every window once, in file order
    assert 1 <= len(runs) <= min(parts, len(windows)) and all(runs)
    total, biggest = sum(sizes), max(sizes)
    for r in runs:  # no run holds more than its share plus one window
        assert sum(w.hi - w.lo for w in r) <= total / parts + biggest
    if parts <= len(sizes) and len(set(sizes)) == 1:
        assert len(runs) == parts


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_helper_modules_use_the_standard_library_only() -> None:
    """The helper runs as ``python -S`` (no site packages): importing torch or marlin_pack would fail there.
    It imports its protocol as a sibling then, and as ``marlin_pack.gpu.helper_protocol`` when imported."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert {m.split(".")[0] for m in _imports(Path(helper_protocol.__file__))} <= stdlib
    found = _imports(Path(helper_main.__file__))
    assert {m.split(".")[0] for m in found} - stdlib == {"helper_protocol", "marlin_pack"}
    assert {m for m in found if m.startswith("marlin_pack")} == {"marlin_pack.gpu"}


def test_the_public_constants() -> None:
    assert DEFAULT_PROCESSES == 4 and HELPER_CONTEXT_BYTES == 512 << 20
    assert helper_protocol.PROTOCOL == 2 and helper_protocol.HELPER_ENV == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_helper_without_a_cuda_driver_says_so_in_one_line() -> None:
    """Run as the pool runs it (a script, ``python -S``): its sibling import works, and no driver is one line."""
    if Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() or torch.cuda.is_available():
        pytest.skip("a CUDA driver is installed here")
    r = subprocess.run([sys.executable, "-S", helper_main.__file__, "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "libcuda" in json.loads(lines[0])["error"]


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "helper.py"
    p.write_text(textwrap.dedent(body))
    return p


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('import json; print(json.dumps({"error": "OSError: no libcuda"}), flush=True)', "no libcuda"),
        ("import sys; sys.exit(3)", "exited with status 3"),
        ('print("garbage", flush=True)', "unreadable answer"),
    ],
)
def test_helpers_that_do_not_start_leave_every_window(tmp_path: Path, body: str, why: str) -> None:
    windows = _windows([4096, 8192])
    with HelperPool(2, 0, script=_script(tmp_path, body)) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert len(pool.failures) == 2 and all(why in f for f in pool.failures), pool.failures
        assert pool.retain([tmp_path / "f"], 1 << 20) == 0  # nothing to retain with: never raises
        pool.let_go()


def test_ready_helpers_that_cannot_prepare_the_job_leave_every_window(tmp_path: Path) -> None:
    """No CUDA here: the destinations' IPC handles cannot be made, so nothing is sent."""
    ready = 'import json, sys; print(json.dumps({"ready": True}), flush=True); sys.stdin.read()'
    windows = _windows([4096])
    with HelperPool(1, 0, script=_script(tmp_path, ready)) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert len(pool.failures) == 1
    assert pool._procs == []  # closed: each helper ended when its input did


class _Stream:
    def synchronize(self) -> None:
        pass


# A stand-in helper: says ready, logs each request to helper-PID.log, answers jobs with ANSWER, retain lines
# with the bytes of their ranges, end with closed.
_ANSWERING = """
    import json, os, sys
    print(json.dumps({{"ready": True}}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        with open(os.path.join({logs!r}, f"helper-{{os.getpid()}}.log"), "a") as f:
            f.write(line)
        if request.get("end"):
            print(json.dumps({{"closed": True}}), flush=True)
        elif "retain" in request:
            print(json.dumps({{"ok": sum(hi - lo for part in request["retain"] for lo, hi in part["ranges"])}}), flush=True)
        else:
            print(json.dumps({answer}), flush=True)
"""


def _answering_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, answer: str = '{"ok": 0}') -> HelperPool:
    """Helpers that say ready and answer each job with ``answer`` (a JSON object); the IPC handles faked (no CUDA here)."""
    pool = HelperPool(count, 0, script=_script(tmp_path, _ANSWERING.format(logs=str(tmp_path), answer=answer)))
    monkeypatch.setattr(pool, "_handle", lambda ptr: ("00" * 64, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    return pool


def _requests(tmp_path: Path) -> list[list[dict]]:
    """Each stand-in helper's requests, in order (the helpers sorted by their first request)."""
    logs = [[json.loads(line) for line in p.read_text().splitlines()] for p in tmp_path.glob("helper-*.log")]
    return sorted(logs, key=json.dumps)


def _sent_files(tmp_path: Path) -> list[list[list]]:
    """Each job the helpers were sent: its windows as ``[file name, window start]``."""
    jobs = [r for log in _requests(tmp_path) for r in log if "parts" in r]
    return sorted([[Path(part["file"]).name, w[0]] for part in job["parts"] for w in part["windows"]] for job in jobs)


def _sent(tmp_path: Path) -> list[list[int]]:
    return [[lo for _, lo in job] for job in _sent_files(tmp_path)]


def test_each_helper_gets_a_contiguous_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 9)
    with _answering_pool(tmp_path, monkeypatch, 3) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == []
        assert pool.failures == []
    assert _sent(tmp_path) == [[0, 10, 20], [30, 40, 50], [60, 70, 80]]


def test_a_failed_helper_leaves_its_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 4)
    with _answering_pool(tmp_path, monkeypatch, 1, '{"error": "RuntimeError: injected"}') as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert "injected" in pool.failures[0]


def test_copy_files_gives_each_helper_one_job_cut_across_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank file and the common tensors: the shares are cut from both files' windows in order, so a
    helper's one job may hold the end of one file and the start of the next."""
    rank, common = _windows([10] * 6), _windows([10] * 2)
    with _answering_pool(tmp_path, monkeypatch, 2) as pool:
        assert pool.copy_files([(tmp_path / "rank", rank), (tmp_path / "common", common)], threads=1) == [[], []]
        assert pool.failures == []
    assert _sent_files(tmp_path) == [
        [["rank", 0], ["rank", 10], ["rank", 20], ["rank", 30]],
        [["rank", 40], ["rank", 50], ["common", 0], ["common", 10]],
    ]


def test_copy_files_hands_a_failed_helpers_windows_back_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rank, common = _windows([10] * 3), _windows([10] * 3)
    with _answering_pool(tmp_path, monkeypatch, 1, '{"error": "RuntimeError: injected"}') as pool:
        assert pool.copy_files([(tmp_path / "rank", rank), (tmp_path / "common", common)], threads=1) == [rank, common]
        assert "injected" in pool.failures[0]
    pool = _answering_pool(tmp_path, monkeypatch, 1)
    pool.close()
    assert pool.copy_files([(tmp_path / "rank", rank), (tmp_path / "common", common)], threads=1) == [rank, common]


def test_a_closed_pool_leaves_every_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 4)
    pool = _answering_pool(tmp_path, monkeypatch, 2)
    assert pool.ready() == 2
    pool.close(wait=False)
    pool.join()
    assert pool.copy(tmp_path / "f", windows, threads=1) == windows
    assert _sent(tmp_path) == []


def test_let_go_ends_every_helper_once_and_leaves_them_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 4)
    with _answering_pool(tmp_path, monkeypatch, 2) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == []
        pool.let_go()
        pool.let_go()  # idempotent
        assert [log[-1] for log in _requests(tmp_path)] == [{"end": True}] * 2
        assert all(p.proc.poll() is None for p in pool._procs)  # alive, their contexts too, until close
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows  # after it: everything left
        assert pool.retain([tmp_path / "f"], 1 << 20) == 0 and pool.failures == []
        procs = list(pool._procs)
    assert [p.proc.returncode for p in procs] == [0, 0]
    assert sum(len(log) for log in _requests(tmp_path)) == 4  # one job and one end each


def test_let_go_before_any_request_sends_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _answering_pool(tmp_path, monkeypatch, 2) as pool:
        pool.let_go()  # the helpers never held anything of ours: not waited for either
        windows = _windows([10])
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
    assert _requests(tmp_path) == []


def test_retain_cuts_the_files_into_one_share_per_helper_and_windows_follow_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retain lines of contiguous blocks at multiples of the window, one share per helper; a window inside a
    block then goes to its helper, whatever the even split would have given it."""
    rank, common = tmp_path / "rank", tmp_path / "common"
    rank.write_bytes(bytes(6 * PAGE))
    common.write_bytes(bytes(2 * PAGE + 10))
    with _answering_pool(tmp_path, monkeypatch, 2) as pool:
        assert pool.retain([rank, common, tmp_path / "missing"], 2 * PAGE) == 8 * PAGE + 10
        assert pool.retained_bytes == 8 * PAGE + 10
        assert len(pool.failures) == 1 and "cannot retain" in pool.failures[0] and "missing" in pool.failures[0]
        retains = sorted(([r["retain"] for r in log if "retain" in r] for log in _requests(tmp_path)), key=json.dumps)
        assert retains == [  # blocks of 2 pages; the rank file's three blocks are as much as half of the bytes
            [[{"file": str(common), "ranges": [[0, 2 * PAGE], [2 * PAGE, 2 * PAGE + 10]]}]],
            [[{"file": str(rank), "ranges": [[0, 2 * PAGE], [2 * PAGE, 4 * PAGE], [4 * PAGE, 6 * PAGE]]}]],
        ]
        # One window per page of rank, one per block of common: each goes to the helper holding it (an even
        # split by bytes would have cut rank in two).
        rank_windows = [_W(lo, lo + PAGE, [(lo, PAGE, torch.empty(0))]) for lo in range(0, 6 * PAGE, PAGE)]
        common_windows = [_W(0, 2 * PAGE, [(0, 2 * PAGE, torch.empty(0))]), _W(2 * PAGE, 2 * PAGE + 10, [(2 * PAGE, 10, torch.empty(0))])]
        assert pool.copy_files([(rank, rank_windows), (common, common_windows)], threads=1) == [[], []]
    assert _sent_files(tmp_path) == [[["common", 0], ["common", 2 * PAGE]], [["rank", lo] for lo in range(0, 6 * PAGE, PAGE)]]


def test_retain_of_a_failing_helper_is_recorded_and_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = """
        import json, sys
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"error": "CudaError: cuMemHostRegister failed with CUDA error 2"}), flush=True)
    """
    f = tmp_path / "f"
    f.write_bytes(bytes(PAGE))
    with HelperPool(1, 0, script=_script(tmp_path, body)) as pool:
        assert pool.retain([f], PAGE) == 0
        assert pool.retained_bytes == 0
        assert pool.failures == ["a helper did not retain its share: CudaError: cuMemHostRegister failed with CUDA error 2"]


@pytest.mark.parametrize(("argv", "want"), [(["0"], helper_main.Settings(0)),
                                            (["3", "--defer-unregister"], helper_main.Settings(3, defer_unregister=True))])
def test_helper_settings_from_its_command_line(argv: list[str], want: object) -> None:
    assert helper_main.Settings.parse(argv) == want


@pytest.mark.parametrize("argv", [["0", "--staged", "2"], ["0", "--fast"], ["x"], ["0", "--nice", "5"], ["0", "--listen", "/d"]])
def test_helper_refuses_an_unknown_command_line(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        helper_main.Settings.parse(argv)


def test_pool_passes_its_settings_and_environment_to_every_helper(tmp_path: Path) -> None:
    """The helper's options reach its command line, HELPER_ENV and ``env`` its environment (a stand-in
    script echoes them in its error)."""
    script = _script(tmp_path, """
        import json, os, sys
        seen = [*sys.argv[1:], os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["EXTRA"]]
        print(json.dumps({'error': ' '.join(seen)}), flush=True)
    """)
    with HelperPool(2, 5, script=script, defer_unregister=True, env={"EXTRA": "x"}) as pool:
        assert pool.ready() == 0
    assert pool.failures == ["a helper did not start: 5 --defer-unregister 1 x"] * 2
    assert pool.ready_after is not None and pool.ready_after >= 0


def test_exit_in_background() -> None:
    assert not exits_in_background()
    with exit_in_background():
        assert exits_in_background()
    assert not exits_in_background()


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("threads", [3, 0], ids=["threads", "no-threads-asked"])  # 0: still one thread
def test_helper_copies_every_piece_and_unregisters_every_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, defer: bool, threads: int
) -> None:
    """The helper's own logic on the host (its CUDA calls faked): every piece of every window lands at its
    destination offset, whichever thread takes it, and every registered window is unregistered by the end of
    the job, or with ``defer_unregister`` after it (on a thread of its own; a job of the same file first waits
    for that)."""
    data = bytes(range(256)) * 1000  # 256000 bytes: windows end inside pages
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    destination = ctypes.create_string_buffer(len(data) + 100)
    helper = fake_helper(monkeypatch, helper_main.Settings(0, defer_unregister=defer), destination)
    # As the reader cuts them: page-aligned windows of 3 pages (the last one ends inside a page); the
    # pieces are the tensors' parts in each, tensors of odd sizes, each 100 bytes further on in the destination.
    cuts = [0, 1, 8192, 8193 + 4096 * 5, 100_003, 200_000, len(data)]
    step = 3 * PAGE
    windows = []
    for lo in range(0, len(data), step):
        hi = min(lo + step, len(data))
        pieces = [[max(a, lo), min(b, hi) - max(a, lo), 0, max(a, lo) + 100] for a, b in itertools.pairwise(cuts) if a < hi and b > lo]
        windows.append([lo, hi, pieces])
    job = {"parts": [{"file": str(path), "windows": windows}], "handles": ["00" * 64], "threads": threads}
    for _ in range(2):  # the same file twice: with deferral the second waits for the first's unregistering
        ctypes.memset(destination, 0, len(destination))
        assert helper.job(job) == len(data)
        assert destination.raw[100:] == data
        assert bool(helper.cu.registered) is defer  # type: ignore[attr-defined]
        thread = helper.unregister_kept()
        if thread is not None:
            thread.join()
        assert not helper.cu.registered  # type: ignore[attr-defined]
    assert helper.cu.calls.count("cuMemHostRegister") == 2 * len(windows)  # type: ignore[attr-defined]


@pytest.mark.parametrize("defer", [False, True])
def test_helper_job_of_two_files_copies_both_and_releases_their_pages_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, defer: bool
) -> None:
    """One job holding the rank file and the common tensors: the threads take windows of both files; with
    ``defer_unregister`` the pages of both stay registered until the reply, are released together, and a
    next job of one of those files waits for that."""
    first, second = bytes(range(256)) * 40, bytes(reversed(range(256))) * 30  # windows end inside pages
    paths = [tmp_path / "rank.bin", tmp_path / "common.bin"]
    for path, data in zip(paths, (first, second), strict=True):
        path.write_bytes(data)
    destination = ctypes.create_string_buffer(len(first) + len(second))
    helper = fake_helper(monkeypatch, helper_main.Settings(0, defer_unregister=defer), destination)
    step = 2 * PAGE

    def part(path: Path, size: int, at: int) -> dict:
        windows = [[lo, min(lo + step, size), [[lo, min(lo + step, size) - lo, 0, at + lo]]] for lo in range(0, size, step)]
        return {"file": str(path), "windows": windows}

    parts = [part(paths[0], len(first), 0), part(paths[1], len(second), len(first))]
    assert helper.job({"parts": parts, "handles": ["00" * 64], "threads": 2}) == len(first) + len(second)
    assert destination.raw == first + second
    assert bool(helper.cu.registered) is defer  # type: ignore[attr-defined]
    thread = helper.unregister_kept()
    assert (thread is not None) is defer
    if thread is not None:
        assert [names for names, _ in helper.releasing] == [{str(p) for p in paths}]
    ctypes.memset(destination, 0, len(destination))
    assert helper.job({"parts": parts[1:], "handles": ["00" * 64], "threads": 2}) == len(second)
    assert destination.raw[len(first) :] == second
    if thread is not None:
        assert not thread.is_alive()  # the common file's pages were released before they were registered again
    later = helper.unregister_kept()
    if later is not None:
        later.join()
    assert not helper.cu.registered  # type: ignore[attr-defined]
    helper.end()
    assert helper.opened == {} and "cuIpcCloseMemHandle" in helper.cu.calls  # type: ignore[attr-defined]


def test_the_helpers_are_spawned_on_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller (vLLM building the model) goes on while the helpers are started."""
    started: list[str] = []
    real = subprocess.Popen

    def popen(*args: object, **kw: object) -> subprocess.Popen:
        import threading

        started.append(threading.current_thread().name)
        return real(*args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(helpers.subprocess, "Popen", popen)
    with _answering_pool(tmp_path, monkeypatch, 2) as pool:
        assert pool.ready() == 2
    assert started == ["marlin-pack-helpers"] * 2
