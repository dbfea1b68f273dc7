"""``tests/on_gpu/device.sh --parallel`` on the CPU: runs at most ``MARLIN_PACK_GPU_JOBS`` pytest runs at once and,
at ``MARLIN_PACK_GPU_DEADLINE_S``, interrupts the runs still going (with what they started), names those never
started, and reports and packs every log either way.

A sitting on the device machine lost everything when 16 runs at once exhausted its memory and the call's own
time limit ended the script before it reported anything (2026-12-06): these are the two behaviours that prevent it.
The runs here are pytest on a throwaway test file whose tests record when they start and end.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
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


def _device_sh(tmp_path: Path, *groups: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "EVENTS": str(tmp_path / "events"), "MARLIN_PACK_DEVICE_NO_INSTALL": "1", **env}
    proc = subprocess.run(
        ["bash", str(DEVICE_SH), "--parallel", *groups], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120
    )
    return proc, out


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
    assert _events(tmp_path)[::2] == order
    assert "== a: exit 0, " in proc.stdout and "== b: exit 0, " in proc.stdout
    assert _archived(out) == {"a.log", "b.log"} and not list(out.glob("*.log"))


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
    assert _archived(out) == {"h.log"}
