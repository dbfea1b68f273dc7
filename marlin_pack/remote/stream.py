"""One rank's planned reads (:func:`~marlin_pack.remote.bundle.plan_rank`) streamed from the bucket by Run:ai's streamer,
every block verified against the publication record as it arrives, then handed to a sink.

Why Run:ai's streamer (``runai-model-streamer``): it is the client vLLM's own ``runai_streamer`` load format uses, so an
engine that streams a checkpoint from S3 today streams a bundle with the same credentials, endpoint variables and
tuning (``RUNAI_STREAMER_CONCURRENCY``, ...); its C++ core reads arbitrary byte ranges of many objects concurrently
(``FileStreamer`` / ``FileChunks``) into a ring of host buffers, and it answers a short or failed range with an error,
never with fewer bytes. boto3 (:mod:`~marlin_pack.remote.store`) does the rest (record, manifest, headers, push); for
``gs://`` its GCS backend reads the ranges with application-default credentials as vLLM's does, and Google's client
does the rest (``MARLIN_PACK_GCS_HMAC=1``: its S3 backend and boto3 at GCS's XML API, with an HMAC key).

Each range asked for is one block of the record, so each response is verified whole before the sink sees it: a block
that is not the record's (an object changed after the plan read the manifest, a damaged object) is refused in one line.
After the last block the record and manifest are read again: a bundle re-published meanwhile is refused too.

The sink is where the bytes go: :class:`HostSink` (host buffers, the tensors as CPU views: the CPU tests, ``verify``
of a remote bundle) or, in the loader, a copy into the rank's GPU arena (not wired yet: docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.errors import BundleMismatchError, MismatchField
from marlin_pack.remote.bundle import FileRead, RankPlan
from marlin_pack.remote.record import RECORD_NAME, block_digest
from marlin_pack.remote.store import RemoteError

__all__ = ["HostSink", "RankRead", "read_rank"]

# sink(file_read, offset, data): ``data`` (uint8, 1-D, valid only during the call) is the file's bytes at ``offset``.
Sink = Callable[[FileRead, int, torch.Tensor], None]


class HostSink:
    """The spans of each file in one host buffer per file; :meth:`tensors` gives the tensors read as views."""

    def __init__(self, plan: RankPlan) -> None:
        self._buffers: dict[str, tuple[FileRead, torch.Tensor, list[tuple[int, int, int]]]] = {}
        for f in plan.files:
            where, at = [], 0
            for start, end in f.spans:
                where.append((start, end, at))
                at += end - start
            self._buffers[f.entry.path] = (f, torch.empty(at, dtype=torch.uint8), where)

    def _at(self, path: str, offset: int, n: int) -> int:
        _, _, where = self._buffers[path]
        for start, end, at in where:
            if start <= offset and offset + n <= end:
                return at + offset - start
        raise ValueError(f"{path}: bytes {offset}..{offset + n} are outside the planned spans")

    def __call__(self, file: FileRead, offset: int, data: torch.Tensor) -> None:
        at = self._at(file.entry.path, offset, data.numel())
        self._buffers[file.entry.path][1][at:at + data.numel()].copy_(data.reshape(-1))

    def tensors(self, path: str) -> dict[str, torch.Tensor]:
        """The tensors the plan reads of ``path``, as typed views of the buffer."""
        file, buffer, _ = self._buffers[path]
        out = {}
        for name, t in file.header.tensors.items():
            at = self._at(path, t.start, t.nbytes) if t.nbytes else 0
            out[name] = buffer[at:at + t.nbytes].view(t.torch_dtype).reshape(t.shape)
        return out


@dataclass
class RankRead:
    """What a streamed read did: bytes per file (all verified), blocks verified."""

    bytes_read: dict[str, int] = field(default_factory=dict)
    blocks: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes_read.values())


def _ranges(plan: RankPlan) -> list[tuple[FileRead, list[int], list[int]]]:
    """Each file's spans cut into the record's blocks: one range per block, so a response is one verifiable block."""
    block = plan.bundle.record.block_size
    out = []
    for f in plan.files:
        offsets, sizes = [], []
        for start, end in f.spans:
            for at in range(start, end, block):
                offsets.append(at)
                sizes.append(min(block, end - at))
        out.append((f, offsets, sizes))
    return out


def _streamer() -> Any:
    try:
        from runai_model_streamer import FileChunks, FileStreamer
    except ImportError as e:
        raise RemoteError(f"reading a bundle from object storage needs runai-model-streamer: install marlin-pack's s3 extra "
                          f"(pip install 'marlin-pack[s3]'): {e}") from e
    return FileStreamer, FileChunks


def _gcs_backend() -> None:
    """``gs://`` names are read by Run:ai's GCS backend (application-default credentials): installed, and at the same
    emulator as Google's client if one is named."""
    import importlib.util

    from marlin_pack.remote.store import GCS_HMAC_ENV, check_gcs_emulator

    if importlib.util.find_spec("runai_model_streamer_gcs") is None:
        raise RemoteError("streaming gs:// needs Run:ai's GCS backend (runai-model-streamer-gcs): install marlin-pack's gcs "
                          f"extra (pip install 'marlin-pack[gcs]'), or set {GCS_HMAC_ENV}=1 to read through GCS's XML API with an HMAC key")
    check_gcs_emulator()


