"""Untrusted text is shown with its control characters escaped: in strings, log records and progress lines."""

from __future__ import annotations

import io
import json
import logging

import pytest

from marlin_pack.shown import UNSAFE, ShownFilter, show_log_records, shown

HOSTILE = "m\x1b]0;title\x07\x1b[2J\nrank 0/1: load"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),
        ("\x1b[2J", "\\x1b[2J"),
        ("\nrank 0/1: load", "\\nrank 0/1: load"),
        ("a\tb\rc\x00d\x7fe", "a\\tb\\rc\\x00d\\u007fe"),
        ("\x85\x9b", "\\u0085\\u009b"),  # C1: NEL, CSI
        ("x\u2028y\u2029z", "x\\u2028y\\u2029z"),
        ("\u202aa\u202eb\u2066c\u2069", "\\u202aa\\u202eb\\u2066c\\u2069"),  # bidi embeddings, overrides, isolates
        ("\udcff.safetensors", "\\udcff.safetensors"),  # a non-UTF-8 name as Python decodes it
        ("plain é 模型 [x] \\x1b C:\\dir", "plain é 模型 [x] \\x1b C:\\dir"),  # printable text and backslashes as they are
    ],
)
def test_shown_escapes_every_control_and_nothing_else(text: str, want: str) -> None:
    assert shown(text) == want
    assert shown(want) == want and not UNSAFE.search(want)  # shown twice is shown once


def test_shown_text_reads_back_as_the_same_json_string() -> None:
    """A sink may show JSON text: json.dumps leaves DEL, C1 and U+2028 raw (ensure_ascii=False); shown writes them as
    escapes JSON reads as the same characters."""
    value = "a\x7f\x85\u2028\u202e\udcffb"
    text = json.dumps({"k": value}, ensure_ascii=False)
    assert json.loads(shown(text).replace("\\udcff", "")) == {"k": value.replace("\udcff", "")}


def test_log_records_through_the_plugin_logger_are_shown() -> None:
    import marlin_pack.vllm_plugin  # noqa: F401  (installs the filter on marlin-pack's logger, without importing vLLM)

    logger = logging.getLogger("vllm.marlin_pack")
    assert sum(isinstance(f, ShownFilter) for f in logger.filters) == 1
    assert show_log_records(logger) is logger and sum(isinstance(f, ShownFilter) for f in logger.filters) == 1
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        logger.warning("marlin-pack: not using the bundle %s ([%s] %s)", f"/m/{HOSTILE}", "files", f"tensor {HOSTILE}")
        logger.warning("marlin-pack: a line without arguments")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    shown_hostile = "m\\x1b]0;title\\x07\\x1b[2J\\nrank 0/1: load"
    assert lines == [
        f"marlin-pack: not using the bundle /m/{shown_hostile} ([files] tensor {shown_hostile})",
        "marlin-pack: a line without arguments",
    ]


def test_plain_progress_lines_show_names() -> None:
    from marlin_pack.progress import PlainProgress

    buf = io.StringIO()
    p = PlainProgress(buf, "converting", interval=0, clock=iter(range(100)).__next__)
    p.update(1, 2, f"model.layers.0.{HOSTILE}")
    p.finish()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and not UNSAFE.search(buf.getvalue().replace("\n", ""))
    assert lines[0].startswith("marlin-pack: converting layer 1/2 (model.layers.0.m\\x1b]0;title\\x07\\x1b[2J\\nrank 0/1: load)")
