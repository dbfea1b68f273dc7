"""The ``marlin_prepacked`` loader's bundle in object storage (``{"bundle": "s3://bucket/prefix"}``, or ``gs://``): its decision and
its copy, kept out of ``loader.py``, which asks three things of this module.

* :func:`decide_bundle`: the decision. A URL: :func:`~marlin_pack.remote.decision.select_remote` (the record, the
  manifest, engine fit, the source checkpoint, this rank's objects and headers, a stage's share), every refusal before
  the GPU and ``fallback`` as for a local bundle (:func:`~marlin_pack.vllm_plugin.decision.decide`'s rules); the
  selection is a :class:`RemoteSelected`. A directory: the local decision, unchanged.
* :data:`IO_PLAN`: no copy helpers, no copy beside the construction (there is no file to page-lock or map).
* :func:`copy_rank`: the rank's spans streamed by Run:ai's streamer (:func:`~marlin_pack.remote.stream.read_rank`),
  every block verified against the publication record before a byte of it is used; the rank file's blocks go into
  the arena's slots (the destinations the local copy fills), on a GPU through a ring of page-locked buffers whose
  copies overlap the next blocks' reads (:class:`~marlin_pack.remote.staging.StagedCopy`); the common file's into one
  host image that the reader then holds (as a cold start's ``common.safetensors`` read whole): the common tensors come
  from there.

The selection names its files by URL (:class:`UrlPath`), so the loader's lines and refusals say where the bundle is.

Experts of another TP size's rank file (expert parallelism, MoE at DP > 1: the plan's ``experts``) are placed as the
rank file's own tensors: the selection's rank header gives each experts tensor a place past the rank file's end (its
pieces one after the other, :attr:`RemoteSelected.experts_at`), so the loader's arena layout gives them slots of the
rank file, and the copy sends each such place's bytes, as they arrive from the experts' file, to those slots. The
arena is the one a local load fills, byte for byte.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from marlin_pack.errors import BundleError, MarlinPackError, MismatchField
from marlin_pack.gpu.host_map import HostMap
from marlin_pack.gpu.plan import IoPlan
from marlin_pack.gpu.reader import CopyItem, ParallelReader
from marlin_pack.io.safetensors_io import SafetensorsHeader, TensorInfo
from marlin_pack.remote.bundle import FileRead, RankPlan
from marlin_pack.remote.staging import CudaCopies, StagedCopy
from marlin_pack.remote.url import UrlPath, sync_command
from marlin_pack.vllm_plugin.decision import Decision, EngineFacts, SelectedBundle, decide, internal_error, refusal, select_for_copy
from marlin_pack.vllm_plugin.expert_share import ExpertShare
from marlin_pack.vllm_plugin.options import LoaderOptions

__all__ = ["IO_PLAN", "RemoteSelected", "StreamedExperts", "UrlPath", "copy_rank", "decide_bundle", "select"]

logger = logging.getLogger("vllm.marlin_pack")

IO_PLAN = IoPlan(mode="staged", during_build=False, why="the bundle is in object storage: each rank streams its own byte "
                 "ranges (Run:ai's streamer), every block verified, then copied into the arena")


@dataclass(frozen=True)
class RemoteSelected(SelectedBundle):
    """A selected bundle published in a bucket: the loader's selection, and what this rank streams (``read``).

    ``experts_at``: where the experts of another file sit in the rank file's offsets (the rank header's experts
    tensors start at the rank file's size): ``(offset, file, start, nbytes)`` per piece, in offset order.
    """

    read: RankPlan | None = None
    experts_at: tuple[tuple[int, str, int, int], ...] = ()


@dataclass(frozen=True)
class StreamedExperts(ExpertShare):
    """This GPU's experts of a bundle in a bucket, addressed as the rank file's tensors (:attr:`RemoteSelected.experts_at`):
    its ``header`` holds none (the arena gives them slots of the rank file), ``streamed`` says the bytes of its experts."""

    streamed: int = 0

    @property
    def read_bytes(self) -> int:
        return self.streamed


def _experts_placed(plan: RankPlan, rank: FileRead) -> tuple[SafetensorsHeader, StreamedExperts, tuple[tuple[int, str, int, int], ...]]:
    """The rank header with this GPU's experts tensors at offsets past the rank file's end, the share as selected, and
    where each of those offsets' bytes come from."""
    share: ExpertShare = plan.experts
    source = plan.files[2] if len(plan.files) > 2 else rank  # (TP 1 at EP: the rank file itself)
    tensors = dict(rank.header.tensors)
    at, placed = rank.entry.size, []
    for name, info in share.header.tensors.items():
        pieces = share.pieces(info)
        nbytes = sum(n for _, n in pieces)
        shape = (len(share.experts), *info.shape[1:]) if info.shape else info.shape
        tensors[name] = TensorInfo(name, info.file, info.dtype, shape, at, at + nbytes)
        for start, n in pieces:
            placed.append((at, source.entry.path, start, n))
            at += n
    header = SafetensorsHeader(rank.header.path, rank.header.raw, tensors, rank.header.metadata)
    fields = {f.name: getattr(share, f.name) for f in dataclasses.fields(share)}
    fields["header"] = SafetensorsHeader(share.header.path, share.header.raw, {}, share.header.metadata)
    return header, StreamedExperts(**fields, streamed=share.read_bytes), tuple(placed)


