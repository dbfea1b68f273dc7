"""The ``marlin-pack`` command line: a thin layer over the library API. Never imports vLLM.

Everything it prints goes through two consoles (``out``, ``err``) that show every string with its control
characters escaped (:mod:`marlin_pack.shown`): a path, manifest string or tensor name cannot drive the terminal.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, ConsoleOptions, RenderableType
from rich.json import JSON
from rich.protocol import rich_cast
from rich.segment import Segment
from rich.table import Table
from rich.text import Span, Text

from marlin_pack._constants import DEBUG_ENV
from marlin_pack._version import __version__
from marlin_pack.errors import MarlinPackError
from marlin_pack.shown import UNSAFE, shown

_CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    name="marlin-pack",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings=_CONTEXT,
    help="Convert AWQ/GPTQ/compressed-tensors checkpoints into vLLM 0.33.0's post-processed Marlin layout, offline, "
    "verify the result, and say what an engine will do with it.",
)
cache_app = typer.Typer(no_args_is_help=True, context_settings=_CONTEXT, help="List or remove the bundles of model ids.")
app.add_typer(cache_app, name="cache")


def _shown_text(text: Text, keep: str = "") -> Text:
    """``text`` with its characters :func:`~marlin_pack.shown.shown` (control characters escaped) but those in
    ``keep``, its styles kept."""
    plain = text.plain
    if not any(ch not in keep for ch in UNSAFE.findall(plain)):
        return text
    pieces = [ch if ch in keep else shown(ch) for ch in plain]
    at = [0]  # where each character of plain starts in the shown text
    for piece in pieces:
        at.append(at[-1] + len(piece))
    safe = Text("".join(pieces), style=text.style, justify=text.justify, overflow=text.overflow, no_wrap=text.no_wrap,
                end=text.end, tab_size=text.tab_size)
    safe.spans = [Span(at[sp.start], at[min(sp.end, len(plain))], sp.style) for sp in text.spans]
    return safe


class _ShownConsole(Console):
    """A console that shows every string and :class:`~rich.text.Text` it renders (tables' cells and titles,
    progress columns, JSON included) through :func:`~marlin_pack.shown.shown`: a path, manifest string or tensor
    name with an escape sequence or a newline prints as ``\\x1b``/``\\n``, never moving the cursor or starting a
    line. The lines, tables and colours rich lays out itself are not text it is given, so they stay as they are."""

    def render_str(self, text: str, **kwargs) -> Text:  # type: ignore[no-untyped-def,override]
        return super().render_str(shown(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        renderable = rich_cast(renderable)
        if isinstance(renderable, Text):
            renderable = _shown_text(renderable)
        return super().render(renderable, options)

    def print_json(self, json: str, **kwargs) -> None:  # type: ignore[no-untyped-def,override]
        """As rich prints JSON text (indented, highlighted), the rest shown: json.dumps escapes the C0 controls inside
        strings, so every newline left is the layout's, and the others are escaped as JSON reads them (``\\u2028``)."""
        self.print(_Shown(_shown_text(JSON(json, **kwargs).text, keep="\n")), soft_wrap=True)


class _Shown:
    """A :class:`~rich.text.Text` shown already, its newlines kept: rendered as it is (a Text would be shown again)."""

    def __init__(self, text: Text) -> None:
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterable[Segment]:
        yield from self.text.__rich_console__(console, options)


# User text (paths, model and tensor names, messages quoting them) is printed as plain text, its control
# characters escaped (_ShownConsole): these consoles read no markup and no emoji codes in strings, so
# "x[/y]" cannot raise and "Llama [old]" keeps "[old]". Colours come as Text spans (_styled), never as
# markup inside strings.
out = _ShownConsole(markup=False, emoji=False)
err = _ShownConsole(stderr=True, markup=False, emoji=False)


class _BadParameter(typer.BadParameter):
    """A usage error whose text typer prints (in its own panel, not through ``err``) shown like the rest."""

    def format_message(self) -> str:
        return shown(super().format_message())


