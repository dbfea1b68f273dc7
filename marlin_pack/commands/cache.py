"""``marlin-pack cache ls`` and ``marlin-pack cache rm``: the bundles of model ids in marlin-pack's cache."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from marlin_pack.commands.console import out, styled
from marlin_pack.commands.params import JsonOpt
from marlin_pack.errors import MarlinPackError

__all__ = ["cache_app"]

cache_app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                        help="List or remove the bundles of model ids.")


@cache_app.command("ls")
def cache_ls(as_json: JsonOpt = False) -> None:
    """List the bundles of model ids in marlin-pack's cache (beside the Hugging Face cache, or $MARLIN_PACK_CACHE).

    Examples:

      marlin-pack cache ls
    """
    from marlin_pack.sources.cache import cache_root, cached_bundles

    entries = cached_bundles()
    if as_json:
        out.print_json(json.dumps([e.to_dict() for e in entries]))
        return
    table = Table("model", "commit", "tp", "dtype", "size", "path", title=f"bundles in {cache_root()}")
    for e in entries:
        table.add_row(e.repo_id, e.commit[:12], e.tp_text, e.dtype, f"{e.size / 1e9:,.2f} GB", str(e.path))
    out.print(table)


@cache_app.command("rm")
def cache_rm(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="The model id (org/name) whose bundles to remove.")],
    revision: Annotated[
        str | None, typer.Option("--revision", help="Remove only this commit's bundle \\[default: every commit's].")
    ] = None,
) -> None:
    """Remove the cached bundles of a model id (never its checkpoint in the Hugging Face cache).

    Examples:

      marlin-pack cache rm Qwen/Qwen2.5-7B-Instruct-AWQ
    """
    from marlin_pack.sources.cache import remove_cached

    removed = remove_cached(model, revision)
    if not removed:
        raise MarlinPackError(f"no cached bundle of {model}{'' if revision is None else ' at ' + revision}; see `marlin-pack cache ls`")
    for path in removed:
        out.print(styled(("removed", "green"), f" {path}"), soft_wrap=True, highlight=False)
