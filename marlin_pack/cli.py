"""The ``marlin-pack`` command line: a thin layer over the library API. Never imports vLLM.

This module makes the typer app of the commands (:mod:`marlin_pack.commands`, one module per concern) and its
console entry point, :func:`main`: bad input is one line on stderr and exit 1, never a traceback unless
``MARLIN_PACK_DEBUG`` is set. Everything is printed through the two consoles of
:mod:`marlin_pack.commands.console`, which show untrusted text with its control characters escaped.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Annotated

import typer

from marlin_pack._constants import DEBUG_ENV
from marlin_pack._version import __version__
from marlin_pack.commands import cache, check, convert, daemon, push, system, verify
from marlin_pack.commands.api_words import as_cli
from marlin_pack.commands.console import err, out, styled
from marlin_pack.commands.plain_help import Command, Group
from marlin_pack.errors import MarlinPackError

__all__ = ["app", "main"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    name="marlin-pack",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings=_CONTEXT,
    cls=Group,
    help="Convert AWQ/GPTQ/compressed-tensors checkpoints into vLLM's post-processed Marlin layout, offline, "
    "verify the result, and say what an engine will do with it.",
)


def _version(value: bool) -> None:
    if value:
        out.print(f"marlin-pack {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print marlin-pack's version and exit.")
    ] = False,
) -> None:
    """Convert AWQ/GPTQ/compressed-tensors checkpoints into vLLM's post-processed Marlin layout, offline."""


app.command("convert", cls=Command)(convert.convert)
app.command("verify", cls=Command)(verify.verify)
app.command("check", cls=Command)(check.check)
app.command("inspect", cls=Command)(verify.inspect)
app.command("push", cls=Command)(push.push)
app.add_typer(cache.cache_app, name="cache")
app.command("daemon", cls=Command, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(daemon.daemon)
app.command("env", cls=Command)(system.env)
app.command("schema", cls=Command)(system.schema)
app.command("version", cls=Command)(system.version)


def main() -> None:
    """Console entry point: one-line errors and exit code 1 instead of tracebacks."""
    try:
        _run_app()
    finally:
        # Python's exit runs a full garbage collection over every object the imports made (torch's
        # ~200k): 0.5-0.6 s of each command on the 2-core VM. Frozen, they are skipped (exit 0.2 s).
        gc.freeze()


def _run_app() -> None:
    try:
        app()
    except MarlinPackError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(styled(("error:", "red"), f" {as_cli(str(e))}"), soft_wrap=True, highlight=False)
        err.print(styled((f"(set {DEBUG_ENV}=1 for a traceback)", "dim")))
        sys.exit(1)
    except Exception as e:  # a bug, not bad input: still one line, but say so
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(
            styled(("internal error:", "red"), f" {type(e).__name__}: {e}; set {DEBUG_ENV}=1 and report the traceback"),
            soft_wrap=True, highlight=False,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
