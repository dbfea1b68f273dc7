"""Which vLLM is running, read cheaply (before any vLLM internal is imported)."""

from __future__ import annotations

from marlin_pack._constants import TARGET_VLLM_VERSION

__all__ = ["vllm_version", "is_target_vllm"]


def vllm_version() -> str:
    """The running vLLM's release (local build suffixes such as ``+cu130`` dropped)."""
    import vllm

    return str(vllm.__version__).split("+")[0]


def is_target_vllm() -> bool:
    """Whether the running vLLM is exactly the release the bundle layout and the patches target."""
    return vllm_version() == TARGET_VLLM_VERSION
