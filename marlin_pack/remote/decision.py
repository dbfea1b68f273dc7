"""The loader's pre-GPU decision for a bundle in object storage: :func:`~marlin_pack.vllm_plugin.decision.select_bundle`'s
order over a published bundle, every refusal before the GPU (and before any tensor byte is read).

Order, as for a local bundle: the running vLLM release; the manifest (read from the bucket through the publication
record, :func:`~marlin_pack.remote.bundle.open_remote`); engine fit (layouts, dtype, TP size, kernel settings:
:func:`~marlin_pack.vllm_plugin.decision.check_engine`); the source checkpoint in ``MODEL_DIR`` (settings, files,
hashes: :func:`~marlin_pack.bundle.integrity.check_source`); then this rank's objects (present, whole, headers exactly as
the manifest implies) and, with ``pipeline_parallel_size > 1``, the stage's share (:func:`~marlin_pack.remote.bundle.plan_rank`).

The loader's ``{"bundle": "s3://..."}`` (:mod:`marlin_pack.vllm_plugin.remote_load`) and ``marlin-pack check --bundle
s3://...`` decide with it. Expert parallelism and MoE at DP > 1 (another TP size's rank file for the experts) are refused here
until they are planned.
"""

from __future__ import annotations

from pathlib import Path

from marlin_pack.bundle.integrity import HashReport, check_source
from marlin_pack.errors import BundleMismatchError, CheckpointError, MismatchField
from marlin_pack.remote.bundle import RankPlan, open_remote, plan_rank
from marlin_pack.remote.url import ObjectUrl
from marlin_pack.sources.hub import resolve_model
from marlin_pack.vllm_plugin.decision import EngineFacts, check_engine, check_release
from marlin_pack.vllm_plugin.expert_share import needs_share

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
        if e.field not in (MismatchField.tp_size, MismatchField.kernel):
            raise
        raise BundleMismatchError(e.field, f"{e}, then publish it again (`marlin-pack push BUNDLE {bundle.url}`)") from e
    if needs_share(tp_set, facts.tp_size, facts.tp_rank, facts.dp_size, facts.expert_parallel, facts.pcp_size):
        raise BundleMismatchError(MismatchField.ep_size, "experts from another TP size's rank file (expert parallelism, MoE at "
                                  "data_parallel_size > 1) are not read from object storage yet; serve from a local copy")
    try:
        model_dir = resolve_model(facts.model, facts.revision, download=False).dir
    except CheckpointError as e:
        raise BundleMismatchError(MismatchField.source, str(e)) from e
    hashed = check_source(bundle.manifest, model_dir, full_hash=full_hash)
    plan = plan_rank(bundle, facts.tp_size, facts.tp_rank, pp_size=facts.pp_size, pp_rank=facts.pp_rank, model_dir=Path(model_dir))
    return plan, hashed
