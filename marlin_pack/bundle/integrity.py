"""Are the bundle's files, and the checkpoint it was made from, exactly what the manifest records?

Sizes are always compared; SHA-256 is computed per ``full_hash`` (always, never, or only for
files whose stamp in ``.stamps.json`` no longer matches, see :mod:`marlin_pack.io.hashing`).
No vLLM, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from marlin_pack._constants import STAMPS_NAME
from marlin_pack.bundle.reader import resolve_file
from marlin_pack.errors import BundleError, BundleMismatchError, CheckpointError, MismatchField, UnsupportedCheckpointError
from marlin_pack.io.checkpoint_files import QUANTIZE_CONFIG_NAME, quant_settings, read_json, weight_files
from marlin_pack.io.hashing import StampCache, file_digests, sha256_bytes
from marlin_pack.io.safetensors_io import read_header_bytes
from marlin_pack.schemas import FileEntry, Manifest, QuantSettings, SourceFile

__all__ = ["canonical_json", "source_digest", "check_files", "check_source", "source_stamp_key"]


def canonical_json(obj: object) -> bytes:
    """The bytes hashed for a JSON value: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def source_digest(files: list[tuple[str, str]], settings: QuantSettings, settings_file: str) -> str:
    """``source.digest``: SHA-256 over every ``(file name, blake3)``, the quantization settings and their file."""
    quant = {"quant_settings": settings.model_dump(mode="json"), "quant_settings_file": settings_file}
    return sha256_bytes("".join(f"{name} {sha}\n" for name, sha in files).encode() + canonical_json(quant))


def _first_difference(found: dict, recorded: dict) -> str:
    """``key is X, the bundle was made with Y`` for the first setting that differs."""
    keys = sorted(found.keys() | recorded.keys(), key=lambda k: (k != "quant_method", k))  # another method first
    key = next(k for k in keys if found.get(k) != recorded.get(k))
    return f"{key} is {json.dumps(found.get(key))}, the bundle was made with {json.dumps(recorded.get(key))}"


def _check_source_settings(manifest: Manifest, model_dir: Path) -> None:
    """The manifest's record of the source is self-consistent, and the checkpoint's relevant
    quantization settings are the recorded ones (other keys of its quantization_config may change)."""
    src = manifest.source
    if source_digest([(f.name, f.blake3) for f in src.files], src.quant_settings, src.quant_settings_file) != src.digest:
        raise BundleMismatchError(
            MismatchField.source_settings,
            "source.digest does not match the recorded files and quantization settings; the manifest was edited, re-convert",
        )
    try:
        found = quant_settings(model_dir, read_json(model_dir / "config.json", "config.json"))
    except (CheckpointError, UnsupportedCheckpointError) as e:
        raise BundleMismatchError(MismatchField.source_settings, str(e)) from e
    if found is None:
        raise BundleMismatchError(
            MismatchField.source_settings,
            f"{model_dir} has no quantization settings (no quantization_config, no {QUANTIZE_CONFIG_NAME}), the bundle was "
            f"made from {src.quant_settings_file}'s; restore the checkpoint's config",
        )
    if found.file != src.quant_settings_file:
        raise BundleMismatchError(
            MismatchField.source_settings,
            f"{model_dir}'s quantization settings are in {found.file}, the bundle was made from {src.quant_settings_file}'s; "
            "re-run `marlin-pack convert --force`",
        )
    if found.settings != src.quant_settings:
        diff = _first_difference(found.settings.model_dump(mode="json"), src.quant_settings.model_dump(mode="json"))
        raise BundleMismatchError(
            MismatchField.source_settings,
            f"{model_dir / found.file}: quantization setting {diff}; re-run `marlin-pack convert --force`",
        )


def source_stamp_key(file_name: str) -> str:
    """The stamp-cache key of a source checkpoint file (bundle files use their own path)."""
    return f"source:{file_name}"