def select(options: LoaderOptions, facts: EngineFacts) -> RemoteSelected:
    """The loader's selection of the bundle published at ``options.bundle`` (every refusal raised before the GPU)."""
    from marlin_pack.remote.decision import select_remote

    url = options.remote
    if url is None:
        raise ValueError("internal error: the remote selection needs an s3:// or gs:// bundle")
    plan, hashed = select_remote(url, facts, full_hash=options.full_hash)
    manifest = plan.bundle.manifest
    rank, common = plan.files[0], plan.files[1]
    tp_set = manifest.tensor_parallel_set(facts.tp_size) if plan.stage is None else plan.stage.tp_set
    header, experts, experts_at = rank.header, None, ()
    if plan.experts is not None:
        tp_set = tp_set.model_copy(update={"moe_layers": list(plan.experts.moe_layers)})
        header, experts, experts_at = _experts_placed(plan, rank)
    return RemoteSelected(
        bundle_dir=UrlPath.of(str(url)), manifest=manifest, tp_set=tp_set, rank=facts.tp_rank,
        rank_file=UrlPath.of(url.url_of(rank.entry.path)), common_file=UrlPath.of(url.url_of(common.entry.path)),
        rank_header=header, common_header=common.header, hashed=hashed, stage=plan.stage, experts=experts, read=plan,
        experts_at=experts_at,
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
    """Verified blocks to their destinations: the rank file's (and the experts' file's) into the arena's slots
    (``items``, by the rank file's offsets; those past its end by ``experts_at``), the common file's into ``image``
    (the file's bytes at their offsets; only the planned spans are written). With ``staged``, a block's slot copies go
    through its ring of page-locked buffers (a GPU arena), else they are copied here (a CPU arena)."""

    def __init__(self, bundle: RemoteSelected, items: list[CopyItem], image: torch.Tensor, staged: StagedCopy | None) -> None:
        plan = bundle.read
        assert plan is not None
        self._common = plan.files[1].entry.path
        rank = plan.files[0].entry
        starts = [at for at, _, _, _ in bundle.experts_at]
        self._slots: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # file -> (start, nbytes, destination bytes)
        for it in items:
            dst = it.dst.view(-1).view(torch.uint8)
            if it.offset + it.nbytes <= rank.size:
                self._slots.setdefault(rank.path, []).append((it.offset, it.nbytes, dst))
                continue
            i = max(0, bisect.bisect_right(starts, it.offset) - 1)  # the experts' pieces this slot's offsets cover
            while i < len(starts) and starts[i] < it.offset + it.nbytes:
                at, path, start, n = bundle.experts_at[i]
                lo, hi = max(at, it.offset), min(at + n, it.offset + it.nbytes)
                if lo < hi:
                    self._slots.setdefault(path, []).append((start + lo - at, hi - lo, dst[lo - it.offset:hi - it.offset]))
                i += 1
        for slots in self._slots.values():
            slots.sort(key=lambda s: s[0])
        self._starts = {path: [s[0] for s in slots] for path, slots in self._slots.items()}
        self._image = image
        self._staged = staged
        self.copied = 0

    def __call__(self, file: FileRead, offset: int, data: torch.Tensor) -> None:
        end = offset + data.numel()
        if file.entry.path == self._common:
            self._image[offset:end].copy_(data)
            return
        slots = self._slots.get(file.entry.path)
        if slots is None:
            raise BundleError(f"internal error: {file.entry.path} holds no slot of this rank's plan")
        copies = []
        # the slots overlapping [offset, end): from the last one starting at or before offset
        i = max(0, bisect.bisect_right(self._starts[file.entry.path], offset) - 1)
        while i < len(slots) and slots[i][0] < end:
            start, nbytes, dst = slots[i]
            lo, hi = max(offset, start), min(end, start + nbytes)
            if lo < hi:
                copies.append((dst[lo - start:hi - start], lo - offset, hi - offset))
                self.copied += hi - lo
            i += 1
        if self._staged is not None:
            self._staged.put(data, copies)
        else:
            for dst, lo, hi in copies:
                dst.copy_(data[lo:hi])  # synchronous: data is lent


def _staging(items: list[CopyItem], block: int) -> StagedCopy | None:
    """The ring of page-locked buffers for an arena on a GPU; None for one in host memory (copied as blocks arrive)."""
    devices = {it.dst.device for it in items}
    if len(devices) != 1 or (device := devices.pop()).type != "cuda":
        return None
    return StagedCopy(CudaCopies(device), block)


def copy_rank(bundle: RemoteSelected, items: list[CopyItem], reader: ParallelReader) -> tuple[int, HostMap]:
    """Stream this rank's planned spans: the rank file's tensors (and its experts of another file) into ``items`` (the
    arena's slots), the common file's into host memory, held by ``reader`` from now on (its tensors come from there).
    Returns the bytes copied into the arena and that host image.

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
    staged = _staging(items, plan.bundle.record.block_size)
    sink = _Sink(bundle, items, image, staged)
    t0 = time.perf_counter()
    try:
        done = read_rank(plan, sink)
    finally:
        if staged is not None:
            staged.finish()  # every queued copy done (also when the read failed: the buffers go next)
    seconds = time.perf_counter() - t0
    want = sum(it.nbytes for it in items)
    if sink.copied != want:
        raise BundleError(f"internal error: {sink.copied:,} of the rank's {want:,} tensor bytes were streamed; "
                          f"serve from a local copy (`{sync_command(plan.bundle.url)} DIR`) and report it")
    host = HostMap.in_memory(bundle.common_file, image)
    reader.hold(host)
    ring = "" if staged is None else f", through page-locked buffers ({staged.waits} waits for a buffer)"
    logger.info("marlin-pack: streamed %s: %.2f GB in %.2f s (%.2f GB/s), %d blocks verified%s", plan.text(), done.total / 1e9,
                seconds, done.total / seconds / 1e9 if seconds > 0 else 0.0, done.blocks, ring)
    return sink.copied, host
