"""Are the bundle's files, and the checkpoint it was made from, exactly what the manifest records?

Sizes are always compared; BLAKE3 is computed per ``full_hash``: always, never, or only for
files without a stamp of this user for their current identity (:mod:`marlin_pack.io.stamps`).
Each check returns a :class:`HashReport` of what it hashed and stamped, and why it stamped
nothing for a file (changed, writable by others, an unwritable store), so a start that hashes
can say so and whether the next one will. A check may leave a file's digest to the copy that reads it
anyway (``leave_to_copy``: a cold file, read once for both); the report lists it as ``pending`` and
:func:`settle_pending` compares and stamps what the copy hashed, before anything is served.
No vLLM, no torch.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from marlin_pack.bundle.reader import resolve_file
from marlin_pack.errors import BundleError, BundleMismatchError, CheckpointError, MismatchField, UnsupportedCheckpointError
from marlin_pack.io.checkpoint_files import QUANTIZE_CONFIG_NAME, quant_settings, read_json, weight_files
from marlin_pack.io.hashing import FileChangedError, HashedFile, file_digests, sha256_bytes
from marlin_pack.io.safetensors_io import read_header_bytes
from marlin_pack.io.sampling import sample_digest
from marlin_pack.io.stamps import NotStamped, StampStore
from marlin_pack.remedies import convert_command
from marlin_pack.schemas import FileEntry, Manifest, QuantSettings, SourceFile

__all__ = [
    "HashReport", "PendingHash", "canonical_json", "source_digest", "check_files", "file_problems", "check_source",
    "settle_pending",
]


@dataclass(frozen=True)
class PendingHash:
    """A bundle file whose size was checked and whose BLAKE3 digest is left to the copy that reads it: ``name`` as the
    manifest has it, ``path`` as resolved, ``blake3`` expected, ``redo`` the advice should it differ. ``source``: a file
    of the checkpoint (:func:`check_source`), whose refusal is worded as that check words it."""

    name: str
    path: Path
    blake3: str
    redo: str
    source: bool = False


@dataclass(frozen=True)
class HashReport:
    """What a check hashed: files, bytes and seconds; where this user's stamps are, or why none are kept.

    ``stamped``: how many of the files hashed were stamped; ``not_stamped``: ``(file name, why)``
    for each of the others (:class:`~marlin_pack.io.stamps.NotStamped`).
    """

    files: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    stamped: int = 0
    stamps: Path | None = None
    unavailable: str | None = None
    every_time: bool = False  # ``verify: full``: stamps are not consulted
    not_stamped: tuple[tuple[str, NotStamped], ...] = ()
    pending: tuple[PendingHash, ...] = ()  # left to the copy (settle_pending): not hashed yet, nothing served before

    def add(self, other: HashReport) -> HashReport:
        """Both reports together (the stamp location of either)."""
        return HashReport(
            self.files + other.files, self.nbytes + other.nbytes, self.seconds + other.seconds, self.stamped + other.stamped,
            self.stamps or other.stamps, self.unavailable or other.unavailable, self.every_time or other.every_time,
            self.not_stamped + other.not_stamped, self.pending + other.pending,
        )

    def summary(self) -> str | None:
        """One line for a log or ``check``: what was hashed and whether the next start does it again; None if nothing."""
        if not self.files:
            return None
        amount = f"{self.nbytes / 1e9:.2f} GB" if self.nbytes >= 1e8 else f"{self.nbytes / 1e6:.2f} MB"
        done = f"hashed {amount} ({self.files} files) in {self.seconds:.2f} s"
        if self.every_time:
            return f"{done}; verify full hashes them at every start (auto skips the files this user stamped unchanged)"
        if self.unavailable:
            return f"{done}; {self.unavailable}, so every start hashes them again"
        if not self.not_stamped:
            return f"{done}; stamped in {self.stamps}: starts by this user on this host skip it while the files are unchanged"
        parts = [f"stamped {self.stamped} of them in {self.stamps}"] if self.stamped else []
        for kind in ("store", "writable", "changed"):
            found = [(name, why.why) for name, why in self.not_stamped if why.kind == kind]
            if found:
                parts.append(_not_stamped_text(kind, found))
        return f"{done}; " + "; ".join(parts)


def _not_stamped_text(kind: str, found: list[tuple[str, str]]) -> str:
    """What the files of one :class:`~marlin_pack.io.stamps.NotStamped` kind mean for the next start, in one phrase."""
    (name, why), n = found[0], len(found)
    them = "them" if n > 1 else "it"
    which = f"{n} files ({name}: {why}; ...)" if n > 1 else f"{name} ({why})"
    if kind == "store":
        return f"not stamped: {why}; every start hashes {them} until the store can be written"
    if kind == "writable":
        return (
            f"hashed at every start: writable by others, {which}; to have {them} stamped, make {them} writable only by "
            "the owner, this user or root, in a directory only that owner may write"
        )
    return f"not stamped: changed just before it was hashed or since, {which}; the next start hashes {them} again"


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


def _redo(model_dir: Path, manifest: Manifest) -> str:
    """The advice for a bundle its checkpoint no longer matches: the whole command that converts it again."""
    return f"re-run `{convert_command(model=model_dir, manifest=manifest)}`"


def _check_source_settings(manifest: Manifest, model_dir: Path) -> None:
    """The manifest's record of the source is self-consistent, and the checkpoint's relevant
    quantization settings are the recorded ones (other keys of its quantization_config may change)."""
    src = manifest.source
    if source_digest([(f.name, f.blake3) for f in src.files], src.quant_settings, src.quant_settings_file) != src.digest:
        raise BundleMismatchError(
            MismatchField.source_settings,
            "source.digest does not match the recorded files and quantization settings; the manifest was edited: "
            f"{_redo(model_dir, manifest)}",
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
            f"{_redo(model_dir, manifest)}",
        )
    if found.settings != src.quant_settings:
        diff = _first_difference(found.settings.model_dump(mode="json"), src.quant_settings.model_dump(mode="json"))
        raise BundleMismatchError(
            MismatchField.source_settings,
            f"{model_dir / found.file}: quantization setting {diff}; {_redo(model_dir, manifest)}",
        )


def _needs_hash(stamps: StampStore, path: Path, expected: str, full_hash: bool | None) -> bool:
    """Whether ``full_hash`` (see :func:`check_files`) and this user's stamps call for hashing the file."""
    return not (full_hash is False or (full_hash is None and stamps.trusted(path, expected)))


