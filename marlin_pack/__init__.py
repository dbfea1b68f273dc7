"""marlin-pack: AWQ/GPTQ checkpoints converted offline into vLLM 0.33.0's Marlin layout.

Importing this package never imports vLLM. Public API::

    from marlin_pack import convert, verify, inspect_bundle, Manifest
"""

from __future__ import annotations

__version__ = "0.1.0"

from marlin_pack.convert import convert  # noqa: E402
from marlin_pack.errors import (  # noqa: E402
    BundleError,
    BundleMismatchError,
    CheckpointError,
    MarlinPackError,
    OutputExistsError,
    UnsupportedCheckpointError,
)
from marlin_pack.schemas import Manifest  # noqa: E402

__all__ = [
    "__version__",
    "convert",
    "Manifest",
    "MarlinPackError",
    "CheckpointError",
    "UnsupportedCheckpointError",
    "BundleError",
    "BundleMismatchError",
    "OutputExistsError",
]
