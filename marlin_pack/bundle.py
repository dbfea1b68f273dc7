"""Reading a bundle back: find it, parse its manifest, check files, source and engine fit.

Everything here treats the bundle as untrusted input and raises one-line
:class:`~marlin_pack.errors.BundleError` messages. No vLLM import.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from marlin_pack._constants import (
    BUNDLE_DIRNAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    KERNEL_NAME,
    LAYOUT_VERSION,
    MANIFEST_NAME,
    STAMPS_NAME,
)
from marlin_pack.checkpoint_files import weight_files
from marlin_pack.errors import BundleError, BundleMismatchError, CheckpointError
from marlin_pack.hashing import StampCache, safetensors_header_bytes, sha256_bytes, sha256_file
from marlin_pack.schemas import FileEntry, Manifest, TensorParallelSet

__all__ = [
    "default_bundle_dir",
    "read_manifest",
    "resolve_file",
    "check_files",
    "check_source",
    "check_compatible",
]

_MAX_MANIFEST_BYTES = 64 << 20


def default_bundle_dir(model_dir: str | Path) -> Path:
    """Where ``convert`` writes and the loader looks by default: ``MODEL_DIR/marlin-pack``."""
    return Path(model_dir) / BUNDLE_DIRNAME


def read_manifest(bundle_dir: str | Path) -> Manifest:
    """Parse and validate ``bundle_dir/manifest.json``.

    Raises:
        BundleError: missing, oversized, not JSON, another format or version, or
            failing the schema; the message names the first problem.
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if not bundle_dir.is_dir():
        raise BundleError(
            f"no bundle at {bundle_dir}: expected a directory with {MANIFEST_NAME}; "
            "run `marlin-pack convert MODEL_DIR` first"
        )
    try:
        size = path.stat().st_size
        if size > _MAX_MANIFEST_BYTES:
            raise BundleError(f"{path} is {size} bytes, expected under {_MAX_MANIFEST_BYTES}: not a marlin-pack manifest")
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise BundleError(
            f"{bundle_dir} has no {MANIFEST_NAME}: an interrupted or foreign directory; "
            "re-run `marlin-pack convert --force`"
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise BundleError(f"cannot read {path}: {type(e).__name__}; re-run `marlin-pack convert --force`") from None
    if not isinstance(raw, dict):
        raise BundleError(f"{path} holds a JSON {type(raw).__name__}, expected an object")
    if raw.get("format") != FORMAT_NAME:
        raise BundleError(f"{path} has format {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise BundleMismatchError(
            "format_version",
            f"bundle format_version is {raw.get('format_version')!r}, this marlin-pack reads "
            f"{FORMAT_VERSION}; re-convert the checkpoint with this version",
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "manifest"
        raise BundleError(f"{path}: field {where}: {err['msg']}; the manifest is corrupt, re-convert") from None


def resolve_file(bundle_dir: Path, entry: FileEntry) -> Path:
    """Absolute path of a manifest file entry, refusing anything that escapes the bundle."""
    root = bundle_dir.resolve()
    path = (root / entry.path).resolve()
    if not path.is_relative_to(root):
        raise BundleError(f"manifest path {entry.path!r} points outside the bundle {root}")
    return path


def check_files(
    bundle_dir: Path,
    manifest: Manifest,
    entries: list[FileEntry] | None = None,
    *,
    full_hash: bool | None = None,
) -> None:
    """Check sizes and SHA-256 of bundle files.

    Args:
        entries: files to check (default: all of the manifest's).
        full_hash: True hashes every file; False checks sizes only; None (default)
            hashes only files whose stat differs from their last checked stamp.

    Raises:
        BundleError: a file is missing, has another size, or another hash.
    """
    stamps = StampCache(bundle_dir / STAMPS_NAME)
    for entry in manifest.files() if entries is None else entries:
        path = resolve_file(bundle_dir, entry)
        if not path.is_file():
            raise BundleError(f"bundle file {entry.path} is missing; re-run `marlin-pack convert --force`")
        size = path.stat().st_size
        if size != entry.size:
            raise BundleError(
                f"bundle file {entry.path} is {size} bytes, manifest says {entry.size}: "
                "truncated or replaced; re-run `marlin-pack convert --force`"
            )
        if full_hash is False or (full_hash is None and stamps.trusted(entry.path, path, entry.sha256)):
            continue
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise BundleError(
                f"bundle file {entry.path} has sha256 {digest[:16]}…, manifest says "
                f"{entry.sha256[:16]}…: the file was modified; re-run `marlin-pack convert --force`"
            )
        stamps.record(entry.path, path, digest)
    stamps.save()


def check_source(
    manifest: Manifest, model_dir: str | Path, bundle_dir: str | Path, *, full_hash: bool | None = None
) -> None:
    """Check that ``model_dir`` holds the checkpoint the bundle was made from.

    Stamps of checked files are kept in ``bundle_dir``. Compares the set of ``*.safetensors`` files, their sizes and header digests, and
    (per ``full_hash``, as in :func:`check_files`) their full SHA-256.

    Raises:
        BundleMismatchError: with ``field`` ``source.files`` / ``source.size`` /
            ``source.header`` / ``source.sha256``.
    """
    model_dir = Path(model_dir)
    try:
        found = weight_files(model_dir)
    except CheckpointError as e:
        raise BundleMismatchError("source.files", str(e)) from None
    expected = sorted(f.name for f in manifest.source.files)
    if found != expected:
        raise BundleMismatchError(
            "source.files",
            f"{model_dir} holds safetensors files {found}, the bundle was made from {expected}; "
            "re-convert this checkpoint",
        )
    stamps = StampCache(Path(bundle_dir) / STAMPS_NAME)
    for f in manifest.source.files:
        path = model_dir / f.name
        size = path.stat().st_size
        if size != f.size:
            raise BundleMismatchError(
                "source.size", f"source file {f.name} is {size} bytes, the bundle was made from {f.size}; re-convert"
            )
        try:
            header = sha256_bytes(safetensors_header_bytes(path))
        except (OSError, ValueError) as e:
            raise BundleMismatchError("source.header", f"source file {f.name} is unreadable ({e}); re-convert") from None
        if header != f.header_sha256:
            raise BundleMismatchError(
                "source.header", f"source file {f.name} has other tensors than when the bundle was made; re-convert"
            )
        key = f"source:{f.name}"
        if full_hash is False or (full_hash is None and stamps.trusted(key, path, f.sha256)):
            continue
        digest = sha256_file(path)
        if digest != f.sha256:
            raise BundleMismatchError(
                "source.sha256",
                f"source file {f.name} changed since the bundle was made (sha256 {digest[:16]}…, "
                f"expected {f.sha256[:16]}…); re-run `marlin-pack convert --force`",
            )
        stamps.record(key, path, digest)
    stamps.save()



def check_compatible(
    manifest: Manifest,
    *,
    vllm_version: str,
    tp_size: int,
    tp_rank: int,
    dtype: str,
    quant_method: str | None = None,
) -> TensorParallelSet:
    """Check the bundle fits an engine; return the TP set to load.

    Args:
        vllm_version: the running vLLM's version.
        tp_size, tp_rank: the engine's tensor-parallel size and this worker's rank.
        dtype: the engine's model dtype name (``float16``/``bfloat16``).
        quant_method: the engine's quantization method name, if known.

    Raises:
        BundleMismatchError: naming the field: ``format_version``, ``vllm_version``,
            ``kernel``, ``layout_version``, ``tp_size``, ``tp_rank``, ``serving_dtype``
            or ``quant_method``.
    """
    if manifest.target.vllm_version != vllm_version:
        raise BundleMismatchError(
            "vllm_version",
            f"bundle was made for vLLM {manifest.target.vllm_version}, this engine runs {vllm_version}; "
            "re-convert with a marlin-pack that targets it",
        )
    if manifest.target.kernel != KERNEL_NAME or manifest.target.layout_version != LAYOUT_VERSION:
        raise BundleMismatchError(
            "kernel", f"bundle layout {manifest.target.kernel} v{manifest.target.layout_version} is not {KERNEL_NAME} v{LAYOUT_VERSION}"
        )
    if dtype != manifest.serving_dtype.value:
        raise BundleMismatchError(
            "serving_dtype",
            f"bundle holds {manifest.serving_dtype.value} scales, the engine runs {dtype}; "
            f"start vLLM with --dtype {manifest.serving_dtype.value} or convert with --dtype {dtype}",
        )
    if quant_method is not None:
        family = "awq" if "awq" in quant_method else "gptq" if "gptq" in quant_method else quant_method
        want = "awq" if manifest.source.format.value.startswith("awq") else "gptq"
        if family != want:
            raise BundleMismatchError(
                "quant_method", f"engine quantization is {quant_method}, the bundle holds {want} weights"
            )
    try:
        tp_set = manifest.tensor_parallel_set(tp_size)
    except KeyError:
        raise BundleMismatchError(
            "tp_size",
            f"bundle has tp_size {manifest.tp_sizes}, the engine runs tensor_parallel_size={tp_size}; "
            f"run `marlin-pack convert MODEL_DIR --tp {','.join(map(str, sorted({*manifest.tp_sizes, tp_size})))} --force`",
        ) from None
    if not 0 <= tp_rank < tp_size:
        raise BundleMismatchError("tp_rank", f"rank {tp_rank} is outside tp_size {tp_size}")
    return tp_set
