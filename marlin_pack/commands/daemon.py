"""``marlin-pack daemon``: vLLM's weight-cache daemon (vllm preload) filled from MODEL's bundle."""

from __future__ import annotations

import shlex

import typer

from marlin_pack.commands.console import err
from marlin_pack.commands.params import ModelArg, local_or_repo
from marlin_pack.errors import MarlinPackError

__all__ = ["daemon"]


def daemon(ctx: typer.Context, model: ModelArg) -> None:
    """Run vLLM's weight-cache daemon (vllm preload) for MODEL, filled from its bundle.

    MODEL comes first; every other argument goes to `vllm preload` unchanged (--load-format defaults to marlin_prepacked). Engines attach with `vllm serve MODEL --load-format ipc_cache`.

    Examples:

      marlin-pack daemon ./Llama-3-8B-AWQ -tp 2
    """  # noqa: E501
    _check_gpus(ctx.args)  # first: nothing else to check matters on a machine without them
    from marlin_pack.vllm_plugin.launcher import preload_argv, run

    argv = preload_argv(local_or_repo(model, None), ctx.args)
    err.print(f"marlin-pack: vllm {shlex.join(argv)}", highlight=False, soft_wrap=True, markup=False)
    run(argv)


def _check_gpus(args: list[str]) -> None:
    """Enough GPUs for the daemon (its -tp x -pp), asked of NVML before vLLM starts: vLLM would find out after its
    imports and engine setup (~14 s), in a traceback."""
    from marlin_pack.gpu.gpu_room import visible_gpus

    need = _size(args, "-tp", "--tensor-parallel-size") * _size(args, "-pp", "--pipeline-parallel-size")
    have, why = visible_gpus()
    if have == 0:
        raise MarlinPackError(f"marlin-pack daemon fills GPU memory, and {why}; run it on a machine with the engines' GPUs")
    if have < need:
        raise MarlinPackError(
            f"marlin-pack daemon with {need} GPUs (-tp x -pp), {have} visible here; run it where the engines' GPUs are, "
            "or lower -tp/-pp to what the engines use"
        )


def _size(args: list[str], *names: str) -> int:
    """``-tp 2`` / ``--tensor-parallel-size=2`` among vllm's arguments (1 when absent or not a number: vLLM says so)."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, rest = arg.partition("=")
        if flag.replace("_", "-") in names:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else 1
