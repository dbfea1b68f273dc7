"""Which vLLM is running, read cheaply (before any vLLM internal is imported). Whether marlin-pack serves it is the
release table's to say (:mod:`.releases`)."""

from __future__ import annotations

__all__ = ["vllm_version"]


def vllm_version() -> str:
    """The running vLLM's release (local build suffixes such as ``+cu130`` dropped)."""
    import vllm

    return str(vllm.__version__).split("+")[0]

