"""What marlin-pack's vLLM plugin patches, as plain rows, and the versions around it (for ``marlin-pack env``).

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

__all__ = ["PURPOSES", "patch_rows", "environment"]

# The purposes, in the order patch_rows() lists them (as marlin_pack.vllm_plugin.patches.registry.PURPOSES).
PURPOSES = ("correctness", "weight_cache", "speed")


def patch_rows(release: str | None = None) -> list[tuple[str, str, str]]:
    """Every patch as ``(purpose, target, remove_when)``, grouped by purpose in :data:`PURPOSES` order; with
    ``release`` (a vLLM release marlin-pack serves), only the rows installed on it.

    ``purpose``: ``correctness`` (a bundle is loaded right), ``weight_cache`` (vLLM's weight cache works
    for AWQ/GPTQ/compressed-tensors Marlin layers) or ``speed`` (a faster start; inert in processes that
    do not use marlin-pack). ``target``: ``"vllm.module:Owner.attribute"`` or ``"vllm.module:function"``.
    ``remove_when``: the upstream vLLM change after which the patch can go.
    """
    from marlin_pack.vllm_plugin.patches import catalog

    rank = {purpose: i for i, purpose in enumerate(PURPOSES)}
    rows = [row for row in catalog.ROWS if release is None or row.applies_to(release)]
    rows = sorted(rows, key=lambda row: rank[row.purpose])  # stable: catalog order within a purpose
    return [(row.purpose, row.target, row.remove_when) for row in rows]


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, object]:
    """What a bug report needs, read without importing vLLM: versions of marlin-pack, vLLM, torch and its CUDA,
    the GPU torch sees, and whether vLLM finds the plugin (its ``vllm.general_plugins`` entry point) and would
    activate it (marlin-pack supports the installed vLLM release: :mod:`marlin_pack.vllm_plugin.releases`)."""
    from importlib.metadata import entry_points

    from marlin_pack._version import __version__
    from marlin_pack.vllm_plugin import releases

    vllm = _installed("vllm")
    plugins = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "marlin_pack"]
    facts: dict[str, object] = {
        "marlin_pack": __version__,
        "vllm": vllm,
        "vllm_supported": releases.supported_text(),
        "vllm_release": "not installed" if vllm == "not installed" else (
            "supported" if releases.release(vllm) is not None else "not supported: the plugin patches nothing"),
        "torch": _installed("torch"),
        "plugin_entry_point": plugins[0].value if plugins else "missing (reinstall marlin-pack into vLLM's environment)",
        "plugin_active": bool(plugins) and releases.release(vllm) is not None,
    }
    try:
        import torch

        facts["torch_cuda"] = torch.version.cuda or "none (CPU build)"
        if torch.cuda.is_available():
            facts["gpu"] = f"{torch.cuda.get_device_name(0)} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))})"
        else:
            facts["gpu"] = "none visible"
    except Exception as e:  # noqa: BLE001 - a broken torch is a fact for the report, not a crash
        facts["torch_cuda"] = f"unknown ({type(e).__name__}: {e})"
    return facts
