"""The ``marlin-pack daemon`` launcher: vLLM's weight-cache daemon (``vllm preload``) filled from a bundle.

``marlin-pack daemon MODEL_DIR [vllm preload flags...]`` runs ``vllm preload --model
MODEL_DIR --load-format marlin_prepacked [flags...]`` in this process, after registering
marlin-pack with vLLM and making every daemon process vLLM spawns register it too (see
:mod:`marlin_pack.vllm_plugin.patches.weight_cache`). It works without the ``vllm.general_plugins`` entry
point (and whatever ``VLLM_PLUGINS`` says), and checks the obvious mistakes before vLLM
starts. Engines then attach with ``vllm serve MODEL_DIR --load-format ipc_cache``.

Importing this module does not import vLLM; :func:`run` does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from marlin_pack._constants import LOAD_FORMAT, MANIFEST_NAME
from marlin_pack.errors import BundleError, CheckpointError, MarlinPackError
from marlin_pack.remote.url import url_scheme
from marlin_pack.sources.hub import locate_bundle

__all__ = ["preload_argv", "run"]


def _norm(flag: str) -> str:
    return flag.split("=", 1)[0].replace("_", "-")


def _option(args: Sequence[str], flag: str) -> tuple[bool, str | None]:
    """Whether ``--flag VALUE`` / ``--flag=VALUE`` is in ``args``, and its value (last one wins).

    ``_`` and ``-`` are alike in flag names, as in vLLM's parser; the value is None if missing.
    """
    found, value = False, None
    for i, arg in enumerate(args):
        if not arg.startswith("--") or _norm(arg) != flag:
            continue
        found = True
        if "=" in arg:
            value = arg.split("=", 1)[1]
        else:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = None if nxt is None or nxt.startswith("--") else nxt
    return found, value


def _check_bundle(model: str, extra: Sequence[str]) -> None:
    """A daemon filled from a bundle needs one (unless the loader may fall back)."""
    _, raw = _option(extra, "--model-loader-extra-config")
    options: dict[str, object] = {}
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except ValueError:
            return  # vLLM reports malformed JSON itself
        if not isinstance(parsed, dict):
            return
        options = parsed
    if options.get("fallback") is True:
        return
    if isinstance(options.get("bundle"), str) and url_scheme(options["bundle"]) is not None:
        return  # a bucket's bundle: the loader decides in the daemon (record, manifest, engine fit), in one line
    try:  # the bundle option, or a directory's MODEL_DIR/marlin-pack, or a cached repo id's marlin-pack cache entry
        bundle = locate_bundle(model, _option(extra, "--revision")[1], str(options["bundle"]) if options.get("bundle") else None)
    except CheckpointError as e:
        raise BundleError(f"{e}; `marlin-pack convert {model}` first, or fill the daemon with --load-format auto") from e
    if not (bundle / MANIFEST_NAME).is_file():
        raise BundleError(
            f"no marlin-pack bundle at {bundle} (no {MANIFEST_NAME}): run `marlin-pack convert {model}` "
            "first, or fill the daemon from the checkpoint with --load-format auto"
        )


def preload_argv(model_dir: str | Path, extra: Sequence[str] = ()) -> list[str]:
    """The ``vllm`` arguments for ``marlin-pack daemon MODEL_DIR [extra...]``.

    Adds ``--load-format marlin_prepacked`` unless ``extra`` names a load format; every other
    argument is passed to ``vllm preload`` unchanged.

    Raises:
        MarlinPackError: ``--model`` given (MODEL_DIR is the model), ``--load-format ipc_cache``
            (the daemon loads from disk), or no bundle where the load format needs one.
    """
    model_dir = str(model_dir)
    extra = list(extra)
    if _option(extra, "--model")[0]:
        raise MarlinPackError(
            f"--model is MODEL_DIR ({model_dir}) for marlin-pack daemon; remove --model from the vllm flags"
        )
    given, load_format = _option(extra, "--load-format")
    if given and load_format is None:
        raise MarlinPackError("--load-format needs a value, e.g. --load-format auto")
    if load_format is None:
        load_format = LOAD_FORMAT
        extra = ["--load-format", LOAD_FORMAT, *extra]
    if load_format.lower() == "ipc_cache":
        raise MarlinPackError(
            "the daemon loads the weights from disk and serves them over IPC; --load-format ipc_cache is "
            f"for engines. Use {LOAD_FORMAT} (default) or auto"
        )
    if load_format.lower() == LOAD_FORMAT:
        _check_bundle(model_dir, extra)
    return ["preload", "--model", str(model_dir), *extra]


def run(argv: Sequence[str]) -> None:
    """Run ``vllm <argv>`` (from :func:`preload_argv`) in this process with marlin-pack installed.

    Registers the plugin here and patches vLLM's daemon module so that every daemon process
    it spawns registers it as well. vLLM's own exit status ends the process (``SystemExit``).

    Raises:
        MarlinPackError: marlin-pack could not register itself with vLLM, or vLLM raised
            (e.g. on a bad flag); the original exception is chained.
    """
    import importlib

    from marlin_pack.vllm_plugin import ensure_registered, releases
    from marlin_pack.vllm_plugin.daemon_process import DAEMON_MODULE
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    if not ensure_registered():  # also where register() ran before and its patches were removed
        raise MarlinPackError(
            f"could not register the {LOAD_FORMAT} load format with vLLM (see the log above); "
            f"is one of vLLM {releases.supported_text()} installed?"
        )
    entry = releases.release(vllm_version())
    if entry is not None and not entry.has("vllm_preload"):
        raise MarlinPackError(
            f"vLLM {vllm_version()} starts its weight-cache daemon without `vllm preload` (python -m {DAEMON_MODULE}), "
            f"which marlin-pack does not fill; use vLLM {_preload_releases()} for the daemon, or start the engines "
            f"with --load-format {LOAD_FORMAT} (as fast from a warm page cache)"
        )
    importlib.import_module(DAEMON_MODULE)  # vllm preload imports it later; the registry patches it on import

    from vllm.entrypoints.cli.main import main as vllm_main

    saved = sys.argv
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except Exception as e:  # vLLM's own refusal (bad flags, no GPU, ...): one line, not "internal error"
        raise MarlinPackError(f"vllm {argv[0]} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.argv = saved


def _preload_releases() -> str:
    """``0.34.0, 0.33.0, ...``: the supported releases whose daemon starts with ``vllm preload``."""
    from marlin_pack.vllm_plugin import releases

    return ", ".join(v for v in releases.supported() if releases.release(v).has("vllm_preload"))  # type: ignore[union-attr]
