"""``push``: publish a local bundle to ``s3://bucket/prefix``, atomically for readers, idempotently.

Order, so that a reader never sees a half-written bundle (readers start from the record,
:mod:`marlin_pack.remote.record`):

1. **prove the local bundle**: its manifest (as every reader checks it), then every file it lists, read once through
   descriptors held from then on (no symlink followed), against the manifest's size and BLAKE3, computing the record's
   block digests on the way. A damaged bundle is refused before anything is sent.
2. **decide from what is there**: the same record already published is a no-op for every object still whole; another
   bundle's record is refused unless ``force``, which first deletes that record (from then on its readers are refused,
   "not published", never given a mix of the two bundles).
3. **upload** each file whose object is missing or differs (size, or the BLAKE3 the object's metadata names), each
   object appearing whole or not at all (S3 PUT, multipart above 64 MiB); then the manifest; then the record, last.

The descriptors are checked unchanged (size, mtime, ctime) after the uploads: a file rewritten meanwhile is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.bundle.reader import MAX_MANIFEST_BYTES, read_manifest
from marlin_pack.errors import BundleError
from marlin_pack.remedies import convert_command
from marlin_pack.remote.record import BLOCK_SIZE, MAX_RECORD_BYTES, RECORD_NAME, PublishedFile, Record, hash_blocks, open_in, parse_record
from marlin_pack.remote.store import Store, open_store
from marlin_pack.remote.url import parse_url
from marlin_pack.schemas import Manifest

__all__ = ["Pushed", "push", "record_bytes"]


@dataclass(frozen=True)
class Pushed:
    """What a push did: the objects it wrote (``uploaded``) and those already there (``kept``)."""

    url: str
    manifest: Manifest
    uploaded: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    replaced: bool = False  # another bundle's record was there (force)

    @property
    def up_to_date(self) -> bool:
        """Nothing was written: the same bundle was already published, whole."""
        return not self.uploaded

    def summary(self) -> str:
        if self.up_to_date:
            return f"{self.url} already holds this bundle ({len(self.kept)} objects); nothing written"
        kept = f", {len(self.kept)} already there" if self.kept else ""
        replaced = " (replacing another bundle)" if self.replaced else ""
        return f"published {self.url}{replaced}: {len(self.uploaded)} objects, {self.bytes_uploaded / 1e6:,.1f} MB uploaded{kept}"


def record_bytes(record: Record) -> bytes:
    """The record as published: deterministic JSON (sorted keys, two-space indent, trailing newline)."""
    return (json.dumps(record.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


@dataclass
class _Local:
    """One proven local file: its held descriptor, identity when proven, and record entry."""

    published: PublishedFile
    fd: int
    identity: tuple[int, int, int]


def _identity(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _prove(bundle_dir: Path, dir_fd: int, manifest: Manifest, block_size: int,
           progress: Callable[[int, int, str], None] | None) -> list[_Local]:
    """Every file of the manifest, read once: its size and BLAKE3 as recorded (step 1)."""
    redo = f"re-run `{convert_command(bundle_dir, manifest=manifest)}`, then push again"
    files: list[_Local] = []
    entries = manifest.files()
    try:
        for i, entry in enumerate(entries):
            try:
                fd = open_in(dir_fd, entry.path)
            except OSError as e:
                raise BundleError(f"cannot read {bundle_dir / entry.path} ({e.strerror or e}); {redo}") from e
            files.append(_Local(PublishedFile(path=entry.path, size=0, blake3="0" * 64, blocks=[]), fd, _identity(fd)))
            try:
                published = hash_blocks(fd, entry.path, block_size)
            except OSError as e:
                raise BundleError(f"cannot read {bundle_dir / entry.path} ({e.strerror or e}); {redo}") from e
            if (published.size, published.blake3) != (entry.size, entry.blake3):
                raise BundleError(
                    f"{bundle_dir / entry.path} is {published.size:,} bytes with BLAKE3 {published.blake3[:16]}…, the manifest "
                    f"records {entry.size:,} bytes, {entry.blake3[:16]}…: the bundle is damaged; {redo}"
                )
            if _identity(files[-1].fd) != files[-1].identity or os.fstat(files[-1].fd).st_size != published.size:
                raise BundleError(f"{bundle_dir / entry.path} changed while it was read; push again once nothing writes the bundle")
            files[-1].published = published
            if progress is not None:
                progress(i + 1, len(entries), entry.path)
    except BaseException:
        for f in files:
            os.close(f.fd)
        raise
    return files


def _published_record(store: Store) -> Record | None | str:
    """The record there (None: none; a string: one that does not parse, said why)."""
    got = store.get(RECORD_NAME, MAX_RECORD_BYTES)
    if got is None:
        return None
    try:
        return parse_record(got[0], store.url.url_of(RECORD_NAME))
    except BundleError as e:
        return str(e)


def push(bundle: str | os.PathLike[str], url: str, *, force: bool = False,
         progress: Callable[[int, int, str], None] | None = None, block_size: int = BLOCK_SIZE) -> Pushed:
    """Publish the bundle directory ``bundle`` at ``url`` (``s3://bucket/prefix``).

    Args:
        bundle: a local bundle directory (holding ``manifest.json``).
        url: where to publish it; the prefix then holds the bundle's files, its manifest and the publication record.
        force: replace another bundle published there (its readers are refused meanwhile, never given a mix).
        progress: called ``(done, total, path)`` as files are proven.
        block_size: bytes per block digest (the unit a partial reader verifies; tests take small ones).

    Returns:
        :class:`Pushed`: what was uploaded and what was already there; ``up_to_date`` when nothing was written.

    Raises:
        UrlNotPathError: ``url`` is not an ``s3://`` URL marlin-pack serves.
        BundleError: the local bundle is damaged, another bundle is published there (without ``force``), or the
            bucket refused (:class:`~marlin_pack.remote.store.RemoteError`: credentials, a missing bucket, ...).

    Example:
        >>> push("Llama-3-8B-AWQ/marlin-pack", "s3://models/llama-3-8b-awq").summary()
        'published s3://models/llama-3-8b-awq: 4 objects, 5,731.2 MB uploaded'
    """
    target = parse_url(url)
    bundle_dir = Path(bundle)
    manifest = read_manifest(bundle_dir)  # every reader's checks, with their messages
    dir_fd = os.open(bundle_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mfd = open_in(dir_fd, MANIFEST_NAME)
        with os.fdopen(mfd, "rb") as f:
            manifest_data = f.read(MAX_MANIFEST_BYTES + 1)
        if Manifest.model_validate_json(manifest_data, strict=True) != manifest:
            raise BundleError(f"{bundle_dir / MANIFEST_NAME} changed while it was read; push again once nothing writes the bundle")
        files = _prove(bundle_dir, dir_fd, manifest, block_size, progress)
    finally:
        os.close(dir_fd)
    try:
        return _publish(open_store(target), manifest, manifest_data, files, force, block_size)
    finally:
        for f in files:
            os.close(f.fd)


def _publish(store: Store, manifest: Manifest, manifest_data: bytes, files: list[_Local], force: bool, block_size: int) -> Pushed:
    """Steps 2 and 3 (see the module's docstring)."""
    record = Record(manifest_sha256=hashlib.sha256(manifest_data).hexdigest(), manifest_size=len(manifest_data),
                    block_size=block_size, files=[f.published for f in files])
    there = _published_record(store)
    # Another bundle's record; the same manifest's (another block size: the same files) only has its record rewritten.
    replaced = there is not None and there != record and not (
        isinstance(there, Record) and there.manifest_sha256 == record.manifest_sha256)
    if replaced and not force:
        what = (f"a bundle with manifest SHA-256 {there.manifest_sha256[:16]}…" if isinstance(there, Record)
                else f"a record this marlin-pack cannot read ({there})")
        raise BundleError(
            f"{store.url} holds {what}, not this bundle ({record.manifest_sha256[:16]}…); pass --force to replace it "
            "(its readers are refused until the new bundle is complete), or push to another prefix"
        )
    if replaced:
        store.delete(RECORD_NAME)  # unpublished from here on: readers refuse rather than mix two bundles
    uploaded: list[str] = []
    kept: list[str] = []
    sent = 0
    for f in files:
        p = f.published
        info = store.head(p.path)
        if info is not None and info.size == p.size and info.metadata.get("blake3") == p.blake3:
            kept.append(p.path)
            continue
        os.lseek(f.fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(f.fd), "rb") as fh:
            store.put_file(p.path, fh, {"blake3": p.blake3})
        after = store.head(p.path)
        if after is None or after.size != p.size:
            raise BundleError(f"{store.url.url_of(p.path)} holds {None if after is None else after.size} bytes after its upload, "
                              f"expected {p.size:,}; push again")
        uploaded.append(p.path)
        sent += p.size
    for f in files:
        if _identity(f.fd) != f.identity:
            raise BundleError(f"{f.published.path} changed while it was pushed; push again once nothing writes the bundle "
                              f"(the prefix {store.url} stays unpublished)")
    sha = record.manifest_sha256
    info = store.head(MANIFEST_NAME)
    if info is None or info.size != len(manifest_data) or info.metadata.get("sha256") != sha or replaced or uploaded:
        store.put_bytes(MANIFEST_NAME, manifest_data, {"sha256": sha})  # after every file
        uploaded.append(MANIFEST_NAME)
        sent += len(manifest_data)
    else:
        kept.append(MANIFEST_NAME)
    if there != record or uploaded:
        data = record_bytes(record)
        store.put_bytes(RECORD_NAME, data, {})  # last: the bundle is published
        uploaded.append(RECORD_NAME)
        sent += len(data)
    else:
        kept.append(RECORD_NAME)
    return Pushed(str(store.url), manifest, uploaded, kept, sent, replaced)
