"""``marlin-pack check``: the loader's own decision, made without a GPU and without starting vLLM.

For every rank of a tensor-parallel size (or one rank), :func:`preflight` runs
:func:`~marlin_pack.vllm_plugin.decision.decide`, the function the ``marlin_prepacked``
loader calls before it allocates anything: manifest, engine fit (as given), source binding,
file integrity per ``verify``, rank-file headers and metadata. Sharing that function is what
keeps ``check`` from drifting from what an engine does. No vLLM import (its version is read
from the installed package's metadata).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Literal

from marlin_pack.bundle.integrity import HashReport
from marlin_pack.errors import LoadRefusedError
from marlin_pack.vllm_plugin.decision import Decision, EngineFacts, SelectedBundle, decide, hopper_machete_layers
from marlin_pack.vllm_plugin.options import LoaderOptions, parse_extra_config

__all__ = ["Outcome", "RankOutcome", "PreflightReport", "installed_vllm_version", "preflight"]

Outcome = Literal["load", "refuse", "fallback"]


@dataclass(frozen=True)
class RankOutcome:
    """What the loader would do on one rank."""

    rank: int
    decision: Outcome
    field: str | None
    message: str
    hashed: HashReport = HashReport()
    stage: int = 0  # the pipeline stage (pipeline_parallel_size > 1)
    reads: dict[str, object] | None = None  # what a loading pipeline stage or expert share reads (StageShare, ExpertShare)
    replica: int = 0  # the data-parallel replica (decided per replica where its experts differ)

    def to_dict(self) -> dict[str, object]:
        out = {"rank": self.rank, "stage": self.stage, "replica": self.replica, "decision": self.decision, "field": self.field,
               "message": self.message}
        return out if self.reads is None else {**out, "reads": self.reads}


@dataclass
class PreflightReport:
    """The loader's decision for every rank asked for; the worst one decides the whole."""

    tp_size: int
    vllm_version: str
    ranks: list[RankOutcome] = field(default_factory=list)
    pp_size: int = 1
    per_replica: bool = False  # each data-parallel replica decided (its experts differ); else replica 0 stands for all
    architecture: str | None = None  # config.json's architectures[0] (None: unreadable)
    transformers_version: str | None = None  # the installed transformers

    @property
    def path(self) -> str | None:
        """How the release builds the model: ``native`` (vLLM's own class), ``transformers`` (its Transformers
        backend) or ``unregistered`` (none); None where the release is not served or the architecture unknown."""
        from marlin_pack.vllm_plugin import releases

        return releases.serving_path(self.vllm_version, self.architecture) if self.architecture else None

    @property
    def path_text(self) -> str | None:
        """Which path the running release takes for the model (one line), e.g. ``Olmo2ForCausalLM: vLLM 0.34.0 builds
        it through its Transformers backend (transformers 5.22.2)``; an architecture the registry does not list that
        transformers has (Helium) says so."""
        path = self.path
        if path is None:
            return None
        if path == "unregistered":
            return f"{self.architecture}: vLLM {self.vllm_version} does not serve it (its model registry lists no such architecture)"
        if path == "transformers":
            from marlin_pack.vllm_plugin import releases

            how = f"through its Transformers backend (transformers {self.transformers_version or 'not installed'})"
            if releases.via_fallback(self.vllm_version, self.architecture or ""):
                how += ": its model registry lists no such architecture, so vLLM takes transformers' class"
        else:
            from marlin_pack.marlin.architectures import architecture_for

            row = architecture_for(self.architecture)
            how = "with its own model class" + (f" ({row.vllm_class})" if row is not None and "native" in row.paths else "")
        return f"{self.architecture}: vLLM {self.vllm_version} builds it {how}"

    @property
    def first_problem(self) -> RankOutcome | None:
        for kind in ("refuse", "fallback"):
            found = next((r for r in self.ranks if r.decision == kind), None)
            if found is not None:
                return found
        return None

    @property
    def hashed(self) -> HashReport:
        """What the checks of every rank hashed together (the source once, then each rank's files)."""
        total = HashReport()
        for r in self.ranks:
            total = total.add(r.hashed)
        return total

    @property
    def release_text(self) -> str:
        """Which vLLM release the engine runs and whether marlin-pack supports it (one line)."""
        from marlin_pack.vllm_plugin import releases

        if releases.release(self.vllm_version) is None:
            return releases.unsupported_reason(self.vllm_version)
        return f"vLLM {self.vllm_version}: supported (supported: {releases.supported_text()})"

    @property
    def decision(self) -> Outcome:
        problem = self.first_problem
        return "load" if problem is None else problem.decision

    def _supported(self) -> bool:
        from marlin_pack.vllm_plugin import releases

        return releases.release(self.vllm_version) is not None

    def to_dict(self) -> dict[str, object]:
        problem = self.first_problem
        return {
            "decision": self.decision,
            "field": problem.field if problem else None,
            "message": problem.message if problem else f"every rank of tp {self.tp_size} loads from the bundle",
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "vllm_version": self.vllm_version,
            "vllm_supported": self._supported(),
            "architecture": self.architecture,
            "serving_path": self.path,
            "hashed": _hash_dict(self.hashed),
            "ranks": [r.to_dict() for r in self.ranks],
        }


