"""``copy_helpers`` / ``copy_helper_main`` (the ``processes`` io mode) without a GPU: how windows are
shared out, and that a helper that cannot start or fails leaves every window to the caller.
The copies themselves are checked on a GPU (tests/on_gpu/test_gpu_reader_gpu.py)."""

from __future__ import annotations

import ast
import ctypes
import itertools
import json
import mmap
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helper_fakes import fake_helper

from marlin_pack.vllm_plugin import copy_helper_main
from marlin_pack.vllm_plugin.copy_helpers import HelperPool, split_by_bytes
from marlin_pack.vllm_plugin.gpu_reader import MODE_DEFAULTS, CopyItem, ParallelReader
from marlin_pack.vllm_plugin.options import parse_extra_config


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


def test_helper_script_uses_the_standard_library_only() -> None:
    """It runs as ``python -S`` (no site packages): importing torch or marlin_pack would fail there."""
    tree = ast.parse(Path(copy_helper_main.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_helper_without_a_cuda_driver_says_so_in_one_line(tmp_path: Path) -> None:
    if Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() or torch.cuda.is_available():
        pytest.skip("a CUDA driver is installed here")
    r = subprocess.run([sys.executable, "-S", copy_helper_main.__file__, "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
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


def test_ready_helpers_that_cannot_prepare_the_job_leave_every_window(tmp_path: Path) -> None:
    """No CUDA here: the destinations' IPC handles cannot be made, so nothing is sent."""
    ready = 'import json, sys; print(json.dumps({"ready": True}), flush=True); sys.stdin.read()'
    windows = _windows([4096])
    with HelperPool(1, 0, script=_script(tmp_path, ready)) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert len(pool.failures) == 1
    assert pool._procs == []  # closed: each helper ended when its input did


@pytest.mark.parametrize("threads", [2, 0])  # 0: the helpers' staging threads only, yet this process reads with one
def test_reader_in_processes_mode_reads_cpu_destinations_itself(tmp_path: Path, threads: int) -> None:
    data = torch.arange(50_000, dtype=torch.int32)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    out = torch.zeros_like(data)
    with ParallelReader(threads=threads, chunk_bytes=1 << 16, mode="processes") as r:
        assert r.copy(path, [CopyItem(0, data.numel() * 4, out)]) == data.numel() * 4
        assert r._helpers is None  # no GPU destination: no helper started
    assert torch.equal(out, data)


def test_io_processes_option() -> None:
    o = parse_extra_config({"io_mode": "processes", "io_processes": 2, "io_threads": 8})
    assert (o.io_mode, o.io_processes, o.io_threads) == ("processes", 2, 8)
    assert parse_extra_config({}).io_processes is None
    with pytest.raises(ValueError, match=r"\['io_processes'\] must be an integer in 1\.\.32"):
        parse_extra_config({"io_processes": 0})


def test_staging_only_helpers_option_and_plan() -> None:
    """``io_threads: 0`` with ``io_staged``: the helpers get no registered threads; other modes their default."""
    o = parse_extra_config({"io_mode": "processes", "io_threads": 0, "io_staged": 3})
    assert (o.io_threads, o.io_staged) == (0, 3)
    assert ParallelReader(threads=0, chunk_bytes=1 << 16, mode="processes").plan("f").threads == 0
    assert ParallelReader(threads=0, chunk_bytes=1 << 16, mode="registered").plan("f").threads == MODE_DEFAULTS["registered"][0]


class _Stream:
    def synchronize(self) -> None:
        pass


def _answering_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, answer: str) -> HelperPool:
    """Helpers that say ready and answer each job with ``answer`` (a JSON object); the IPC handles
    faked (no CUDA here). Each helper logs the windows it was sent to helper-PID.log."""
    body = f"""
        import json, os, sys
        print(json.dumps({{"ready": True}}), flush=True)
        for line in sys.stdin:
            with open(os.path.join({str(tmp_path)!r}, f"helper-{{os.getpid()}}.log"), "a") as f:
                parts = json.loads(line)["parts"]
                f.write(json.dumps([[os.path.basename(part["file"]), w[0]] for part in parts for w in part["windows"]]) + "\\n")
            print(json.dumps({answer}), flush=True)
    """
    pool = HelperPool(count, 0, script=_script(tmp_path, body))
    monkeypatch.setattr(pool, "_handle", lambda ptr: ("00" * 64, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    return pool


def _sent_files(tmp_path: Path) -> list[list[list]]:
    """Each job the helpers were sent: its windows as ``[file name, window start]``."""
    return sorted(json.loads(line) for p in tmp_path.glob("helper-*.log") for line in p.read_text().splitlines())


def _sent(tmp_path: Path) -> list[list[int]]:
    """Each job the helpers were sent: its windows' starts."""
    return [[lo for _, lo in job] for job in _sent_files(tmp_path)]


def test_own_share_is_the_tail_and_runs_beside_the_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 9)
    mine: list[list[int]] = []
    with _answering_pool(tmp_path, monkeypatch, 2, '{"ok": 0}') as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1, own=lambda share: mine.append([w.lo for w in share])) == []
        assert pool.failures == []
    assert mine == [[60, 70, 80]]  # three parties, a third each; the caller's is the file's tail
    assert _sent(tmp_path) == [[0, 10, 20], [30, 40, 50]]


def test_a_failed_helper_leaves_its_share_but_not_the_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 4)
    mine: list[int] = []
    with _answering_pool(tmp_path, monkeypatch, 1, '{"error": "RuntimeError: injected"}') as pool:
        left = pool.copy(tmp_path / "f", windows, threads=1, own=lambda share: mine.extend(w.lo for w in share))
        assert "injected" in pool.failures[0]
    assert mine == [20, 30] and left == windows[:2]


def test_when_the_callers_share_fails_the_helpers_are_still_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """They write into the caller's memory: the caller must not free it (raise) before they are done."""
    windows = _windows([10] * 4)
    pool = _answering_pool(tmp_path, monkeypatch, 1, '{"ok": 0}')
    answered: list[dict] = []
    read = pool._read
    monkeypatch.setattr(pool, "_read", lambda p, deadline: answered.append(read(p, deadline)) or answered[-1])

    def own(share: list) -> None:
        raise OSError("disk gone")

    with pool, pytest.raises(OSError, match="disk gone"):
        pool.copy(tmp_path / "f", windows, threads=1, own=own)
    assert answered[-1] == {"ok": 0}  # the helper's job reply was read before the error went up


def test_copy_files_gives_each_helper_one_job_cut_across_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank file and the common tensors: the shares are cut from both files' windows in order, so a
    helper's one job may hold the end of one file and the start of the next."""
    rank, common = _windows([10] * 6), _windows([10] * 2)
    with _answering_pool(tmp_path, monkeypatch, 2, '{"ok": 0}') as pool:
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
    pool = _answering_pool(tmp_path, monkeypatch, 1, '{"ok": 0}')
    pool.close()
    assert pool.copy_files([(tmp_path / "rank", rank), (tmp_path / "common", common)], threads=1) == [rank, common]


def test_a_closed_pool_leaves_every_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows([10] * 4)
    pool = _answering_pool(tmp_path, monkeypatch, 2, '{"ok": 0}')
    assert pool.ready() == 2
    pool.close(wait=False)
    pool.join()
    assert pool.copy(tmp_path / "f", windows, threads=1, own=lambda share: None) == windows
    assert _sent(tmp_path) == []


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["0"], copy_helper_main.Settings(0)),
        (["3", "--defer-unregister"], copy_helper_main.Settings(3, defer_unregister=True)),
        (["1", "--staged", "2", "--stage-mib", "16"], copy_helper_main.Settings(1, staged=2, stage_bytes=16 << 20)),
        (["2", "--nice", "5"], copy_helper_main.Settings(2, nice=5)),
        (["2", "--nice", "40"], copy_helper_main.Settings(2, nice=19)),
    ],
)
def test_helper_settings_from_its_command_line(argv: list[str], want: object) -> None:
    assert copy_helper_main.Settings.parse(argv) == want


