"""Decisions of the ``marlin_prepacked`` loader, as pure functions over plain facts (no vLLM import).

The loader gathers facts from vLLM (:class:`EngineFacts`, see ``engine.py``) and these
functions decide, before anything touches the GPU: which bundle, whether it fits the engine
and this rank, whether to refuse or fall back. ``layer_check.py`` decides the same for the
layers vLLM then builds. Keeping them free of
vLLM and of the GPU makes every message testable on a CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marlin_pack._constants import KERNEL_NAME, LOAD_FORMAT, MACHETE_KERNEL_NAME, MANIFEST_NAME
from marlin_pack.bundle.integrity import HashReport, check_files, check_source
from marlin_pack.bundle.rank_files import check_rank_header
from marlin_pack.bundle.reader import read_manifest, resolve_file
from marlin_pack.errors import BundleError, BundleMismatchError, CheckpointError, LoadRefusedError, MarlinPackError, MismatchField
from marlin_pack.gpu.plan import hash_left_to_copy
from marlin_pack.io.checkpoint_files import read_json
from marlin_pack.io.home import HomeDirectoryError
from marlin_pack.io.safetensors_io import SafetensorsFormatError, SafetensorsHeader, read_header
from marlin_pack.remedies import convert_command
from marlin_pack.remote.url import ObjectUrl
from marlin_pack.schemas import TARGET_KERNELS, Manifest, TensorParallelSet
from marlin_pack.sources.hub import ResolvedModel, locate_bundle, resolve_model
from marlin_pack.vllm_plugin import releases
from marlin_pack.vllm_plugin.expert_share import (
    ExpertShare,
    check_experts_source,
    expert_share,
    moe_ranks,
    needs_share,
    num_expert_group,
    placement,
)
from marlin_pack.vllm_plugin.options import LoaderOptions
from marlin_pack.vllm_plugin.stage import StageShare, stage_share

__all__ = [
    "EngineFacts",
    "SelectedBundle",
    "Decision",
    "hopper_machete_layers",
    "load_manifest",
    "resolve_bundle_dir",
    "check_engine",
    "check_release",
    "serving_path_problem",
    "loaded_zero_word",
    "bundle_layouts",
    "select_bundle",
    "select_for_copy",
    "refusal",
    "internal_error",
    "decide",
]

_8BIT_ACTIVATIONS = ("int8", "fp8")
_FALLBACK_HINT = (
    """pass --model-loader-extra-config '{"fallback": true}' to load the checkpoint the ordinary way"""
)
F = MismatchField


@dataclass(frozen=True)
class EngineFacts:
    """What the loader needs to know about the engine (gathered from vLLM by ``engine.engine_facts``)."""

    model: str
    vllm_version: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0  # this rank's pipeline stage
    dp_size: int = 1  # --data-parallel-size: replicas of tp_size x pp_size GPUs each
    dp_rank: int = 0  # this GPU's replica
    expert_parallel: bool = False  # --enable-expert-parallel
    expert_placement: str = "linear"  # --expert-placement-strategy
    all2all_backend: str = "allgather_reducescatter"  # --all2all-backend
    pcp_size: int = 1  # --prefill-context-parallel-size (vLLM flattens it with DP for experts)
    pcp_rank: int = 0
    dtype: str = "float16"
    quantization: str | None = None
    marlin_input_dtype: str | None = None
    batch_invariant: bool = False
    disabled_kernels: tuple[str, ...] = ()
    linear_backend: str = "auto"
    linear_backend_per_quant: Mapping[str, str] | None = None
    revision: str | None = None  # of a Hugging Face model id
    capability: int | None = None  # the GPU's compute capability, major*10 + minor (None: unknown, e.g. `check`)
    transformers_version: str | None = None  # the installed transformers (vLLM's Transformers backend builds from it)


@dataclass(frozen=True)
class SelectedBundle:
    """A bundle checked against the engine: what this rank loads, headers already checked."""

    bundle_dir: Path
    manifest: Manifest
    tp_set: TensorParallelSet
    rank: int
    rank_file: Path
    common_file: Path
    rank_header: SafetensorsHeader
    common_header: SafetensorsHeader
    hashed: HashReport = HashReport()  # what the checks hashed (nothing: stamps vouched, or ``verify: size``)
    # pipeline_parallel_size > 1: this stage's share (``tp_set`` and both headers above are already restricted to it)
    stage: StageShare | None = None
    # expert parallelism, or experts at data_parallel_size > 1: where the experts come from (``tp_set.moe_layers`` are
    # already its entries, the rank header holds no experts tensor)
    experts: ExpertShare | None = None


@dataclass(frozen=True)
class Decision:
    """Either a selected bundle, or (fallback on) the field and reason to load ordinarily instead."""

    bundle: SelectedBundle | None
    field: MismatchField | None = None
    reason: str | None = None

    @property
    def fallback(self) -> bool:
        return self.bundle is None


def _resolve(model: str, revision: str | None) -> ResolvedModel:
    """The engine's model as a local checkpoint: a directory, or a repo id found in the Hugging Face cache.

    Never downloads: vLLM has fetched the checkpoint before it builds the model.
    """
    try:
        return resolve_model(model, revision, download=False)
    except (CheckpointError, HomeDirectoryError) as e:
        raise BundleMismatchError(F.source, str(e)) from e


def resolve_bundle_dir(options: LoaderOptions, model: str, revision: str | None = None) -> Path:
    """The explicit ``bundle`` option, else ``MODEL_DIR/marlin-pack``, else (a repo id) its marlin-pack cache entry."""
    bundle = options.bundle
    if isinstance(bundle, ObjectUrl):  # streamed (remote_load.decide_bundle), never a directory
        raise BundleMismatchError(F.bundle, f"{bundle} is a bundle in object storage, which only the {LOAD_FORMAT} loader "
                                  "(marlin_pack.vllm_plugin.remote_load) and `marlin-pack check --bundle` read")
    try:
        return locate_bundle(model, revision, bundle)
    except HomeDirectoryError as e:  # HF_HOME, MARLIN_PACK_CACHE, ...: the message names it
        raise BundleMismatchError(F.bundle, str(e)) from e
    except CheckpointError as e:
        raise BundleMismatchError(
            F.bundle,
            f"{e}; so it has no marlin-pack bundle: convert it first (`marlin-pack convert {model}`) or name the bundle with "
            '--model-loader-extra-config \'{"bundle": "/path"}\'',
        ) from e


_MANIFESTS: dict[tuple[str, int, int, int, int, int], Manifest] = {}


def load_manifest(bundle_dir: Path) -> Manifest:
    """The bundle's manifest, read and validated once per process while the file stays the same (the
    page-locking planned ahead of the copy and the loader's checks both need it before the GPU)."""
    path = bundle_dir / MANIFEST_NAME
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        return read_manifest(bundle_dir)  # it says what is wrong
    if key not in _MANIFESTS:
        _MANIFESTS.clear()  # one bundle per process, in practice
        _MANIFESTS[key] = read_manifest(bundle_dir)
    return _MANIFESTS[key]


