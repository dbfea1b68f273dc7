"""The ``marlin-pack`` command line: a thin layer over the library API. Never imports vLLM."""

from __future__ import annotations

import gc
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from marlin_pack._constants import DEBUG_ENV
from marlin_pack._version import __version__
from marlin_pack.errors import MarlinPackError

app = typer.Typer(
    name="marlin-pack",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    help="Convert AWQ/GPTQ checkpoints into vLLM 0.33.0's Marlin layout, offline, and verify the result.",
)
# User text (paths, model and tensor names, messages quoting them) is printed as it is: these consoles
# read no markup and no emoji codes in strings, so "x[/y]" cannot raise and "Llama [old]" keeps "[old]".
# Colours come as Text spans (_styled), never as markup inside strings; every str printed is plain text.
out = Console(markup=False, emoji=False)
err = Console(stderr=True, markup=False, emoji=False)


def _styled(*parts: str | tuple[str, str]) -> Text:
    """One line of plain text with styled spans, e.g. ``_styled(("error:", "red"), " ", message)``."""
    return Text.assemble(*parts)

ModelArg = Annotated[
    str, typer.Argument(metavar="MODEL", help="Checkpoint directory, or a Hugging Face model id (org/name) as given to vllm serve.")
]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit of a model id \\[default: main].")]
BundleArg = Annotated[Path, typer.Argument(help="Bundle directory (default location: MODEL_DIR/marlin-pack).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


def _parse_tp(value: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise typer.BadParameter(f"{value!r}: expected sizes like 1 or 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"{value!r}: expected positive sizes like 1 or 1,2,4,8")
    return sizes


@contextmanager
def _progress(enabled: bool, what: str) -> Iterator[Callable[[int, int, str], None] | None]:
    if not enabled or not err.is_terminal:  # no bar (nor stray newlines) in logs and pipes
        yield None
        return
    with Progress(
        TextColumn(what, style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}", markup=False),  # a file or layer name: plain text, never markup
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)

        yield update


@app.command()
def convert(
    model_dir: ModelArg,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Bundle directory \\[default: MODEL_DIR/marlin-pack].")] = None,
    tp: Annotated[str, typer.Option("--tp", help="Tensor-parallel sizes to write, e.g. 1,2,4,8.")] = "1",
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Serving dtype: float16 or bfloat16 \\[default: what vllm serve --dtype auto picks].")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle.")] = False,
    device: Annotated[str, typer.Option("--device", help="Where to do the tensor work: cpu or cuda.")] = "cpu",
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a Marlin bundle for MODEL (engine-free; CPU is enough)."""
    from marlin_pack.conversion import convert as run_convert

    model_dir = _absolute_if_local(model_dir)
    try:
        with _progress(not as_json, "converting") as progress:
            manifest = run_convert(
                model_dir, output, tp_sizes=_parse_tp(tp), dtype=dtype, force=force, device=device, revision=revision, progress=progress
            )
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM/SIGHUP (Interrupted): the writer removed its files
        signum = getattr(e, "signum", 2)
        err.print(_styled(("interrupted", "red"), f" ({e or 'SIGINT'}): nothing was written (partial output removed)"), highlight=False)
        raise typer.Exit(128 + signum) from None
    bundle = output or _default_bundle(model_dir, revision)
    if as_json:
        out.print_json(json.dumps({"bundle": str(bundle), "manifest": manifest.model_dump(mode="json")}))
        return
    _render_manifest(manifest, bundle)
    out.print(_styled(("wrote", "green"), f" {bundle}"), soft_wrap=True)


@app.command()
def verify(
    bundle: BundleArg,
    source: Annotated[
        Path | None, typer.Option("--source", help="Checkpoint the bundle was made from \\[default: the bundle's parent].")
    ] = None,
    integrity_only: Annotated[
        bool, typer.Option("--integrity-only", help="Check the bundle alone (files, hashes, tensors); skip the source checks.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Prove a bundle is intact and faithful to its source.

    Exit 0 only when every check ran and passed (with --integrity-only: every bundle check);
    exit 1 when a check failed or the source checks could not run.
    """
    from marlin_pack.verification import verify as run_verify

    with _progress(not as_json, "round trip") as progress:
        report = run_verify(bundle, source, integrity_only=integrity_only, progress=progress)
    if as_json:
        out.print_json(json.dumps({"ok": report.ok, "checks": [c.to_dict() for c in report.checks]}))
    else:
        table = Table("check", "result", "detail", title=f"verify {bundle}")
        marks = {"ok": Text("ok", "green"), "failed": Text("FAILED", "red"), "skipped": Text("skipped", "yellow")}
        for c in report.checks:
            table.add_row(c.name, marks[c.status], c.detail)
        out.print(table)
    failed = report.first_failure
    if failed is not None:
        raise MarlinPackError(f"verify failed at {failed.name}: {failed.detail}")
    if report.incomplete:
        raise MarlinPackError(
            f"verify could not check {bundle} against its checkpoint: pass --source MODEL_DIR, "
            "or --integrity-only to check the bundle alone"
        )


@app.command()
def check(
    model_dir: ModelArg,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Bundle directory \\[default: MODEL_DIR/marlin-pack].")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, max=1024, help="The engine's --tensor-parallel-size.")] = 1,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Check one rank only \\[default: every rank].")] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="The engine's --dtype: float16 or bfloat16 \\[default: what --dtype auto picks].")
    ] = None,
    verify_mode: Annotated[str, typer.Option("--verify", help="auto (hash what changed), full or size, as the loader.")] = "auto",
    fallback: Annotated[bool, typer.Option("--fallback", help="As the loader's fallback: a bad bundle means loading ordinarily.")] = False,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decide, as the marlin_prepacked loader would, whether an engine can serve MODEL_DIR from its bundle.

    Runs the loader's own pre-GPU checks for every rank (no GPU, no vLLM start): manifest, engine fit, source binding, file integrity, rank headers.

    Exit 0 to load (or, with --fallback, to fall back), 1 to refuse.
    """  # noqa: E501
    from marlin_pack.vllm_plugin.preflight import preflight

    model_dir = _absolute_if_local(model_dir)
    if rank is not None and rank >= tp:
        raise typer.BadParameter(f"--rank {rank} is outside --tp {tp}", param_hint="--rank")
    try:
        report = preflight(
            model_dir, bundle=bundle, tp_size=tp, rank=rank, dtype=dtype or _engine_dtype(model_dir, revision),
            verify=verify_mode, fallback=fallback, revision=revision,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        colour = {"load": "green", "fallback": "yellow", "refuse": "red"}
        for r in report.ranks:
            out.print(_styled(f"rank {r.rank}/{report.tp_size}: ", (r.decision, colour[r.decision]), f" {r.message}"), soft_wrap=True)
        if (hashed := report.hashed.summary()) is not None:
            out.print(f"check {hashed}", soft_wrap=True)
    if report.decision == "refuse":
        raise typer.Exit(1)


def _absolute_if_local(model: str) -> str:
    """A local directory as an absolute path (what vLLM and the bundle record see); a repo id as it is."""
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def _default_bundle(model: str, revision: str | None) -> Path:
    from marlin_pack.sources.hub import locate_bundle

    return locate_bundle(model, revision)


def _engine_dtype(model: str, revision: str | None) -> str:
    """The dtype a default `vllm serve MODEL` runs in (what --dtype auto picks)."""
    from marlin_pack.errors import CheckpointError
    from marlin_pack.io.checkpoint_files import read_json, weight_files
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.schemas import default_serving_dtype
    from marlin_pack.sources.hub import resolve_model

    try:
        model_dir = resolve_model(model, revision, download=False).dir
        config = read_json(model_dir / "config.json", "config.json")
        codes = {t.dtype for f in weight_files(model_dir) for t in read_header(model_dir / f).tensors.values()}
    except (CheckpointError, OSError, ValueError):
        return "float16"  # the source check reports what is wrong with the checkpoint
    return default_serving_dtype(config, codes).value


@app.command()
def inspect(bundle: BundleArg, as_json: JsonOpt = False) -> None:
    """Show what a bundle holds."""
    from marlin_pack.bundle.reader import read_manifest

    manifest = read_manifest(bundle)
    if as_json:
        out.print_json(manifest.to_json())
        return
    _render_manifest(manifest, bundle)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def daemon(ctx: typer.Context, model_dir: ModelArg) -> None:
    """Run vLLM's weight-cache daemon (vllm preload) for MODEL_DIR, filled from its bundle.

    MODEL_DIR comes first; every other argument goes to `vllm preload` unchanged
    (--load-format defaults to marlin_prepacked). Engines attach with
    `vllm serve MODEL_DIR --load-format ipc_cache`.
    """
    from marlin_pack.vllm_plugin.launcher import preload_argv, run

    argv = preload_argv(_absolute_if_local(model_dir), ctx.args)
    err.print(f"marlin-pack: vllm {shlex.join(argv)}", highlight=False, soft_wrap=True, markup=False)
    run(argv)


@app.command()
def env() -> None:
    """Say what marlin-pack changes in vLLM: the targeted release, the installed one, and each patch by purpose.

    Speed patches act only in processes that use marlin_prepacked, ipc_cache or `marlin-pack daemon`.
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    from marlin_pack._constants import TARGET_VLLM_VERSION
    from marlin_pack.patch_list import patch_rows

    try:
        running = installed_version("vllm")
    except PackageNotFoundError:
        running = "not installed"
    out.print(f"marlin-pack {__version__}; targets vLLM {TARGET_VLLM_VERSION}; installed vLLM {running}", highlight=False)
    if running != TARGET_VLLM_VERSION:
        out.print("the plugin installs no patch and registers no load format on this vLLM", highlight=False)
    table = Table("purpose", "patched in vLLM", "remove when", title="patches installed in every vLLM process")
    for purpose, target, remove_when in patch_rows():
        table.add_row(purpose, target, remove_when)
    out.print(table)


@app.command()
def schema() -> None:
    """Print the manifest's JSON schema."""
    from marlin_pack.schemas import manifest_json_schema

    out.print_json(json.dumps(manifest_json_schema(), sort_keys=True))


@app.command()
def version() -> None:
    """Print marlin-pack's version."""
    out.print(__version__)


def _render_manifest(manifest, bundle: Path) -> None:  # type: ignore[no-untyped-def]
    src = manifest.source
    info = Table.grid(padding=(0, 2))
    info.add_row("bundle", str(bundle))
    info.add_row("source", f"{src.format.value} {src.architecture}, {len(src.files)} file(s), digest {src.digest[:16]}…")
    q = manifest.quant
    info.add_row("weights", f"{q.weight_type.value} ({q.bits}-bit), group size {q.group_size}, zero points {q.zero_points}")
    info.add_row("serving dtype", manifest.serving_dtype.value)
    info.add_row("target", f"vLLM {manifest.target.vllm_version}, {manifest.target.kernel} layout v{manifest.target.layout_version}")
    moe = manifest.tensor_parallel[0].moe_layers
    if moe:
        per_tp = ", ".join(f"tp {s.tp_size}: {s.moe_layers[0].intermediate_size} (padded {s.moe_layers[0].padded_intermediate})"
                           for s in manifest.tensor_parallel)
        info.add_row("experts", f"{len(moe)} Marlin MoE layers x {moe[0].num_experts} experts; intermediate per rank {per_tp}")
    out.print(info)
    table = Table("tp", "files", "size", "layers", "padded layers", title="tensor-parallel sets")
    for s in manifest.tensor_parallel:
        padded = sum(1 for e in s.layers if (e.padded_k, e.padded_n) != (e.size_k, e.size_n))
        size = sum(r.file.size for r in s.ranks)
        table.add_row(str(s.tp_size), str(len(s.ranks)), f"{size / 1e6:,.1f} MB", str(len(s.layers)), str(padded))
    table.add_row("common", "1", f"{manifest.common.size / 1e6:,.1f} MB", "-", "-")
    out.print(table)


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
        err.print(_styled(("error:", "red"), f" {e}"), soft_wrap=True, highlight=False)
        err.print(_styled((f"(set {DEBUG_ENV}=1 for a traceback)", "dim")))
        sys.exit(1)
    except Exception as e:  # a bug, not bad input: still one line, but say so
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(
            _styled(("internal error:", "red"), f" {type(e).__name__}: {e}; set {DEBUG_ENV}=1 and report the traceback"),
            soft_wrap=True, highlight=False,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