@pytest.mark.parametrize("argv", [["0", "--staged"], ["0", "--fast"], ["x"], ["0", "--nice"]])
def test_helper_refuses_an_unknown_command_line(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        copy_helper_main.Settings.parse(argv)


def test_pool_passes_its_settings_to_every_helper(tmp_path: Path) -> None:
    """The helper's options reach its command line (a stand-in script echoes its arguments in its error)."""
    script = tmp_path / "echo_helper.py"
    script.write_text("import json, sys\nprint(json.dumps({'error': ' '.join(sys.argv[1:])}), flush=True)\n")
    with HelperPool(2, 5, script=script, staged=3, stage_mib=8, defer_unregister=True, nice=7) as pool:
        assert pool.ready() == 0
    assert pool.failures == ["a helper did not start: 5 --staged 3 --stage-mib 8 --defer-unregister --nice 7"] * 2
    assert pool.ready_after is not None and pool.ready_after >= 0


def test_helper_lowers_its_priority_before_its_threads_start() -> None:
    """``--nice N``: the helper's process (and so every thread it starts) runs N steps nicer than its parent."""
    import subprocess
    import sys

    code = (
        "import os, sys, threading; sys.path.insert(0, sys.argv[1]); import copy_helper_main as m\n"
        "class D:\n    def __call__(self, *a): pass\n"
        "m._Driver = D\n"
        "m.Helper(m.Settings.parse(['0', '--nice', '6']))\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); t.start(); t.join()\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), seen[0])\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code, str(Path(copy_helper_main.__file__).parent)],
                         capture_output=True, text=True, check=True).stdout.split()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert out == [str(min(19, base + 6))] * 2


@pytest.mark.parametrize(
    "settings",
    [
        copy_helper_main.Settings(0),
        copy_helper_main.Settings(0, defer_unregister=True),
        copy_helper_main.Settings(0, staged=2, stage_bytes=3 << 12),  # windows cut into several stages
        copy_helper_main.Settings(0, staged=2, stage_bytes=1 << 12, defer_unregister=True),
        copy_helper_main.Settings(0, staged=2, stage_bytes=3 << 12),  # with a job of 0 registered threads (below)
        copy_helper_main.Settings(0),  # a job of 0 threads without staging ones: still one registered thread
    ],
    ids=["registered", "deferred", "staged", "staged-deferred", "staged-only", "no-threads-asked"],
)
def test_helper_copies_every_piece_and_unregisters_every_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: object, request: pytest.FixtureRequest
) -> None:
    """The helper's own logic on the host (its CUDA calls faked): every piece of every window lands at its
    destination offset, whichever thread takes it (registered or staged), and every registered window is
    unregistered by the end of the job, or with ``defer_unregister`` after it (on a thread of its own;
    a job of the same file first waits for that)."""
    data = bytes(range(256)) * 1000  # 256000 bytes: windows end inside pages
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    destination = ctypes.create_string_buffer(len(data) + 100)
    helper = fake_helper(monkeypatch, settings, destination)
    # As the reader cuts them: page-aligned windows of 3 pages (the last one ends inside a page); the
    # pieces are the tensors' parts in each, tensors of odd sizes, each 100 bytes further on in the destination.
    cuts = [0, 1, 8192, 8193 + 4096 * 5, 100_003, 200_000, len(data)]
    step = 3 * mmap.PAGESIZE
    windows = []
    for lo in range(0, len(data), step):
        hi = min(lo + step, len(data))
        pieces = [[max(a, lo), min(b, hi) - max(a, lo), 0, max(a, lo) + 100] for a, b in itertools.pairwise(cuts) if a < hi and b > lo]
        windows.append([lo, hi, pieces])
    threads = 0 if request.node.callspec.id in ("staged-only", "no-threads-asked") else 3
    job = {"parts": [{"file": str(path), "windows": windows}], "handles": ["00" * 64], "threads": threads}
    for _ in range(2):  # the same file twice: with deferral the second waits for the first's unregistering
        ctypes.memset(destination, 0, len(destination))
        assert helper.job(job) == len(data)
        assert destination.raw[100:] == data
        if settings.defer_unregister:  # type: ignore[attr-defined]
            assert helper.cu.registered  # type: ignore[attr-defined]
        else:
            assert not helper.cu.registered  # type: ignore[attr-defined]
        thread = helper.unregister_kept()
        if thread is not None:
            thread.join()
        assert not helper.cu.registered  # type: ignore[attr-defined]
    staged = settings.staged > 0  # type: ignore[attr-defined]
    registered = helper.cu.calls.count("cuMemHostRegister")  # type: ignore[attr-defined]
    if threads == 0 and staged:
        assert registered == 0  # the staging threads copied everything
    else:
        assert 0 < registered < 2 * len(windows) if staged else registered == 2 * len(windows)  # staged threads took some


