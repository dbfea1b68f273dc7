"""marlin-pack: AWQ/GPTQ/compressed-tensors checkpoints converted offline into vLLM's post-processed Marlin/Machete layouts.

Importing this package never imports vLLM (nor torch, until an API that needs it is
touched). Public API::

    from marlin_pack import convert, verify, Manifest
    manifest = convert("llama-awq", tp=(1, 2)).manifest
    report = verify("llama-awq/marlin-pack")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from marlin_pack._version import __version__
from marlin_pack.errors import (
    BundleError,
    BundleMismatchError,
    CheckpointError,
    MarlinPackError,
    OutputExistsError,
    UnsupportedCheckpointError,
)

__all__ = [
    "__version__",
    "convert",
    "verify",
    "read_manifest",
    "Manifest",
    "VerifyReport",
    "MarlinPackError",
    "CheckpointError",
    "UnsupportedCheckpointError",
    "BundleError",
    "BundleMismatchError",
    "OutputExistsError",
]

if TYPE_CHECKING:
    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.conversion import convert
    from marlin_pack.schemas import Manifest
    from marlin_pack.verification import VerifyReport, verify

# Lazy re-exports keep `marlin-pack --help` from paying torch's import time.
_LAZY = {
    "convert": "marlin_pack.conversion",
    "verify": "marlin_pack.verification",
    "VerifyReport": "marlin_pack.verification",
    "read_manifest": "marlin_pack.bundle.reader",
    "Manifest": "marlin_pack.schemas",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'marlin_pack' has no attribute {name!r}")
