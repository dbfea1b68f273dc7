"""Error hierarchy. Every message says what was found, what was expected and what to do.

A message quotes paths, manifest strings and tensor names as they are; its text (``str(error)``) shows
them with their control characters escaped (:func:`~marlin_pack.shown.shown`), wherever it is printed:
the CLI, a log line, or vLLM's report of a refusal.
"""

from __future__ import annotations

from enum import Enum, unique

from marlin_pack.shown import shown

__all__ = [
    "SERVE_WITHOUT",
    "RESTORE_CONFIG",
    "MarlinPackError",
    "CheckpointError",
    "UnsupportedCheckpointError",
    "BundleError",
    "MismatchField",
    "BundleMismatchError",
    "LoadRefusedError",
    "OutputExistsError",
]


class MarlinPackError(Exception):
    """Base class of every error marlin-pack raises on bad input; its text is one line, safe to show."""

    def __str__(self) -> str:
        return shown(super().__str__())


class CheckpointError(MarlinPackError):
    """The source checkpoint is missing, unreadable, truncated or inconsistent."""


class UnsupportedCheckpointError(MarlinPackError, ValueError):
    """The checkpoint is valid but vLLM would not serve it through Marlin."""


# What to do where vLLM may still serve the checkpoint its own way: the end of such a refusal.
SERVE_WITHOUT = "serve it without --load-format marlin_prepacked (vLLM picks its own kernel, if one takes it)"
# What to do where the checkpoint's config.json holds what no model has: the end of such a refusal.
RESTORE_CONFIG = "restore the checkpoint's config.json"


class BundleError(MarlinPackError):
    """A bundle is missing, malformed, corrupt or does not match its source."""


@unique
class MismatchField(str, Enum):
    """What a :class:`BundleMismatchError` names: a manifest field or an engine setting."""

    bundle = "bundle"  # where the bundle is (or is not)
    manifest = "manifest"
    files = "files"  # the bundle's own files: sizes, hashes, headers
    source = "source"
    source_settings = "source.quant_settings"
    source_files = "source.files"
    source_size = "source.size"
    source_header = "source.header"
    source_blake3 = "source.blake3"
    source_sample = "source.sample"  # samples of every tensor's bytes (marlin_pack.io.sampling)
    format_version = "format_version"
    vllm_version = "vllm_version"
    kernel = "kernel"
    layout = "layout"
    layers = "layers"
    tp_size = "tp_size"
    tp_rank = "tp_rank"
    pp_size = "pp_size"
    dp_size = "dp_size"
    ep_size = "ep_size"  # --enable-expert-parallel: the GPUs experts are placed over
    serving_dtype = "serving_dtype"
    activation_dtype = "activation_dtype"
    quant_method = "quant_method"
    linear_backend = "linear_backend"
    group_size = "group_size"
    weight_type = "weight_type"
    zero_points = "zero_points"
    transformers_version = "transformers_version"  # the transformers vLLM's Transformers backend builds layers from

    def __str__(self) -> str:  # f"[{field}]" prints the wire name on every Python version
        return self.value

    __format__ = str.__format__


class BundleMismatchError(BundleError):
    """A bundle is intact but does not fit this engine or source.

    Attributes:
        field: the manifest field or engine setting that does not match (e.g. ``tp_size``).
    """

    def __init__(self, field: MismatchField | str, message: str) -> None:
        super().__init__(message)
        self.field = MismatchField(field)


class LoadRefusedError(BundleMismatchError):
    """The ``marlin_prepacked`` loader will not serve the bundle (and ``fallback`` is off)."""


class OutputExistsError(MarlinPackError):
    """The output location exists and ``force`` was not given."""