def _styled(*parts: str | tuple[str, str]) -> Text:
    """One line of plain text with styled spans, e.g. ``_styled(("error:", "red"), " ", message)``. Its parts are
    shown first: rich drops some control characters (CR, BEL) from a Text silently, shown writes them as escapes."""
    return Text.assemble(*((shown(p) if isinstance(p, str) else (shown(p[0]), p[1])) for p in parts))

ModelArg = Annotated[
    str, typer.Argument(metavar="MODEL", help="Checkpoint directory, or a Hugging Face model id (org/name) as given to vllm serve.")
]
TargetArg = Annotated[
    str, typer.Argument(metavar="MODEL|BUNDLE", help="A bundle directory, or MODEL (a checkpoint directory or a model id): its bundle.")
]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit of a model id \\[default: main].")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


class Dtype(str, Enum):
    """vLLM 0.33.0's --dtype words (float/float32 are refused: these layers run 16-bit activations)."""

    auto = "auto"
    half = "half"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float = "float"
    float32 = "float32"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Kernel(str, Enum):
    """The layout of the bundle's layers: vLLM's choice on SM90 per layer (machete), or Marlin for every layer."""

    marlin = "marlin"
    machete = "machete"


class VerifyMode(str, Enum):
    auto = "auto"
    full = "full"
    size = "size"


DtypeOpt = Annotated[
    Dtype, typer.Option("--dtype", help="The engine's --dtype, as vllm serve takes it (auto: what vLLM picks from config.json).")
]


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
    """Convert AWQ/GPTQ/compressed-tensors checkpoints into vLLM 0.33.0's post-processed Marlin layout, offline."""


