"""The loader's pre-GPU decision for a bundle in object storage: :func:`~marlin_pack.vllm_plugin.decision.select_bundle`'s
order over a published bundle, every refusal before the GPU (and before any tensor byte is read).

Order, as for a local bundle: the running vLLM release; the manifest (read from the bucket through the publication
record, :func:`~marlin_pack.remote.bundle.open_remote`); engine fit (layouts, dtype, TP size, kernel settings:
:func:`~marlin_pack.vllm_plugin.decision.check_engine`); the source checkpoint in ``MODEL_DIR`` (settings, files,
hashes: :func:`~marlin_pack.bundle.integrity.check_source`); then this rank's objects (present, whole, headers exactly as
the manifest implies) and, with ``pipeline_parallel_size > 1``, the stage's share (:func:`~marlin_pack.remote.bundle.plan_rank`).

With expert parallelism or MoE at DP > 1, vLLM shards the experts over another TP size than the attention's
(:mod:`~marlin_pack.vllm_plugin.expert_share`): that size's rank file (its object and header checked as this rank's)
gives this GPU's experts, and the plan reads only their byte ranges there (:func:`~marlin_pack.remote.bundle.with_experts`),
exactly as a local load reads them.

The loader's ``{"bundle": "s3://..."}`` (:mod:`marlin_pack.vllm_plugin.remote_load`) and ``marlin-pack check --bundle
s3://...`` decide with it (``gs://`` alike).
"""

from __future__ import annotations

from pathlib import Path

from marlin_pack.bundle.integrity import HashReport, check_source
from marlin_pack.errors import BundleMismatchError, CheckpointError, MarlinPackError, MismatchField
from marlin_pack.io.checkpoint_files import read_json
from marlin_pack.remote.bundle import RankPlan, RemoteBundle, open_remote, plan_rank, rank_header_of, with_experts
from marlin_pack.remote.url import ObjectUrl, UrlPath
from marlin_pack.sources.hub import resolve_model
from marlin_pack.vllm_plugin.decision import EngineFacts, check_engine, check_release
from marlin_pack.vllm_plugin.expert_share import expert_share, moe_ranks, needs_share, num_expert_group, placement

__all__ = ["select_remote"]


def select_remote(url: str | ObjectUrl, facts: EngineFacts, *, full_hash: bool | None = None) -> tuple[RankPlan, HashReport]:
    """Check the bundle published at ``url`` against the engine and this rank; what this rank reads, and what checking
    the source checkpoint hashed.

    Raises:
        BundleMismatchError: naming the field that does not fit (as the local decision names it).
        BundleError, RemoteError: the bucket's refusals (nothing published, half-published, credentials...).
    """
    check_release(facts.vllm_version)
    bundle = open_remote(url)
    try:
        tp_set = check_engine(bundle.manifest, facts)
    except BundleMismatchError as e:
        if e.field not in (MismatchField.tp_size, MismatchField.kernel, MismatchField.ep_size, MismatchField.dp_size):
            raise
        raise BundleMismatchError(e.field, f"{e}, then publish it again (`marlin-pack push BUNDLE {bundle.url}`)") from e
    try:
        model_dir = Path(resolve_model(facts.model, facts.revision, download=False).dir)
    except CheckpointError as e:
        raise BundleMismatchError(MismatchField.source, str(e)) from e
    hashed = check_source(bundle.manifest, model_dir, full_hash=full_hash, sampled=True)
    plan = plan_rank(bundle, facts.tp_size, facts.tp_rank, pp_size=facts.pp_size, pp_rank=facts.pp_rank, model_dir=model_dir)
    if needs_share(tp_set, facts.tp_size, facts.tp_rank, facts.dp_size, facts.expert_parallel, facts.pcp_size):
        plan = _with_experts(bundle, plan, facts, model_dir)
    return plan, hashed


def _with_experts(bundle: RemoteBundle, plan: RankPlan, facts: EngineFacts, model_dir: Path) -> RankPlan:
    """``plan`` with this GPU's experts taken from the TP size vLLM shards them at (as the local decision's
    ``_experts``): that rank file's object and header checked, the placement vLLM uses, only their bytes read."""
    manifest = bundle.manifest
    try:
        groups = num_expert_group(manifest.source.architecture, read_json(model_dir / "config.json", "config.json"))
    except (MarlinPackError, OSError, ValueError) as e:
        raise BundleMismatchError(MismatchField.source, str(e)) from e
    ranks = moe_ranks(facts.tp_size, facts.tp_rank, facts.dp_size, facts.dp_rank, facts.expert_parallel, facts.pcp_size,
                      facts.pcp_rank)
    source = manifest.tensor_parallel_set(ranks.tp_size)  # check_engine made sure the bundle holds it
    rank = plan.files[0]
    if source.ranks[ranks.tp_rank].file.path == rank.entry.path and plan.stage is None:  # TP 1 at EP: its own file, whole
        entry, header, head_bytes = rank.entry, rank.header, 0
    else:
        entry, header, head_bytes = rank_header_of(bundle, source, ranks.tp_rank)
    strategy = placement(facts.expert_placement, ep_size=ranks.ep_size, num_expert_group=groups, dp_size=facts.dp_size,
                         all2all_backend=facts.all2all_backend, pcp_size=facts.pcp_size)
    tp_set = plan.stage.tp_set if plan.stage is not None else manifest.tensor_parallel_set(facts.tp_size)
    share = expert_share(manifest, tp_set, source, header, UrlPath.of(bundle.url.url_of(entry.path)), ranks, strategy)
    return with_experts(plan, share, entry, head_bytes)