def bundle_layouts(manifest: Manifest) -> dict[str, int]:
    """The layouts a bundle holds: each layer family it has (``marlin``, ``machete``, ``marlin_moe``) -> its layout version."""
    from marlin_pack.schemas import LayerKernel

    v = manifest.target.layout_version
    kernels = {e.kernel for s in manifest.tensor_parallel for e in s.layers}
    families = {"marlin": LayerKernel.marlin in kernels, "machete": LayerKernel.machete in kernels,
                "marlin_moe": any(s.moe_layers for s in manifest.tensor_parallel)}
    return {f: v for f, present in families.items() if present}


def loaded_zero_word(manifest: Manifest) -> int | None:
    """The int32 word every ``qzeros`` word of a symmetric GPTQ source holds (the source's checks made sure), which
    vLLM loads and no Marlin kernel reads; None for other sources (their zero points, if any, are in the bundle)."""
    from marlin_pack.marlin.packed_codes import repeated_word
    from marlin_pack.schemas import GptqSettings
    from marlin_pack.sources.gptq import GptqV1Source

    settings = manifest.source.quant_settings
    if not isinstance(settings, GptqSettings):
        return None
    source = GptqV1Source.from_settings(settings)
    return repeated_word(source.stored_zero, source.bits)


def check_release(vllm_version: str) -> None:
    """The running vLLM is a release marlin-pack serves (its entry in :mod:`.releases`).

    Raises:
        BundleMismatchError: ``vllm_version``, naming the releases served.
    """
    if releases.release(vllm_version) is None:
        raise BundleMismatchError(F.vllm_version, releases.unsupported_reason(vllm_version))


