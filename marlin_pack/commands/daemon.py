"""``marlin-pack daemon``: vLLM's weight-cache daemon (vllm preload) filled from MODEL's bundle."""

from __future__ import annotations

import shlex

import typer

from marlin_pack.commands.console import err
from marlin_pack.commands.params import ModelArg, local_or_repo

__all__ = ["daemon"]


def daemon(ctx: typer.Context, model: ModelArg) -> None:
    """Run vLLM's weight-cache daemon (vllm preload) for MODEL, filled from its bundle.

    MODEL comes first; every other argument goes to `vllm preload` unchanged (--load-format defaults to marlin_prepacked). Engines attach with `vllm serve MODEL --load-format ipc_cache`.

    Examples:

      marlin-pack daemon ./Llama-3-8B-AWQ -tp 2
    """  # noqa: E501
    from marlin_pack.vllm_plugin.launcher import preload_argv, run

    argv = preload_argv(local_or_repo(model, None), ctx.args)
    err.print(f"marlin-pack: vllm {shlex.join(argv)}", highlight=False, soft_wrap=True, markup=False)
    run(argv)
