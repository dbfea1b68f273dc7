"""The CLI's two consoles (``out``, ``err``) and its styled one-line texts.

Everything the CLI prints goes through them, and they show every string with its control characters escaped
(:mod:`marlin_pack.shown`): a path, manifest string or tensor name cannot drive the terminal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console, ConsoleDimensions, ConsoleOptions, RenderableType
from rich.json import JSON
from rich.protocol import rich_cast
from rich.segment import Segment
from rich.text import Span, Text

from marlin_pack.shown import UNSAFE, shown

__all__ = ["PIPE_WIDTH", "BadParameter", "ShownConsole", "err", "out", "progress", "styled"]

# Where output is not a terminal (a pipe, a file, a container's log), lines are as long as their text: a table is as
# wide as its cells, never squeezed to 80 columns and cut with "…" (a patch target, a model id, a path).
PIPE_WIDTH = 100_000


def _shown_text(text: Text, keep: str = "") -> Text:
    """``text`` with its characters :func:`~marlin_pack.shown.shown` (control characters escaped) but those in
    ``keep``, its styles kept."""
    plain = text.plain
    if not any(ch not in keep for ch in UNSAFE.findall(plain)):
        return text
    pieces = [ch if ch in keep else shown(ch) for ch in plain]
    at = [0]  # where each character of plain starts in the shown text
    for piece in pieces:
        at.append(at[-1] + len(piece))
    safe = Text("".join(pieces), style=text.style, justify=text.justify, overflow=text.overflow, no_wrap=text.no_wrap,
                end=text.end, tab_size=text.tab_size)
    safe.spans = [Span(at[sp.start], at[min(sp.end, len(plain))], sp.style) for sp in text.spans]
    return safe


class ShownConsole(Console):
    """A console that shows every string and :class:`~rich.text.Text` it renders (tables' cells and titles,
    progress columns, JSON included) through :func:`~marlin_pack.shown.shown`: a path, manifest string or tensor
    name with an escape sequence or a newline prints as ``\\x1b``/``\\n``, never moving the cursor or starting a
    line. The lines, tables and colours rich lays out itself are not text it is given, so they stay as they are.

    Not on a terminal, and given no width, it is :data:`PIPE_WIDTH` wide whatever ``COLUMNS`` says: piped text is
    whole (a terminal's width still lays out what a terminal shows)."""

    def __init__(self, *args, width: int | None = None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, width=width, **kwargs)
        self._asked_width = width

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._asked_width is not None or self.is_terminal:
            return dims
        return ConsoleDimensions(PIPE_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]
        self._asked_width = new_size[0]

    def render_str(self, text: str, **kwargs) -> Text:  # type: ignore[no-untyped-def,override]
        return super().render_str(shown(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        renderable = rich_cast(renderable)
        if isinstance(renderable, Text):
            renderable = _shown_text(renderable)
        return super().render(renderable, options)

    def print_json(self, json: str, **kwargs) -> None:  # type: ignore[no-untyped-def,override]
        """As rich prints JSON text (indented, highlighted), the rest shown: json.dumps escapes the C0 controls inside
        strings, so every newline left is the layout's, and the others are escaped as JSON reads them (``\\u2028``)."""
        self.print(_Shown(_shown_text(JSON(json, **kwargs).text, keep="\n")), soft_wrap=True)


class _Shown:
    """A :class:`~rich.text.Text` shown already, its newlines kept: rendered as it is (a Text would be shown again)."""

    def __init__(self, text: Text) -> None:
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterable[Segment]:
        yield from self.text.__rich_console__(console, options)


# User text (paths, model and tensor names, messages quoting them) is printed as plain text, its control
# characters escaped (ShownConsole): these consoles read no markup and no emoji codes in strings, so
# "x[/y]" cannot raise and "Llama [old]" keeps "[old]". Colours come as Text spans (styled), never as
# markup inside strings.
out = ShownConsole(markup=False, emoji=False)
err = ShownConsole(stderr=True, markup=False, emoji=False)


class BadParameter(typer.BadParameter):
    """A usage error whose text typer prints (in its own panel, not through ``err``) shown like the rest."""

    def format_message(self) -> str:
        return shown(super().format_message())


def styled(*parts: str | tuple[str, str]) -> Text:
    """One line of plain text with styled spans, e.g. ``styled(("error:", "red"), " ", message)``. Its parts are
    shown first: rich drops some control characters (CR, BEL) from a Text silently, shown writes them as escapes."""
    return Text.assemble(*((shown(p) if isinstance(p, str) else (shown(p[0]), p[1])) for p in parts))


@contextmanager
def progress(enabled: bool, what: str) -> Iterator[Callable[..., None] | None]:
    """A rich bar on a terminal, plain flushed lines in logs and pipes, nothing for --json (see marlin_pack.progress)."""
    from marlin_pack.progress import progress_reporter

    with progress_reporter(err, enabled, what) as update:
        yield update