def serving_path_problem(manifest: Manifest, vllm_version: str, transformers_version: str | None) -> tuple[MismatchField, str] | None:
    """Whether the release builds the bundle's layers for its architecture: the path it takes (vLLM's own class, or its
    Transformers backend: ``releases.serving_path``) is one the bundle's layout is for (its architecture row's
    ``paths``), and through the backend the installed transformers is one the layout was checked against (the
    manifest's ``target.transformers``; a bundle made before it was recorded: the table's). None: it does."""
    from marlin_pack.marlin.architectures import architecture_for
    from marlin_pack.marlin.transformers_backend import CHECKED_TRANSFORMERS

    name = manifest.source.architecture
    row = architecture_for(name)
    paths = row.paths if row is not None else frozenset({"native"})
    names = None
    if manifest.target.paths is not None and frozenset(manifest.target.paths) < paths:
        # fewer than the row's: the checkpoint's names load on those paths only (Olmoe's experts named w1/w3/w2)
        from marlin_pack.marlin.moe import MOE_ARCHITECTURES

        paths = frozenset(manifest.target.paths)
        moe = MOE_ARCHITECTURES.get(name)
        named = [n.describe() for n in (moe.namings if moe is not None else ()) if n.paths == paths]
        names = f"experts named {' or '.join(named)}" if named else "tensor names"
    problem = releases.path_problem(vllm_version, name, paths, checkpoint=names)
    if problem is not None:
        return F.vllm_version, problem
    if releases.serving_path(vllm_version, name) == "transformers":
        problem = releases.transformers_problem(manifest.target.transformers or CHECKED_TRANSFORMERS, transformers_version)
        if problem is not None:
            return F.transformers_version, problem
    return None


def _check_target(manifest: Manifest, facts: EngineFacts) -> None:
    """The running release serves the bundle's layouts (whatever release it was made with) on the path it takes for its
    architecture, and its dtype and method."""
    check_release(facts.vllm_version)
    path = serving_path_problem(manifest, facts.vllm_version, facts.transformers_version)
    if path is not None:
        raise BundleMismatchError(*path)
    layouts = bundle_layouts(manifest)
    if manifest.target.kernel not in TARGET_KERNELS or not releases.serves(facts.vllm_version, layouts):
        held = ", ".join(f"{f} v{v}" for f, v in layouts.items())
        raise BundleMismatchError(
            F.kernel,
            f"bundle layout {manifest.target.kernel} ({held}, made with vLLM {manifest.target.vllm_version}) is not one "
            f"vLLM {facts.vllm_version} serves; re-convert with a marlin-pack that supports it",
        )
    if facts.dtype != manifest.serving_dtype.value:
        raise BundleMismatchError(
            F.serving_dtype,
            f"bundle holds {manifest.serving_dtype.value} scales, the engine runs {facts.dtype}; "
            f"start vLLM with --dtype {manifest.serving_dtype.value} or convert with --dtype {facts.dtype}",
        )
    if facts.quantization is not None:
        method = facts.quantization
        family = "awq" if "awq" in method else "gptq" if "gptq" in method else method
        fmt = manifest.source.format.value
        want = "awq" if fmt.startswith("awq") else "compressed-tensors" if fmt == "compressed-tensors" else "gptq"
        if family != want:
            raise BundleMismatchError(F.quant_method, f"engine quantization is {method}, the bundle holds {want} weights")


def _tp_set(manifest: Manifest, facts: EngineFacts) -> TensorParallelSet:
    try:
        tp_set = manifest.tensor_parallel_set(facts.tp_size)
    except KeyError:
        raise BundleMismatchError(F.tp_size, _tp_advice(manifest, facts)) from None
    if not 0 <= facts.tp_rank < facts.tp_size:
        raise BundleMismatchError(F.tp_rank, f"rank {facts.tp_rank} is outside tp_size {facts.tp_size}")
    return tp_set