def _hash_all(
    stamps: StampStore, to_hash: list[tuple[str, Path, str]], failed: Callable[[str, OSError | str], Exception]
) -> HashReport:
    """Hash ``(name, path, expected blake3)`` in parallel; stamp the ones that match (saying why any was not); the first
    failure, in order, raises.

    ``failed(name, why)``: the exception for a file that cannot be read or changed while hashed
    (an OSError) or hashed to another digest (the digest found).
    """
    report, failures = _hash_each(stamps, to_hash)
    if failures:
        name, why = failures[0]
        raise failed(name, why) from (why if isinstance(why, OSError) else None)
    return report


def _hash_each(
    stamps: StampStore, to_hash: list[tuple[str, Path, str]]
) -> tuple[HashReport, list[tuple[str, OSError | str]]]:
    """Hash ``(name, path, expected blake3)`` in parallel and stamp the ones that match: what was hashed, and
    ``(name, why)`` for each other one, in order (an OSError, or the digest found)."""
    t0 = time.perf_counter()
    results = file_digests([p for _, p, _ in to_hash])
    seconds = time.perf_counter() - t0
    good: list[tuple[str, HashedFile]] = []
    failures: list[tuple[str, OSError | str]] = []
    for (name, _, expected), hashed in zip(to_hash, results, strict=True):
        if isinstance(hashed, OSError):
            failures.append((name, hashed))
        elif hashed.digest != expected:
            failures.append((name, hashed.digest))
        else:
            good.append((name, hashed))
    not_stamped = tuple((name, why) for name, hashed in good if (why := stamps.record(hashed)) is not None)
    stamped = len(good) - len(not_stamped)
    report = HashReport(
        len(good), sum(h.identity[0] for _, h in good), seconds, stamped, stamps.where, stamps.unavailable, not_stamped=not_stamped
    )
    return report, failures


