"""vLLM plugin: the ``marlin_prepacked`` load format, and weight-cache support for Marlin layers.

Installed with the package as the ``vllm.general_plugins`` entry point
``marlin_pack = marlin_pack.vllm_plugin:register``, so every vLLM process (API server,
engine core, workers) calls :func:`register` once. Importing this package does not
import vLLM; :func:`register` does, lazily.

Hence every patch is installed in every vLLM process; a process that uses neither
``--load-format marlin_prepacked``, ``--load-format ipc_cache`` nor ``marlin-pack daemon``
behaves exactly as without the plugin: the correctness and weight-cache patches act only on what
those paths produce, and the speed patches only inside marlin-pack's scope
(:mod:`.patches.scope`). ``marlin_pack.patch_list.patch_rows()`` lists them all, by purpose.

Usage::

    marlin-pack convert MODEL_DIR              # writes MODEL_DIR/marlin-pack
    vllm serve MODEL_DIR --load-format marlin_prepacked

Modules: ``loader`` (the model loader), ``options`` (its extra config), ``decision`` (pure
checks over plain facts), ``engine`` (every read of vLLM internals), ``patches/`` (the registry
of vLLM patches, by purpose), ``launcher`` (``marlin-pack daemon``), ``daemon_process`` (the spawn
target of ``vllm preload``'s daemons), ``preload`` (copy helpers page-locking the bundle before the
copy: a daemon as it starts, an engine as its worker sets up). Bundle bytes reach the GPU through
:mod:`marlin_pack.gpu` (reader, copy helpers), which does not import vLLM. Every line logged through the
``vllm.marlin_pack`` logger is shown with its control characters escaped (:mod:`marlin_pack.shown`).
"""

from __future__ import annotations

import logging

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.shown import show_log_records

__all__ = ["register", "is_registered", "ensure_registered", "LOAD_FORMAT"]

# The one logger of every marlin-pack module in vLLM's processes: its lines quote paths, model and tensor
# names, shown with their control characters escaped (a forged second line, a cleared screen: never).
show_log_records(logging.getLogger("vllm.marlin_pack"))

_REGISTERED = False
_UNSERVED: str | None = None  # a release not served, for which only the refusing loader is registered


def register() -> None:
    """Install marlin-pack's vLLM patches and register the ``marlin_prepacked`` model loader.

    Cheap and idempotent: vLLM may call it in every process, and more than once. It never
    raises (vLLM does not guard plugin functions): a failure is logged and the load format
    stays unregistered, so only engines asking for it are affected. On a vLLM release marlin-pack
    does not serve (:mod:`.releases`) it logs once, patches nothing and registers a loader that
    refuses in one line naming the supported releases (or, ``fallback`` on, loads ordinarily).

    Example:
        >>> from marlin_pack.vllm_plugin import register
        >>> register()
        >>> from vllm.config.load import LoadConfig
        >>> from vllm.model_executor.model_loader import get_model_loader
        >>> type(get_model_loader(LoadConfig(load_format="marlin_prepacked"))).__name__
        'MarlinPrepackedLoader'
    """
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from marlin_pack.vllm_plugin import patches, releases
        from marlin_pack.vllm_plugin.version_guard import vllm_version

        running = vllm_version()
        if releases.release(running) is None:
            if running != _UNSERVED:
                patches.install()  # logs once which releases are supported; installs nothing
                _register_unserved(running)
            return
        if not patches.install():
            return
        from vllm.model_executor.model_loader import register_model_loader

        from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

        register_model_loader(LOAD_FORMAT)(MarlinPrepackedLoader)
    except Exception:
        logging.getLogger("vllm.marlin_pack").exception("marlin-pack: could not register the %s load format", LOAD_FORMAT)
        return
    _REGISTERED = True


def _register_unserved(running: str) -> None:
    """On a release marlin-pack does not serve: only the load format's name, whose loader refuses in one line (or falls
    back); nothing patched, so an engine not asking for it runs exactly as without the plugin."""
    global _UNSERVED
    from vllm.model_executor.model_loader import register_model_loader

    from marlin_pack.vllm_plugin.unserved import UnservedReleaseLoader

    register_model_loader(LOAD_FORMAT)(UnservedReleaseLoader)
    _UNSERVED = running


def is_registered() -> bool:
    """Whether :func:`register` succeeded in this process."""
    return _REGISTERED


def ensure_registered() -> bool:
    """:func:`register`, then install marlin-pack's patches again where something removed them since (idempotent).

    For marlin-pack's own ways into vLLM (``marlin-pack daemon``, a spawned weight-cache daemon), which
    must run with every patch in place whatever happened in the process before. Returns :func:`is_registered`.
    """
    register()
    if not is_registered():
        return False
    from marlin_pack.vllm_plugin import patches

    patches.install()
    return True