def _credentials(endpoint: str | None) -> Any:
    """The streamer's credentials argument: None (its S3 backend's default chain and the environment's endpoint; its GCS
    backend's application-default credentials for ``gs://`` names), or that chain at ``endpoint`` (a ``gs://`` bundle
    with ``MARLIN_PACK_GCS_HMAC=1``: GCS's XML API, :meth:`~marlin_pack.remote.store.S3Store.stream_target`)."""
    if endpoint is None:
        return None
    from runai_model_streamer.s3_utils.s3_utils import S3Credentials

    from marlin_pack.remote.store import GCS_REGION

    return S3Credentials(endpoint=endpoint, region_name=GCS_REGION)


def read_rank(plan: RankPlan, sink: Sink, *, memory_limit: int | None = None) -> RankRead:
    """Stream every span of ``plan`` into ``sink``, each block verified against the publication record first.

    Args:
        sink: called ``(file, offset, data)`` once per verified block, in whatever order blocks arrive.
        memory_limit: bytes of host buffers the streamer may hold (None: its default).

    Raises:
        BundleMismatchError: ``files``: a block that is not the record's, or the bundle re-published during the read.
        RemoteError: the streamer could not read an object (credentials, the object gone).
    """
    FileStreamer, FileChunks = _streamer()
    bundle = plan.bundle
    block = bundle.record.block_size
    jobs = _ranges(plan)
    done = RankRead({f.entry.path: 0 for f, _, _ in jobs})
    targets = {f.entry.path: bundle.store.stream_target(f.entry.path) for f, _, _ in jobs}
    requests = [FileChunks(i, targets[f.entry.path][0], offsets, sizes) for i, (f, offsets, sizes) in enumerate(jobs) if sizes]
    by_id = {i: (f, offsets) for i, (f, offsets, sizes) in enumerate(jobs) if sizes}
    endpoints = {endpoint for _, endpoint in targets.values()}
    if requests and any(target.startswith("gs://") for target, _ in targets.values()):
        _gcs_backend()
    if requests:
        try:
            with FileStreamer() as streamer:
                streamer.stream_files(requests, credentials=_credentials(endpoints.pop()), device="cpu", memory_limit=memory_limit)
                for file_id, index, data in streamer.get_chunks():
                    f, offsets = by_id[file_id]
                    offset = offsets[index]
                    flat = data.reshape(-1)
                    digest = block_digest(flat.numpy().data)
                    expected = bundle.record.file(f.entry.path).blocks[offset // block]
                    if digest != expected:
                        raise BundleMismatchError(
                            MismatchField.files,
                            f"{bundle.url.url_of(f.entry.path)}: block {offset // block} (bytes {offset:,}..{offset + flat.numel():,}) "
                            "does not match the publication record: the object changed since its manifest was read, or is damaged; "
                            f"retry, or publish it again with `marlin-pack push BUNDLE {bundle.url}`",
                        )
                    sink(f, offset, flat)
                    done.bytes_read[f.entry.path] += flat.numel()
                    done.blocks += 1
        except ValueError as e:
            if isinstance(e, BundleMismatchError):
                raise
            raise RemoteError(f"reading {bundle.url} failed: {e}; check the credentials and that the bundle is still published "
                              f"there (or publish it again with `marlin-pack push BUNDLE {bundle.url}`)") from e
    _still_published(plan)
    return done


def _still_published(plan: RankPlan) -> None:
    """The record and manifest are still those the plan read (ETags): a re-push during the read is refused."""
    bundle = plan.bundle
    for name, etag in ((RECORD_NAME, bundle.record_etag), (MANIFEST_NAME, bundle.manifest_etag)):
        info = bundle.store.head(name)
        if info is None or info.etag != etag:
            raise BundleMismatchError(
                MismatchField.files,
                f"{bundle.url.url_of(name)} changed while the bundle was read (a push replaced it): the bytes read may mix two "
                "bundles; retry once the push is finished",
            )
