"""``--model-loader-extra-config`` of the ``marlin_prepacked`` load format, parsed and validated.

No vLLM import: the loader's constructor and the tests use it alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from marlin_pack._constants import LOAD_FORMAT

__all__ = ["COMMON_IOS", "CommonIo", "IO_MODES", "IoMode", "LoaderOptions", "OPTION_KEYS", "OWN_SHARES", "OwnShare", "parse_extra_config"]

Verify = Literal["auto", "full", "size"]
IoMode = Literal["auto", "staged", "registered", "hybrid", "processes"]
IO_MODES: tuple[str, ...] = ("auto", "staged", "registered", "hybrid", "processes")  # see vllm_plugin/gpu_reader.py
OwnShare = Literal["during_build", "after_build", "none"]
OWN_SHARES: tuple[str, ...] = ("during_build", "after_build", "none")
CommonIo = Literal["with_rank_file", "staged"]
COMMON_IOS: tuple[str, ...] = ("with_rank_file", "staged")
_FULL_HASH: dict[str, bool | None] = {"auto": None, "full": True, "size": False}


@dataclass(frozen=True)
class LoaderOptions:
    """``--model-loader-extra-config`` of the ``marlin_prepacked`` load format.

    Attributes:
        bundle: bundle directory; default ``MODEL_DIR/marlin-pack``.
        fallback: load the checkpoint the ordinary way (with a warning) instead of
            refusing a missing, stale or mismatched bundle.
        verify: ``auto`` hashes files whose (size, mtime) stamp changed since the last
            check, ``full`` hashes everything, ``size`` checks sizes and headers only.
        io_threads: reader threads (each with its own CUDA stream); default per mode. With
            helpers, each helper's registered threads; 0 (only with ``io_staged`` >= 1) leaves
            the whole copy to the staging threads: no page-locking at all while loading.
        chunk_mb: size of one read / host-to-device copy window, in MiB; default per mode.
        io_mode: how a window reaches the GPU: ``staged`` (read into pinned buffers),
            ``registered`` (page-lock the mapped file in place), ``hybrid`` (half the
            threads each way), ``processes`` (registered in ``io_processes`` helper
            processes of ``io_threads`` threads each) or ``auto`` (staged for a file on
            a tmpfs without huge pages, else processes where helpers help, see ``gpu_reader.helpers_help``, else
            registered).
        io_processes: helper processes of the ``processes`` mode; default 4.
        copy_during_build: start copying the rank file into its device memory before vLLM
            builds the model (whose quantized placeholders then take no memory), so the copy
            runs beside the construction; ``false`` copies after it. Bundles with experts
            layers always copy after it.
        common_during_build: with ``copy_during_build`` at TP=1, also copy the large common tensors
            (embedding, output head) beside the construction, into tensors of their own that their
            parameters are then pointed at (vLLM's embedding method makes no placeholders meanwhile),
            instead of reading them once the model is built. Default: on in a weight-cache daemon's
            fill that copies with helpers (with ``io_defer_unregister``, fill 1.28-1.48 s against
            1.57-1.78 s for a 70B on an H200), off in an engine and without helpers.
        common_io: with ``common_during_build``, who copies those common tensors: the rank file's
            reader once the rank file is copied (``with_rank_file``, the default; with helpers,
            the helpers), or this process at the same time as the rank file, through pinned
            buffers (``staged``: no pages pinned in the engine's process beside the construction).
        io_own_share: with helpers (``processes``), whether the engine's process copies a share of
            the rank file too: not at all (``none``, the default: the helpers copy everything;
            pages pinned in the engine's process slow its own work beside the copy, vLLM's
            construction, the placing of the tensors, the common tensors), once vLLM has built
            the model (``after_build``) or from the start (``during_build``). With
            ``common_during_build`` and ``common_io`` ``with_rank_file`` (one job for the rank file
            and the common tensors) the helpers copy everything.
        io_staged: with helpers, staging threads per helper beside its registered ones (pinned
            buffers, a CPU copy per byte instead of page-locking); default 0.
        io_stage_mib: with ``io_staged``, the size of each of a staging thread's two pinned buffers,
            in MiB (1..256, default 64); a helper allocates them before it is ready, so smaller
            buffers make it ready sooner.
        io_defer_unregister: with helpers, keep the registered windows page-locked until a
            helper's whole share is copied, unregistering them after it answers. Default: on in a
            weight-cache daemon's fill (its helpers exit in the background), off in an engine (which
            waits for its helpers to exit before vLLM measures the free memory).
        io_common_by_helpers: with helpers and the copy beside the construction, the helpers also
            copy the large common tensors (embedding, head) once they are done with the rank
            file, instead of this process reading them beside them.
        io_helper_nice: with helpers, the niceness they add to their own (``os.nice``), so that
            vLLM's own work beside the copy (building the model, placing, the common tensors)
            keeps its CPU time; 0..19, default 0.
        io_helper_service: with helpers, use the helpers of ``marlin-pack helpers`` where it serves this
            GPU (ready at once, and not waited for after loading; their settings are the service's,
            so ``io_processes``, ``io_staged``, ``io_stage_mib``, ``io_defer_unregister`` and
            ``io_helper_nice`` do not apply to them); ``false`` always starts the engine's own.
            Default true; without a service the engine starts its own.
        daemon_preload: in a weight-cache daemon (``vllm preload``, ``marlin-pack daemon``) of one GPU whose
            fill copies with helpers: start those helpers as the daemon process starts and page-lock the
            bundle in them while vLLM is still importing and configuring, so that the fill copies without
            page-locking (see :mod:`.preload`). Default true; no effect in engines.
        engine_preload: in an engine of one GPU whose loader copies with helpers: start those helpers as vLLM's
            GPU worker begins setting up and page-lock the bundle in them beside that set-up and the model's
            construction, so that the copy does not page-lock; they live until the KV cache is sized (their
            CUDA contexts, ~0.5 GiB each, are counted as another process's memory). Only where the GPU keeps
            room for them above ``--gpu-memory-utilization``. Default true; no effect in daemons.
    """

    bundle: Path | None = None
    fallback: bool = False
    verify: Verify = "auto"
    # None: the measured defaults of the mode used (vllm_plugin/gpu_reader.py MODE_DEFAULTS).
    io_threads: int | None = None
    chunk_mb: int | None = None
    io_mode: IoMode = "auto"
    io_processes: int | None = None
    copy_during_build: bool = True
    common_during_build: bool | None = None  # None: on in a weight-cache daemon's fill, off in an engine
    common_io: CommonIo = "with_rank_file"
    io_own_share: OwnShare = "none"
    io_staged: int = 0
    io_stage_mib: int = 64
    io_defer_unregister: bool | None = None  # None: as common_during_build
    io_common_by_helpers: bool = False
    io_helper_nice: int = 0
    io_helper_service: bool = True
    daemon_preload: bool = True
    engine_preload: bool = True

    @property
    def full_hash(self) -> bool | None:
        return _FULL_HASH[self.verify]


OPTION_KEYS = (
    "bundle", "fallback", "verify", "io_threads", "chunk_mb", "io_mode", "io_processes", "copy_during_build", "common_during_build",
    "common_io", "io_own_share", "io_staged", "io_stage_mib", "io_defer_unregister", "io_common_by_helpers", "io_helper_nice",
    "io_helper_service", "daemon_preload", "engine_preload",
)


def _int_option(extra: Mapping[str, Any], key: str, default: int | None, high: int) -> int | None:
    value = extra.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"model_loader_extra_config[{key!r}] must be an integer in 1..{high}, got {value!r}")
    return value


def parse_extra_config(extra: object, load_format: str = LOAD_FORMAT) -> LoaderOptions:
    """Validate ``model_loader_extra_config`` the way vLLM's own loaders do.

    Raises:
        ValueError: not a dict, an unknown key, or a value of the wrong type.
    """
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config must be a dict for load format {load_format}, "
            f"got {type(extra).__name__}"
        )
    unexpected = sorted(set(extra) - set(OPTION_KEYS))
    if unexpected:
        raise ValueError(
            f"Unexpected extra config keys for load format {load_format}: {unexpected}; "
            f"expected some of {list(OPTION_KEYS)}"
        )
    bundle = extra.get("bundle")
    if bundle is not None and (not isinstance(bundle, (str, os.PathLike)) or not str(bundle)):
        raise ValueError(f"model_loader_extra_config['bundle'] must be a directory path, got {bundle!r}")
    fallback = extra.get("fallback", False)
    if not isinstance(fallback, bool):
        raise ValueError(f"model_loader_extra_config['fallback'] must be true or false, got {fallback!r}")
    during_build = extra.get("copy_during_build", LoaderOptions.copy_during_build)
    if not isinstance(during_build, bool):
        raise ValueError(f"model_loader_extra_config['copy_during_build'] must be true or false, got {during_build!r}")
    flags = {}
    for key in ("io_defer_unregister", "io_common_by_helpers", "common_during_build", "io_helper_service", "daemon_preload",
                "engine_preload"):
        flags[key] = extra.get(key, getattr(LoaderOptions, key))  # a default may be None (decided where it is used)
        if key in extra and not isinstance(flags[key], bool):
            raise ValueError(f"model_loader_extra_config[{key!r}] must be true or false, got {flags[key]!r}")
    staged = extra.get("io_staged", LoaderOptions.io_staged)
    if isinstance(staged, bool) or not isinstance(staged, int) or not 0 <= staged <= 16:
        raise ValueError(f"model_loader_extra_config['io_staged'] must be an integer in 0..16, got {staged!r}")
    nice = extra.get("io_helper_nice", LoaderOptions.io_helper_nice)
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValueError(f"model_loader_extra_config['io_helper_nice'] must be an integer in 0..19, got {nice!r}")
    verify = extra.get("verify", "auto")
    if verify not in _FULL_HASH:
        raise ValueError(
            f"model_loader_extra_config['verify'] must be one of {list(_FULL_HASH)}, got {verify!r}"
        )
    io_mode = extra.get("io_mode", LoaderOptions.io_mode)
    if io_mode not in IO_MODES:
        raise ValueError(f"model_loader_extra_config['io_mode'] must be one of {list(IO_MODES)}, got {io_mode!r}")
    own_share = extra.get("io_own_share", LoaderOptions.io_own_share)
    if own_share not in OWN_SHARES:
        raise ValueError(f"model_loader_extra_config['io_own_share'] must be one of {list(OWN_SHARES)}, got {own_share!r}")
    common_io = extra.get("common_io", LoaderOptions.common_io)
    if common_io not in COMMON_IOS:
        raise ValueError(f"model_loader_extra_config['common_io'] must be one of {list(COMMON_IOS)}, got {common_io!r}")
    try:
        bundle_dir = Path(bundle).expanduser() if bundle is not None else None
    except RuntimeError as e:  # "~nosuchuser/x": no such user's home
        raise ValueError(f"model_loader_extra_config['bundle'] is {bundle!r}: {e}") from e
    staging_only = type(extra.get("io_threads")) is int and extra.get("io_threads") == 0
    if staging_only and staged == 0:
        raise ValueError(
            "model_loader_extra_config['io_threads'] is 0 (no registered threads per copy helper) but io_staged is 0: "
            "give io_staged >= 1 (staging threads only) or io_threads >= 1"
        )
    return LoaderOptions(
        bundle=bundle_dir,
        fallback=fallback,
        verify=verify,
        io_threads=0 if staging_only else _int_option(extra, "io_threads", LoaderOptions.io_threads, 64),
        chunk_mb=_int_option(extra, "chunk_mb", LoaderOptions.chunk_mb, 1024),
        io_mode=io_mode,
        io_processes=_int_option(extra, "io_processes", LoaderOptions.io_processes, 32),
        copy_during_build=during_build,
        common_io=common_io,
        io_own_share=own_share,
        io_staged=staged,
        io_stage_mib=_int_option(extra, "io_stage_mib", LoaderOptions.io_stage_mib, 256),  # type: ignore[arg-type]
        io_helper_nice=nice,
        **flags,
    )
