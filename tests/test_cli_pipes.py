"""Output that survives a pipe: with stdout not a terminal, help, tables and usage errors are printed whole, at any
COLUMNS (a container's log, `| less`, `| grep`); on a terminal, rich's panels as before, flags without `<bool>`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
_TTY_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "TERMINAL_WIDTH", "MARLIN_PACK_DEBUG")


def _piped(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI with stdout and stderr pipes, in an 80-column environment (what a log or `| cat` gets)."""
    base = {k: v for k, v in os.environ.items() if k not in _TTY_ENV}
    return subprocess.run([sys.executable, "-c", _CODE, *args], capture_output=True, text=True, timeout=120,
                          env={**base, "COLUMNS": "80", **(env or {})})


def _option_lines(help_text: str) -> dict[str, str]:
    """{option: its help line}: plain help gives each option's help on its line, or on the next one for a long name."""
    lines, found = help_text.splitlines(), {}
    for i, line in enumerate(lines):
        words = line.strip().split()
        if words and words[0].startswith("-"):
            rest = line.strip()
            found[words[0].rstrip(",")] = rest if "  " in rest else f"{rest} {lines[i + 1].strip()}"
    return found


def test_help_in_a_pipe_prints_every_option_and_sentence_whole() -> None:
    r = _piped("check", "--help")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and "╭" not in r.stdout, r.stdout
    options = _option_lines(r.stdout)
    for name in ("--bundle", "-tp", "-pp", "-dp", "-ep", "--expert-placement-strategy", "--rank", "--dtype", "--verify",
                 "--fallback", "--compute-capability", "--revision", "--json", "-h"):
        assert name in options, (name, r.stdout)
    assert "--tensor-parallel-size" in r.stdout and "--enable-expert-parallel" in r.stdout
    # a sentence longer than the 80 columns, on one line, its default and rich's escapes read as text
    assert ("The engine's --data-parallel-size: each replica loads the same TP rank files, so every replica decides as the ranks "
            "below.  [default: 1; 1<=x<=1024]") in options["-dp"], options["-dp"]
    capability = options["--compute-capability"]
    assert "X.Y" in capability and "[default: this machine's GPU, if one is visible]" in capability, capability
    assert "\\[" not in r.stdout
    assert "marlin-pack check ./Llama-3-70B-AWQ --compute-capability 9.0    # as an H100/H200 engine would decide" in r.stdout


@pytest.mark.parametrize("argv", [[], ["convert"], ["verify"], ["inspect"], ["cache"], ["cache", "rm"], ["daemon"], ["env"]])
def test_no_help_in_a_pipe_shows_a_type_for_a_flag(argv: list[str]) -> None:
    r = _piped(*argv, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout, r.stderr
    assert "<bool>" not in r.stdout and "…" not in r.stdout, r.stdout


def test_a_terminal_still_gets_panels_and_flags_take_no_type() -> None:
    """On a terminal (here: a pseudo-terminal), typer's panels as wide as it, no `<bool>` after a flag."""
    pty = pytest.importorskip("pty")
    out = bytearray()

    def read(fd: int) -> bytes:
        data = os.read(fd, 1024)
        out.extend(data)
        return data

    env = {k: v for k, v in os.environ.items() if k not in _TTY_ENV}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({**env, "COLUMNS": "120", "NO_COLOR": "1"})
    try:
        pty.spawn([sys.executable, "-c", _CODE, "verify", "--help"], read)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode(errors="replace"))  # styles (bold stays under NO_COLOR)
    assert "╭─ Options" in text and "--integrity-only" in text, text
    assert "<bool>" not in text and "<path>" in text, text


def test_a_usage_error_in_a_pipe_is_one_whole_line() -> None:
    r = _piped("convert", "/nonexistent", "--tp", "1,,2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: Invalid value for --tp: '1,,2': expected positive sizes separated by commas, like 1 or 1,2,4,8"], r.stderr
    assert "╭" not in r.stderr


def test_env_in_a_pipe_prints_every_patch_target_whole() -> None:
    from importlib.metadata import version

    from marlin_pack.patch_list import patch_rows

    r = _piped("env")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    rows = patch_rows(version("vllm"))
    lines = r.stdout.splitlines()
    for purpose, target, remove_when in rows:  # each row whole, on one line
        assert any(target in line and purpose in line and remove_when in line for line in lines), target


def test_cache_ls_in_a_pipe_prints_model_and_path_whole(make_bundle, tmp_path: Path) -> None:
    model = "an-organisation-with-a-long-name/Some-Model-70B-Instruct-AWQ-with-a-longer-name"
    entry = tmp_path / "a cache folder with a long name" / f"models--{model.replace('/', '--')}" / ("c" * 40)
    entry.parent.mkdir(parents=True)
    shutil.copytree(make_bundle("awq", "tiny") / "marlin-pack", entry)
    r = _piped("cache", "ls", env={"MARLIN_PACK_CACHE": str(entry.parent.parent)})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    row = next(line for line in r.stdout.splitlines() if model in line)
    assert str(entry) in row and "c" * 12 in row and "float16" in row, r.stdout