@pytest.mark.parametrize("defer", [False, True])
def test_helper_job_of_two_files_copies_both_and_releases_their_pages_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, defer: bool
) -> None:
    """One job holding the rank file and the common tensors: the threads (registered and staged) take windows
    of both files; with ``defer_unregister`` the pages of both stay registered until the reply, are released
    together, and a next job of one of those files waits for that."""
    first, second = bytes(range(256)) * 40, bytes(reversed(range(256))) * 30  # windows end inside pages
    paths = [tmp_path / "rank.bin", tmp_path / "common.bin"]
    for path, data in zip(paths, (first, second), strict=True):
        path.write_bytes(data)
    destination = ctypes.create_string_buffer(len(first) + len(second))
    helper = fake_helper(monkeypatch, copy_helper_main.Settings(0, staged=1, stage_bytes=1 << 12, defer_unregister=defer), destination)
    step = 2 * mmap.PAGESIZE

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
        assert helper.releasing is not None and helper.releasing[0] == {str(p) for p in paths}
    ctypes.memset(destination, 0, len(destination))
    assert helper.job({"parts": parts[1:], "handles": ["00" * 64], "threads": 2}) == len(second)
    assert destination.raw[len(first) :] == second
    if thread is not None:
        assert not thread.is_alive()  # the common file's pages were released before they were registered again
    later = helper.unregister_kept()
    if later is not None:
        later.join()
    assert not helper.cu.registered  # type: ignore[attr-defined]
