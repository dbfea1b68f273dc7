"""A published bundle opened from a bucket, and one rank's read planned: every refusal before a byte of tensor data.

:func:`open_remote` reads the publication record (the commit point; none: unpublished or half-published), then the
manifest, whose SHA-256 must be the record's, and checks the manifest as a local bundle's is read (format, version,
strict schema) and the record against it (same files, sizes, whole-file BLAKE3).

:func:`plan_rank` decides what one engine rank reads: its TP rank file and the common file (each object's size checked
against the manifest: a missing or truncated object is refused here), their safetensors headers (read in verified
blocks, checked as the loader checks a local rank file's), and for a pipeline stage only its layers' tensors and the
common tensors it loads (:func:`~marlin_pack.vllm_plugin.stage.stage_share`). The plan's spans are those tensors'
bytes widened to whole blocks of the record, so that every byte read is verified against a block digest
(:mod:`marlin_pack.remote.stream`); a rank never reads another rank's file but the one its experts come from:
:func:`with_experts` moves the experts tensors (expert parallelism, MoE at DP > 1) to the byte ranges of this GPU's
experts in the file vLLM shards them from (:func:`~marlin_pack.vllm_plugin.expert_share.expert_share`).

No vLLM, no GPU, no streamer here: boto3 (:mod:`marlin_pack.remote.store`) reads the record, manifest and headers.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from marlin_pack._constants import FORMAT_NAME, MANIFEST_NAME, READABLE_FORMAT_VERSIONS
from marlin_pack.bundle.rank_files import check_rank_header
from marlin_pack.bundle.reader import MAX_MANIFEST_BYTES
from marlin_pack.errors import BundleError, BundleMismatchError, MismatchField
from marlin_pack.io.safetensors_io import MAX_HEADER_BYTES, SafetensorsFormatError, SafetensorsHeader, parse_header
from marlin_pack.remote.record import MAX_RECORD_BYTES, RECORD_NAME, Record, block_digest, parse_record
from marlin_pack.remote.store import Store, open_store
from marlin_pack.remote.url import ObjectUrl, parse_url
from marlin_pack.schemas import FileEntry, Manifest, TensorParallelSet

__all__ = ["FileRead", "RankPlan", "RemoteBundle", "open_remote", "plan_rank", "rank_header_of", "with_experts"]

_PUSH = "marlin-pack push BUNDLE {url}"


@dataclass(frozen=True)
class RemoteBundle:
    """A published bundle: its manifest and record as read, and the ETags they were read at (for "changed since")."""

    url: ObjectUrl
    store: Store
    manifest: Manifest
    record: Record
    manifest_etag: str
    record_etag: str


def _push_again(url: ObjectUrl) -> str:
    return f"publish it again with `{_PUSH.format(url=url)}`"


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest read from a bucket, checked as :func:`~marlin_pack.bundle.reader.read_manifest` checks a file's.

    Raises:
        BundleError: not JSON, not a marlin-pack manifest, or failing the schema.
        BundleMismatchError: ``format_version``, another format version than this marlin-pack reads.
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BundleError(f"cannot read {where}: {type(e).__name__}; the manifest is damaged") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise BundleError(f"{where} has format {found!r}, expected {FORMAT_NAME!r}")
    version = raw.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise BundleMismatchError(
            MismatchField.format_version,
            f"bundle {where} has format_version {version!r}, this marlin-pack reads formats {min(READABLE_FORMAT_VERSIONS)} to "
            f"{max(READABLE_FORMAT_VERSIONS)}; re-convert it with this marlin-pack and push it again",
        )
    try:
        return Manifest.model_validate_json(data, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "manifest"
        raise BundleError(f"{where}: field {field}: {err['msg']}; the manifest is corrupt, re-convert and push again") from e


def open_remote(url: str | ObjectUrl, store: Store | None = None) -> RemoteBundle:
    """Open the bundle published at ``url``: record, manifest, and the two checked against each other.

    Raises:
        UrlNotPathError: not an ``s3://`` URL marlin-pack serves.
        RemoteError: the bucket refused (credentials, no such bucket, ...).
        BundleError: nothing published there, a half-published bundle (no record, or a manifest that is not the
            record's), a damaged record or manifest.
    """
    target = url if isinstance(url, ObjectUrl) else parse_url(url)
    store = store if store is not None else open_store(target)
    got = store.get(RECORD_NAME, MAX_RECORD_BYTES)
    if got is None:
        if store.head(MANIFEST_NAME) is not None:
            raise BundleError(
                f"{target} is half-published: it holds {MANIFEST_NAME} but no {RECORD_NAME} (a push was interrupted, or is "
                f"replacing the bundle now); wait for that push to finish, or {_push_again(target)}"
            )
        raise BundleError(f"no bundle at {target}: expected {RECORD_NAME} there; publish one with `{_PUSH.format(url=target)}`")
    record = parse_record(got[0], target.url_of(RECORD_NAME))
    mgot = store.get(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if mgot is None:
        raise BundleError(f"{target} is half-published: its record names a manifest that is not there; {_push_again(target)}")
    if hashlib.sha256(mgot[0]).hexdigest() != record.manifest_sha256:
        raise BundleError(
            f"{target.url_of(MANIFEST_NAME)} is not the manifest its publication record names (SHA-256 "
            f"{hashlib.sha256(mgot[0]).hexdigest()[:16]}…, recorded {record.manifest_sha256[:16]}…): a push is replacing the "
            "bundle, or it was changed by hand; wait for the push to finish and retry"
        )
    manifest = parse_manifest(mgot[0], target.url_of(MANIFEST_NAME))
    record.check_against(manifest, str(target))
    return RemoteBundle(target, store, manifest, record, mgot[1], got[1])


@dataclass(frozen=True)
class FileRead:
    """What one rank reads of one bundle file: whole blocks covering the tensors it loads."""

    entry: FileEntry
    header: SafetensorsHeader  # restricted to the tensors read whole
    spans: tuple[tuple[int, int], ...]  # [start, end) byte ranges, block-aligned (the last may end at the file's end)
    header_bytes: int  # bytes read (in verified blocks, with boto3) for the header; the spans read them again
    pieces: tuple[tuple[int, int], ...] = ()  # (start, nbytes) read besides the header's tensors: this GPU's experts

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.header.tensors.values()) + sum(n for _, n in self.pieces)

    @property
    def span_bytes(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True)
class RankPlan:
    """Everything one engine rank reads from a published bundle, decided and checked before any tensor byte moves."""

    bundle: RemoteBundle
    tp_size: int
    rank: int
    pp_size: int
    pp_rank: int
    files: tuple[FileRead, ...]  # the rank file, the common file, then the experts' file where it is another
    stage: Any = None  # pp_size > 1: the stage's StageShare (marlin_pack.vllm_plugin.stage), which the loader keeps
    experts: Any = None  # experts of another TP size's file: the ExpertShare (marlin_pack.vllm_plugin.expert_share)

    @property
    def read_bytes(self) -> int:
        """Bytes this rank reads from the bucket: its spans and the blocks holding the headers."""
        return sum(f.span_bytes + f.header_bytes for f in self.files)

    @property
    def tensor_bytes(self) -> int:
        return sum(f.tensor_bytes for f in self.files)

    def text(self) -> str:
        stage = f" stage {self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else ""
        files = ", ".join(f"{f.entry.path} {f.span_bytes / 1e6:,.2f} of {f.entry.size / 1e6:,.2f} MB" for f in self.files)
        experts = f" ({self.experts.text()})" if self.experts is not None else ""
        return f"tp {self.tp_size} rank {self.rank}{stage} reads {self.read_bytes / 1e6:,.2f} MB from {self.bundle.url}: {files}{experts}"


def _checked_object(bundle: RemoteBundle, entry: FileEntry) -> None:
    """The object is there, at the manifest's size (a missing or truncated one refused before any read)."""
    info = bundle.store.head(entry.path)
    url = bundle.url.url_of(entry.path)
    if info is None:
        raise BundleMismatchError(MismatchField.files, f"{url} is missing; {_push_again(bundle.url)}")
    if info.size != entry.size:
        why = "truncated" if info.size < entry.size else "longer than its manifest says"
        raise BundleMismatchError(
            MismatchField.files, f"{url} is {info.size:,} bytes, the manifest says {entry.size:,}: {why}; {_push_again(bundle.url)}"
        )


def _verified_blocks(bundle: RemoteBundle, entry: FileEntry, end: int) -> bytes:
    """The file's first blocks, up to the one holding byte ``end - 1``, each checked against the record."""
    published = bundle.record.file(entry.path)
    block = bundle.record.block_size
    stop = min(entry.size, -(-end // block) * block)
    data, _ = bundle.store.get_range(entry.path, 0, stop)
    for i in range(0, stop, block):
        if block_digest(data[i:i + block]) != published.blocks[i // block]:
            raise BundleMismatchError(
                MismatchField.files,
                f"{bundle.url.url_of(entry.path)}: block {i // block} (bytes {i:,}..{min(i + block, stop):,}) does not match the "
                f"publication record: the object changed or is damaged; {_push_again(bundle.url)}",
            )
    return data


def _header(bundle: RemoteBundle, entry: FileEntry) -> tuple[SafetensorsHeader, int]:
    """The file's safetensors header from verified blocks, and how many bytes were read for it."""
    where = Path(bundle.url.url_of(entry.path))
    if entry.size < 8:
        raise BundleMismatchError(MismatchField.files, f"{where} is {entry.size} bytes: too short for safetensors; re-convert")
    data = _verified_blocks(bundle, entry, 8)
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > entry.size:
        raise BundleMismatchError(MismatchField.files, f"{where} declares a {n:,}-byte header in a {entry.size:,}-byte file; re-convert")
    if len(data) < 8 + n:
        data = _verified_blocks(bundle, entry, 8 + n)
    try:
        return parse_header(data[:8 + n], entry.size, where), len(data)
    except SafetensorsFormatError as e:
        raise BundleMismatchError(MismatchField.files, f"{e}; re-convert and push again") from e


def _spans(header: SafetensorsHeader, block: int, size: int, pieces: tuple[tuple[int, int], ...] = ()) -> tuple[tuple[int, int], ...]:
    """The tensors' byte ranges and ``pieces`` (start, nbytes) widened to whole blocks, merged."""
    spans: list[tuple[int, int]] = []
    for lo, hi in sorted([(t.start, t.end) for t in header.tensors.values()] + [(a, a + n) for a, n in pieces]):
        if hi <= lo:
            continue
        start, end = lo // block * block, min(size, -(-hi // block) * block)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return tuple(spans)


def _common_header_checked(manifest: Manifest, header: SafetensorsHeader) -> None:
    for alias, original in manifest.common_aliases.items():
        if original not in header.tensors or alias in header.tensors:
            raise BundleMismatchError(MismatchField.files, f"{manifest.common.path}: common_aliases maps {alias} to {original}, "
                                      "which the file does not hold (or holds under both names); re-convert")


def rank_header_of(bundle: RemoteBundle, tp_set: TensorParallelSet, rank: int) -> tuple[FileEntry, SafetensorsHeader, int]:
    """Rank ``rank`` of ``tp_set``'s object (present, of the manifest's size) and its safetensors header, from verified
    blocks and checked as the loader checks a local rank file's; the bytes read for it.

    Raises:
        BundleMismatchError: ``files``: the object missing, truncated, a block not the record's, a header not the
            manifest's.
    """
    entry = tp_set.ranks[rank].file
    _checked_object(bundle, entry)
    header, head_bytes = _header(bundle, entry)
    try:
        check_rank_header(bundle.manifest, tp_set, rank, header)
    except BundleMismatchError as e:
        raise BundleMismatchError(MismatchField.files, f"{e}; push it again once re-converted") from e
    return entry, header, head_bytes


def with_experts(plan: RankPlan, share: Any, entry: FileEntry, head_bytes: int) -> RankPlan:
    """``plan`` reading this GPU's experts as ``share`` (an :class:`~marlin_pack.vllm_plugin.expert_share.ExpertShare`
    over ``entry``, another TP size's rank file whose header took ``head_bytes``) places them: its experts tensors
    left out of the rank file's reads, their pieces read of ``entry`` (the rank file itself at TP 1 with EP)."""
    block = plan.bundle.record.block_size
    names = {e.name for e in share.moe_layers}
    pieces = tuple(p for info in share.header.tensors.values() for p in share.pieces(info))
    rank, common, *_ = plan.files
    tensors = {n: i for n, i in rank.header.tensors.items() if n.rsplit(".", 1)[0] not in names}
    header = SafetensorsHeader(rank.header.path, rank.header.raw, tensors, rank.header.metadata)
    own = entry.path == rank.entry.path
    mine = pieces if own else ()
    files = [FileRead(rank.entry, header, _spans(header, block, rank.entry.size, mine), rank.header_bytes, mine), common]
    if not own:
        empty = SafetensorsHeader(share.header.path, share.header.raw, {}, share.header.metadata)
        files.append(FileRead(entry, empty, _spans(empty, block, entry.size, pieces), head_bytes, pieces))
    return RankPlan(plan.bundle, plan.tp_size, plan.rank, plan.pp_size, plan.pp_rank, tuple(files), plan.stage, share)


def plan_rank(bundle: RemoteBundle, tp_size: int, rank: int, *, pp_size: int = 1, pp_rank: int = 0,
              model_dir: str | Path | None = None) -> RankPlan:
    """What TP rank ``rank`` of ``tp_size`` (pipeline stage ``pp_rank`` of ``pp_size``) reads from ``bundle``.

    Args:
        model_dir: the checkpoint (its ``config.json`` says which layers a stage builds); needed when ``pp_size > 1``.

    Raises:
        BundleMismatchError: ``tp_size``/``tp_rank`` the bundle lacks; ``files``: an object missing, truncated, a header
            block that does not match the record, a header that is not the manifest's; ``pp_size``: a stage that does
            not fit the model (as the loader decides).
    """
    manifest = bundle.manifest
    try:
        tp_set = manifest.tensor_parallel_set(tp_size)
    except KeyError:
        held = ", ".join(str(s) for s in manifest.tp_sizes)
        raise BundleMismatchError(MismatchField.tp_size, f"bundle {bundle.url} has tp {held}, not {tp_size}; convert it with "
                                  f"--tp {tp_size} and push it again") from None
    if not 0 <= rank < tp_size:
        raise BundleMismatchError(MismatchField.tp_rank, f"rank {rank} is outside tensor-parallel size {tp_size}")
    common_entry = manifest.common
    rank_entry, rank_header, rank_head_bytes = rank_header_of(bundle, tp_set, rank)
    _checked_object(bundle, common_entry)
    common_header, common_head_bytes = _header(bundle, common_entry)
    _common_header_checked(manifest, common_header)
    if pp_size > 1:
        from marlin_pack.vllm_plugin.stage import stage_share

        if model_dir is None:
            raise ValueError("a pipeline stage's plan needs model_dir (its config.json says which layers the stage builds)")
        stage = stage_share(manifest, tp_set, rank_header, common_header, Path(model_dir), pp_size, pp_rank)
        rank_header, common_header = stage.rank_header, stage.common_header
    else:
        stage = None
    block = bundle.record.block_size
    files = tuple(
        FileRead(entry, header, _spans(header, block, entry.size), head_bytes)
        for entry, header, head_bytes in ((rank_entry, rank_header, rank_head_bytes), (common_entry, common_header, common_head_bytes))
    )
    return RankPlan(bundle, tp_size, rank, pp_size, pp_rank, files, stage)