def _needs_hash(stamps: StampCache, key: str, path: Path, expected: str, full_hash: bool | None) -> bool:
    """Whether ``full_hash`` (see :func:`check_files`) and the stamps call for hashing the file."""
    return not (full_hash is False or (full_hash is None and stamps.trusted(key, path, expected)))


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
    to_hash: list[tuple[FileEntry, Path]] = []
    for entry in manifest.files() if entries is None else entries:  # cheap checks first, every file
        path = resolve_file(bundle_dir, entry)
        if not path.is_file():
            raise BundleError(f"bundle file {entry.path} is missing; re-run `marlin-pack convert --force`")
        size = path.stat().st_size
        if size != entry.size:
            raise BundleError(
                f"bundle file {entry.path} is {size} bytes, manifest says {entry.size}: "
                "truncated or replaced; re-run `marlin-pack convert --force`"
            )
        if _needs_hash(stamps, entry.path, path, entry.blake3, full_hash):
            to_hash.append((entry, path))
    # Then the hashes, in parallel; a failure is reported for the first file in manifest order.
    for (entry, path), digest in zip(to_hash, file_digests([p for _, p in to_hash]), strict=True):
        if isinstance(digest, OSError):
            raise BundleError(
                f"bundle file {entry.path} cannot be read ({digest.strerror or digest}); the serving user must be able to "
                "read the bundle (check its permissions), or re-run `marlin-pack convert --force`"
            ) from digest
        if digest != entry.blake3:
            raise BundleError(
                f"bundle file {entry.path} has blake3 {digest[:16]}…, manifest says "
                f"{entry.blake3[:16]}…: the file was modified; re-run `marlin-pack convert --force`"
            )
        stamps.record(entry.path, path, digest)
    stamps.save()


def check_source(
    manifest: Manifest, model_dir: str | Path, bundle_dir: str | Path, *, full_hash: bool | None = None
) -> None:
    """Check that ``model_dir`` holds the checkpoint the bundle was made from.

    Compares the quantization settings that decide the bundle (and the manifest's digest), the set of
    ``*.safetensors`` files, their sizes and header digests, and (per ``full_hash``, as in
    :func:`check_files`) their full SHA-256. Stamps of checked files are kept in ``bundle_dir``.

    Raises:
        BundleMismatchError: with ``field`` ``source.quant_settings`` / ``source.files`` /
            ``source.size`` / ``source.header`` / ``source.blake3``.
    """
    model_dir = Path(model_dir)
    _check_source_settings(manifest, model_dir)
    try:
        found = weight_files(model_dir)
    except CheckpointError as e:
        raise BundleMismatchError(MismatchField.source_files, str(e)) from e
    expected = sorted(f.name for f in manifest.source.files)
    if found != expected:
        raise BundleMismatchError(
            MismatchField.source_files,
            f"{model_dir} holds safetensors files {found}, the bundle was made from {expected}; "
            "re-convert this checkpoint",
        )
    stamps = StampCache(Path(bundle_dir) / STAMPS_NAME)
    to_hash: list[tuple[SourceFile, Path]] = []
    for f in manifest.source.files:
        path = model_dir / f.name
        try:
            size = path.stat().st_size
        except OSError as e:  # e.g. a dangling symlink: a pruned Hugging Face cache blob
            raise BundleMismatchError(
                MismatchField.source_files,
                f"source file {f.name} cannot be read ({e.strerror or e}); restore the checkpoint (download it again)",
            ) from e
        if size != f.size:
            raise BundleMismatchError(
                MismatchField.source_size,
                f"source file {f.name} is {size} bytes, the bundle was made from {f.size}; re-convert",
            )
        try:
            header = sha256_bytes(read_header_bytes(path))
        except (OSError, ValueError) as e:
            raise BundleMismatchError(
                MismatchField.source_header, f"source file {f.name} is unreadable ({e}); re-convert"
            ) from e
        if header != f.header_sha256:
            raise BundleMismatchError(
                MismatchField.source_header,
                f"source file {f.name} has other tensors than when the bundle was made; re-convert",
            )
        if _needs_hash(stamps, source_stamp_key(f.name), path, f.blake3, full_hash):
            to_hash.append((f, path))
    for (f, path), digest in zip(to_hash, file_digests([p for _, p in to_hash]), strict=True):
        if isinstance(digest, OSError):
            raise BundleMismatchError(
                MismatchField.source_blake3,
                f"source file {f.name} cannot be read ({digest.strerror or digest}); check its permissions",
            ) from digest
        if digest != f.blake3:
            raise BundleMismatchError(
                MismatchField.source_blake3,
                f"source file {f.name} changed since the bundle was made (blake3 {digest[:16]}…, "
                f"expected {f.blake3[:16]}…); re-run `marlin-pack convert --force`",
            )
        stamps.record(source_stamp_key(f.name), path, digest)
    stamps.save()
