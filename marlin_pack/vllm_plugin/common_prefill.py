"""The bundle's large common tensors (embedding, output head) copied beside the model's construction.

At TP=1 the loader reads the large tensors of ``common.safetensors`` straight into their parameters
where vLLM's weight loader would only copy them (:func:`plain_copy_target`). With the option
``common_during_build`` it starts those copies before vLLM builds the model, into device tensors of
their own (:meth:`CommonPrefill.allocate`), in the same background job as the rank file, while
vLLM's embedding method makes memory-less stubs (:mod:`.patches.placeholders`). Once the model is
built, :meth:`CommonPrefill.bind` points the parameters at those tensors; a tensor it cannot bind
goes the ordinary way (vLLM's weight loader) and its copy is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from marlin_pack.gpu.reader import CopyItem
from marlin_pack.io.safetensors_io import TensorInfo
from marlin_pack.vllm_plugin.decision import SelectedBundle

__all__ = ["CommonPrefill", "PLAIN_COPY_LOADERS", "PrefillSlot", "alias_names", "plain_copy_target"]

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
