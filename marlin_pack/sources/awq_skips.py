"""Which layers vLLM's AutoAWQ leaves unquantized (``modules_to_not_convert``).

vLLM matches the list as *substrings* of its own layer names (``is_layer_skipped(...,
match_mode="substring")``): a fused layer is skipped when an entry is in its own name, else
when an entry is in the names of its parts (``qkv_proj`` -> ``q_proj``, ``k_proj``,
``v_proj``), and then all parts must agree. An empty list is not "nothing": vLLM then fills
it from the checkpoint (``AutoAWQConfig.maybe_update_config``) with every module whose tensors
are all 16/32-bit floats. So an entry such as ``"gate"`` also unquantizes ``gate_up_proj``;
marlin-pack predicts this at convert time instead of writing a bundle the loader refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.sources.checkpoint import Checkpoint

__all__ = ["float_only_modules", "skipping_entry"]

# Safetensors dtype codes vLLM counts as unquantized (torch.float16, bfloat16, float32).
_FLOAT_CODES = frozenset({"F16", "BF16", "F32"})


def float_only_modules(ckpt: Checkpoint) -> tuple[str, ...]:
    """The modules whose tensors are all floats: vLLM's ``modules_to_not_convert`` when the config gives none."""
    modules: set[str] = set()
    quantized: set[str] = set()
    for name, info in ckpt.tensors.items():
        module = name.rsplit(".", 1)[0]
        modules.add(module)
        if info.dtype not in _FLOAT_CODES:
            quantized.add(module)
    return tuple(sorted(modules - quantized))


def _first_hit(name: str, entries: Iterable[str]) -> str | None:
    return next((e for e in entries if e in name), None)


def skipping_entry(name: str, parts: Sequence[str], entries: Sequence[str]) -> str | None:
    """The entry that makes vLLM leave layer ``name`` unquantized, or None if it quantizes it.

    ``parts`` are vLLM's names of a fused layer's parts (empty for a layer of one module).

    Raises:
        UnsupportedCheckpointError: the entries skip some parts of a fused layer but not all,
            which vLLM refuses at start-up.
    """
    hit = _first_hit(name, entries)
    if hit is not None or not parts:
        return hit
    hits = [_first_hit(p, entries) for p in parts]
    if any(h is None for h in hits) and any(h is not None for h in hits):
        skipped = next(p for p, h in zip(parts, hits, strict=True) if h is not None)
        kept = next(p for p, h in zip(parts, hits, strict=True) if h is None)
        raise UnsupportedCheckpointError(
            f"AWQ modules_to_not_convert leaves {skipped} unquantized but not {kept}, which vLLM fuses into {name} "
            "and refuses to mix; list all parts of the fused layer or none"
        )
    return hits[0]