def _parse_tp(value: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise _BadParameter(f"{value!r}: expected sizes like 1 or 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise _BadParameter(f"{value!r}: expected positive sizes like 1 or 1,2,4,8")
    return sizes


@contextmanager
def _progress(enabled: bool, what: str) -> Iterator[Callable[..., None] | None]:
    """A rich bar on a terminal, plain flushed lines in logs and pipes, nothing for --json (see marlin_pack.progress)."""
    from marlin_pack.progress import progress_reporter

    with progress_reporter(err, enabled, what) as update:
        yield update


@app.command()
def convert(
    model: ModelArg,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Bundle directory \\[default: MODEL_DIR/marlin-pack].")] = None,
    tp: Annotated[
        str, typer.Option("--tp", "-tp", "--tensor-parallel-size", help="Tensor-parallel sizes to write, e.g. 1,2,4,8.")
    ] = "1",
    dtype: DtypeOpt = Dtype.auto,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle, even an up-to-date one.")] = False,
    device: Annotated[Device, typer.Option("--device", help="Where to do the tensor work.")] = Device.cpu,
    kernel: Annotated[
        Kernel | None,
        typer.Option(
            "--kernel",
            help="machete: the layers as vLLM serves them on Hopper (SM90: Machete where it can, Marlin elsewhere); "
            "marlin: Marlin for every layer (other GPUs) \\[default: what vLLM picks on this machine's GPU; Marlin without one].",
        ),
    ] = None,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a bundle for MODEL (engine-free; CPU is enough): the tensors vLLM holds after post-processing.

    Idempotent: an up-to-date bundle for the same settings is reused (exit 0, nothing written), and a conversion of the same output already running is waited for, then its result reused.

    Examples:

      marlin-pack convert ./Llama-3-8B-AWQ --tp 1,2

      marlin-pack convert Qwen/Qwen2.5-7B-Instruct-AWQ -tp 2 --dtype bfloat16

      marlin-pack convert ./Llama-3-70B-AWQ --kernel machete    # for H100/H200 engines, converted on any machine
    """  # noqa: E501
    from marlin_pack.conversion import convert as run_convert
    from marlin_pack.kernel_choice import default_kernel

    model = _local_or_repo(model, revision)
    _check_dtype_word(dtype.value)
    why = None
    if kernel is None:
        chosen, why = default_kernel()
        kernel = Kernel(chosen.value)
    try:
        with _progress(not as_json, "converting") as progress:
            result = run_convert(
                model, output, tp=_parse_tp(tp), dtype=dtype.value, force=force, device=device.value, revision=revision,
                progress=progress, kernel=kernel.value,
                on_wait=lambda line: err.print(f"marlin-pack: {line}", highlight=False, soft_wrap=True),
            )
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM/SIGHUP (Interrupted): the writer removed its files
        signum = getattr(e, "signum", 2)
        err.print(_styled(("interrupted", "red"), f" ({e or 'SIGINT'}): nothing was written (partial output removed)"), highlight=False)
        raise typer.Exit(128 + signum) from None
    if as_json:
        body = {"bundle": str(result.bundle), "reused": result.reused, "manifest": result.manifest.model_dump(mode="json")}
        out.print_json(json.dumps(body))
        return
    if why is not None:  # after the work: a refusal stays the first line of stderr
        err.print(f"marlin-pack: --kernel {kernel.value}: {why}", highlight=False, soft_wrap=True)
    if result.reused:
        sizes = ",".join(map(str, result.manifest.tp_sizes))
        hashed = result.hashed.summary()
        checked = f"; checked the checkpoint: {hashed}" if hashed else ""
        out.print(
            _styled(("up to date", "green"), f" {result.bundle} (tp {sizes}, {result.manifest.serving_dtype.value}); "
                    f"nothing written{checked}"),
            soft_wrap=True, highlight=False,
        )
        return
    _render_manifest(result.manifest, result.bundle)
    out.print(_styled(("wrote", "green"), f" {result.bundle}"), soft_wrap=True)


@app.command()
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

    bundle, model = _bundle_of(target, revision)
    with _progress(not as_json, "round trip") as progress:
        report = run_verify(bundle, source if source is not None else model, integrity_only=integrity_only, progress=progress)
    if as_json:
        out.print_json(json.dumps({"bundle": str(bundle), "ok": report.ok, "checks": [c.to_dict() for c in report.checks]}))
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
    model: ModelArg,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Bundle directory \\[default: MODEL_DIR/marlin-pack].")] = None,
    tp: Annotated[
        int, typer.Option("--tp", "-tp", "--tensor-parallel-size", min=1, max=1024, help="The engine's --tensor-parallel-size.")
    ] = 1,
    pp: Annotated[
        int, typer.Option("-pp", "--pipeline-parallel-size", min=1, max=1024, help="The engine's --pipeline-parallel-size.")
    ] = 1,
    dp: Annotated[
        int,
        typer.Option("-dp", "--data-parallel-size", min=1, max=1024, help="The engine's --data-parallel-size: each replica "
                     "loads the same TP rank files, so every replica decides as the ranks below."),
    ] = 1,
    ep: Annotated[bool, typer.Option("-ep", "--enable-expert-parallel", help="The engine's --enable-expert-parallel: each "
                                     "GPU's whole experts, from the tp1 rank file.")] = False,
    placement: Annotated[str, typer.Option("--expert-placement-strategy", help="The engine's (linear or round_robin).")] = "linear",
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Check one rank only \\[default: every rank].")] = None,
    dtype: DtypeOpt = Dtype.auto,
    verify_mode: Annotated[VerifyMode, typer.Option("--verify", help="As the loader's verify option: auto hashes what changed.")] = (
        VerifyMode.auto
    ),
    fallback: Annotated[bool, typer.Option("--fallback", help="As the loader's fallback: a bad bundle means loading ordinarily.")] = False,
    compute_capability: Annotated[
        str | None,
        typer.Option("--compute-capability", help="The engine's GPU, e.g. 9.0 (H100/H200) or 8.0 \\[default: this machine's GPU, if any]."),
    ] = None,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decide, as the marlin_prepacked loader would, whether an engine can serve MODEL from its bundle.

    Runs the loader's own pre-GPU checks for every rank (no GPU, no vLLM start): manifest, engine fit, source binding, file integrity, rank headers. Takes vllm serve's words for the engine's settings.

    Exit 0 to load (or, with --fallback, to fall back), 1 to refuse.

    Examples:

      marlin-pack check ./Llama-3-8B-AWQ -tp 2

      marlin-pack check Qwen/Qwen2.5-7B-Instruct-AWQ --tensor-parallel-size 4 --dtype half

      marlin-pack check ./Llama-3-70B-AWQ --compute-capability 9.0    # as an H100/H200 engine would decide

      marlin-pack check ./Qwen3-30B-A3B-GPTQ -tp 2 -dp 2 -ep    # each GPU's experts, per replica
    """  # noqa: E501
    from marlin_pack.vllm_plugin.preflight import preflight

    model = _local_or_repo(model, revision)
    if placement not in ("linear", "round_robin"):
        raise _BadParameter(f"{placement!r}: expected linear or round_robin", param_hint="--expert-placement-strategy")
    if rank is not None and rank >= tp:
        raise _BadParameter(f"--rank {rank} is outside --tensor-parallel-size {tp}", param_hint="--rank")
    try:
        report = preflight(
            model, bundle=bundle, tp_size=tp, rank=rank, dtype=_engine_dtype(model, revision, dtype.value),
            verify=verify_mode.value, fallback=fallback, revision=revision, capability=_capability(compute_capability),
            pp_size=pp, dp_size=dp, expert_parallel=ep, expert_placement=placement,
        )
    except ValueError as e:
        raise _BadParameter(str(e)) from None
    if as_json:
        out.print_json(json.dumps({**report.to_dict(), "data_parallel_size": dp}))
    else:
        err.print(report.release_text, highlight=False, soft_wrap=True, markup=False)  # stdout: the decisions only
        if dp > 1 and not report.per_replica:
            out.print(f"each of the {dp} data-parallel replicas decides as follows (the same TP rank files)", highlight=False)
        colour = {"load": "green", "fallback": "yellow", "refuse": "red"}
        for ranks, decision, message in _grouped(report):
            out.print(_styled(f"{ranks}: ", (decision, colour[decision]), f" {message}"), soft_wrap=True)
        if (hashed := report.hashed.summary()) is not None:
            out.print(f"check {hashed}", soft_wrap=True)
    if report.decision == "refuse":
        raise typer.Exit(1)


def _capability(text: str | None) -> int | None:
    """``--compute-capability 9.0`` as 90; without it, this machine's GPU's (torch), else None."""
    if text is None:
        from marlin_pack.kernel_choice import visible_gpu

        gpu = visible_gpu()
        return None if gpu is None else gpu[1]
    try:
        major, _, minor = text.partition(".")
        return int(major) * 10 + int(minor or 0)
    except ValueError:
        raise _BadParameter(f"{text!r}: expected MAJOR.MINOR, e.g. 9.0", param_hint="--compute-capability") from None


def _grouped(report) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    """Ranks with the same decision and message, said once: ``("ranks 0-3/4", "refuse", why)``; with pipeline
    stages, ranks count across them (``stage 1 rank 0``, or ``ranks 0-3/4 of pp 2 x tp 2``)."""
    groups: list[tuple[list, str, str]] = []
    for r in report.ranks:
        if groups and groups[-1][1:] == (r.decision, r.message) and groups[-1][0][-1].replica == r.replica:
            groups[-1][0].append(r)
        else:
            groups.append(([r], r.decision, r.message))

    def where(rs: list) -> str:
        return (f"replica {rs[0].replica} " if report.per_replica else "") + ranks_of(rs)

    def ranks_of(rs: list) -> str:
        if report.pp_size == 1:
            span = f"rank {rs[0].rank}" if len(rs) == 1 else f"ranks {rs[0].rank}-{rs[-1].rank}"
            return f"{span}/{report.tp_size}"
        if len(rs) == 1:
            return f"stage {rs[0].stage} rank {rs[0].rank}/{report.tp_size}"
        first, last = (x.stage * report.tp_size + x.rank for x in (rs[0], rs[-1]))
        return f"ranks {first}-{last}/{report.pp_size * report.tp_size} of pp {report.pp_size} x tp {report.tp_size}"

    return [(where(rs), d, m) for rs, d, m in groups]


def _local_or_repo(model: str, revision: str | None) -> str:
    """A local directory as an absolute path (what vLLM and the bundle record see); a repo id as it is.

    Raises:
        typer.BadParameter: ``--revision`` given with a local directory (it names a commit of a model id).
    """
    if Path(model).is_dir():
        if revision is not None:
            raise _BadParameter(
                f"{model} is a local directory; --revision names a branch, tag or commit of a model id: drop it",
                param_hint="--revision",
            )
        return str(Path(model).resolve())
    return model


def _bundle_of(target: str, revision: str | None) -> tuple[Path, str | None]:
    """The bundle a command was pointed at, and the model it belongs to when MODEL was given (else None).

    ``target``: a bundle directory (it holds manifest.json), a checkpoint directory (its default bundle) or a
    model id (its bundle in marlin-pack's cache; nothing is downloaded).
    """
    from marlin_pack._constants import MANIFEST_NAME
    from marlin_pack.sources.hub import is_repo_id, locate_bundle

    if Path(target).is_dir() and (Path(target) / MANIFEST_NAME).is_file():
        if revision is not None:
            raise _BadParameter(f"{target} is a bundle directory; --revision is for a model id: drop it", param_hint="--revision")
        return Path(target).resolve(), None
    if not Path(target).is_dir() and not is_repo_id(target):
        return Path(target), None  # a bundle path that is not there: reading its manifest says so
    model = _local_or_repo(target, revision)
    return locate_bundle(model, revision), model


def _check_dtype_word(word: str) -> None:
    """A --dtype word vLLM takes but these layers cannot run in (float, float32) is a usage error, before any work."""
    from marlin_pack.dtypes import serving_dtype_for

    try:
        serving_dtype_for(word, {})
    except ValueError as e:
        raise _BadParameter(str(e), param_hint="--dtype") from None


def _engine_dtype(model: str, revision: str | None, word: str) -> str:
    """The dtype `vllm serve MODEL --dtype WORD` runs in (auto: what vLLM picks from the config)."""
    from marlin_pack.dtypes import serving_dtype_for
    from marlin_pack.errors import CheckpointError
    from marlin_pack.io.checkpoint_files import read_json, weight_files
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.sources.hub import resolve_model

    _check_dtype_word(word)
    try:
        model_dir = resolve_model(model, revision, download=False).dir
        config = read_json(model_dir / "config.json", "config.json")
        codes = {t.dtype for f in weight_files(model_dir) for t in read_header(model_dir / f).tensors.values()}
    except (CheckpointError, OSError, ValueError):
        return serving_dtype_for(word, {"dtype": "float16"}).value  # the source check reports what is wrong
    return serving_dtype_for(word, config, codes).value


@app.command()
def inspect(target: TargetArg, revision: RevisionOpt = None, as_json: JsonOpt = False) -> None:
    """Show what a bundle holds, and where it is.

    Examples:

      marlin-pack inspect ./Llama-3-8B-AWQ

      marlin-pack inspect Qwen/Qwen2.5-7B-Instruct-AWQ --json
    """
    from marlin_pack.bundle.reader import read_manifest

    bundle, _ = _bundle_of(target, revision)
    manifest = read_manifest(bundle)
    if as_json:
        out.print_json(json.dumps({"bundle": str(bundle), "manifest": manifest.model_dump(mode="json")}))
        return
    _render_manifest(manifest, bundle)


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
        out.print(_styled(("removed", "green"), f" {path}"), soft_wrap=True, highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def daemon(ctx: typer.Context, model: ModelArg) -> None:
    """Run vLLM's weight-cache daemon (vllm preload) for MODEL, filled from its bundle.

    MODEL comes first; every other argument goes to `vllm preload` unchanged (--load-format defaults to marlin_prepacked). Engines attach with `vllm serve MODEL --load-format ipc_cache`.

    Examples:

      marlin-pack daemon ./Llama-3-8B-AWQ -tp 2
    """  # noqa: E501
    from marlin_pack.vllm_plugin.launcher import preload_argv, run

    argv = preload_argv(_local_or_repo(model, None), ctx.args)
    err.print(f"marlin-pack: vllm {shlex.join(argv)}", highlight=False, soft_wrap=True, markup=False)
    run(argv)


@app.command()
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


@app.command()
def schema() -> None:
    """Print the manifest's JSON schema."""
    from marlin_pack.schemas import manifest_json_schema

    out.print_json(json.dumps(manifest_json_schema(), sort_keys=True))


@app.command()
def version() -> None:
    """Print marlin-pack's version (also: marlin-pack --version)."""
    out.print(__version__)


def _render_manifest(manifest, bundle: Path) -> None:  # type: ignore[no-untyped-def]
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
