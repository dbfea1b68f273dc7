"""tools/run-tests.sh: the suite in one pytest process per core, each every N-th test (tests/conftest.py's --shard)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tools/run-tests.sh"


def _run(*args: str, shards: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "MARLIN_PACK_TEST_SHARDS": str(shards)}
    return subprocess.run(["bash", str(SCRIPT), *args, "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_shards_together_run_each_test_once() -> None:
    whole = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                            "tests/test_errors.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    names = {line for line in whole.stdout.splitlines() if "::" in line}
    shards = [subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                              "--shard", f"{i}/2", "tests/test_errors.py"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120) for i in range(2)]
    parts = [{line for line in s.stdout.splitlines() if "::" in line} for s in shards]
    assert len(names) >= 2 and parts[0] and parts[1]
    assert parts[0] | parts[1] == names and not parts[0] & parts[1]


def test_totals_and_exit_status() -> None:
    ok = _run("tests/test_errors.py")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    last = ok.stdout.strip().splitlines()[-1]
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                                "tests/test_errors.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    n = sum("::" in line for line in collected.stdout.splitlines())
    assert re.fullmatch(rf"{n} passed in \d+\.00s", last), ok.stdout  # the closing line .ci/run counts
    assert ok.stdout.count("--- shard ") == 2
    broken = _run("tests/test_errors.py", "-k", "not field")  # fewer tests: still fine
    assert broken.returncode == 0, broken.stdout
    failed = _run("tests/test_errors.py::no_such_test")
    assert failed.returncode != 0 and "--- shard" in failed.stdout


@pytest.mark.parametrize("spec", ["2/2", "x", "1/0"])
def test_a_bad_shard_is_refused(spec: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--shard", spec,
                        "tests/test_errors.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4 and f"--shard {spec}: expected I/N" in r.stderr, r.stdout + r.stderr
