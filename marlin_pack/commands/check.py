"""``marlin-pack check``: the marlin_prepacked loader's pre-GPU decision for every rank, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from marlin_pack.commands.console import BadParameter, err, out, styled
from marlin_pack.commands.gpu import CapabilityOpt, engine_gpu
from marlin_pack.commands.params import (
    Dtype,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    RevisionOpt,
    VerifyMode,
    bundle_or_url,
    engine_dtype,
    local_or_repo,
    unconvertible,
)

__all__ = ["check"]

_NOT_CHECKED = (
    "no GPU is visible here and none was named; pass --compute-capability X.Y for the engine's GPU (9.0 for H100/H200: "
    "there a Marlin bundle runs with Marlin forced, slower; a Machete bundle loads on 9.0 only)"
)


def check(
    model: ModelArg,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="Bundle directory \\[default: MODEL_DIR/marlin-pack], or "
                                                "s3://BUCKET/PREFIX or gs://BUCKET/PREFIX where it is published.")] = None,
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
    compute_capability: CapabilityOpt = None,
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
    from marlin_pack.io.hashing import remembered
    from marlin_pack.vllm_plugin.preflight import preflight

    model = local_or_repo(model, revision)
    bundle_at = bundle_or_url(bundle)
    if placement not in ("linear", "round_robin"):
        raise BadParameter(f"{placement!r}: expected linear or round_robin", param_hint="--expert-placement-strategy")
    if rank is not None and rank >= tp:
        raise BadParameter(f"--rank {rank} is outside --tensor-parallel-size {tp}", param_hint="--rank")
    gpu = engine_gpu(compute_capability)
    try:
        with remembered():  # each file read once, whatever the ranks and the stamp store (a cold bundle: once from the disk)
            report = preflight(
                model, bundle=bundle_at, tp_size=tp, rank=rank, dtype=engine_dtype(model, revision, dtype.value),
                verify=verify_mode.value, fallback=fallback, revision=revision, capability=None if gpu is None else gpu.capability,
                pp_size=pp, dp_size=dp, expert_parallel=ep, expert_placement=placement,
            )
    except ValueError as e:
        raise BadParameter(str(e)) from None
    if as_json:
        gpu_dict = None if gpu is None else {"compute_capability": gpu.text, "named": gpu.named, "name": gpu.name or None}
        out.print_json(json.dumps({**report.to_dict(), "data_parallel_size": dp, "gpu": gpu_dict, "kernel_fit_checked": gpu is not None}))
    else:
        err.print(report.release_text, highlight=False, soft_wrap=True, markup=False)  # stdout: the decisions only
        if report.path_text is not None:
            err.print(report.path_text, highlight=False, soft_wrap=True, markup=False)
        if dp > 1 and not report.per_replica:
            out.print(f"each of the {dp} data-parallel replicas decides as follows (the same TP rank files)", highlight=False)
        colour = {"load": "green", "fallback": "yellow", "refuse": "red"}
        for ranks, decision, message in _grouped(report):
            out.print(styled(f"{ranks}: ", (decision, colour[decision]), f" {message}"), soft_wrap=True)
        if (hashed := report.hashed.summary()) is not None:
            out.print(f"check {hashed}", soft_wrap=True)
        problem = report.first_problem
        if problem is not None and problem.field == "manifest" and bundle is None and _no_bundle(model, revision):
            why = unconvertible(model, revision)  # the refusal says how to convert; say instead why it cannot be
            if why is not None:
                out.print(styled(("why:", "yellow"), f" {model} cannot have a bundle: {why}"), soft_wrap=True)
        if gpu is None and report.decision != "refuse":
            out.print(styled(("kernel fit not checked:", "yellow"), f" {_NOT_CHECKED}"), soft_wrap=True)
    if report.decision == "refuse":
        raise typer.Exit(1)


def _no_bundle(model: str, revision: str | None) -> bool:
    """MODEL's default bundle is not there (a model id not in the hub's cache: that refusal says why itself)."""
    from marlin_pack.errors import MarlinPackError
    from marlin_pack.sources.hub import locate_bundle

    try:
        return not locate_bundle(model, revision).exists()
    except MarlinPackError:
        return False


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
