"""The bundle's common tensors (``common.safetensors``: embeddings, norms, output head) into the model vLLM built.

:func:`common_weights` feeds them, in file order, to the model's own ``load_weights`` (sharding, stacking, tied
embeddings: vLLM's weight loaders); at TP=1 the large ones are read straight into their parameters where vLLM's weight
loader would only copy them (:func:`direct_target`). With the option ``common_during_build`` the loader starts those
copies before vLLM builds the model, into device tensors of their own (:meth:`CommonPrefill.allocate`), in the same
background job as the rank file, while vLLM's embedding method makes memory-less stubs (:mod:`.patches.placeholders`).
Once the model is built, :meth:`CommonPrefill.bind` points the parameters at those tensors; a tensor it cannot bind
goes the ordinary way (vLLM's weight loader) and its copy is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from marlin_pack.gpu.host_map import HostMap
from marlin_pack.gpu.reader import CopyItem, ParallelReader
from marlin_pack.io.safetensors_io import TensorInfo
from marlin_pack.vllm_plugin.decision import SelectedBundle
from marlin_pack.vllm_plugin.engine import built_parameters

__all__ = ["CommonPrefill", "LARGE_COMMON", "PLAIN_COPY_LOADERS", "PrefillSlot", "alias_names", "common_weights", "direct_target",
           "plain_copy_target"]

# Common tensors from this size on are read with the parallel reader (common_weights), and copied beside the
# construction where the plan says so (CommonPrefill).
LARGE_COMMON = 16 << 20

# vLLM weight loaders that, given a tensor of the parameter's own shape at TP=1, only copy it.
PLAIN_COPY_LOADERS = frozenset({"default_weight_loader", "VocabParallelEmbedding.weight_loader"})


def alias_names(bundle: SelectedBundle) -> dict[str, list[str]]:
    """Common tensor name -> the other checkpoint names stored as it (``common_aliases``)."""
    copies: dict[str, list[str]] = {}
    for alias, original in bundle.manifest.common_aliases.items():
        copies.setdefault(original, []).append(alias)
    return copies


def plain_copy_target(param: nn.Parameter | None, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter | None:
    """``param`` when loading a checkpoint tensor of ``shape``/``dtype`` into it is exactly a copy in vLLM
    at TP=1 (same shape and dtype, a plain-copy weight loader), else None."""
    if param is None or tuple(param.shape) != tuple(shape) or param.dtype != dtype:
        return None
    loader = getattr(param, "weight_loader", None)
    name = "default_weight_loader" if loader is None else getattr(loader, "__qualname__", "")
    return param if name in PLAIN_COPY_LOADERS else None


@dataclass(frozen=True)
class PrefillSlot:
    """One common tensor copied beside the construction: its checkpoint names (aliases too) and file range."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