def _hash_dict(h: HashReport) -> dict[str, object]:
    """``hashed`` of ``check --json``: ``stamped`` counts the stamps really written; ``not_stamped`` says why for each other
    file (``kind``: ``changed``, ``writable`` by others: hashed at every start, ``store``: the store cannot be written)."""
    stamps = None if h.stamps is None or h.unavailable else str(h.stamps)
    return {
        "files": h.files, "bytes": h.nbytes, "seconds": round(h.seconds, 3), "stamped": h.stamped, "stamps": stamps,
        "unavailable": h.unavailable,
        "not_stamped": [{"file": name, "kind": why.kind, "why": why.why} for name, why in h.not_stamped],
    }


def installed_vllm_version() -> str:
    """The installed vLLM's release, read without importing it; the newest supported one if none is installed."""
    try:
        return metadata.version("vllm").split("+")[0]
    except metadata.PackageNotFoundError:
        from marlin_pack.vllm_plugin import releases

        return releases.supported()[0]


def _kernels_text(sel: SelectedBundle, facts: EngineFacts) -> str:
    """``8 layers on MarlinLinearKernel``, ``6 on MacheteLinearKernel, 2 on MarlinLinearKernel``, and for a Marlin
    bundle on SM90 how many layers vLLM's default would have given Machete."""
    if not sel.manifest.has_machete_layers:
        text = f"{len(sel.tp_set.layers)} layers on MarlinLinearKernel"
        n = hopper_machete_layers(sel.manifest, sel.tp_set, facts)
        if n:
            text += f", forced: vLLM's default on this SM90 GPU runs {n} of them on Machete (convert --kernel machete)"
        return text
    counts = Counter(e.kernel.value for e in sel.tp_set.layers)
    names = (("machete", "MacheteLinearKernel"), ("marlin", "MarlinLinearKernel"))
    return ", ".join(f"{counts[k]} on {name}" for k, name in names if counts[k])