def _unreadable(e: OSError) -> str:
    if isinstance(e, FileChangedError):
        return f"{e.strerror}: something is writing it; nothing was stamped, check again once it is complete"
    return f"cannot be read ({e.strerror or e})"


def check_files(
    bundle_dir: Path,
    manifest: Manifest,
    entries: list[FileEntry] | None = None,
    *,
    full_hash: bool | None = None,
    leave_to_copy: Callable[[Path], bool] | None = None,
) -> HashReport:
    """Check sizes and BLAKE3 digests of bundle files; what was hashed.

    Args:
        entries: files to check (default: all of the manifest's).
        full_hash: True hashes every file; False checks sizes only; None (default)
            hashes only files without a stamp of this user for their current identity.
        leave_to_copy: for a file to be hashed, whether its digest is left to the copy that will read it
            (the report's ``pending``; the caller must :func:`settle_pending` before it serves anything).

    Raises:
        BundleError: a file is missing, has another size, another hash, or changed while hashed.
    """
    redo = f"re-run `{convert_command(bundle_dir, manifest=manifest)}`"  # it rewrites what is damaged
    with StampStore.open() as stamps:
        to_hash: list[tuple[str, Path, str]] = []
        for entry in manifest.files() if entries is None else entries:  # cheap checks first, every file
            path = resolve_file(bundle_dir, entry)
            if not path.is_file():
                raise BundleError(f"bundle file {entry.path} is missing; {redo}")
            size = path.stat().st_size
            if size != entry.size:
                raise BundleError(f"bundle file {entry.path} is {size} bytes, manifest says {entry.size}: truncated or replaced; {redo}")
            if _needs_hash(stamps, path, entry.blake3, full_hash):
                to_hash.append((entry.path, path, entry.blake3))
        pending = tuple(PendingHash(n, p, d, redo) for n, p, d in to_hash if leave_to_copy is not None and leave_to_copy(p))
        to_hash = [t for t in to_hash if t[1] not in {p.path for p in pending}]
        expected = {e.path: e.blake3 for e in manifest.files()}
        report = _hash_all(stamps, to_hash, lambda name, why: _bundle_file_failed(name, why, expected[name], redo))
    return replace(report, every_time=full_hash is True, pending=pending)


def settle_pending(
    pending: tuple[PendingHash, ...], found: dict[str, HashedFile | OSError], seconds: float = 0.0, every_time: bool = False
) -> HashReport:
    """Compare what the copy hashed of each pending file (``found``, by ``str(path)``: a
    :class:`~marlin_pack.io.hashing.HashedFile`, or the ``OSError`` saying why there is none) with the manifest, and stamp
    each file that matches as :func:`check_files` stamps what it hashes (the same store, the same rules); what was hashed.
    ``seconds``: the copy's; ``every_time``: ``verify: full``.

    Raises:
        BundleError: a file hashed to another digest, changed while it was copied, or was not hashed at all (the first,
            in order), in the words of :func:`check_files` (of :func:`check_source` for a ``source`` file: a
            :class:`~marlin_pack.errors.BundleMismatchError`).
    """
    with StampStore.open() as stamps:
        good: list[tuple[str, HashedFile]] = []
        for p in pending:
            hashed = found.get(str(p.path))
            if hashed is None:
                raise BundleError(f"internal error: bundle file {p.name} was left to its copy to hash, and the copy did not")
            if isinstance(hashed, OSError) or hashed.digest != p.blake3:
                failed = _source_file_failed if p.source else _bundle_file_failed
                raise failed(p.name, hashed if isinstance(hashed, OSError) else hashed.digest, p.blake3, p.redo)
            good.append((p.name, hashed))
        not_stamped = tuple((name, why) for name, hashed in good if (why := stamps.record(hashed)) is not None)
        return HashReport(
            len(good), sum(h.identity[0] for _, h in good), seconds, len(good) - len(not_stamped), stamps.where,
            stamps.unavailable, every_time, not_stamped,
        )


