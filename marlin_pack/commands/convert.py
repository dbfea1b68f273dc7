"""``marlin-pack convert``: a bundle for MODEL, said in a table (or JSON), or ``up to date``."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated

import typer

from marlin_pack.commands.api_words import as_cli
from marlin_pack.commands.console import err, out, progress, styled
from marlin_pack.commands.gpu import CapabilityOpt, engine_gpu, kernel_for_gpu
from marlin_pack.commands.params import (
    Device,
    Dtype,
    DtypeOpt,
    JsonOpt,
    Kernel,
    ModelArg,
    RevisionOpt,
    check_dtype_word,
    local_dir,
    local_or_repo,
    parse_tp,
)
from marlin_pack.commands.verify import render_manifest

__all__ = ["convert"]


def convert(
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Bundle directory \\[default: MODEL_DIR/marlin-pack].")] = None,
    tp: Annotated[
        str, typer.Option("--tp", "-tp", "--tensor-parallel-size", metavar="SIZES", help="Tensor-parallel sizes to write, e.g. 1,2,4,8.")
    ] = "1",
    dtype: DtypeOpt = Dtype.auto,
    force: Annotated[bool, typer.Option("--force", help="Rewrite the whole bundle, even an up-to-date one: only --tp's sizes.")] = False,
    device: Annotated[Device, typer.Option(
        "--device", help="Where to do the tensor work. On the CPU, Machete's layout takes 4-5x as long as Marlin's "
        "(about 35 minutes for a 40 GB model): with any CUDA GPU, pass --device cuda.")] = Device.cpu,
    kernel: Annotated[
        Kernel | None,
        typer.Option(
            "--kernel",
            help="machete: the layers as vLLM serves them on Hopper (SM90: Machete where it can, Marlin elsewhere); "
            "marlin: Marlin for every layer (other GPUs) \\[default: what vLLM picks on the GPU --compute-capability names, "
            "else on this machine's; Marlin without one].",
        ),
    ] = None,
    compute_capability: CapabilityOpt = None,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a bundle for MODEL (engine-free; CPU is enough): the tensors vLLM holds after post-processing.

    Idempotent and self-healing: an up-to-date bundle is reused (exit 0, nothing written); TP sizes it lacks are added and files damaged or stale (another checkpoint, --dtype or --kernel) rewritten, the rest kept; an empty directory is written into, one that is not a bundle refused. A conversion of the same output already running is waited for.

    Examples:

      marlin-pack convert ./Llama-3-8B-AWQ --tp 1,2

      marlin-pack convert Qwen/Qwen2.5-7B-Instruct-AWQ -tp 2 --dtype bfloat16

      marlin-pack convert ./Llama-3-70B-AWQ --compute-capability 9.0    # for H100/H200 engines, converted on any machine
    """  # noqa: E501
    from marlin_pack.conversion import convert as run_convert

    model = local_or_repo(model, revision)
    output = local_dir(output, "-o")
    check_dtype_word(dtype.value)
    chosen, why = kernel_for_gpu(None if kernel is None else kernel.value, engine_gpu(compute_capability))
    kernel = Kernel(chosen)
    try:
        with progress(not as_json, "converting") as update:
            result = run_convert(
                model, output, tp=parse_tp(tp), dtype=dtype.value, force=force, device=device.value, revision=revision,
                progress=update, kernel=kernel.value,
                on_wait=lambda line: err.print(f"marlin-pack: {line}", highlight=False, soft_wrap=True),
            )
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM/SIGHUP (Interrupted): the writer removed its files
        signum = getattr(e, "signum", signal.SIGINT)
        said = f" ({signal.Signals(signum).name}): nothing was written (partial output removed)"
        err.print(styled(("interrupted", "red"), said), highlight=False)
        raise typer.Exit(128 + signum) from None
    if as_json:
        body = {"bundle": str(result.bundle), "reused": result.reused, "done": as_cli(result.summary),
                "manifest": result.manifest.model_dump(mode="json")}
        out.print_json(json.dumps(body))
        return
    if why is not None:  # after the work: a refusal stays the first line of stderr
        err.print(f"marlin-pack: {why}", highlight=False, soft_wrap=True)
    if result.reused:
        sizes = ",".join(map(str, result.manifest.tp_sizes))
        hashed = result.hashed.summary()
        checked = f"; checked the checkpoint and the bundle: {hashed}" if hashed else ""
        out.print(
            styled(("up to date", "green"), f" {result.bundle} (tp {sizes}, {result.manifest.serving_dtype.value}); "
                   f"nothing written{checked}"),
            soft_wrap=True, highlight=False,
        )
        return
    render_manifest(result.manifest, result.bundle)
    out.print(styled(("wrote", "green"), f" {result.bundle}: {as_cli(result.summary)}"), soft_wrap=True, highlight=False)
