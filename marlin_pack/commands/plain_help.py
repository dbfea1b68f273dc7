"""Help that survives a pipe: typer's rich panels on a terminal; elsewhere click's plain help, one line per option.

On a terminal typer lays help out in panels as wide as the terminal. Piped (``marlin-pack check --help | less``, a
container's log, a file), a panel is 80 columns and squeezes its columns until option names and defaults are cut
with "…"; plain help prints every name and every sentence whole instead, and never wraps a line, so that
``grep`` finds an option with its whole help. Either way a flag takes no value, so it shows none (typer's
``<bool>``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from typer.core import TyperCommand, TyperGroup, TyperOption

__all__ = ["Command", "Group"]

_UNWRAPPED = 100_000


def _terminal(stream: Any = None) -> bool:
    try:
        return (stream or sys.stdout).isatty()
    except (AttributeError, ValueError):  # no stdout, or a closed one
        return False


def _flags_without_metavar(params: list[Any]) -> list[Any]:
    for p in params:
        if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
            p.metavar = ""  # typer would show <bool>: a flag is given or not
    return params


@contextmanager
def _plain(command: TyperCommand | TyperGroup, formatter: Any) -> Iterator[None]:
    """typer's help without rich (click's), unwrapped, rich's markup escapes (``\\[default: ...]``) read as the
    text they stand for."""
    formatter.width = _UNWRAPPED
    mode, command.rich_markup_mode = command.rich_markup_mode, None
    try:
        yield
    finally:
        command.rich_markup_mode = mode
    formatter.buffer = [piece.replace("\\[", "[") for piece in formatter.buffer]


class _PlainHelp:
    """Help plain where stdout is not a terminal; flags without a metavar (mixed into a click command or group)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_metavar(super().get_params(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> Any:
        if _terminal():
            return super().format_help(ctx, formatter)
        with _plain(self, formatter):
            return super().format_help(ctx, formatter)


class Command(_PlainHelp, TyperCommand):
    """A command whose help is plain where stdout is not a terminal; flags without a metavar."""


class Group(_PlainHelp, TyperGroup):
    """A command group whose help is plain where stdout is not a terminal, and whose usage errors are click's plain
    lines where stderr is not one (``Error: Invalid value for '--tp': ...`` whole, not wrapped in an 80-column
    panel); flags without a metavar."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not _terminal(sys.stderr):
            self.rich_markup_mode = None
        return super().main(*args, **kwargs)
