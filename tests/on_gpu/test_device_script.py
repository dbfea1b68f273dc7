"""``tests/on_gpu/device.sh --parallel`` on the CPU: runs at most ``MARLIN_PACK_GPU_JOBS`` pytest runs at once and,
at ``MARLIN_PACK_GPU_DEADLINE_S``, interrupts the runs still going (with what they started), names those never
started, and reports and packs every log either way.

A sitting on the device machine lost everything when 16 runs at once exhausted its memory and the call's own
time limit ended the script before it reported anything (2026-12-06): these are the behaviours that prevent it, with
the host-memory guard (``MARLIN_PACK_GPU_MIN_FREE_GB``, read from ``MARLIN_PACK_MEMINFO`` here) that stops the newest
run before the kernel's OOM killer or a thrashing machine ends the call (six daemon selections, the same day).
The runs here are pytest on a throwaway test file whose tests record when they start and end.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

DEVICE_SH = Path(__file__).with_name("device.sh")
REPO = DEVICE_SH.parents[2]

TESTS = """
import os, subprocess, time
import pytest

EVENTS = os.environ["EVENTS"]


def _event(what):
    with open(EVENTS, "a") as f:
        f.write(what + "\\n")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["one", "two"])
def test_steady(name):
    _event("start " + name)
    _event("port " + os.environ.get("MARLIN_PACK_TEST_PORT_BASE", "none"))
    time.sleep(2)
    _event("end " + name)


@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "the failure the summary shows"


@pytest.mark.gpu
def test_hangs_with_a_child(tmp_path):
    child = subprocess.Popen(["sleep", "300"])  # as an engine the test started
    _event(f"child {child.pid}")
    time.sleep(300)
"""


def _meminfo(path: Path, free_gib: int) -> None:
    path.write_text(f"MemTotal:       131072000 kB\nMemAvailable:   {free_gib * 1048576} kB\n")


def _env(tmp_path: Path, **env: str) -> dict[str, str]:
    """device.sh's environment here: output under tmp_path, no install, no stagger, a stand-in meminfo with plenty
    free (whatever this machine has) unless ``env`` names another."""
    if not (tmp_path / "meminfo").exists():
        _meminfo(tmp_path / "meminfo", 100)
    return {**os.environ, "OUT": str(tmp_path / "out"), "EVENTS": str(tmp_path / "events"),
            "MARLIN_PACK_DEVICE_NO_INSTALL": "1", "MARLIN_PACK_GPU_STAGGER_S": "0",
            "MARLIN_PACK_MEMINFO": str(tmp_path / "meminfo"), **env}


def _device_sh(tmp_path: Path, *groups: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    proc = subprocess.run(["bash", str(DEVICE_SH), "--parallel", *groups], cwd=REPO, env=_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=120)
    return proc, tmp_path / "out"


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    d = tmp_path / "suite"
    d.mkdir()
    (d / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: on the device\n")
    (d / "test_runs.py").write_text(TESTS)
    return d / "test_runs.py"


def _events(tmp_path: Path) -> list[str]:
    return (tmp_path / "events").read_text().split()


def _archived(out: Path) -> set[str]:
    (archive,) = out.glob("gpu-logs-*.tgz")
    with tarfile.open(archive) as tar:
        return {Path(m.name).name for m in tar.getmembers()}


@pytest.mark.slow
@pytest.mark.parametrize(("jobs", "order"), [("1", ["start", "end", "start", "end"]), ("2", ["start", "start", "end", "end"])])
def test_at_most_jobs_runs_at_once(tmp_path: Path, suite: Path, jobs: str, order: list[str]) -> None:
    proc, out = _device_sh(tmp_path, f"a:{suite} -k 'steady and one'", f"b:{suite} -k 'steady and two'", MARLIN_PACK_GPU_JOBS=jobs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = _events(tmp_path)
    ports = [events[i + 1] for i, e in enumerate(events) if e == "port"]
    assert sorted(ports) == ["10040", "12040"]  # each run's engines count their rendezvous ports from a base of its own
    assert [e for e in events if e in ("start", "end")] == order
    assert "== a: exit 0, " in proc.stdout and "== b: exit 0, " in proc.stdout
    assert _archived(out) == {"a.log", "b.log", "memory.log"} and not list(out.glob("*.log"))


@pytest.mark.slow
def test_a_failure_is_summarised(tmp_path: Path, suite: Path) -> None:
    proc, _ = _device_sh(tmp_path, f"a:{suite} -k steady", f"f:{suite} -k fails")
    assert proc.returncode == 1
    assert "== a: exit 0, " in proc.stdout and "== f: exit 1, " in proc.stdout
    assert "f: E       AssertionError: the failure the summary shows" in proc.stdout


@pytest.mark.slow
def test_deadline_interrupts_reports_and_names_runs_not_started(tmp_path: Path, suite: Path) -> None:
    proc, out = _device_sh(
        tmp_path, f"h:{suite} -k hangs", f"n:{suite} -k steady", MARLIN_PACK_GPU_JOBS="1", MARLIN_PACK_GPU_DEADLINE_S="6"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "== deadline of 6 s" in proc.stdout
    assert "== h: exit 2, interrupted: " in proc.stdout  # pytest reported the interrupt
    assert "== n: not started (deadline)" in proc.stdout
    (child,) = [int(e.split()[1]) for e in (tmp_path / "events").read_text().splitlines() if e.startswith("child ")]
    with pytest.raises(ProcessLookupError):  # the run's process group was interrupted: its child is gone
        os.kill(child, 0)
    assert _archived(out) == {"h.log", "memory.log"}


@pytest.mark.slow
def test_low_host_memory_stops_the_newest_run_not_the_machine(tmp_path: Path, suite: Path) -> None:
    """MemAvailable under the guard: the run started last is stopped with what it started, named as stopped for
    memory; the older one goes on (here until the deadline); the lowest figure is reported."""
    meminfo, out = tmp_path / "meminfo", tmp_path / "out"
    proc = subprocess.Popen(["bash", str(DEVICE_SH), "--parallel", f"old:{suite} -k hangs", f"new:{suite} -k hangs"], cwd=REPO,
                            env=_env(tmp_path, MARLIN_PACK_GPU_DEADLINE_S="14"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for _ in range(200):  # both runs' children started
        if (tmp_path / "events").exists() and _events(tmp_path).count("child") == 2:
            break
        time.sleep(0.05)
    _meminfo(meminfo, 4)
    time.sleep(3)
    _meminfo(meminfo, 100)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout
    assert "== host memory low (4 GiB available, guard 12 GiB): stopping new" in stdout
    assert "stopping old" not in stdout
    assert "== new: stopped, host memory low (4 GiB available): run it with fewer beside it" in stdout
    assert "== old: exit 2, interrupted: " in stdout  # the older run went on until the deadline
    assert "== host memory: lowest available 4 GiB (guard 12 GiB)" in stdout
    children = [int(e.split()[1]) for e in (tmp_path / "events").read_text().splitlines() if e.startswith("child ")]
    for child in children:  # both runs' engines are gone
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    assert _archived(out) == {"old.log", "new.log", "memory.log"}
