"""``marlin-pack env``, ``schema`` and ``version``: facts about this installation."""

from __future__ import annotations

import json

from rich.table import Table

from marlin_pack._version import __version__
from marlin_pack.commands.console import out
from marlin_pack.commands.params import JsonOpt

__all__ = ["env", "schema", "version"]


def env(as_json: JsonOpt = False) -> None:
    """Versions (marlin-pack, vLLM, torch, CUDA), the plugin's registration and each patch by purpose: for bug reports.

    Speed patches act only in processes that use marlin_prepacked, ipc_cache or `marlin-pack daemon`.

    Examples:

      marlin-pack env
    """
    from marlin_pack.patch_list import environment, patch_rows

    facts = environment()
    rows = patch_rows(str(facts["vllm"])) if facts["plugin_active"] else []
    if as_json:
        out.print_json(json.dumps({**facts, "patches": [dict(zip(("purpose", "target", "remove_when"), r, strict=True)) for r in rows]}))
        return
    info = Table.grid(padding=(0, 2))
    for key, value in facts.items():
        info.add_row(key.replace("_", " "), str(value))
    out.print(info)
    if not facts["plugin_active"]:
        out.print("the plugin installs no patch on this vLLM; --load-format marlin_prepacked refuses in one line naming the "
                  "supported releases (or, with fallback, loads the checkpoint the ordinary way)", highlight=False)
        return
    table = Table("purpose", "patched in vLLM", "remove when", title="patches installed in every vLLM process")
    for purpose, target, remove_when in rows:
        table.add_row(purpose, target, remove_when)
    out.print(table)


def schema() -> None:
    """Print the manifest's JSON schema."""
    from marlin_pack.schemas import manifest_json_schema

    out.print_json(json.dumps(manifest_json_schema(), sort_keys=True))


def version() -> None:
    """Print marlin-pack's version (also: marlin-pack --version)."""
    out.print(__version__)