def preflight(
    model_dir: str | Path,
    *,
    bundle: str | Path | None = None,
    tp_size: int = 1,
    rank: int | None = None,
    dtype: str = "float16",
    verify: str = "auto",
    fallback: bool = False,
    vllm_version: str | None = None,
    revision: str | None = None,
    capability: int | None = None,
    pp_size: int = 1,
    dp_size: int = 1,
    expert_parallel: bool = False,
    expert_placement: str = "linear",
) -> PreflightReport:
    """What ``vllm serve MODEL_DIR --load-format marlin_prepacked`` would decide, per rank.

    Args:
        model_dir: the checkpoint directory, or the Hugging Face model id (``revision``), the engine would serve.
        bundle, verify, fallback: as the loader's ``--model-loader-extra-config``.
        tp_size: the engine's ``--tensor-parallel-size``; ``rank``: one rank only (default: all).
        dtype: the engine's ``--dtype`` (``float16``/``bfloat16``).
        vllm_version: the engine's vLLM (default: the installed one).
        pp_size: the engine's ``--pipeline-parallel-size``: every (stage, rank) is decided, each message saying what
            that stage reads of its rank file and of the common file.
        dp_size: the engine's ``--data-parallel-size``: every replica decides as the ranks shown (the same TP rank files),
            except where the experts differ per replica (vLLM shards them over all replicas' ranks): then each replica.
        expert_parallel, expert_placement: ``--enable-expert-parallel``, ``--expert-placement-strategy``: each GPU's
            experts and the file they come from (:mod:`~marlin_pack.vllm_plugin.expert_share`).
        capability: the engine's GPU, major*10 + minor (None: unknown; then which kernel family vLLM picks is
            not checked, only said).

    Raises:
        ValueError: an option the loader itself would refuse (unknown ``verify``, ...).
    """
    extra: dict[str, object] = {"fallback": fallback, "verify": verify}
    if bundle is not None:
        extra["bundle"] = str(bundle)
    options = parse_extra_config(extra)
    version = vllm_version or installed_vllm_version()
    tf_version = _installed("transformers")
    report = PreflightReport(tp_size=tp_size, vllm_version=version, pp_size=pp_size,
                             architecture=_architecture(model_dir, revision), transformers_version=tf_version)
    for replica in range(dp_size):
        for stage, r in ((s, r) for s in range(pp_size) for r in (range(tp_size) if rank is None else [rank])):
            facts = EngineFacts(
                model=str(model_dir), vllm_version=version, tp_size=tp_size, tp_rank=r, pp_size=pp_size, pp_rank=stage,
                dp_size=dp_size, dp_rank=replica, expert_parallel=expert_parallel, expert_placement=expert_placement,
                dtype=dtype, revision=revision, capability=capability, transformers_version=tf_version,
            )
            report.ranks.append(_outcome(options, facts, replica))
        if not any(o.reads and "experts" in o.reads for o in report.ranks):
            break  # every replica loads the same TP rank files: replica 0 stands for them
        report.per_replica = dp_size > 1
    return report


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _architecture(model_dir: str | Path, revision: str | None) -> str | None:
    """The model's ``architectures[0]`` from its config.json, found as the loader finds the checkpoint (no download);
    None where it cannot be read (the decisions say why)."""
    from marlin_pack.errors import MarlinPackError
    from marlin_pack.io.checkpoint_files import read_json
    from marlin_pack.marlin.architectures import config_architecture
    from marlin_pack.sources.hub import resolve_model

    try:
        model = resolve_model(str(model_dir), revision, download=False)
        return config_architecture(read_json(model.dir / "config.json", "config.json"))
    except (MarlinPackError, OSError, ValueError):
        return None


def _decide_remote(options: LoaderOptions, facts: EngineFacts) -> Decision:
    """The loader's decision over a bundle published in a bucket (imported here only: it needs torch)."""
    from marlin_pack.vllm_plugin.remote_load import decide_bundle

    return decide_bundle(options, facts)


def _outcome(options: LoaderOptions, facts: EngineFacts, replica: int) -> RankOutcome:
    """What the loader decides for one GPU."""
    r, stage = facts.tp_rank, facts.pp_rank
    try:
        decision = decide(options, facts) if options.remote is None else _decide_remote(options, facts)
    except LoadRefusedError as e:
        return RankOutcome(r, "refuse", str(e.field), str(e), stage=stage, replica=replica)
    if decision.bundle is None:
        message = f"[{decision.field}] {decision.reason}; the engine would load the checkpoint the ordinary way"
        return RankOutcome(r, "fallback", str(decision.field), message, stage=stage, replica=replica)
    sel = decision.bundle
    entry = sel.tp_set.ranks[r].file
    if sel.stage is None:
        message = (
            f"{entry.path} ({_kernels_text(sel, facts)}, {entry.size / 1e6:,.1f} MB) and {sel.manifest.common.path} "
            f"from {sel.bundle_dir}"
        )
    else:  # a pipeline stage: its layers of the rank file, its common tensors
        message = (
            f"{entry.path} and {sel.manifest.common.path} from {sel.bundle_dir}, {sel.stage.text()} "
            f"({_kernels_text(sel, facts)})"
        )
    reads = None if sel.stage is None else sel.stage.to_dict()
    if sel.experts is not None:  # its experts of another rank file
        message += f"; {sel.experts.text()} ({sel.experts.read_bytes / 1e6:,.1f} MB)"
        reads = {**(reads or {}), "experts": sel.experts.to_dict()}
    if (streamed := getattr(sel, "read", None)) is not None:  # a bundle in a bucket: what this GPU streams
        message += f"; streams {streamed.read_bytes / 1e6:,.1f} MB, every block verified against the publication record"
        reads = {**(reads or {}), "streamed_bytes": streamed.read_bytes}
    return RankOutcome(r, "load", None, message, sel.hashed, stage=stage, reads=reads, replica=replica)