def file_problems(bundle_dir: Path, manifest: Manifest, entries: list[FileEntry]) -> tuple[dict[str, str], HashReport]:
    """What is wrong with each of ``entries`` (bundle files), checked as :func:`check_files` checks them with ``full_hash=None``
    (sizes; BLAKE3 unless this user's stamp vouches for the file as it is), every file rather than the first: ``{path: why}``
    (``why`` a phrase: "is missing", "changed since it was written", ...), and what was hashed. Files that match are stamped.
    """
    problems: dict[str, str] = {}
    with StampStore.open() as stamps:
        to_hash: list[tuple[str, Path, str]] = []
        for entry in entries:
            try:
                path = resolve_file(bundle_dir, entry)
                st = os.stat(path)
            except BundleError:
                problems[entry.path] = "points outside the bundle"
                continue
            except FileNotFoundError:
                problems[entry.path] = "is missing"
                continue
            except OSError as e:
                problems[entry.path] = f"cannot be read ({e.strerror or e})"
                continue
            if not stat.S_ISREG(st.st_mode):
                problems[entry.path] = "is not a file"
            elif st.st_size != entry.size:
                problems[entry.path] = f"is {st.st_size} bytes, the manifest says {entry.size} (truncated or replaced)"
            elif _needs_hash(stamps, path, entry.blake3, None):
                to_hash.append((entry.path, path, entry.blake3))
        report, failures = _hash_each(stamps, to_hash)
    for name, why in failures:
        if isinstance(why, FileChangedError):
            problems[name] = f"{why.strerror}"
        elif isinstance(why, OSError):
            problems[name] = f"cannot be read ({why.strerror or why})"
        else:
            problems[name] = "changed since it was written"
    return problems, report


def _bundle_file_failed(name: str, why: OSError | str, expected: str, redo: str) -> BundleError:
    if isinstance(why, OSError):
        advice = "" if isinstance(why, FileChangedError) else (
            f"; the serving user must be able to read the bundle (check its permissions), or {redo}"
        )
        return BundleError(f"bundle file {name} {_unreadable(why)}{advice}")
    return BundleError(f"bundle file {name} has blake3 {why[:16]}…, manifest says {expected[:16]}…: the file was modified; {redo}")