class CommonPrefill:
    """Device tensors holding the bundle's large common tensors, filled beside the construction."""

    def __init__(self, slots: tuple[PrefillSlot, ...], tensors: list[torch.Tensor]) -> None:
        self.slots = slots
        self.tensors = tensors

    @classmethod
    def allocate(cls, bundle: SelectedBundle, min_bytes: int, device: torch.device | None = None) -> CommonPrefill | None:
        """Memory for ``bundle``'s common tensors of ``min_bytes`` or more (TP=1 only), on ``device`` or the
        default device; None when there are none."""
        if bundle.tp_set.tp_size != 1:
            return None
        aliases = alias_names(bundle)
        ordered = sorted(bundle.common_header.tensors.items(), key=lambda kv: kv[1].start)
        slots = tuple(_slot(name, info, aliases) for name, info in ordered if info.nbytes >= min_bytes)
        if not slots:
            return None
        return cls(slots, [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots])

    def copy_items(self) -> list[CopyItem]:
        """What to read from ``common.safetensors`` into the tensors."""
        return [CopyItem(s.start, s.nbytes, t) for s, t in zip(self.slots, self.tensors, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def bind(self, params: Mapping[str, nn.Parameter], common_names: Iterable[str]) -> set[str]:
        """Point the parameters the slots' names load (a plain copy each) at the slots' tensors.

        ``params``: the model's parameters by name (duplicates kept); ``common_names``: every
        checkpoint name ``common.safetensors`` loads (aliases too). A slot is bound when all its
        names load one parameter, by a plain copy; a later slot of the same parameter wins, as
        loading in file order gives. A parameter that a name left to vLLM's weight loaders also
        loads is not bound: that loader would write into a tensor still being copied.
        The tensors may still be filling: nothing may read them until the copy is joined.

        Returns the checkpoint names now loaded (to be skipped by the ordinary path).
        """
        candidates: dict[int, nn.Parameter] = {}  # slot index -> its parameter
        for i, slot in enumerate(self.slots):
            targets = [plain_copy_target(params.get(n), slot.shape, slot.dtype) for n in slot.names]
            if targets and all(t is not None for t in targets) and len({id(t) for t in targets}) == 1:
                candidates[i] = targets[0]  # type: ignore[assignment]
        names = set(common_names)
        while True:  # drop candidates whose parameter an unbound name loads too, until none is left
            bound_names = {n for i in candidates for n in self.slots[i].names}
            loaded_otherwise = {id(params[n]) for n in names - bound_names if n in params}
            clashes = [i for i, p in candidates.items() if id(p) in loaded_otherwise]
            if not clashes:
                break
            for i in clashes:
                del candidates[i]
        for i in sorted(candidates):  # file order: a later slot of the same parameter wins
            candidates[i].data = self.tensors[i]
        return {n for i in candidates for n in self.slots[i].names}


def _slot(name: str, info: TensorInfo, aliases: Mapping[str, list[str]]) -> PrefillSlot:
    return PrefillSlot((name, *aliases.get(name, ())), info.torch_dtype, tuple(info.shape), info.start, info.nbytes)


def common_weights(
    reader: ParallelReader, host: HostMap, bundle: SelectedBundle, model: nn.Module, device: torch.device,
    skip: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """``common.safetensors`` in file order, for the model's ``load_weights``.

    Large tensors (embeddings, output head) at TP=1 are read straight into their
    parameters by ``reader`` when a plain copy is all vLLM's weight loader would do
    (:func:`direct_target`), and not yielded; other large tensors are staged on the GPU
    at TP=1. Everything else is yielded as CPU views of the file map for vLLM's weight
    loaders to narrow (TP shards) and copy. The direct copies run first, as one batch. A tensor stored once for several checkpoint
    names (``common_aliases``) goes to each of them, as the checkpoint's loader would. Names in ``skip``
    are loaded already (the loader's ``_bind_common``).
    """
    copies = alias_names(bundle)
    # (name, info, the checkpoint names it still loads) in file order; a tensor all of whose names are loaded is left out.
    ordered = [
        (name, info, names)
        for name, info in sorted(bundle.common_header.tensors.items(), key=lambda kv: kv[1].start)
        if (names := [n for n in (name, *copies.get(name, ())) if n not in skip])
    ]
    whole = device.type == "cuda" and bundle.tp_set.tp_size == 1  # each rank uses whole tensors
    params = dict(model.named_parameters(remove_duplicate=False)) if whole else {}

    def direct_targets(names: list[str], info: TensorInfo) -> dict[int, nn.Parameter] | None:
        """The parameters (by address) a large tensor is copied straight into, or None."""
        if not whole or info.nbytes < LARGE_COMMON:
            return None
        targets = [direct_target(params.get(n), info.shape, info.torch_dtype) for n in names]
        if any(t is None for t in targets):
            return None
        return {t.data_ptr(): t for t in targets}  # type: ignore[union-attr]  # a tied head is the embedding itself

    # The direct copies go first, in one batch: the reader's threads then share all their windows (one
    # tensor at a time, a 2 GB embedding's 8 windows of 256 MiB kept half of 16 threads idle).
    batch: list[CopyItem] = []
    done: set[str] = set()
    filled: set[int] = set()  # a later tensor into a destination already in the batch waits (file order)
    for name, info, names in ordered:
        targets = direct_targets(names, info)
        if targets is not None and filled.isdisjoint(targets):
            batch += [CopyItem(info.start, info.nbytes, t.data) for t in targets.values()]
            filled |= targets.keys()
            done.add(name)
    if batch:
        reader.copy(bundle.common_file, batch)
    for name, info, names in ordered:
        if name in done:
            continue
        targets = direct_targets(names, info)
        if targets is not None:
            reader.copy(bundle.common_file, [CopyItem(info.start, info.nbytes, t.data) for t in targets.values()])
            continue
        # Staged on the GPU where the model holds it: a pipeline stage's vLLM skips the rest, reading nothing.
        if whole and info.nbytes >= LARGE_COMMON and (bundle.stage is None or built_parameters(model, names)):
            t = torch.empty(info.shape, dtype=info.torch_dtype, device=device)
            reader.copy(bundle.common_file, [CopyItem(info.start, info.nbytes, t)])
        else:
            t = host.tensor(info.start, info.nbytes, info.torch_dtype, info.shape)
        for n in names:
            yield n, t


def direct_target(param: nn.Parameter | None, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter | None:
    """``param`` when copying a checkpoint tensor of ``shape``/``dtype`` into its memory is exactly what
    its vLLM weight loader would do at TP=1 (:func:`plain_copy_target`, contiguous), else None."""
    target = plain_copy_target(param, shape, dtype)
    return target if target is not None and target.data.is_contiguous() else None
