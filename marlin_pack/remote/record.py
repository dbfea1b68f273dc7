"""The publication record: what ``push`` writes last beside a bundle in a bucket, and readers require first.

A bundle in a bucket is the local layout under a prefix (``manifest.json``, ``common.safetensors``,
``tpT/rank-R.safetensors``: ``aws s3 sync`` of it is a local bundle) plus ``marlin-pack-published.json``, this record:

- **the commit point.** ``push`` writes the files, then the manifest, then the record. A reader starts from the
  record: without it the prefix is unpublished or half-published (an interrupted push, a push replacing another),
  and is refused; a manifest whose SHA-256 is not the record's was replaced after the record was read.
- **block digests.** The manifest's BLAKE3 covers a whole file, which a pipeline stage (only its layers) never reads.
  The record adds each file's BLAKE3 per block of ``block_size`` bytes, so a reader verifies every block it reads, as it
  arrives, whatever it reads. ``push`` computes them in the same pass that proves each file against the manifest.

Strict and versioned like the manifest (unknown fields, wrong types and versions are refused); untrusted: the reader
checks it against the manifest (same files, sizes and whole-file digests) before using it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from marlin_pack.errors import BundleError
from marlin_pack.schemas import Manifest

__all__ = [
    "BLOCK_SIZE", "MAX_RECORD_BYTES", "RECORD_NAME", "PublishedFile", "Record", "block_digest", "hash_blocks", "open_in", "parse_record",
]

RECORD_NAME = "marlin-pack-published.json"
BLOCK_SIZE = 8 << 20  # 8 MiB: a 40 GB rank file is 5,000 digests (320 kB of record); a stage reads at most 2 blocks more per run
MAX_RECORD_BYTES = 64 << 20
_HEX64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PublishedFile(BaseModel):
    """One bundle file as published: the manifest's entry and its block digests (the last block may be shorter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: Annotated[int, Field(ge=0, le=1 << 44)]
    blake3: _HEX64
    blocks: list[_HEX64]


class Record(BaseModel):
    """``marlin-pack-published.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["marlin-pack-published"] = "marlin-pack-published"
    format_version: Literal[1] = 1
    manifest_sha256: _HEX64
    manifest_size: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1 << 16, le=1 << 30)]
    files: list[PublishedFile]

    def file(self, path: str) -> PublishedFile:
        for f in self.files:
            if f.path == path:
                return f
        raise BundleError(f"the publication record lists no {path}; push the bundle again")

    def check_against(self, manifest: Manifest, where: str) -> None:
        """The record describes exactly the manifest's files (paths, sizes, whole-file BLAKE3) with whole blocks.

        Raises:
            BundleError: naming the first difference.
        """
        want = {f.path: f for f in manifest.files()}
        have = {f.path: f for f in self.files}
        if set(want) != set(have):
            odd = sorted(set(want) ^ set(have))[0]
            raise BundleError(f"{where}: the publication record and the manifest list different files ({odd}): a push replaced "
                              "the bundle while it was read, or the record is damaged; push the bundle again")
        for path, entry in want.items():
            f = have[path]
            if (f.size, f.blake3) != (entry.size, entry.blake3):
                raise BundleError(f"{where}: the publication record says {path} is {f.size:,} bytes, BLAKE3 {f.blake3[:16]}…, "
                                  f"the manifest {entry.size:,} bytes, {entry.blake3[:16]}…; push the bundle again")
            if len(f.blocks) != -(-f.size // self.block_size):
                raise BundleError(f"{where}: the publication record has {len(f.blocks)} block digests for {path} "
                                  f"({f.size:,} bytes in blocks of {self.block_size:,}); push the bundle again")


def parse_record(data: bytes, where: str) -> Record:
    """A record read from a bucket, validated strictly.

    Raises:
        BundleError: not JSON, another format or version, or failing the schema; names the first problem.
    """
    try:
        return Record.model_validate_json(data, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "record"
        raise BundleError(f"{where}: field {field}: {err['msg']}; not a publication record this marlin-pack reads: push "
                          "the bundle again with this marlin-pack") from e


def hash_blocks(fd: int, path: str, block_size: int, on_bytes: Callable[[int], None] | None = None) -> PublishedFile:
    """Read the bundle file ``path`` through its descriptor ``fd`` (:func:`open_in`) once: its whole BLAKE3 and each
    block's.

    Raises:
        OSError: unreadable, or it changed size while read.
    """
    import blake3

    size = os.fstat(fd).st_size
    whole = blake3.blake3(max_threads=blake3.blake3.AUTO)
    blocks: list[str] = []
    offset = 0
    while offset < size:
        data = os.pread(fd, min(block_size, size - offset), offset)
        if not data:
            raise OSError(f"{path} ended at {offset:,} bytes while read, expected {size:,}")
        whole.update(data)
        blocks.append(block_digest(data))
        offset += len(data)
        if on_bytes is not None:
            on_bytes(len(data))
    if os.fstat(fd).st_size != size:
        raise OSError(f"{path} changed size while read")
    return PublishedFile(path=path, size=size, blake3=whole.hexdigest(), blocks=blocks)


def block_digest(data: bytes | memoryview) -> str:
    """One block's digest, as the record holds it: BLAKE3, hex."""
    import blake3

    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def open_in(dir_fd: int, rel: str) -> int:
    """A read-only descriptor of the bundle file ``rel`` (``tp2/rank-1.safetensors``) under ``dir_fd``, opened one
    component at a time, never through a symlink, as a regular file (a FIFO would block, a device never end).

    Raises:
        OSError: missing, a symlink, not a regular file, unreadable.
    """
    parts = rel.split("/")
    fds: list[int] = []
    try:
        at = dir_fd
        for part in parts[:-1]:
            at = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
            fds.append(at)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=at)
    finally:
        for d in fds:
            os.close(d)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{rel} is not a regular file")
    os.set_blocking(fd, True)
    return fd

