"""benchmarks/sitting_guard.py on the CPU: the checkpoint-size estimate, the one-line refusal where a file system lacks the
room (bench_cold.py and bench_remote.py refuse so before drawing anything), and a stopped sitting's clean-up (SIGTERM
through the ``finally`` blocks, past a row's ``except (Exception, SystemExit)``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import sitting_guard  # noqa: E402

from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint  # noqa: E402

Usage = namedtuple("Usage", "total used free")


def test_the_estimate_is_a_drawn_checkpoints_size(tmp_path: Path) -> None:
    shape = dataclasses.replace(PRESETS["tiny-vocab"], num_hidden_layers=4)
    write_awq_checkpoint(tmp_path, shape, group_size=128, tokenizer=False)
    drawn = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert abs(sitting_guard.checkpoint_bytes(shape) - drawn) < 0.02 * drawn
    # the figures of docs/development.md: a 70B-shaped checkpoint of 40 layers ~22 GB, of 80 layers 39.8 GB
    seventy = PRESETS["llama-70b"]
    assert round(sitting_guard.checkpoint_bytes(dataclasses.replace(seventy, num_hidden_layers=40)) / 1e9) == 22
    assert round(sitting_guard.checkpoint_bytes(seventy) / 1e8) == 398


def test_room_is_refused_in_one_line_per_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sitting_guard.shutil, "disk_usage", lambda path: Usage(100e9, 70e9, 30e9))
    needs = [(tmp_path / "work", 10e9, "checkpoint"), (tmp_path / "work" / "b", 11e9, "bundle")]
    sitting_guard.check_room("bench_x", needs, "fewer --layers")  # 21 GB x 1.1 + 2 GB < 30 GB
    with pytest.raises(SystemExit) as refused:  # the two on one file system: summed
        sitting_guard.check_room("bench_x", [*needs, (tmp_path / "other", 5e9, "bucket")], "fewer --layers")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"bench_x: {tmp_path / 'work'} and ")
    assert "needs ~31 GB free (checkpoint ~10.0 GB + bundle ~11.0 GB + bucket ~5.0 GB" in line
    assert "30.0 GB free" in line and line.endswith(": fewer --layers")


SHIM = """
import runpy, shutil, sys
from collections import namedtuple
import marlin_pack.testing.synthetic as synthetic
shutil.disk_usage = lambda path: namedtuple("Usage", "total used free")(64e9, 54e9, 10e9)
def drawn(*args, **kwargs):
    raise SystemExit("a checkpoint was drawn")
synthetic.write_awq_checkpoint = synthetic.write_gptq_checkpoint = drawn
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(("script", "args", "said"), [
    ("bench_cold.py", [], "bench_cold: {work} needs ~79 GB free (checkpoint ~22.0 GB + 2 bundle(s) ~48.4 GB"),
    ("bench_cold.py", ["--skip", "convert-rows"], "bench_cold: {work} needs ~53 GB free"),
    ("bench_remote.py", ["--bucket-root", "{work}/bucket"], "bench_remote: {work} and {work}/bucket needs ~79 GB free"),
])
def test_the_benchmarks_refuse_before_drawing_anything(tmp_path: Path, script: str, args: list[str], said: str) -> None:
    work = tmp_path / "work"
    (work / "leftover").mkdir(parents=True)  # an earlier run's: removed first, as the sitting would
    argv = [str(BENCH / script), "--preset", "llama-70b", "--layers", "40", "--workdir", str(work),
            *(a.format(work=work) for a in args)]
    done = subprocess.run([sys.executable, "-c", SHIM, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(said.format(work=work)) and "10.0 GB free" in line and "fewer --layers" in line, done.stderr
    assert not work.exists()


STOPPED = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import sitting_guard
work = Path(sys.argv[2])
def main():
    work.mkdir()
    try:
        (work / "checkpoint").write_bytes(b"x" * 1000)
        for _ in range(600):
            try:  # a row that reports its failures and goes on
                print("ready", flush=True)
                time.sleep(0.1)
            except (Exception, SystemExit):
                pass
    finally:
        import shutil
        shutil.rmtree(work)
sitting_guard.run(main, "bench_x")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_sitting_removes_its_files(tmp_path: Path, sig: signal.Signals) -> None:
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-c", STOPPED, str(BENCH), str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig and not work.exists()
    assert err.strip() == f"bench_x: stopped by {sig.name}: its engines ended and its files removed (unless --keep)"
