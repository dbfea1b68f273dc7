"""Cheaper per-layer bookkeeping while vLLM builds a model, for marlin-pack's start paths.

An ``ipc_cache`` engine spends most of "Model loading took" building the model on ``meta``, and
so does the ``marlin_prepacked`` loader's create phase. vLLM does three things per layer
whose cost grows with the size of the whole model. For GPTQ, per linear, attention and experts
layer (and again per attention layer in its post-processing), with the *quantized modules of the
whole checkpoint* (``AutoGPTQConfig.modules_in_block_to_quantize``, filled from the safetensors
headers: 18,624 names for Qwen3-30B-A3B's 48 x 128 experts):

* ``get_linear_quant_method`` / ``get_moe_quant_method`` deep-copy the quant config, list
  included, so that ``override_config`` can apply the layer's ``dynamic`` rules to a private copy.
  Without dynamic rules ``override_config`` assigns every field the value it already has, and
  the layer's quant method reads only scalar fields (``quant_type``, ``group_size``,
  ``pack_factor``, ``is_sym``, ``weight_bits``, ``desc_act``). Then a shallow copy, a distinct
  config object per layer as before, with the same values, is all the copy is for
  (:func:`copy_is_enough`); otherwise vLLM's deep copy runs.
* ``is_layer_gptq_quantized`` flattens that list and tests each name as a substring of the
  layer's (shard) prefixes. The same answer comes from the names equal to a substring of those
  prefixes, found in a set (:class:`NameIndex`); vLLM's function then runs on those names alone
  (plus one name too long to be a substring of anything tested, which keeps the list non-empty
  exactly when the checkpoint's is).

For every model, per module, ``record_metadata_for_reloading`` collects the storage pointers of
all parameters below it (``_parameter_storage_ptrs``), which vLLM reads only to tell whether a
*non-persistent buffer* of that module aliases a parameter. A module without non-persistent
buffers (almost all of them) gets the empty set: nothing reads it. The same function asks
``torch.get_default_device()`` twice per module (889 modules for a 70B llama); under the ``meta``
device context of the build each answer walks the torch-function mode stack (0.016 s of the
record's 0.033 s on a 2-core CPU). The device cannot change inside the loop, so it is asked once
and the record is otherwise vLLM's (:func:`_record`).

``speed`` patches (:mod:`.catalog`), acting only inside marlin-pack's scope (:mod:`.scope`: a
``marlin_prepacked`` or ``ipc_cache`` engine's load, a weight-cache daemon's fill); outside it each calls
vLLM's original with the same arguments. None of them changes what vLLM builds
(tests/vllm_plugin/patches/test_construct.py compares every module, quant method, parameter, buffer and
reload record of models built with and without them).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from marlin_pack.vllm_plugin.patches import catalog, scope

__all__ = ["PATCHES", "NameIndex", "copy_is_enough"]

_GPTQ_UTILS = "vllm.model_executor.layers.quantization.utils.gptq_utils"
_AUTO_GPTQ = "vllm.model_executor.layers.quantization.auto_gptq"


def copy_is_enough(config: Any) -> bool:
    """True when ``override_config`` cannot change any field of ``config``: an exact ``AutoGPTQConfig``
    without dynamic rules whose derived fields are what its constructor derives from the others."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    if type(config) is not AutoGPTQConfig or config.dynamic:
        return False
    bits, group_size = config.weight_bits, config.group_size
    return (
        isinstance(bits, int)
        and bits > 0
        and config.pack_factor == 32 // bits
        and config.TYPE_MAP.get((bits, config.is_sym)) == config.quant_type
        and not (config.desc_act and group_size == -1)
    )


def _config_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    """For the module-level ``deepcopy`` of gptq_utils / auto_gptq (each module's only use is the quant config)."""

    @functools.wraps(original)
    def deepcopy(x: Any, memo: dict[int, Any] | None = None) -> Any:
        if memo is None and scope.active() and copy_is_enough(x):
            return copy.copy(x)
        return original(x, memo)

    return deepcopy