def _check_data_parallel(manifest: Manifest, tp_set: TensorParallelSet, facts: EngineFacts) -> None:
    """Experts layers at expert parallelism or ``--data-parallel-size > 1``: vLLM shards them over the TP ranks
    of every replica together (``FusedMoEParallelConfig.make``), so they come from another TP size's rank files
    (:mod:`~marlin_pack.vllm_plugin.expert_share`), which the bundle must hold."""
    if needs_share(tp_set, facts.tp_size, facts.tp_rank, facts.dp_size, facts.expert_parallel, facts.pcp_size):
        from marlin_pack.planning import convertible_tp_sizes

        check_experts_source(manifest, facts.model, architecture=manifest.source.architecture, tp_size=facts.tp_size,
                             dp_size=facts.dp_size, expert_parallel=facts.expert_parallel, pcp_size=facts.pcp_size,
                             accepted=lambda sizes: convertible_tp_sizes(facts.model, sizes, facts.revision))


def _tp_advice(manifest: Manifest, facts: EngineFacts) -> str:
    """Why the bundle lacks the engine's TP size, naming only sizes ``convert`` accepts for this checkpoint."""
    from marlin_pack.planning import convertible_tp_sizes

    held = ",".join(map(str, manifest.tp_sizes))
    found = f"bundle has tp {held}, the engine runs --tensor-parallel-size {facts.tp_size}"
    accepted = convertible_tp_sizes(facts.model, sorted({1, 2, 4, 8, facts.tp_size, *manifest.tp_sizes}), facts.revision)
    if facts.tp_size in accepted:
        sizes = ",".join(map(str, sorted({*manifest.tp_sizes, facts.tp_size})))
        return f"{found}; run `marlin-pack convert {facts.model} --tp {sizes}` (it adds the size, the others kept)"
    others = ",".join(map(str, accepted)) or "none of 1,2,4,8"
    return (
        f"{found}, which this checkpoint cannot be split into (marlin-pack convert accepts --tp {others} for it); "
        f"start vLLM with one of those sizes"
    )


def _check_kernel_settings(manifest: Manifest, facts: EngineFacts) -> None:
    """Engine settings that would make vLLM run another layout than the bundle's."""
    if (facts.marlin_input_dtype or "").lower() in _8BIT_ACTIVATIONS:
        raise BundleMismatchError(
            F.activation_dtype,
            f"VLLM_MARLIN_INPUT_DTYPE={facts.marlin_input_dtype} makes vLLM quantize activations to 8 bits, "
            f"whose Marlin layout differs; the bundle holds the {manifest.activation_dtype.value}-activation "
            "layout. Unset VLLM_MARLIN_INPUT_DTYPE",
        )
    if facts.batch_invariant:
        raise BundleMismatchError(
            F.kernel, f"VLLM_BATCH_INVARIANT=1 disables Marlin, the bundle holds the {KERNEL_NAME} layout; unset it"
        )
    if manifest.has_machete_layers:
        _check_machete_settings(manifest, facts)
        return
    if KERNEL_NAME in facts.disabled_kernels:
        raise BundleMismatchError(
            F.kernel,
            f"VLLM_DISABLED_KERNELS disables {KERNEL_NAME}, the layout the bundle holds; remove it from the list",
        )
    per_quant = dict(facts.linear_backend_per_quant or {})
    backend, source = (
        (per_quant["mixed_precision"], "--kernel-config linear_backend_per_quant.mixed_precision")
        if per_quant.get("mixed_precision")
        else (facts.linear_backend, "--linear-backend")
    )
    if backend not in ("auto", "marlin"):
        raise BundleMismatchError(
            F.linear_backend,
            f"{source} is {backend!r}, the bundle holds the {KERNEL_NAME} layout; drop the option or set it to 'marlin'",
        )


