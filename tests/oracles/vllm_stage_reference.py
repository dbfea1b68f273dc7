"""Oracle for pipeline stages: what vLLM's own model classes hold and load on one (stage, TP rank).

Built as :mod:`vllm_reference` (dense) and :mod:`vllm_moe_reference` (experts) build a TP rank, with the
stand-in pipeline group of ``pp=(size, stage)``: the layers and the ``PPMissingLayer`` placeholders are
vLLM's (``make_layers``, each class's ``is_first_rank``/``is_last_rank`` choices), and so is the loading.

* :func:`stage_params`: every parameter of the stage model after vLLM's default loading of the whole
  checkpoint (its own ``load_weights``, which skips what the stage lacks) and ``process_weights_after_loading``.
* :func:`stage_loads`: which of the given checkpoint names the stage's ``load_weights`` loads (fed one by one).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import vllm_moe_reference as vmr
from . import vllm_reference as vr

__all__ = ["is_moe", "stage_model", "stage_loads", "stage_params"]


def is_moe(model_dir: Path) -> bool:
    from marlin_pack.marlin.architectures import architecture_for

    arch = architecture_for((json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0])
    return bool(arch and arch.moe)


@contextlib.contextmanager
def stage_model(model_dir: Path, tp: int, rank: int, dtype: torch.dtype, pp: tuple[int, int],
                build: bool = True) -> Iterator[tuple[Any, Any]]:
    """Inside the oracle's patches for ``(tp, rank)`` and pipeline ``pp``: vLLM's stage model and its ModelConfig
    (``build=False``: none, only the patches, as a loader under test builds the model itself)."""
    model_dir = Path(model_dir)
    if is_moe(model_dir):
        with vr._LOCK, vmr._moe_patched(tp, rank, pp=pp) as m, m.base.set_default_torch_dtype(dtype):
            yield vmr._build(model_dir, tp, dtype, m, "marlin") if build else (None, None)
    else:
        with vr._LOCK, vr._patched(tp, rank, pp=pp) as v, v.set_default_torch_dtype(dtype):
            yield vr.vllm_model(model_dir, tp, rank, dtype, v) if build else (None, None)


def stage_params(model_dir: Path, tp: int, rank: int, dtype: torch.dtype, pp: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every parameter (duplicates under each name) of vLLM's stage model, loaded from the checkpoint the
    ordinary way and post-processed; CPU copies."""
    with stage_model(model_dir, tp, rank, dtype, pp) as (model, model_config):
        model.load_weights(vr._all_tensors(Path(model_dir)))
        vr._vllm().process_weights_after_loading(model, model_config, torch.device("cpu"))
        return {n: p.data.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def stage_loads(model_dir: Path, tp: int, rank: int, dtype: torch.dtype, pp: tuple[int, int],
                tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """The names of ``tensors`` (checkpoint names) that vLLM's stage model loads: each fed alone to its
    ``load_weights``, loaded when that changed a parameter (all filled with a sentinel first). What
    ``load_weights`` returns is not used: DeepSeek-V2's reports names it skipped as missing on the stage."""
    sentinel = 7
    loaded = set()
    with stage_model(model_dir, tp, rank, dtype, pp) as (model, _):
        params = [p for _, p in model.named_parameters()]
        for p in params:
            p.data.fill_(sentinel)
        for name, t in tensors:
            model.load_weights([(name, t)])
            changed = [p for p in params if p.numel() and not bool((p.data == sentinel).all())]
            if changed:
                loaded.add(name)
                for p in changed:
                    p.data.fill_(sentinel)
    return loaded
