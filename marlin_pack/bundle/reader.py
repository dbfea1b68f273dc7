"""Finding a bundle and parsing its manifest, treating both as untrusted input (no vLLM, no torch)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pydantic import ValidationError

from marlin_pack._constants import BUNDLE_DIRNAME, FORMAT_NAME, MANIFEST_NAME, READABLE_FORMAT_VERSIONS
from marlin_pack.errors import BundleError, BundleMismatchError, MismatchField
from marlin_pack.io.files import FileTooLargeError, NotRegularFileError, read_limited
from marlin_pack.remedies import convert_command
from marlin_pack.remote.url import refuse_url
from marlin_pack.schemas import FileEntry, Manifest

__all__ = ["MAX_MANIFEST_BYTES", "default_bundle_dir", "read_manifest", "listed_files", "resolve_file"]

MAX_MANIFEST_BYTES = 64 << 20


def default_bundle_dir(model_dir: str | Path) -> Path:
    """Where ``convert`` writes and the loader looks by default: ``MODEL_DIR/marlin-pack``."""
    return Path(model_dir) / BUNDLE_DIRNAME


def _read_raw(bundle_dir: Path) -> tuple[Path, bytes, dict]:
    """``manifest.json``'s path, bytes and JSON object, if it is a marlin-pack manifest of any version."""
    refuse_url(bundle_dir, "bundle", "a directory", "copy it to a local directory first (`{sync} DIR`) and read DIR")
    path = bundle_dir / MANIFEST_NAME
    if not bundle_dir.is_dir():
        raise BundleError(
            f"no bundle at {bundle_dir}: expected a directory with {MANIFEST_NAME}; "
            f"run `{convert_command(bundle_dir)}` first"
        )
    try:
        text = read_limited(path, MAX_MANIFEST_BYTES)
        raw = json.loads(text)
    except FileTooLargeError as e:
        raise BundleError(f"{path} {e.strerror}, expected under {MAX_MANIFEST_BYTES}: not a marlin-pack manifest") from e
    except NotRegularFileError as e:
        raise BundleError(
            f"{path} {e.strerror}: not a marlin-pack manifest; remove {bundle_dir}, then run `{convert_command(bundle_dir)}`"
        ) from e
    except FileNotFoundError as e:
        raise BundleError(
            f"{bundle_dir} has no {MANIFEST_NAME}: an interrupted or foreign directory; "
            f"remove it (or empty it), then run `{convert_command(bundle_dir)}`"
        ) from e
    except OSError as e:
        raise BundleError(f"cannot read {path} ({e.strerror or type(e).__name__}); check its permissions") from e
    except (ValueError, RecursionError) as e:  # not JSON: a damaged manifest, which no conversion replaces
        raise BundleError(
            f"cannot read {path}: {type(e).__name__}; remove {bundle_dir}, then run `{convert_command(bundle_dir)}`"
        ) from e
    if not isinstance(raw, dict):
        raise BundleError(f"{path} holds a JSON {type(raw).__name__}, expected an object")
    if raw.get("format") != FORMAT_NAME:
        raise BundleError(f"{path} has format {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    return path, text, raw


def read_manifest(bundle_dir: str | Path) -> Manifest:
    """Parse and validate ``bundle_dir/manifest.json``.

    Raises:
        BundleError: missing, oversized, not JSON, another format or version, or
            failing the schema; the message names the first problem.
    """
    bundle_dir = Path(bundle_dir)
    path, text, raw = _read_raw(bundle_dir)
    if raw.get("format_version") not in READABLE_FORMAT_VERSIONS or isinstance(raw.get("format_version"), bool):
        raise BundleMismatchError(MismatchField.format_version, _version_advice(bundle_dir, raw.get("format_version")))
    try:  # strict: "462056", true or 1.0 are not sizes or counts
        return Manifest.model_validate_json(text, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "manifest"
        raise BundleError(f"{path}: field {where}: {err['msg']}; the manifest is corrupt, re-convert") from e


def listed_files(bundle_dir: str | Path) -> list[str]:
    """Paths of the bundle files its manifest lists, whatever its format version: what ``convert`` may replace.

    A bundle of another format version, or with a manifest failing the schema, must stay replaceable, since
    re-converting is the advice for it; every format version so far lists ``common`` and ``tensor_parallel[].ranks[].file``.

    Raises:
        BundleError: not a marlin-pack manifest, or no file entries that parse.
    """
    bundle_dir = Path(bundle_dir)
    path, _, raw = _read_raw(bundle_dir)
    if raw.get("format_version") in READABLE_FORMAT_VERSIONS and not isinstance(raw.get("format_version"), bool):
        with contextlib.suppress(BundleError):  # a manifest failing the schema (damaged) is read for its paths below
            return [f.path for f in read_manifest(bundle_dir).files()]
    try:
        entries = [raw["common"], *(r["file"] for s in raw["tensor_parallel"] for r in s["ranks"])]
        # Older versions name their digests differently: only the paths matter here, checked as
        # this version checks them (relative, plain names).
        return [FileEntry.model_validate({"path": e["path"], "size": 0, "blake3": "0" * 64}, strict=True).path for e in entries]
    except (KeyError, TypeError, ValidationError) as e:
        raise BundleError(
            f"{path} (format_version {raw.get('format_version')!r}) lists no bundle files this marlin-pack can read; "
            "remove the directory yourself"
        ) from e


def _version_advice(bundle_dir: Path, found: object) -> str:
    """One line for a bundle of another format version: found, expected, and the command that replaces it."""
    command = convert_command(bundle_dir, extra="--force")
    older = isinstance(found, int) and not isinstance(found, bool) and found < min(READABLE_FORMAT_VERSIONS)
    why = "made by an older marlin-pack" if older else "not a format this marlin-pack knows (a newer one may)"
    readable = f"formats {min(READABLE_FORMAT_VERSIONS)} to {max(READABLE_FORMAT_VERSIONS)}"
    return (
        f"bundle {bundle_dir} has format_version {found!r}, this marlin-pack reads {readable} ({why}); "
        f"re-convert it with `{command}`"
    )


def resolve_file(bundle_dir: Path, entry: FileEntry) -> Path:
    """Absolute path of a manifest file entry, refusing anything that escapes the bundle."""
    root = bundle_dir.resolve()
    path = (root / entry.path).resolve()
    if not path.is_relative_to(root):
        raise BundleError(f"manifest path {entry.path!r} points outside the bundle {root}")
    return path
