"""Error hierarchy. Every message says what was found, what was expected and what to do."""

__all__ = [
    "MarlinPackError",
    "CheckpointError",
    "UnsupportedCheckpointError",
    "BundleError",
    "BundleMismatchError",
    "OutputExistsError",
]


class MarlinPackError(Exception):
    """Base class of every error marlin-pack raises on bad input."""


class CheckpointError(MarlinPackError):
    """The source checkpoint is missing, unreadable, truncated or inconsistent."""


class UnsupportedCheckpointError(MarlinPackError, ValueError):
    """The checkpoint is valid but vLLM 0.33.0 would not serve it through Marlin."""


class BundleError(MarlinPackError):
    """A bundle is missing, malformed, corrupt or does not match its source."""


class BundleMismatchError(BundleError):
    """A bundle is intact but does not fit this engine or source.

    Attributes:
        field: the manifest field that does not match (e.g. ``tp_size``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class OutputExistsError(MarlinPackError):
    """The output location exists and ``force`` was not given."""
