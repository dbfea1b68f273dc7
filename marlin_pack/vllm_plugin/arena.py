"""The *arena*: one device allocation holding a rank file's tensors, and its copy in the background.

The weight-cache daemon exports one allocation as one CUDA IPC handle, so an ``ipc_cache``
engine opens one mapping instead of one per tensor (about a thousand for a 70B model). Its
layout (:class:`ArenaLayout`) follows from the bundle alone: which layer parameter each rank-file
tensor replaces, in which dtype and shape, at which file offset and arena offset (each view
aligned as the CUDA caching allocator aligns its blocks). So the loader can allocate the arena
and start filling it (:class:`BackgroundCopy`) before vLLM builds the model, and bind the views
to the layers' parameters afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from marlin_pack.errors import BundleError
from marlin_pack.gpu.reader import CopyItem, ParallelReader
from marlin_pack.marlin.moe import moe_entry_specs
from marlin_pack.marlin.rank_tensors import param_names, tensor_specs
from marlin_pack.schemas import LayerKernel, torch_dtype
from marlin_pack.vllm_plugin.decision import SelectedBundle

__all__ = ["ARENA_ALIGN", "ArenaLayout", "ArenaSlot", "BackgroundCopy", "release"]

ARENA_ALIGN = 512  # bytes; the CUDA caching allocator's alignment (Marlin's vector loads need 16)


@dataclass(frozen=True)
class ArenaSlot:
    """One tensor in the arena: where its bytes are in its file and in the arena, as which dtype and shape.

    A rank-file tensor is named ``{layer}.{param}``: the layer parameter it replaces.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # file offset
    nbytes: int
    offset: int  # arena offset
    retyped: bool = False  # the parameter changes dtype in post-processing (Machete's int32 zero points -> -s*z)
    # Bytes of another file (an expert share's, :mod:`.expert_share`): its ranges ``(start, nbytes)``, in arena order
    path: Path | None = None
    pieces: tuple[tuple[int, int], ...] = ()

    @property
    def layer(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def param(self) -> str:
        return self.name.rsplit(".", 1)[1]

    def view(self, arena: torch.Tensor) -> torch.Tensor:
        """The slot's bytes of ``arena`` as its tensor."""
        return arena[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class ArenaLayout:
    """Where every tensor of a rank file goes: :meth:`of` a bundle."""

    slots: tuple[ArenaSlot, ...]
    nbytes: int

    @classmethod
    def of(cls, bundle: SelectedBundle) -> ArenaLayout:
        """The layout of ``bundle``'s rank file: its layers' tensors in manifest order (headers already checked)."""
        dtype = torch_dtype(bundle.manifest.serving_dtype)
        quant, fmt = bundle.manifest.quant, bundle.manifest.source.format
        zeros = param_names(fmt).zeros
        specs = [(entry.name, spec, entry.kernel is LayerKernel.machete and quant.zero_points and spec[0] == f"{entry.name}.{zeros}")
                 for entry in bundle.tp_set.layers for spec in tensor_specs(entry, quant, dtype, fmt)]
        specs += [(entry.name, spec, False) for entry in bundle.tp_set.moe_layers for spec in moe_entry_specs(entry, quant, dtype, fmt)]
        experts = bundle.experts
        slots, offset = [], 0
        for layer, (name, tdtype, shape), retyped in specs:
            if experts is not None and name in experts.header.tensors:  # this GPU's experts of another rank file
                pieces = tuple(experts.pieces(experts.header.tensors[name]))
                slot = ArenaSlot(name, tdtype, tuple(shape), pieces[0][0] if pieces else 0, sum(n for _, n in pieces), offset,
                                 path=experts.rank_file, pieces=pieces)
                slots.append(slot)
                offset += -(-slot.nbytes // ARENA_ALIGN) * ARENA_ALIGN
                continue
            info = bundle.rank_header.tensors[name]
            slot = ArenaSlot(name, tdtype, tuple(shape), info.start, info.nbytes, offset, retyped)
            assert slot.layer == layer, f"internal error: rank tensor {name} is not a parameter of layer {layer}"
            slots.append(slot)
            offset += -(-info.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        return cls(tuple(slots), offset)

    def allocate(self, device: torch.device | None = None) -> torch.Tensor:
        """The arena's memory (uninitialised), on ``device`` or the current default device."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def copy_items(self, arena: torch.Tensor) -> list[CopyItem]:
        """What to read of the rank file into ``arena``: each slot's file bytes into its byte range (a layout with
        slots of another file: :meth:`copy_jobs`)."""
        if any(s.path is not None for s in self.slots):
            raise BundleError("internal error: this arena is filled from several files (copy_jobs)")
        return [CopyItem(s.start, s.nbytes, arena[s.offset : s.offset + s.nbytes]) for s in self.slots]

    def copy_jobs(self, arena: torch.Tensor, rank_file: Path) -> list[tuple[Path, list[CopyItem]]]:
        """What to read of each file into ``arena`` (``rank_file`` first): a slot of another file piece by piece."""
        jobs: dict[Path, list[CopyItem]] = {rank_file: []}
        for s in self.slots:
            if s.path is None:
                jobs[rank_file].append(CopyItem(s.start, s.nbytes, arena[s.offset : s.offset + s.nbytes]))
                continue
            at = s.offset
            for start, nbytes in s.pieces:
                jobs.setdefault(s.path, []).append(CopyItem(start, nbytes, arena[at : at + nbytes]))
                at += nbytes
        return [(path, items) for path, items in jobs.items() if items]

    def parameters(self, layers: Mapping[str, nn.Module]) -> list[nn.Parameter]:
        """The parameter each slot replaces, checked: it exists and has the slot's dtype."""
        params = []
        for s in self.slots:
            param = getattr(layers[s.layer], s.param, None)
            if not isinstance(param, nn.Parameter) or (param.dtype != s.dtype and not s.retyped):
                raise BundleError(
                    f"layer {s.layer}: parameter {s.layer}.{s.param} is {type(param).__name__} "
                    f"{getattr(param, 'dtype', None)}, the bundle holds {s.dtype}"
                )
            params.append(param)
        return params

    def bind(self, params: Sequence[nn.Parameter], arena: torch.Tensor) -> None:
        """Point each parameter at its slot's view of ``arena``, in the slot's shape.

        The Parameter objects stay (and their loader attributes), as vLLM's ``replace_parameter`` keeps them.
        """
        for param, s in zip(params, self.slots, strict=True):
            param.data = s.view(arena)


def release(params: Sequence[nn.Parameter]) -> None:
    """Free the placeholders ``params`` hold (before the arena is allocated beside them)."""
    for param in params:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class BackgroundCopy:
    """Reads file ranges into tensors on a thread of its own, from construction until :meth:`join`.

    ``make_reader`` is called on that thread (one reader for every file); ``on_done`` runs there once the copy has ended
    (done or failed). The items, and so their destinations, are referenced until then: the
    memory cannot be freed under the copy.
    """

    def __init__(
        self,
        make_reader: Callable[[], ParallelReader],
        path: str | Path,
        items: list[CopyItem],
        on_done: Callable[[], None] | None = None,
        then: Sequence[tuple[str | Path, list[CopyItem]]] = (),
        name: str = "marlin-pack-arena-copy",
        hashed: Sequence[str | Path] = (),
    ) -> None:
        """Copy ``items`` of ``path``, then each ``(path, items)`` of ``then``, with one reader and in one
        :meth:`~marlin_pack.gpu.reader.ParallelReader.copy_files` call, on a thread called ``name``; ``hashed``: files
        hashed as they are copied (their digests in ``digests`` once joined)."""
        self.bytes = 0
        self.digests: dict[str, object] = {}  # the reader's: HashedFile, or the OSError why none
        self._hashed = tuple(hashed)
        self.seconds = 0.0
        self.modes_used: set[str] = set()
        self._error: BaseException | None = None
        self._jobs = [(path, items), *then]
        self._make_reader, self._on_done = make_reader, on_done
        devices = {it.dst.device for _, job in self._jobs for it in job}
        self._device = devices.pop() if len(devices) == 1 else None
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread (a TP rank's is not cuda:0)
            with self._make_reader() as reader:
                # One call for every file: with helpers, each gets one job holding its share of all of them.
                if self._hashed:  # read once for the copy and the digests
                    self.bytes += reader.copy_files(self._jobs, hashed=self._hashed)
                    self.digests = dict(reader.digests)
                else:
                    self.bytes += reader.copy_files(self._jobs)
                self.modes_used = set(reader.modes_used)
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._jobs = []
            if self._on_done is not None:
                try:
                    self._on_done()
                except Exception as e:  # noqa: BLE001
                    self._error = self._error or e

    def join(self) -> float:
        """Wait for the copy; returns the seconds waited. Raises what the copy raised."""
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return waited

    def abandon(self) -> None:
        """Wait for the copy and drop its outcome (the caller is failing or falling back already)."""
        self._thread.join()
        self._error = None