def _check_machete_settings(manifest: Manifest, facts: EngineFacts) -> None:
    """A bundle holding Machete layers: vLLM must make, on this GPU with these settings, the per-layer choice the
    bundle was converted for (Machete where it implements a layer, Marlin elsewhere): its default on SM90."""
    if facts.capability is not None and facts.capability != 90:
        raise BundleMismatchError(
            F.kernel,
            f"the bundle holds layers in Machete's layout (SM90 only), this GPU has compute capability "
            f"{facts.capability // 10}.{facts.capability % 10}, where vLLM uses Marlin; convert with --kernel marlin for it",
        )
    per_quant = dict(facts.linear_backend_per_quant or {})
    backend = per_quant.get("mixed_precision") or facts.linear_backend
    if backend not in ("auto", ""):
        raise BundleMismatchError(
            F.linear_backend,
            f"--linear-backend is {backend!r}; the bundle holds vLLM's own per-layer choice on SM90 (Machete, Marlin "
            "where Machete cannot): drop the option, or convert with --kernel marlin and keep --linear-backend marlin",
        )
    for name in (MACHETE_KERNEL_NAME, KERNEL_NAME):
        if name in facts.disabled_kernels:
            raise BundleMismatchError(
                F.kernel, f"VLLM_DISABLED_KERNELS disables {name}, whose layout the bundle holds for some layers; remove it"
            )


def hopper_machete_layers(manifest: Manifest, tp_set: TensorParallelSet, facts: EngineFacts) -> int:
    """How many of the bundle's Marlin layers vLLM's default (these kernel settings, this GPU) would serve with
    Machete: non-zero only on SM90 for a bundle converted with ``--kernel marlin``."""
    if facts.capability != 90:
        return 0
    from marlin_pack.machete.supports import machete_supports
    from marlin_pack.schemas import LayerKernel, torch_dtype

    q, act = manifest.quant, torch_dtype(manifest.serving_dtype)
    return sum(
        machete_supports(
            capability=90, weight_type=q.weight_type.value, zero_points=q.zero_points, group_size=q.group_size, act_dtype=act,
            in_features=e.size_k, out_features=e.size_n, disabled_kernels=facts.disabled_kernels,
            linear_backend=facts.linear_backend, linear_backend_per_quant=facts.linear_backend_per_quant,
        )[0]
        for e in tp_set.layers
        if e.kernel is LayerKernel.marlin
    )


def check_engine(manifest: Manifest, facts: EngineFacts) -> TensorParallelSet:
    """Check the bundle fits the engine's configuration; return the TP set to load.

    Raises:
        BundleMismatchError: naming the field (``vllm_version``, ``kernel``, ``serving_dtype``,
            ``quant_method``, ``tp_size``, ``tp_rank``, ``activation_dtype``, ``linear_backend``, ``dp_size``, ``ep_size``).
    """
    _check_target(manifest, facts)
    tp_set = _tp_set(manifest, facts)
    _check_kernel_settings(manifest, facts)
    _check_data_parallel(manifest, tp_set, facts)
    return tp_set


def _with_field(field: MismatchField, fn: Callable[[], Any], redo: str = "re-convert") -> Any:
    """Run a check; any failure becomes a :class:`BundleMismatchError` naming ``field``.

    Files that cannot be read (a dangling symlink, a permission the serving user lacks, a
    malformed header) and a ``config.json`` no model has are refusals like any other, so that ``fallback`` covers them.
    """
    try:
        return fn()
    except BundleMismatchError:
        raise
    except MarlinPackError as e:  # BundleError, UnsupportedCheckpointError, ...: one line that says what to do
        raise BundleMismatchError(field, str(e)) from e
    except SafetensorsFormatError as e:
        raise BundleMismatchError(field, f"{e}; {redo}") from e
    except OSError as e:
        where = e.filename or "a file"
        advice = "the serving user must be able to read it" if isinstance(e, PermissionError) else redo
        raise BundleMismatchError(field, f"cannot read {where} ({e.strerror or e}); {advice}") from e
    except (ValueError, RecursionError) as e:
        raise BundleMismatchError(field, f"{type(e).__name__}: {e}") from e


def _checked_header(manifest: Manifest, tp_set: TensorParallelSet, rank: int, path: Path) -> SafetensorsHeader:
    header = read_header(path)
    check_rank_header(manifest, tp_set, rank, header)
    return header


