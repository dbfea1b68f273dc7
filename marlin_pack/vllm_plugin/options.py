"""``--model-loader-extra-config`` of the ``marlin_prepacked`` load format, validated with pydantic.

Four keys, each a real choice of the user's (docs/options.md): where the bundle is, what to do when it
does not fit, how much to hash at start, and whether copy helpers page-lock the bundle ahead of the copy.
Everything else (how the bytes reach the GPU) is decided from the machine, once
(:mod:`marlin_pack.gpu.plan`). An unknown key is refused with the nearest known one.

No vLLM import: the loader's constructor, the weight-cache patches and the tests use it alike.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError, field_validator

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.io.home import HomeDirectoryError, expand_user
from marlin_pack.remote.url import ObjectUrl, parse_url, url_scheme

__all__ = ["LoaderOptions", "OPTION_KEYS", "parse_extra_config"]

_FULL_HASH: dict[str, bool | None] = {"auto": None, "full": True, "size": False}


class LoaderOptions(BaseModel):
    """``--model-loader-extra-config`` of the ``marlin_prepacked`` load format.

    Attributes:
        bundle: bundle directory; default ``MODEL_DIR/marlin-pack`` (a repo id: its marlin-pack cache entry); or
            ``s3://bucket/prefix`` or ``gs://bucket/prefix``, a bundle published there
            (:class:`~marlin_pack.remote.url.ObjectUrl`), each rank streaming its own byte ranges
            (:mod:`~marlin_pack.vllm_plugin.remote_load`).
        fallback: load the checkpoint the ordinary way (with a warning) instead of refusing a missing,
            stale or mismatched bundle.
        verify: ``auto`` hashes files whose stamp (identity, size, times) changed since this user last
            hashed them, ``full`` hashes everything at every start, ``size`` checks sizes and headers only.
        preload: where the bundle is copied with copy helpers (one GPU), they page-lock it while vLLM sets
            up (an engine's worker, a weight-cache daemon as it starts), so the copy does not page-lock.
            Costs their CUDA contexts (~0.5 GiB each) on the GPU until the KV cache is sized and the
            bundle's pages pinned in host memory meanwhile; ``false`` gives both back at a slower copy.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle: Path | ObjectUrl | None = None
    fallback: StrictBool = False
    verify: Literal["auto", "full", "size"] = "auto"
    preload: StrictBool = True

    @field_validator("bundle", mode="before")
    @classmethod
    def _bundle(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, ObjectUrl):
            return value
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError("must be a directory path")
        if url_scheme(value) is not None:
            return parse_url(value)  # s3:// or gs://bucket/prefix; another scheme refused in one line naming what is served
        try:
            return expand_user(os.fspath(value), "bundle")
        except HomeDirectoryError as e:  # "~nosuchuser/x", or "~/x" for a user without a home directory
            raise ValueError(str(e)) from e

    @property
    def remote(self) -> ObjectUrl | None:
        """The bucket prefix the bundle is published at, or None (a local directory)."""
        return self.bundle if isinstance(self.bundle, ObjectUrl) else None

    @property
    def full_hash(self) -> bool | None:
        return _FULL_HASH[self.verify]


OPTION_KEYS: tuple[str, ...] = tuple(LoaderOptions.model_fields)
# Keys of earlier releases: how the bytes reach the GPU is now decided from the machine (marlin_pack.gpu.plan).
REMOVED_KEYS = frozenset({
    "io_threads", "chunk_mb", "io_mode", "io_processes", "copy_during_build", "common_during_build", "common_io",
    "io_own_share", "io_staged", "io_stage_mib", "io_defer_unregister", "io_common_by_helpers", "io_helper_nice",
    "io_helper_service",
})
_RENAMED = {"engine_preload": "preload", "daemon_preload": "preload"}


def _unknown(key: str, load_format: str) -> str:
    near = [_RENAMED[key]] if key in _RENAMED else difflib.get_close_matches(key, OPTION_KEYS, n=1, cutoff=0.5)
    hint = f"did you mean {near[0]!r}? " if near else ""
    if key in REMOVED_KEYS:
        hint = "it was removed: how the bundle reaches the GPU is decided from the machine; drop it. "
    return (
        f"model_loader_extra_config has an unknown key {key!r} for load format {load_format}; {hint}"
        f"expected some of {', '.join(OPTION_KEYS)} (docs/options.md)"
    )


def parse_extra_config(extra: object, load_format: str = LOAD_FORMAT) -> LoaderOptions:
    """Validate ``model_loader_extra_config`` as vLLM's own loaders do: one line naming the key and what it takes.

    Raises:
        ValueError: not a dict, an unknown key (with the nearest known one), or a value of the wrong type.
    """
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config must be a dict for load format {load_format}, got {type(extra).__name__}"
        )
    for key in extra:
        if key not in OPTION_KEYS:
            raise ValueError(_unknown(str(key), load_format))
    try:
        return LoaderOptions(**extra)
    except ValidationError as e:
        error = e.errors()[0]
        key = ".".join(map(str, error["loc"])) or "?"
        expected = {
            "bundle": "a directory path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX", "fallback": "true or false", "preload": "true or false",
            "verify": "one of 'auto', 'full', 'size'",
        }.get(key, "another value")
        raise ValueError(
            f"model_loader_extra_config[{key!r}] must be {expected}, got {error.get('input')!r} ({error['msg']})"
        ) from None