@dataclass(frozen=True)
class NameIndex:
    """The flat list of module names ``is_layer_gptq_quantized`` searches, as a set (plus the name lengths)."""

    source: list[str]  # the list indexed; reused only while it is unchanged (equal to the snapshot)
    snapshot: list[str]
    names: frozenset[str]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, names: Any) -> NameIndex | None:
        """The index of a list of ``str`` (None for anything else: vLLM's own code handles it)."""
        if type(names) is not list or not all(type(n) is str for n in names):
            return None
        return cls(names, list(names), frozenset(names), tuple(sorted({len(n) for n in names})))

    def within(self, texts: Iterable[str]) -> set[str]:
        """The names that are a substring of one of ``texts`` (``name in text``)."""
        found: set[str] = set()
        for text in texts:
            for size in self.lengths:
                if size > len(text):
                    break
                found.update(part for i in range(len(text) - size + 1) if (part := text[i : i + size]) in self.names)
        return found


_LAST: list[NameIndex] = []  # the index of the last list seen (a model's layers all pass their config's list)


def _index(names: Any) -> NameIndex | None:
    # Same list object, same items (a fast pointer comparison): the index still holds.
    if _LAST and _LAST[0].source is names and _LAST[0].snapshot == names:
        return _LAST[0]
    index = NameIndex.of(names)
    _LAST[:] = [] if index is None else [index]
    return index


def _layer_quantized(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def is_layer_gptq_quantized(prefix: str, quantized_layers: Any, fused_mapping: Mapping[str, Any] | None = None) -> bool:
        args = () if fused_mapping is None else (fused_mapping,)
        index = _index(quantized_layers) if scope.active() else None
        if index is None or not index.names or not isinstance(prefix, str):
            return original(prefix, quantized_layers, *args)
        proj = prefix.split(".")[-1]
        try:
            # Every string vLLM may test: the prefix, or its shard prefixes for a fused layer.
            texts = [prefix, *(prefix.replace(proj, shard) for shard in (fused_mapping or {}).get(proj, ()))]
        except Exception:  # an unusual fused mapping: vLLM's own code decides (and raises what it raises)
            return original(prefix, quantized_layers, *args)
        never_inside = "\0" * (max(map(len, texts)) + 1)
        return original(prefix, [*sorted(index.within(texts)), never_inside], *args)

    return is_layer_gptq_quantized


def _storage_ptrs(original: Callable[[Any], set[int]]) -> Callable[[Any], set[int]]:
    @functools.wraps(original)
    def _parameter_storage_ptrs(layer: Any) -> set[int]:
        # vLLM reads the set only for the layer's non-persistent buffers (_is_non_persistent_parameter_alias_buffer).
        if scope.active() and not layer._non_persistent_buffers_set:
            return set()
        return original(layer)

    return _parameter_storage_ptrs


def _record(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``record_metadata_for_reloading`` with the default device asked once for the whole model.

    Per module the same entry as vLLM's: ``restore_metadata`` from vLLM's own
    ``capture_layer_to_meta``, ``restore_device`` the default device; an entry that exists is updated.
    """

    @functools.wraps(original)
    def record_metadata_for_reloading(model: Any) -> None:
        if not scope.active():
            return original(model)
        import torch
        from vllm.model_executor.model_loader.reload import layerwise, meta
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        device = torch.get_default_device()
        infos = layerwise.LAYERWISE_INFO
        for layer in model.modules():
            captured = meta.capture_layer_to_meta(layer)
            info = infos.get(layer)
            if info is None:
                infos[layer] = LayerReloadingInfo(restore_metadata=captured, restore_device=device)
            else:
                info.restore_metadata, info.restore_device = captured, device
        return None

    return record_metadata_for_reloading


PATCHES = catalog.patches(
    __name__,
    {
        f"{_GPTQ_UTILS}:deepcopy": _config_copy,
        f"{_AUTO_GPTQ}:deepcopy": _config_copy,
        f"{_GPTQ_UTILS}:is_layer_gptq_quantized": _layer_quantized,
        "vllm.model_executor.model_loader.reload.meta:_parameter_storage_ptrs": _storage_ptrs,
        "vllm.model_executor.model_loader.utils:record_metadata_for_reloading": _record,
    },
)
