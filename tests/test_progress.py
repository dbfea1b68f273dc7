"""Progress reporting: a rich bar on a terminal, plain flushed lines in logs and pipes (issue 50)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from marlin_pack.progress import INTERVAL_ENV, PlainProgress, as_progress_fn, interval_from_env, progress_reporter

GB = 10**9
ANSI = re.compile(r"\x1b\[")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class CountingFlushes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes: list[int] = []  # how many lines were written at each flush

    def flush(self) -> None:
        self.flushes.append(self.getvalue().count("\n"))
        super().flush()


def _plain_console(file: io.StringIO) -> Console:
    return Console(file=file, force_terminal=False, markup=False, emoji=False)


def test_plain_lines_are_throttled_and_say_layer_gb_rate_and_eta() -> None:
    buf, clock = CountingFlushes(), FakeClock()
    with progress_reporter(_plain_console(buf), True, "converting", interval=5, clock=clock) as update:
        assert update is not None
        for i in range(1, 81):  # 80 layers of 0.5 GB, one a second
            clock.t += 1
            update(i, 80, f"model.layers.{i - 1}.mlp", bytes_done=i * GB // 2, bytes_total=40 * GB)
    lines = buf.getvalue().splitlines()
    # the first update, then one line per 5 s (layers 6, 11, ... 76), then the final line
    assert len(lines) == 1 + 15 + 1, lines
    assert lines[0] == "marlin-pack: converting layer 1/80 (model.layers.0.mlp), 0.5/40.0 GB read"  # no rate measured yet
    assert lines[1] == "marlin-pack: converting layer 6/80 (model.layers.5.mlp), 3.0/40.0 GB read, 0.5 GB/s, ETA 1 min 14 s"
    assert lines[-2].startswith("marlin-pack: converting layer 76/80 ")
    assert lines[-1] == "marlin-pack: converting done: 80 layers, 40.0 GB read in 1 min 20 s (0.5 GB/s)"
    assert buf.flushes == list(range(1, len(lines) + 1))  # every line flushed as it is written
    assert not ANSI.search(buf.getvalue())


def test_eta_comes_from_the_byte_rate_or_else_the_layer_rate() -> None:
    buf, clock = io.StringIO(), FakeClock()
    p = PlainProgress(buf, "converting", interval=0, clock=clock)
    clock.t += 2
    p.update(1, 10, "a", bytes_done=1 * GB, bytes_total=10 * GB)  # no rate yet: the 2 s include the setup
    clock.t += 1
    p.update(2, 10, "b", bytes_done=3 * GB, bytes_total=10 * GB)  # since the first update: 2 GB/s
    p.finish()
    first, second, last = buf.getvalue().splitlines()
    assert first == "marlin-pack: converting layer 1/10 (a), 1.0/10.0 GB read"
    assert second == "marlin-pack: converting layer 2/10 (b), 3.0/10.0 GB read, 2.0 GB/s, ETA 4 s"
    assert last == "marlin-pack: converting done: 2 layers, 3.0 GB read in 3 s (1.0 GB/s)"

    buf = io.StringIO()
    p = PlainProgress(buf, "round trip", interval=0, clock=clock)
    clock.t += 3
    p.update(1, 4, "x")  # no bytes: layers only
    clock.t += 1
    p.update(2, 4, "y")  # a layer a second since the first
    p.finish()
    assert buf.getvalue().splitlines() == [
        "marlin-pack: round trip layer 1/4 (x)", "marlin-pack: round trip layer 2/4 (y), ETA 2 s",
        "marlin-pack: round trip done: 2 layers in 4 s",
    ]


def test_a_long_setup_does_not_slow_the_first_eta() -> None:
    """40 s of setup (headers, hashing, planning) before 80 layers of 0.5 GB at one a second: no line's ETA counts
    the setup (a rate from the start gave the first ETA as 79 x 41 s = 54 min for 79 s of work left)."""
    buf, clock = io.StringIO(), FakeClock()
    p = PlainProgress(buf, "converting", interval=0, clock=clock)
    clock.t += 40
    for i in range(1, 4):
        clock.t += 1
        p.update(i, 80, f"l{i}", bytes_done=i * GB // 2, bytes_total=40 * GB)
    lines = buf.getvalue().splitlines()
    assert "ETA" not in lines[0] and "GB/s" not in lines[0], lines
    assert lines[1].endswith("0.5 GB/s, ETA 1 min 18 s") and lines[2].endswith("0.5 GB/s, ETA 1 min 17 s"), lines


def test_small_jobs_read_in_mb() -> None:
    buf, clock = io.StringIO(), FakeClock()
    p = PlainProgress(buf, "converting", interval=0, clock=clock)
    clock.t += 1
    p.update(1, 4, "a", bytes_done=3_000_000, bytes_total=12_000_000)
    clock.t += 1
    p.update(2, 4, "b", bytes_done=6_000_000, bytes_total=12_000_000)
    assert buf.getvalue().splitlines() == ["marlin-pack: converting layer 1/4 (a), 3.0/12.0 MB read",
                                           "marlin-pack: converting layer 2/4 (b), 6.0/12.0 MB read, 3.0 MB/s, ETA 2 s"]


def test_an_error_ends_with_where_it_stopped_and_no_update_prints_nothing() -> None:
    buf, clock = io.StringIO(), FakeClock()
    with pytest.raises(RuntimeError), progress_reporter(_plain_console(buf), True, "converting", interval=5, clock=clock) as update:
        assert update is not None
        clock.t += 1
        update(1, 3, "a")
        raise RuntimeError("boom")
    assert buf.getvalue().splitlines()[-1] == "marlin-pack: converting stopped after layer 1/3 (1 s)"

    buf = io.StringIO()
    with pytest.raises(RuntimeError), progress_reporter(_plain_console(buf), True, "converting"):
        raise RuntimeError("refused before the first layer")  # the CLI's error is then stderr's first line
    assert buf.getvalue() == ""


def test_disabled_prints_nothing() -> None:
    for terminal in (True, False):
        buf = io.StringIO()
        with progress_reporter(Console(file=buf, force_terminal=terminal), False, "converting") as update:
            assert update is None
        assert buf.getvalue() == ""


def test_a_terminal_gets_the_rich_bar_with_names_as_they_are() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200, markup=False, color_system=None)
    with progress_reporter(console, True, "converting", interval=0) as update:
        assert update is not None
        update(1, 2, "x[/y] [bold]z", bytes_done=GB, bytes_total=2 * GB)
    out = buf.getvalue()
    assert "x[/y] [bold]z" in out and "1/2" in out
    assert "marlin-pack: converting layer" not in out  # not the plain lines


def test_interval_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in [("0", 0.0), ("2.5", 2.5), ("", 5.0), ("soon", 5.0), ("-1", 5.0), ("nan", 5.0), ("inf", 5.0)]:
        monkeypatch.setenv(INTERVAL_ENV, raw)
        assert interval_from_env() == want, raw


def test_three_argument_callbacks_keep_working() -> None:
    seen: list[tuple] = []
    as_progress_fn(lambda done, total, name: seen.append((done, total, name)))(1, 2, "a", bytes_done=1, bytes_total=2)
    as_progress_fn(lambda *a: seen.append(a))(2, 2, "b", bytes_done=2, bytes_total=2)
    as_progress_fn(lambda *a, **k: seen.append((*a, k)))(3, 3, "c", bytes_done=3, bytes_total=4)

    def keywords(done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
        seen.append((done, bytes_done, bytes_total))

    as_progress_fn(keywords)(4, 4, "d", bytes_done=5, bytes_total=6)
    assert seen == [(1, 2, "a"), (2, 2, "b"), (3, 3, "c", {"bytes_done": 3, "bytes_total": 4}), (4, 5, 6)]


def test_conversion_reports_the_checkpoint_bytes_read(make_checkpoint, tmp_path: Path) -> None:
    from marlin_pack import conversion

    d = tmp_path / "m"
    shutil.copytree(make_checkpoint("awq", "tiny", group_size=32), d)
    seen: list[tuple] = []

    def record(done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
        seen.append((done, total, name, bytes_done, bytes_total))

    conversion.convert(d, progress=record)
    assert seen and seen[-1][0] == seen[-1][1] == len(seen)
    done_bytes = [s[3] for s in seen]
    assert done_bytes == sorted(done_bytes) and done_bytes[0] > 0 and done_bytes[-1] == seen[-1][4]
    quantized = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert seen[-1][4] < quantized  # the quantized layers' tensors, not the embeddings and norms


def test_cli_convert_to_a_pipe_prints_plain_start_and_final_lines(make_checkpoint, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(make_checkpoint("awq", "tiny", group_size=32), d)
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    r = subprocess.run([sys.executable, "-c", code, "convert", str(d)], capture_output=True, text=True, timeout=120,
                       env={**env, INTERVAL_ENV: "0", "COLUMNS": "80"})
    lines = [line for line in r.stderr.splitlines() if line.startswith("marlin-pack: converting ")]
    assert lines, r.stderr
    first = r"marlin-pack: converting layer 1/(\d+) \(\S+\), [\d.]+/[\d.]+ [MG]B read"  # no rate yet, so no ETA
    assert re.fullmatch(first, lines[0]), lines
    n = int(lines[0].split("/")[1].split()[0])
    assert len(lines) == n + 1  # interval 0: a line per layer, and the final one
    assert re.fullmatch(rf"marlin-pack: converting done: {n} layers, [\d.]+ [MG]B read in \d+ s( \([\d.]+ [MG]B/s\))?", lines[-1]), lines
    assert not ANSI.search(r.stderr)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr
