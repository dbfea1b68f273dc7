"""``marlin-pack verify`` and ``marlin-pack inspect``: what a bundle holds, and whether it is intact and faithful."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from marlin_pack.commands.api_words import as_cli
from marlin_pack.commands.console import out, progress
from marlin_pack.commands.params import JsonOpt, RevisionOpt, TargetArg, bundle_of, local_dir
from marlin_pack.errors import MarlinPackError

__all__ = ["inspect", "render_manifest", "verify"]


def verify(
    target: TargetArg,
    source: Annotated[
        Path | None, typer.Option("--source", help="Checkpoint the bundle was made from \\[default: MODEL, or the bundle's parent].")
    ] = None,
    integrity_only: Annotated[
        bool, typer.Option("--integrity-only", help="Check the bundle alone (files, hashes, tensors); skip the source checks.")
    ] = False,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Prove a bundle is intact and faithful to its source.

    Exit 0 only when every check ran and passed (with --integrity-only: every bundle check); exit 1 when a check failed or the source checks could not run.

    Examples:

      marlin-pack verify ./Llama-3-8B-AWQ

      marlin-pack verify Qwen/Qwen2.5-7B-Instruct-AWQ --integrity-only
    """  # noqa: E501
    from marlin_pack.verification import verify as run_verify

    bundle, model = bundle_of(target, revision)
    source = local_dir(source, "--source")
    with progress(not as_json, "round trip") as update:
        report = run_verify(bundle, source if source is not None else model, integrity_only=integrity_only, progress=update)
    if as_json:
        out.print_json(json.dumps({"bundle": str(bundle), "ok": report.ok, "checks": [c.to_dict() for c in report.checks]}))
    else:
        table = Table("check", "result", "detail", title=f"verify {bundle}")
        marks = {"ok": Text("ok", "green"), "failed": Text("FAILED", "red"), "skipped": Text("skipped", "yellow")}
        for c in report.checks:
            table.add_row(c.name, marks[c.status], as_cli(c.detail))
        out.print(table)
    failed = report.first_failure
    if failed is not None:
        raise MarlinPackError(f"verify failed at {failed.name}: {failed.detail}")
    if report.incomplete:
        raise MarlinPackError(
            f"verify could not check {bundle} against its checkpoint: pass --source MODEL_DIR, "
            "or --integrity-only to check the bundle alone"
        )


def inspect(target: TargetArg, revision: RevisionOpt = None, as_json: JsonOpt = False) -> None:
    """Show what a bundle holds, and where it is.

    Examples:

      marlin-pack inspect ./Llama-3-8B-AWQ

      marlin-pack inspect Qwen/Qwen2.5-7B-Instruct-AWQ --json
    """
    from marlin_pack.bundle.reader import read_manifest

    bundle, _ = bundle_of(target, revision)
    manifest = read_manifest(bundle)
    if as_json:
        out.print_json(json.dumps({"bundle": str(bundle), "manifest": manifest.model_dump(mode="json")}))
        return
    render_manifest(manifest, bundle)


def render_manifest(manifest, bundle: Path) -> None:  # type: ignore[no-untyped-def]
    """The manifest as two tables: where the bundle is and what it holds, then its tensor-parallel sets."""
    src = manifest.source
    info = Table.grid(padding=(0, 2))
    info.add_row("bundle", str(bundle))
    info.add_row("source", f"{src.format.value} {src.architecture}, {len(src.files)} file(s), digest {src.digest[:16]}…")
    q = manifest.quant
    info.add_row("weights", f"{q.weight_type.value} ({q.bits}-bit), group size {q.group_size}, zero points {q.zero_points}")
    info.add_row("serving dtype", manifest.serving_dtype.value)
    layouts = "MacheteLinearKernel (SM90) per layer, else MarlinLinearKernel" if manifest.has_machete_layers else manifest.target.kernel
    info.add_row("target", f"vLLM {manifest.target.vllm_version}, {layouts} layout v{manifest.target.layout_version}")
    moe = manifest.tensor_parallel[0].moe_layers
    if moe:
        per_tp = ", ".join(f"tp {s.tp_size}: {s.moe_layers[0].intermediate_size} (padded {s.moe_layers[0].padded_intermediate})"
                           for s in manifest.tensor_parallel)
        info.add_row("experts", f"{len(moe)} Marlin MoE layers x {moe[0].num_experts} experts; intermediate per rank {per_tp}")
    out.print(info)
    table = Table("tp", "files", "size", "layers", "kernels", "padded layers", title="tensor-parallel sets")
    for s in manifest.tensor_parallel:
        padded = sum(1 for e in s.layers if (e.padded_k, e.padded_n) != (e.size_k, e.size_n))
        size = sum(r.file.size for r in s.ranks)
        kernels = Counter(e.kernel.value for e in s.layers)
        mix = ", ".join(f"{kernels[k]} {k}" for k in ("machete", "marlin") if kernels[k])
        table.add_row(str(s.tp_size), str(len(s.ranks)), f"{size / 1e6:,.1f} MB", str(len(s.layers)), mix, str(padded))
    table.add_row("common", "1", f"{manifest.common.size / 1e6:,.1f} MB", "-", "-", "-")
    out.print(table)
