"""The docs' generated tables match the code they describe; the README stays a user's page; links hold."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from marlin_pack import _docs
from marlin_pack._docs import DOCS, architecture_table, render
from marlin_pack.marlin.architectures import ARCHITECTURES

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("rel", sorted(DOCS))
def test_generated_tables_are_current(rel: str) -> None:
    text = (ROOT / rel).read_text()
    assert render(text, DOCS[rel]) == text, f"{rel}: generated tables are stale: run `python -m marlin_pack._docs`"


def test_a_stale_table_is_caught() -> None:
    text = (ROOT / "docs/architectures.md").read_text()
    stale = text.replace("| `LlamaForCausalLM` |", "| `LlamaForCausalLMX` |", 1)
    assert stale != text and render(stale, DOCS["docs/architectures.md"]) != stale


def test_main_rewrites_the_pages_it_is_given(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "architectures.md"
    page.parent.mkdir()
    page.write_text("x\n<!-- architectures:begin -->\nold\n<!-- architectures:end -->\n<!-- paths:begin -->\nold\n<!-- paths:end -->\n")
    assert _docs.main([str(page)]) == 0
    assert "| `LlamaForCausalLM` |" in page.read_text() and "old" not in page.read_text()
    assert "| `Olmo2ForCausalLM` | Transformers backend |" in page.read_text()


def test_every_architecture_is_in_the_table() -> None:
    table = architecture_table()
    assert all(f"| `{name}` |" in table for name in ARCHITECTURES)


def test_render_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="architectures:begin"):
        render("no markers here")


def test_readme_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    first = lines.index("```bash")
    assert lines[first + 1] == (
        "python3 -m venv .venv && .venv/bin/pip install -e . -c tools/torch-constraint.txt && .venv/bin/python examples/quickstart.py"
    )
    marker = lines.index("<!-- test-command -->")
    assert marker > first and lines[marker + 2] == "bash tools/vllm-env.sh 0.34.0 .venv && bash tools/run-tests.sh"


def test_first_command_installs_the_torch_the_test_command_keeps() -> None:
    """The README's two commands share .venv: the first pins the torch that the test command's vLLM pins, so the
    second neither fetches another torch nor swaps it (and the first, run again, keeps it)."""
    pins = [line.split("#")[0].strip() for line in (ROOT / "tools/torch-constraint.txt").read_text().splitlines()]
    pins = [pin for pin in pins if pin]
    assert len(pins) == 1 and pins[0].startswith("torch==")
    lines = README.read_text().splitlines()
    newest = lines[lines.index("<!-- test-command -->") + 2].split()[2]
    try:
        installed = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed: its torch pin cannot be read")
    if installed != newest:
        pytest.skip(f"vLLM {installed} is installed, the README's test command installs {newest}")
    vllm_torch = [r.split(";")[0].replace(" ", "") for r in metadata.requires("vllm") or [] if r.startswith("torch=")]
    assert vllm_torch == [pins[0]], f"vLLM {newest} requires {vllm_torch}; tools/torch-constraint.txt says {pins[0]}"


def test_performance_page_is_short() -> None:
    assert len((ROOT / "docs/performance.md").read_text().splitlines()) <= 300


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_exist(page: Path) -> None:
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), f"{page.name}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_user_pages_state_current_facts(page: Path) -> None:
    """User pages say what is true now: no issue numbers and no paths outside the repository (history stays in git)."""
    text = page.read_text()
    assert not re.findall(r"\bissues? #?\d+", text, re.I), f"{page.name} cites an issue number"
    assert "../shared" not in text and "/work/" not in text, f"{page.name} points outside the repository"