def check_source(
    manifest: Manifest, model_dir: str | Path, *, full_hash: bool | None = None, sampled: bool = False,
    leave_to_copy: Callable[[Path], bool] | None = None,
) -> HashReport:
    """Check that ``model_dir`` holds the checkpoint the bundle was made from.

    Compares the quantization settings that decide the bundle (and the manifest's digest), the set of
    ``*.safetensors`` files, their sizes and header digests, and (per ``full_hash``, as in
    :func:`check_files`) their full BLAKE3 digests, stamped in this user's stamp store; what was hashed.

    ``sampled`` (a start: the loader, ``check``): where the manifest records samples of every source file
    (:mod:`marlin_pack.io.sampling`), those are compared instead of the full digests, whatever the stamps (unless
    ``full_hash`` is False: sizes and headers only). A start then reads kilobytes of the checkpoint, not the whole
    of it: vLLM never reads it when it serves the bundle, and on a fresh node that read doubled the start's disk reads.

    ``leave_to_copy``: as in :func:`check_files`, for a file to be hashed whole, whether its digest is left to the read
    that reads it anyway (``verify``'s comparison); the report's ``pending``, for :func:`settle_pending`.

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
            f"{model_dir} holds safetensors files {found}, the bundle was made from {expected}; {_redo(model_dir, manifest)}",
        )
    if sampled and full_hash is not False and all(f.sample_sha256 for f in manifest.source.files):
        redo = _redo(model_dir, manifest)
        for f in manifest.source.files:
            _checked_source_sample(model_dir, f, redo)
        return HashReport()
    digests = {f.name: f.blake3 for f in manifest.source.files}
    with StampStore.open() as stamps:
        redo = _redo(model_dir, manifest)
        to_hash = [t for f in manifest.source.files if (t := _checked_source_file(model_dir, f, full_hash, stamps, redo))]
        left = [t for t in to_hash if leave_to_copy is not None and leave_to_copy(t[1])]
        pending = tuple(PendingHash(n, p, d, redo, source=True) for n, p, d in left)
        to_hash = [t for t in to_hash if t not in left]
        report = _hash_all(stamps, to_hash, lambda name, why: _source_file_failed(name, why, digests[name], redo))
    return replace(report, every_time=full_hash is True, pending=pending)


def _checked_source_file(
    model_dir: Path, f: SourceFile, full_hash: bool | None, stamps: StampStore, redo: str
) -> tuple[str, Path, str] | None:
    """Size and header of one source file checked; ``(name, path, blake3)`` if it is to be hashed."""
    path = model_dir / f.name
    try:
        size = path.stat().st_size
    except OSError as e:  # e.g. a dangling symlink: a pruned Hugging Face cache blob
        raise BundleMismatchError(
            MismatchField.source_files,
            f"source file {f.name} cannot be read ({e.strerror or e}); restore the checkpoint (download it again)",
        ) from e
    if size != f.size:
        raise _size_mismatch(f, size, redo)
    try:
        header = sha256_bytes(read_header_bytes(path))
    except (OSError, ValueError) as e:
        raise BundleMismatchError(
            MismatchField.source_header, f"source file {f.name} is unreadable ({e}); {redo}"
        ) from e
    if header != f.header_sha256:
        raise _header_mismatch(f, redo)
    return (f.name, path, f.blake3) if _needs_hash(stamps, path, f.blake3, full_hash) else None


def _size_mismatch(f: SourceFile, size: int, redo: str) -> BundleMismatchError:
    return BundleMismatchError(
        MismatchField.source_size, f"source file {f.name} is {size} bytes, the bundle was made from {f.size}; {redo}"
    )


def _header_mismatch(f: SourceFile, redo: str) -> BundleMismatchError:
    return BundleMismatchError(
        MismatchField.source_header, f"source file {f.name} has other tensors than when the bundle was made; {redo}"
    )


def _checked_source_sample(model_dir: Path, f: SourceFile, redo: str) -> None:
    """One source file's size, header and samples (:func:`~marlin_pack.io.sampling.sample_digest`) as recorded."""
    path = model_dir / f.name
    try:
        size = path.stat().st_size
        if size == f.size:
            header, sample = sample_digest(path, f.header_sha256)
    except FileChangedError as e:
        raise BundleMismatchError(MismatchField.source_sample, f"source file {f.name} {_unreadable(e)}") from e
    except (OSError, ValueError) as e:  # a dangling symlink (a pruned Hugging Face cache blob), unreadable, not safetensors
        raise BundleMismatchError(
            MismatchField.source_files,
            f"source file {f.name} cannot be read ({getattr(e, 'strerror', None) or e}); restore the checkpoint (download it again)",
        ) from e
    if size != f.size:
        raise _size_mismatch(f, size, redo)
    if header != f.header_sha256:
        raise _header_mismatch(f, redo)
    if sample != f.sample_sha256:
        raise BundleMismatchError(
            MismatchField.source_sample,
            f"source file {f.name} holds other tensor bytes than when the bundle was made (sampled); {redo}",
        )


def _source_file_failed(name: str, why: OSError | str, expected: str, redo: str) -> BundleMismatchError:
    if isinstance(why, OSError):
        advice = "" if isinstance(why, FileChangedError) else "; check its permissions"
        return BundleMismatchError(MismatchField.source_blake3, f"source file {name} {_unreadable(why)}{advice}")
    return BundleMismatchError(
        MismatchField.source_blake3,
        f"source file {name} changed since the bundle was made (blake3 {why[:16]}…, expected {expected[:16]}…); {redo}",
    )
