"""Decisions of the ``marlin_prepacked`` loader as plain functions (no vLLM import).

The loader gathers facts from vLLM (:class:`EngineFacts`, :class:`LayerFacts`) and
these functions decide: which bundle, whether it fits the engine, whether to refuse
or fall back. Keeping them free of vLLM and of the GPU makes every message testable
on a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from marlin_pack._constants import FORMAT_NAME, FORMAT_VERSION, KERNEL_NAME, LOAD_FORMAT
from marlin_pack.bundle import (
    check_compatible,
    check_files,
    check_source,
    default_bundle_dir,
    read_manifest,
    resolve_file,
)
from marlin_pack.errors import BundleError, BundleMismatchError
from marlin_pack.layout import SERVING_DTYPES, tensor_specs
from marlin_pack.schemas import Manifest, TensorParallelSet

__all__ = [
    "LoaderOptions",
    "EngineFacts",
    "LayerFacts",
    "BundlePlan",
    "Decision",
    "LoadRefusedError",
    "SUPPORTED_METHODS",
    "TORCH_DTYPES",
    "parse_extra_config",
    "resolve_bundle_dir",
    "check_engine",
    "plan_bundle",
    "decide",
    "check_layers",
    "check_rank_header",
]

Verify = Literal["auto", "full", "size"]
_FULL_HASH: dict[str, bool | None] = {"auto": None, "full": True, "size": False}
_8BIT_ACTIVATIONS = ("int8", "fp8")
# The quant methods whose layers a bundle can fill (vLLM 0.33.0 dense AWQ / GPTQ).
SUPPORTED_METHODS = ("AutoAWQMarlinLinearMethod", "AutoGPTQLinearMethod")
TORCH_DTYPES = SERVING_DTYPES
_FALLBACK_HINT = (
    """pass --model-loader-extra-config '{"fallback": true}' to load the checkpoint the ordinary way"""
)


class LoadRefusedError(BundleMismatchError):
    """The loader will not serve the bundle (and ``fallback`` is off); ``field`` says why."""


@dataclass(frozen=True)
class LoaderOptions:
    """``--model-loader-extra-config`` of the ``marlin_prepacked`` load format.

    Attributes:
        bundle: bundle directory; default ``MODEL_DIR/marlin-pack``.
        fallback: load the checkpoint the ordinary way (with a warning) instead of
            refusing a missing, stale or mismatched bundle.
        verify: ``auto`` hashes files whose (size, mtime) stamp changed since the last
            check, ``full`` hashes everything, ``size`` checks sizes and headers only.
        io_threads: reader threads (each with its own pinned buffers and CUDA stream).
        chunk_mb: size of one read / host-to-device copy, in MiB.
    """

    bundle: Path | None = None
    fallback: bool = False
    verify: Verify = "auto"
    io_threads: int = 8
    chunk_mb: int = 64

    @property
    def full_hash(self) -> bool | None:
        return _FULL_HASH[self.verify]


_OPTION_KEYS = ("bundle", "fallback", "verify", "io_threads", "chunk_mb")


def _int_option(extra: Mapping[str, Any], key: str, default: int, high: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"model_loader_extra_config[{key!r}] must be an integer in 1..{high}, got {value!r}")
    return value


def parse_extra_config(extra: object, load_format: str = LOAD_FORMAT) -> LoaderOptions:
    """Validate ``model_loader_extra_config`` the way vLLM's own loaders do.

    Raises:
        ValueError: not a dict, an unknown key, or a value of the wrong type.
    """
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config must be a dict for load format {load_format}, "
            f"got {type(extra).__name__}"
        )
    unexpected = sorted(set(extra) - set(_OPTION_KEYS))
    if unexpected:
        raise ValueError(
            f"Unexpected extra config keys for load format {load_format}: {unexpected}; "
            f"expected some of {list(_OPTION_KEYS)}"
        )
    bundle = extra.get("bundle")
    if bundle is not None and (not isinstance(bundle, (str, os.PathLike)) or not str(bundle)):
        raise ValueError(f"model_loader_extra_config['bundle'] must be a directory path, got {bundle!r}")
    fallback = extra.get("fallback", False)
    if not isinstance(fallback, bool):
        raise ValueError(f"model_loader_extra_config['fallback'] must be true or false, got {fallback!r}")
    verify = extra.get("verify", "auto")
    if verify not in _FULL_HASH:
        raise ValueError(
            f"model_loader_extra_config['verify'] must be one of {list(_FULL_HASH)}, got {verify!r}"
        )
    return LoaderOptions(
        bundle=Path(bundle).expanduser() if bundle is not None else None,
        fallback=fallback,
        verify=verify,
        io_threads=_int_option(extra, "io_threads", 8, 64),
        chunk_mb=_int_option(extra, "chunk_mb", 64, 1024),
    )


@dataclass(frozen=True)
class EngineFacts:
    """What the loader needs to know about the engine (gathered from vLLM by the loader)."""

    model: str
    vllm_version: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    dtype: str = "float16"
    quantization: str | None = None
    marlin_input_dtype: str | None = None
    batch_invariant: bool = False
    disabled_kernels: tuple[str, ...] = ()
    linear_backend: str = "auto"
    linear_backend_per_quant: Mapping[str, str] | None = None


@dataclass(frozen=True)
class BundlePlan:
    """A bundle checked against the engine: what this rank loads."""

    bundle_dir: Path
    manifest: Manifest
    tp_set: TensorParallelSet
    rank: int
    rank_file: Path
    common_file: Path


@dataclass(frozen=True)
class Decision:
    """Either a plan, or (fallback on) the field and reason to load ordinarily instead."""

    plan: BundlePlan | None
    field: str | None = None
    reason: str | None = None

    @property
    def fallback(self) -> bool:
        return self.plan is None


def resolve_bundle_dir(options: LoaderOptions, model: str) -> Path:
    """The explicit ``bundle`` option, else ``MODEL_DIR/marlin-pack``."""
    if options.bundle is not None:
        return options.bundle
    if not Path(model).is_dir():
        raise BundleMismatchError(
            "bundle",
            f"model {model!r} is not a local directory, so it has no marlin-pack bundle; serve the local "
            "checkpoint directory or name the bundle with "
            '--model-loader-extra-config \'{"bundle": "/path"}\'',
        )
    return default_bundle_dir(model)


def check_engine(manifest: Manifest, facts: EngineFacts) -> TensorParallelSet:
    """Check the bundle fits the engine's configuration; return the TP set to load.

    Raises:
        BundleMismatchError: naming the field (``vllm_version``, ``serving_dtype``,
            ``tp_size``, ``activation_dtype``, ``pp_size``, ``kernel``, ``linear_backend``, ...).
    """
    tp_set = check_compatible(
        manifest,
        vllm_version=facts.vllm_version,
        tp_size=facts.tp_size,
        tp_rank=facts.tp_rank,
        dtype=facts.dtype,
        quant_method=facts.quantization,
    )
    act = (facts.marlin_input_dtype or "").lower()
    if act in _8BIT_ACTIVATIONS:
        raise BundleMismatchError(
            "activation_dtype",
            f"VLLM_MARLIN_INPUT_DTYPE={facts.marlin_input_dtype} makes vLLM quantize activations to 8 bits, "
            f"whose Marlin layout differs; the bundle holds the {manifest.activation_dtype.value}-activation "
            "layout. Unset VLLM_MARLIN_INPUT_DTYPE",
        )
    if facts.pp_size != 1:
        raise BundleMismatchError(
            "pp_size",
            f"the engine runs pipeline_parallel_size={facts.pp_size}; marlin-pack bundles support "
            "pipeline_parallel_size=1 only",
        )
    if facts.batch_invariant:
        raise BundleMismatchError(
            "kernel",
            f"VLLM_BATCH_INVARIANT=1 disables Marlin, the bundle holds the {KERNEL_NAME} layout; unset it",
        )
    if KERNEL_NAME in facts.disabled_kernels:
        raise BundleMismatchError(
            "kernel",
            f"VLLM_DISABLED_KERNELS disables {KERNEL_NAME}, the layout the bundle holds; "
            "remove it from the list",
        )
    per_quant = dict(facts.linear_backend_per_quant or {})
    backend, source = (
        (per_quant["mixed_precision"], "--kernel-config linear_backend_per_quant.mixed_precision")
        if per_quant.get("mixed_precision")
        else (facts.linear_backend, "--linear-backend")
    )
    if backend not in ("auto", "marlin"):
        raise BundleMismatchError(
            "linear_backend",
            f"{source} is {backend!r}, the bundle holds the {KERNEL_NAME} layout; "
            "drop the option or set it to 'marlin'",
        )
    return tp_set


def _with_field(field: str, fn: Callable[[], Any]) -> Any:
    """Run a check; a :class:`BundleError` without a field gets ``field``."""
    try:
        return fn()
    except BundleMismatchError:
        raise
    except BundleError as e:
        raise BundleMismatchError(field, str(e)) from e


def plan_bundle(options: LoaderOptions, facts: EngineFacts) -> BundlePlan:
    """Find and check the bundle for this engine and rank, before anything touches the GPU.

    Order: manifest (format version), engine fit (vLLM version, dtype, TP, kernel
    settings), the source checkpoint (files, sizes, headers, hashes by stamp), then this
    rank's file and the common file (sizes, hashes by stamp).

    Raises:
        BundleMismatchError: naming the field that does not fit.
    """
    bundle_dir = resolve_bundle_dir(options, facts.model)
    manifest: Manifest = _with_field("manifest", lambda: read_manifest(bundle_dir))
    tp_set = check_engine(manifest, facts)
    if not Path(facts.model).is_dir():
        raise BundleMismatchError(
            "source",
            f"model {facts.model!r} is not a local directory: cannot check it is the bundle's source",
        )
    _with_field(
        "source", lambda: check_source(manifest, facts.model, bundle_dir, full_hash=options.full_hash)
    )
    rank_entry = tp_set.ranks[facts.tp_rank].file
    entries = [manifest.common, rank_entry]
    _with_field("files", lambda: check_files(bundle_dir, manifest, entries, full_hash=options.full_hash))
    return BundlePlan(
        bundle_dir=bundle_dir,
        manifest=manifest,
        tp_set=tp_set,
        rank=facts.tp_rank,
        rank_file=_with_field("files", lambda: resolve_file(bundle_dir, rank_entry)),
        common_file=_with_field("files", lambda: resolve_file(bundle_dir, manifest.common)),
    )


def refusal(field: str, reason: str, model: str, bundle: Path | str | None) -> LoadRefusedError:
    where = f"bundle {bundle}" if bundle is not None else "its bundle"
    return LoadRefusedError(
        field,
        f"marlin-pack cannot serve {model} from {where}: [{field}] {reason}. Fix it, or {_FALLBACK_HINT}.",
    )


def decide(
    options: LoaderOptions,
    facts: EngineFacts,
    planner: Callable[[LoaderOptions, EngineFacts], BundlePlan] = plan_bundle,
) -> Decision:
    """Plan the bundle load; on a problem, fall back (``fallback: true``) or refuse.

    Raises:
        LoadRefusedError: the bundle does not fit and ``fallback`` is off; the message
            names the field and how to fall back.
    """
    try:
        return Decision(planner(options, facts))
    except BundleError as e:
        field = getattr(e, "field", None) or "bundle"
        if options.fallback:
            return Decision(None, field, str(e))
        bundle: Path | str | None
        try:
            bundle = resolve_bundle_dir(options, facts.model)
        except BundleError:
            bundle = options.bundle
        raise refusal(field, str(e), facts.model, bundle) from e


@dataclass(frozen=True)
class LayerFacts:
    """One quantized layer as vLLM built it (see ``loader.layer_facts``)."""

    method: str
    kernel: str | None = None
    partition_shape: tuple[int, int] | None = None  # (size_k, size_n) per rank
    padded_nk: tuple[int, int] | None = None  # vLLM's marlin_padded_nk(size_n, size_k, group_size)
    group_size: int | None = None
    weight_type: str | None = None
    act_dtype: str | None = None
    zero_points: bool | None = None
    has_bias: bool = False
    skips_when_marked: bool = True  # its post-processing honours prepacked.mark_prepacked


def _sample(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def check_layers(manifest: Manifest, tp_set: TensorParallelSet, found: Mapping[str, LayerFacts]) -> None:
    """Check that vLLM built exactly the bundle's layers, each with Marlin and its configuration.

    Raises:
        BundleMismatchError: ``layers`` (set, shapes, bias), ``kernel``, ``layout``,
            ``group_size``, ``weight_type``, ``activation_dtype`` or ``zero_points``.
    """
    expected = {entry.name: entry for entry in tp_set.layers}
    only_bundle = sorted(set(expected) - set(found))
    only_engine = sorted(set(found) - set(expected))
    if only_bundle or only_engine:
        parts = []
        if only_bundle:
            parts.append(f"{len(only_bundle)} only in the bundle ({_sample(only_bundle)})")
        if only_engine:
            parts.append(f"{len(only_engine)} only in the engine ({_sample(only_engine)})")
        raise BundleMismatchError(
            "layers",
            "the engine's quantized layers differ from the bundle's: " + "; ".join(parts) + "; re-convert",
        )
    q = manifest.quant
    for name, entry in expected.items():
        f = found[name]
        if f.method not in SUPPORTED_METHODS:
            raise BundleMismatchError(
                "kernel",
                f"layer {name} uses {f.method}, expected one of {list(SUPPORTED_METHODS)} with {KERNEL_NAME}",
            )
        if f.kernel != KERNEL_NAME:
            raise BundleMismatchError(
                "kernel", f"vLLM chose {f.kernel} for layer {name}; the bundle holds the {KERNEL_NAME} layout"
            )
        if not f.skips_when_marked:
            raise BundleMismatchError(
                "kernel",
                f"layer {name}: {f.method}.process_weights_after_loading is not patched by marlin-pack",
            )
        checks: list[tuple[str, object, object, str]] = [
            ("layers", f.partition_shape, (entry.size_k, entry.size_n), "per-rank (K, N)"),
            ("layout", f.padded_nk, (entry.padded_n, entry.padded_k), "Marlin padded (N, K)"),
            ("group_size", f.group_size, q.group_size, "group size"),
            ("weight_type", f.weight_type, q.weight_type.value, "weight type"),
            ("activation_dtype", f.act_dtype, manifest.activation_dtype.value, "activation dtype"),
            ("zero_points", f.zero_points, q.zero_points, "zero points"),
            ("layers", f.has_bias, entry.has_bias, "bias"),
        ]
        for field, got, want, what in checks:
            if got != want:
                raise BundleMismatchError(
                    field, f"layer {name}: the engine's {what} is {got}, the bundle's is {want}"
                )


def check_rank_header(
    plan: BundlePlan, tensors: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]
) -> None:
    """Check a rank file's header: its metadata and exactly the tensors the manifest implies.

    Args:
        tensors: ``name -> (safetensors dtype code, shape)``.

    Raises:
        BundleMismatchError: field ``files``.
    """
    rel = plan.tp_set.ranks[plan.rank].file.path
    want_meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "tp_size": str(plan.tp_set.tp_size),
        "rank": str(plan.rank),
    }
    if dict(metadata) != want_meta:
        raise BundleMismatchError(
            "files", f"bundle file {rel} has metadata {dict(metadata)}, expected {want_meta}"
        )
    dtype = TORCH_DTYPES[plan.manifest.serving_dtype.value]
    codes = {torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16"}
    want: dict[str, tuple[str, tuple[int, ...]]] = {}
    for entry in plan.tp_set.layers:
        for name, tdtype, shape in tensor_specs(entry, plan.manifest.quant, dtype):
            want[name] = (codes[tdtype], tuple(shape))
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise BundleMismatchError(
            "files",
            f"bundle file {rel} lacks {_sample(missing) or 'nothing'} and has unexpected "
            f"{_sample(extra) or 'nothing'}; re-convert",
        )
    for name, spec in want.items():
        got = (tensors[name][0], tuple(tensors[name][1]))
        if got != spec:
            raise BundleMismatchError(
                "files", f"bundle file {rel}: tensor {name} is {got}, the manifest implies {spec}"
            )