def select_bundle(options: LoaderOptions, facts: EngineFacts, *, copy_hashes: bool = False) -> SelectedBundle:
    """Find and check the bundle for this engine and rank, before anything touches the GPU.

    Order: the running vLLM release (one marlin-pack supports), manifest (format version), engine fit (layouts the
    release serves, dtype, TP, kernel settings), the source checkpoint (quantization config, files, sizes, headers,
    and samples of every tensor's bytes; whole hashes where the bundle records no samples, unless this user's stamps
    vouch for them), then this rank's file and the common file (sizes, hashes unless stamped, readable, headers and
    metadata exactly as the manifest implies). With ``pipeline_parallel_size > 1`` the
    selection is this stage's share of them (:func:`~marlin_pack.vllm_plugin.stage.stage_share`); where vLLM shards the
    experts over another TP size (expert parallelism, data parallelism), its experts come from that size's rank file,
    checked likewise (:func:`~marlin_pack.vllm_plugin.expert_share.expert_share`).

    ``copy_hashes`` (the loader's, :func:`select_for_copy`): a cold bundle file it would hash (the rank file, the common
    file, an expert share's file) is left to the loader's copy (``hashed.pending``;
    :func:`~marlin_pack.gpu.plan.hash_left_to_copy`), which reads such a file whole, the bytes it does not copy (other
    stages' layers, other GPUs' experts) only into its hash: each byte read once, the digest compared before anything
    is bound.

    Raises:
        BundleMismatchError: naming the field that does not fit.
    """
    check_release(facts.vllm_version)  # first: an unknown release is refused whatever the bundle
    bundle_dir = resolve_bundle_dir(options, facts.model, facts.revision)
    manifest: Manifest = _with_field(F.manifest, lambda: load_manifest(bundle_dir))
    tp_set = check_engine(manifest, facts)
    model_dir = _resolve(facts.model, facts.revision).dir
    hashed: HashReport = _with_field(
        F.source, lambda: check_source(manifest, model_dir, full_hash=options.full_hash, sampled=True))
    rank_entry = tp_set.ranks[facts.tp_rank].file
    entries = [manifest.common, rank_entry]
    leave = hash_left_to_copy if copy_hashes else None
    hashed = hashed.add(_with_field(F.files, lambda: check_files(
        bundle_dir, manifest, entries, full_hash=options.full_hash, leave_to_copy=leave)))
    rank_file = _with_field(F.files, lambda: resolve_file(bundle_dir, rank_entry))
    common_file = _with_field(F.files, lambda: resolve_file(bundle_dir, manifest.common))
    redo = f"re-run `{convert_command(bundle_dir, manifest=manifest)}`"  # it rewrites a damaged file
    common_header = _with_field(F.files, lambda: _checked_common_header(manifest, common_file), redo)
    rank_header = _with_field(F.files, lambda: _checked_header(manifest, tp_set, facts.tp_rank, rank_file), redo)
    stage = None
    if facts.pp_size > 1:
        stage = _with_field(F.pp_size, lambda: stage_share(
            manifest, tp_set, rank_header, common_header, model_dir, facts.pp_size, facts.pp_rank))
        tp_set, rank_header, common_header = stage.tp_set, stage.rank_header, stage.common_header
    experts = None
    if needs_share(tp_set, facts.tp_size, facts.tp_rank, facts.dp_size, facts.expert_parallel, facts.pcp_size):
        config = _with_field(F.source, lambda: read_json(model_dir / "config.json", "config.json"))
        groups = _with_field(F.source, lambda: num_expert_group(manifest.source.architecture, config))
        experts, also = _with_field(F.files, lambda: _experts(bundle_dir, manifest, tp_set, facts, options.full_hash, groups,
                                                              leave))
        hashed = hashed.add(also)
        moe = {e.name for e in tp_set.moe_layers}
        tp_set = tp_set.model_copy(update={"moe_layers": list(experts.moe_layers)})
        rank_header = dataclasses.replace(rank_header, tensors={
            n: i for n, i in rank_header.tensors.items() if n.rsplit(".", 1)[0] not in moe})
    return SelectedBundle(
        bundle_dir=bundle_dir,
        manifest=manifest,
        tp_set=tp_set,
        rank=facts.tp_rank,
        rank_file=rank_file,
        common_file=common_file,
        rank_header=rank_header,
        common_header=common_header,
        hashed=hashed,
        stage=stage,
        experts=experts,
    )


def select_for_copy(options: LoaderOptions, facts: EngineFacts) -> SelectedBundle:
    """:func:`select_bundle` for the loader, whose copy hashes the cold files it reads (``copy_hashes``)."""
    return select_bundle(options, facts, copy_hashes=True)


