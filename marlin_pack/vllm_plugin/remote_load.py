"""The ``marlin_prepacked`` loader's bundle in object storage (``{"bundle": "s3://bucket/prefix"}``, or ``gs://``): its decision and
its copy, kept out of ``loader.py``, which asks three things of this module.

* :func:`decide_bundle`: the decision. A URL: :func:`~marlin_pack.remote.decision.select_remote` (the record, the
  manifest, engine fit, the source checkpoint, this rank's objects and headers, a stage's share), every refusal before
  the GPU and ``fallback`` as for a local bundle (:func:`~marlin_pack.vllm_plugin.decision.decide`'s rules); the
  selection is a :class:`RemoteSelected`. A directory: the local decision, unchanged.
* :data:`IO_PLAN`: no copy helpers, no copy beside the construction (there is no file to page-lock or map).
* :func:`copy_rank`: the rank's spans streamed by Run:ai's streamer (:func:`~marlin_pack.remote.stream.read_rank`),
  every block verified against the publication record before a byte of it is used; the rank file's blocks go straight
  into the arena's slots (the destinations the local copy fills), the common file's into one host image that the
  reader then holds (as a cold start's ``common.safetensors`` read whole): the common tensors come from there.

The selection names its files by URL (:class:`UrlPath`), so the loader's lines and refusals say where the bundle is.
Expert shares (expert parallelism, MoE at DP > 1) are refused by the decision until they are planned.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from pathlib import PosixPath

import torch

from marlin_pack.errors import BundleError, MarlinPackError, MismatchField
from marlin_pack.gpu.host_map import HostMap
from marlin_pack.gpu.plan import IoPlan
from marlin_pack.gpu.reader import CopyItem, ParallelReader
from marlin_pack.remote.bundle import FileRead, RankPlan
from marlin_pack.remote.url import sync_command
from marlin_pack.vllm_plugin.decision import Decision, EngineFacts, SelectedBundle, decide, internal_error, refusal, select_for_copy
from marlin_pack.vllm_plugin.options import LoaderOptions

__all__ = ["IO_PLAN", "RemoteSelected", "UrlPath", "copy_rank", "decide_bundle", "select"]

logger = logging.getLogger("vllm.marlin_pack")

IO_PLAN = IoPlan(mode="staged", during_build=False, why="the bundle is in object storage: each rank streams its own byte "
                 "ranges (Run:ai's streamer), every block verified, then copied into the arena")


class UrlPath(PosixPath):
    """A bundle object named by its URL where the loader expects a path (its messages, the reader's held files): ``str``
    is the URL as written (``s3://bucket/prefix/tp1/rank-0.safetensors``). Nothing opens it: the copy is streamed."""

    _url: str

    @classmethod
    def of(cls, url: str) -> UrlPath:
        path = cls(url)
        path._url = url
        return path

    def __str__(self) -> str:
        return getattr(self, "_url", None) or super().__str__()

    def __fspath__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class RemoteSelected(SelectedBundle):
    """A selected bundle published in a bucket: the loader's selection, and what this rank streams (``read``)."""

    read: RankPlan | None = None


def select(options: LoaderOptions, facts: EngineFacts) -> RemoteSelected:
    """The loader's selection of the bundle published at ``options.bundle`` (every refusal raised before the GPU)."""
    from marlin_pack.remote.decision import select_remote

    url = options.remote
    if url is None:
        raise ValueError("internal error: the remote selection needs an s3:// or gs:// bundle")
    plan, hashed = select_remote(url, facts, full_hash=options.full_hash)
    manifest = plan.bundle.manifest
    rank, common = plan.files
    tp_set = manifest.tensor_parallel_set(facts.tp_size) if plan.stage is None else plan.stage.tp_set
    return RemoteSelected(
        bundle_dir=UrlPath.of(str(url)), manifest=manifest, tp_set=tp_set, rank=facts.tp_rank,
        rank_file=UrlPath.of(url.url_of(rank.entry.path)), common_file=UrlPath.of(url.url_of(common.entry.path)),
        rank_header=rank.header, common_header=common.header, hashed=hashed, stage=plan.stage, read=plan,
    )


def decide_bundle(options: LoaderOptions, facts: EngineFacts) -> Decision:
    """The loader's decision: a bundle in object storage as :func:`select` decides it, refused or fallen back from as
    :func:`~marlin_pack.vllm_plugin.decision.decide` does; a directory as the local loader decides."""
    url = options.remote
    if url is None:
        return decide(options, facts, select_for_copy)
    try:
        return Decision(select(options, facts))
    except MarlinPackError as e:  # a refusal: the bucket's, the bundle's, the checkpoint's
        field = getattr(e, "field", None) or (MismatchField.bundle if isinstance(e, BundleError) else MismatchField.source)
        if options.fallback:
            return Decision(None, field, str(e))
        raise refusal(field, str(e), facts.model, str(url)) from e
    except Exception as e:  # not a refusal: a bug of marlin-pack's (a client's surprise included)
        if not options.fallback:
            raise
        return Decision(None, MismatchField.bundle, internal_error(e))


class _Sink:
    """Verified blocks to their destinations: the rank file's into the arena's slots (``items``, by file offset), the
    common file's into ``image`` (the file's bytes at their offsets; only the planned spans are written)."""

    def __init__(self, plan: RankPlan, items: list[CopyItem], image: torch.Tensor) -> None:
        self._rank, self._common = plan.files[0].entry.path, plan.files[1].entry.path
        self._items = sorted(items, key=lambda it: it.offset)
        self._starts = [it.offset for it in self._items]
        self._image = image
        self.copied = 0

    def __call__(self, file: FileRead, offset: int, data: torch.Tensor) -> None:
        end = offset + data.numel()
        if file.entry.path == self._common:
            self._image[offset:end].copy_(data)
            return
        if file.entry.path != self._rank:
            raise BundleError(f"internal error: {file.entry.path} is not a file of this rank's plan")
        # the slots overlapping [offset, end): from the last one starting at or before offset
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self._items) and self._items[i].offset < end:
            it = self._items[i]
            lo, hi = max(offset, it.offset), min(end, it.offset + it.nbytes)
            if lo < hi:
                dst = it.dst.view(-1).view(torch.uint8)
                dst[lo - it.offset:hi - it.offset].copy_(data[lo - offset:hi - offset])  # synchronous: data is lent
                self.copied += hi - lo
            i += 1


def copy_rank(bundle: RemoteSelected, items: list[CopyItem], reader: ParallelReader) -> tuple[int, HostMap]:
    """Stream this rank's planned spans: the rank file's tensors into ``items`` (the arena's slots), the common file's
    into host memory, held by ``reader`` from now on (its tensors come from there). Returns the rank file's bytes
    copied and that host image.

    Raises:
        BundleMismatchError: a block that is not the record's, the bundle re-published during the read.
        RemoteError: the streamer could not read an object (credentials, the object gone).
        BundleError: a slot the plan did not cover (internal error).
    """
    from marlin_pack.remote.stream import read_rank

    plan = bundle.read
    if plan is None:
        raise BundleError("internal error: a remote selection without its read plan")
    image = torch.empty(plan.files[1].entry.size, dtype=torch.uint8)
    sink = _Sink(plan, items, image)
    t0 = time.perf_counter()
    done = read_rank(plan, sink)
    seconds = time.perf_counter() - t0
    want = sum(it.nbytes for it in items)
    if sink.copied != want:
        raise BundleError(f"internal error: {sink.copied:,} of the rank file's {want:,} tensor bytes were streamed; "
                          f"serve from a local copy (`{sync_command(plan.bundle.url)} DIR`) and report it")
    host = HostMap.in_memory(bundle.common_file, image)
    reader.hold(host)
    logger.info("marlin-pack: streamed %s: %.2f GB in %.2f s (%.2f GB/s), %d blocks verified", plan.text(), done.total / 1e9,
                seconds, done.total / seconds / 1e9 if seconds > 0 else 0.0, done.blocks)
    return sink.copied, host
