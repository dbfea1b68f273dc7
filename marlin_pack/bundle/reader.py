"""Finding a bundle and parsing its manifest, treating both as untrusted input (no vLLM, no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from marlin_pack._constants import BUNDLE_DIRNAME, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from marlin_pack.errors import BundleError, BundleMismatchError, MismatchField
from marlin_pack.io.files import FileTooLargeError, NotRegularFileError, read_limited
from marlin_pack.schemas import FileEntry, Manifest

__all__ = ["MAX_MANIFEST_BYTES", "default_bundle_dir", "read_manifest", "resolve_file"]

MAX_MANIFEST_BYTES = 64 << 20


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
        text = read_limited(path, MAX_MANIFEST_BYTES)
        raw = json.loads(text)
    except FileTooLargeError as e:
        raise BundleError(f"{path} {e.strerror}, expected under {MAX_MANIFEST_BYTES}: not a marlin-pack manifest") from e
    except NotRegularFileError as e:
        raise BundleError(f"{path} {e.strerror}: not a marlin-pack manifest; re-run `marlin-pack convert --force`") from e
    except FileNotFoundError as e:
        raise BundleError(
            f"{bundle_dir} has no {MANIFEST_NAME}: an interrupted or foreign directory; "
            "re-run `marlin-pack convert --force`"
        ) from e
    except (OSError, ValueError, RecursionError) as e:
        raise BundleError(f"cannot read {path}: {type(e).__name__}; re-run `marlin-pack convert --force`") from e
    if not isinstance(raw, dict):
        raise BundleError(f"{path} holds a JSON {type(raw).__name__}, expected an object")
    if raw.get("format") != FORMAT_NAME:
        raise BundleError(f"{path} has format {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise BundleMismatchError(
            MismatchField.format_version,
            f"bundle format_version is {raw.get('format_version')!r}, this marlin-pack reads "
            f"{FORMAT_VERSION}; re-convert the checkpoint with this version",
        )
    try:  # strict: "462056", true or 1.0 are not sizes or counts
        return Manifest.model_validate_json(text, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "manifest"
        raise BundleError(f"{path}: field {where}: {err['msg']}; the manifest is corrupt, re-convert") from e


def resolve_file(bundle_dir: Path, entry: FileEntry) -> Path:
    """Absolute path of a manifest file entry, refusing anything that escapes the bundle."""
    root = bundle_dir.resolve()
    path = (root / entry.path).resolve()
    if not path.is_relative_to(root):
        raise BundleError(f"manifest path {entry.path!r} points outside the bundle {root}")
    return path