def _experts(bundle_dir: Path, manifest: Manifest, tp_set: TensorParallelSet, facts: EngineFacts, full_hash: bool,
             groups: int | None, leave: Callable[[Path], bool] | None = None) -> tuple[ExpertShare, HashReport]:
    """This GPU's experts (its rank of the TP size vLLM shards them at; checked as its own rank file is) and what
    checking that file hashed; ``groups``: the model's expert groups (:func:`~.expert_share.num_expert_group`);
    ``leave``: as for the rank file, whether that file's digest is left to the loader's copy."""
    ranks = moe_ranks(facts.tp_size, facts.tp_rank, facts.dp_size, facts.dp_rank, facts.expert_parallel, facts.pcp_size,
                      facts.pcp_rank)
    source = manifest.tensor_parallel_set(ranks.tp_size)  # check_engine made sure the bundle holds it
    entry = source.ranks[ranks.tp_rank].file
    own = entry.path == tp_set.ranks[facts.tp_rank].file.path  # (TP 1 at EP: its own rank file, checked already)
    hashed = HashReport() if own else check_files(bundle_dir, manifest, [entry], full_hash=full_hash, leave_to_copy=leave)
    path = resolve_file(bundle_dir, entry)
    header = _checked_header(manifest, source, ranks.tp_rank, path)
    strategy = placement(facts.expert_placement, ep_size=ranks.ep_size, num_expert_group=groups, dp_size=facts.dp_size,
                         all2all_backend=facts.all2all_backend, pcp_size=facts.pcp_size)
    return expert_share(manifest, tp_set, source, header, path, ranks, strategy), hashed


def _checked_common_header(manifest: Manifest, common_file: Path) -> SafetensorsHeader:
    """The common file's header; every alias must name a tensor stored there (and not be one)."""
    header = read_header(common_file)
    for alias, original in manifest.common_aliases.items():
        if original not in header.tensors or alias in header.tensors:
            raise BundleError(
                f"{manifest.common.path}: common_aliases maps {alias} to {original}, which the file "
                f"{'does not hold' if original not in header.tensors else 'holds under both names'}; re-convert"
            )
    return header


def refusal(field: MismatchField, reason: str, model: str, bundle: Path | str | None) -> LoadRefusedError:
    """The one-line refusal: which model, which bundle, which field, why, and how to fall back."""
    where = f"bundle {bundle}" if bundle is not None else "its bundle"
    return LoadRefusedError(
        field, f"marlin-pack cannot serve {model} from {where}: [{field}] {reason}. Fix it, or {_FALLBACK_HINT}."
    )


def internal_error(e: BaseException) -> str:
    """The reason of a fallback for an exception that is not a refusal: a bug of marlin-pack's, on one line."""
    text = " ".join(str(e).split()) or "no message"
    return (f"internal error {type(e).__name__}: {text[:300]} while checking the bundle; please report it "
            "(MARLIN_PACK_DEBUG=1 marlin-pack check MODEL shows the traceback)")


def decide(
    options: LoaderOptions,
    facts: EngineFacts,
    selector: Callable[[LoaderOptions, EngineFacts], SelectedBundle] = select_bundle,
) -> Decision:
    """Select the bundle; on a problem, fall back (``fallback: true``) or refuse.

    With ``fallback`` on, every failure falls back, whatever its type: one that is not a refusal (a bug of
    marlin-pack's) too, said to be an internal error (:func:`internal_error`); nothing has touched the GPU yet.

    Raises:
        LoadRefusedError: the bundle does not fit and ``fallback`` is off; the message
            names the field and how to fall back.
        Exception: (``fallback`` off) an internal error, as it was raised.
    """
    try:
        return Decision(selector(options, facts))
    except MarlinPackError as e:  # a refusal (a bundle error, or a checkpoint no bundle can serve)
        field = getattr(e, "field", None) or (F.bundle if isinstance(e, BundleError) else F.source)
        if options.fallback:
            return Decision(None, field, str(e))
        bundle: Path | str | None
        try:
            bundle = resolve_bundle_dir(options, facts.model, facts.revision)
        except BundleError:
            bundle = None if options.bundle is None else str(options.bundle)
        raise refusal(field, str(e), facts.model, bundle) from e
    except Exception as e:  # not a refusal: a bug of marlin-pack's
        if not options.fallback:
            raise
        return Decision(None, F.bundle, internal_error(e))
