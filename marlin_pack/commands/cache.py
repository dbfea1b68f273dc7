"""``marlin-pack cache ls`` and ``marlin-pack cache rm``: the bundles of model ids in marlin-pack's cache."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from marlin_pack.commands.console import out, styled
from marlin_pack.commands.params import JsonOpt
from marlin_pack.commands.plain_help import Command, Group
from marlin_pack.errors import MarlinPackError

if TYPE_CHECKING:
    from marlin_pack.sources.cache import CachedBundle

__all__ = ["cache_app"]

cache_app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]}, cls=Group,
                        help="List or remove the bundles of model ids.")


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _table(entries: list[CachedBundle], title: str) -> Table:
    table = Table("model", "commit", "tp", "dtype", "size", "path", title=title)
    for e in entries:
        table.add_row(e.repo_id, e.commit[:12], e.tp_text, e.dtype, _size(e.size), str(e.path))
    return table


@cache_app.command("ls", cls=Command)
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
    out.print(_table(entries, f"bundles in {cache_root()}"))


@cache_app.command("rm", cls=Command)
def cache_rm(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="The model id (org/name) whose bundles to remove.")],
    revision: Annotated[
        str | None, typer.Option("--revision", help="Remove only this commit's bundle \\[default: every commit's].")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed, and its size; remove nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
) -> None:
    """Remove the cached bundles of a model id (never its checkpoint in the Hugging Face cache).

    Shows each bundle and its size, then asks (unless --yes); --dry-run shows them and removes nothing.

    Examples:

      marlin-pack cache rm Qwen/Qwen2.5-7B-Instruct-AWQ

      marlin-pack cache rm Qwen/Qwen2.5-7B-Instruct-AWQ --revision main --yes
    """
    from marlin_pack.sources.cache import cache_root, cached_of, remove_entries

    entries = cached_of(model, revision)
    if not entries:
        raise MarlinPackError(f"no cached bundle of {model}{'' if revision is None else ' at ' + revision}; see `marlin-pack cache ls`")
    total = _size(sum(e.size for e in entries))
    what = f"{len(entries)} bundle{'' if len(entries) == 1 else 's'} ({total})"
    out.print(_table(entries, f"{what} of {model} in {cache_root()}"))
    if dry_run:
        out.print(f"dry run: nothing removed; without --dry-run this removes {what}", soft_wrap=True, highlight=False)
        return
    if not yes:
        try:
            if not typer.confirm(f"Remove {what}?", default=False):
                out.print("nothing removed", highlight=False)
                return
        except typer.Abort:  # no answer (stdin closed or not a terminal): never remove on a guess
            raise MarlinPackError(f"no answer to 'Remove {what}?': nothing removed; pass --yes to remove without asking") from None
    for path, e in zip(remove_entries(entries), entries, strict=False):
        out.print(styled(("removed", "green"), f" {path} ({_size(e.size)})"), soft_wrap=True, highlight=False)
