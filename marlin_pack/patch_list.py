"""What marlin-pack's vLLM plugin patches, as plain rows (for ``marlin-pack env``).

The rows come from the data the patch modules themselves are built from
(:mod:`marlin_pack.vllm_plugin.patches.catalog`), so the listing is what ``register()`` installs on the
targeted vLLM release. Importing this module, or calling :func:`patch_rows`, imports neither vLLM nor
torch: the CLI stays fast and works where vLLM is not installed.

Example:
    >>> from marlin_pack.patch_list import patch_rows
    >>> purpose, target, remove_when = patch_rows()[0]
    >>> purpose
    'correctness'
"""

from __future__ import annotations

__all__ = ["PURPOSES", "patch_rows"]

# The purposes, in the order patch_rows() lists them (as marlin_pack.vllm_plugin.patches.registry.PURPOSES).
PURPOSES = ("correctness", "weight_cache", "speed")


def patch_rows() -> list[tuple[str, str, str]]:
    """Every patch as ``(purpose, target, remove_when)``, grouped by purpose in :data:`PURPOSES` order.

    ``purpose``: ``correctness`` (a bundle is loaded right), ``weight_cache`` (vLLM's weight cache works
    for AWQ/GPTQ/compressed-tensors Marlin layers) or ``speed`` (a faster start; inert in processes that
    do not use marlin-pack). ``target``: ``"vllm.module:Owner.attribute"`` or ``"vllm.module:function"``.
    ``remove_when``: the upstream vLLM change after which the patch can go.
    """
    from marlin_pack.vllm_plugin.patches import catalog

    rank = {purpose: i for i, purpose in enumerate(PURPOSES)}
    rows = sorted(catalog.ROWS, key=lambda row: rank[row.purpose])  # stable: catalog order within a purpose
    return [(row.purpose, row.target, row.remove_when) for row in rows]
