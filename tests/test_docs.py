"""The README's generated tables match the code they describe."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlin_pack._docs import architecture_table, render
from marlin_pack.marlin.architectures import ARCHITECTURES

README = Path(__file__).parents[1] / "README.md"


def test_readme_tables_are_current() -> None:
    text = README.read_text()
    assert render(text) == text, "README tables are stale: run `python -m marlin_pack._docs README.md`"


def test_every_architecture_is_in_the_table() -> None:
    table = architecture_table()
    assert all(f"| `{name}` |" in table for name in ARCHITECTURES)


def test_render_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="architectures:begin"):
        render("no markers here")
