"""vLLM's weight cache (``vllm preload`` / ``--load-format ipc_cache``) for AWQ/GPTQ Marlin layers.

The quant-method side (``supports_pre_processed_weights`` and the pre-processed
post-processing) is in ``post_processing.py``; this module makes the rest of the weight cache
work with it:

* Marlin for weight-cache processes: ``IpcModelLoader`` (its IPC build and its disk
  fallback) and the daemon's ``get_model`` resolve an ``auto`` mixed-precision backend to
  Marlin for AWQ/GPTQ models, unless the model's bundle holds Machete layers (converted with
  ``--kernel machete``: then both keep vLLM's own SM90 choice, whose Machete tensors the cache shares too) (as ``--kernel-config
  '{"linear_backend_per_quant": {"mixed_precision": "marlin"}}'`` would), because Marlin is
  the only kernel whose processed weights can be shared: on Hopper vLLM would otherwise
  build Machete layers on the engine side for Marlin tensors. An explicit backend is kept
  (and refused if not Marlin). ``WeightCacheKey`` keeps seeing the backend settings as
  configured, so daemon and engine keys still match on what the user typed.
* vLLM's daemon spawn: ``vllm preload`` starts its daemons with the ``spawn`` method and
  they never call ``load_general_plugins()``. ``_run_daemon`` of the daemon module is
  replaced by :func:`.daemon_process.run_daemon`, a module-level function that pickles by
  reference: every spawned daemon first registers marlin-pack, then runs vLLM's own
  ``_run_daemon``. The daemon module is patched when first imported (only ``vllm preload``
  imports it).
* The daemon's page-locking ahead of its fill (:mod:`.preload`): ``get_draft_daemon_config``,
  which ``vllm preload`` calls with the final configuration just before it spawns the daemons,
  also plans it (only for ``--load-format marlin_prepacked``); the daemon's ``get_model`` stops it
  after the fill.
* compressed-tensors attention layers of an ``ipc_cache`` engine post-process on ``meta``.

Every patch here is a ``weight_cache`` one (:mod:`.catalog`) and acts only in weight-cache processes:
the IPC loader's steps run only in ``ipc_cache`` engines, the daemon's functions only in ``vllm preload``
/ ``marlin-pack daemon`` processes, the KV-cache branch only under ``weights_already_processed()``, and
``WeightCacheKey`` sees another kernel configuration only where one of those forced Marlin. The IPC
loader's steps and the daemon's ``get_model`` also enter marlin-pack's scope (:mod:`.scope`) for the build.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from marlin_pack.vllm_plugin import daemon_process, preload
from marlin_pack.vllm_plugin.daemon_process import DAEMON_MODULE, RUN_DAEMON, run_daemon, stands_in_for
from marlin_pack.vllm_plugin.patches import catalog, scope

__all__ = ["DAEMON_MODULE", "RUN_DAEMON", "CACHE_QUANTIZATIONS", "PATCHES", "ct_weight_only_int", "force_marlin_for_cache",
           "run_daemon"]

logger = logging.getLogger("vllm.marlin_pack")

_IPC_LOADER = "vllm.model_executor.model_loader.weight_cache.ipc_loader:IpcModelLoader"
_KEY = "vllm.model_executor.model_loader.weight_cache.protocol:WeightCacheKey"
_CT_KV_CACHE_METHOD = (
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:CompressedTensorsKVCacheMethod"
)
# ModelConfig.quantization of AWQ/GPTQ checkpoints (vLLM resolves them to auto_awq/auto_gptq), and of
# compressed-tensors ones (only their WNA16 Marlin layers accept pre-processed weights).
CACHE_QUANTIZATIONS = frozenset(
    {"auto_awq", "auto_gptq", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"}
)
_UNSUPPORTED_HINT = (
    "marlin-pack: the weight cache shares AWQ/GPTQ/compressed-tensors linear layers only when vLLM serves them with "
    "MarlinLinearKernel and 16-bit activations. Check --linear-backend / --kernel-config "
    "(an explicit non-Marlin backend is kept), VLLM_MARLIN_INPUT_DTYPE (must be unset), "
    "VLLM_DISABLED_KERNELS and VLLM_BATCH_INVARIANT; AWQ/GPTQ/compressed-tensors WNA16 mixture-of-experts layers are "
    "shared only on the Marlin MoE backend (--moe-backend auto or marlin) with 16-bit activations"
)
# AWQ/GPTQ quantizations whose experts (AutoAWQMoEMethod/AutoGPTQMoEMethod) the cache shares on Marlin MoE; and
# compressed-tensors, whose experts (CompressedTensorsWNA16MoEMethod) it shares when every scheme is weight-only int.
MOE_CACHE_QUANTIZATIONS = frozenset({"auto_awq", "auto_gptq", "awq", "awq_marlin", "gptq", "gptq_marlin"})


def ct_weight_only_int(qc: Any) -> bool:
    """A compressed-tensors ``quantization_config`` whose config groups are all pack-quantized weight-only int
    (WNA16): its experts get ``CompressedTensorsWNA16MoEMethod``, so forcing the Marlin MoE backend changes
    nothing else (an FP8 or NVFP4 MoE keeps vLLM's own backend choice)."""
    if not isinstance(qc, dict) and callable(getattr(qc, "to_dict", None)):  # a transformers quantization config object
        qc = qc.to_dict()
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return False
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    return bool(groups) and all(
        (g["weights"] or {}).get("type") == "int" and not g.get("input_activations")
        and (g.get("format") or qc.get("format")) == "pack-quantized"
        for g in groups
    )


def _forces_marlin_moe(model_config: Any) -> bool:
    quantization = getattr(model_config, "quantization", None)
    if quantization in MOE_CACHE_QUANTIZATIONS:
        return True
    hf = getattr(model_config, "hf_config", None)
    return quantization == "compressed-tensors" and ct_weight_only_int(getattr(hf, "quantization_config", None))

# id(KernelConfig) -> (the config, its linear_backend_per_quant and moe_backend before we forced Marlin).
_FORCED: dict[int, tuple[Any, Any, Any]] = {}


def force_marlin_for_cache(vllm_config: Any, model_config: Any, role: str = "weight cache") -> bool:
    """Resolve an ``auto`` mixed-precision backend to Marlin for an AWQ/GPTQ model.

    Returns whether the kernel configuration was changed. An explicit backend (other than
    ``auto``) is kept: if it is not Marlin, the weight cache refuses its layers.
    """
    if getattr(model_config, "quantization", None) not in CACHE_QUANTIZATIONS:
        return False
    if _bundle_holds_machete(model_config):
        logger.info(
            "marlin-pack: %s: the model's bundle holds vLLM's SM90 choice (Machete layers): nothing is forced", role
        )
        return False
    kc = vllm_config.kernel_config
    if id(kc) not in _FORCED:
        _FORCED[id(kc)] = (kc, copy.deepcopy(kc.linear_backend_per_quant), getattr(kc, "moe_backend", "auto"))
    if _forces_marlin_moe(model_config):
        from marlin_pack.vllm_plugin.moe_engine import force_marlin_moe

        if force_marlin_moe(kc):  # experts of MoE models: only the Marlin MoE layout is shared (auto: Humming on SM90)
            logger.info("marlin-pack: %s: AWQ/GPTQ/compressed-tensors WNA16 mixture-of-experts layers use the Marlin MoE "
                        "backend (moe_backend=marlin)", role)
    per_quant = dict(kc.linear_backend_per_quant or {})
    backend = per_quant.get("mixed_precision") or kc.linear_backend
    if backend != "auto":
        if backend != "marlin":
            logger.info(
                "marlin-pack: %s keeps the explicit mixed-precision backend %r; the weight cache refuses "
                "AWQ/GPTQ layers not served by MarlinLinearKernel",
                role,
                backend,
            )
        return False
    from marlin_pack.vllm_plugin.engine import force_marlin

    force_marlin(kc)
    logger.info(
        "marlin-pack: %s: AWQ/GPTQ/compressed-tensors linear layers use MarlinLinearKernel, the only kernel whose processed "
        "weights the weight cache shares (linear_backend_per_quant mixed_precision=marlin)",
        role,
    )
    return True


def _bundle_holds_machete(model_config: Any) -> bool:
    """Whether the model's bundle (at its default place: daemon and engine find the same one) holds Machete layers.

    Then daemon and engine both keep vLLM's own per-layer choice (Machete on SM90, whose processed tensors the
    cache shares too); otherwise both force Marlin. No bundle, or one that cannot be read: False.
    """
    from marlin_pack.sources.hub import locate_bundle
    from marlin_pack.vllm_plugin.decision import load_manifest

    try:
        return load_manifest(locate_bundle(str(model_config.model), getattr(model_config, "revision", None))).has_machete_layers
    except Exception:  # noqa: BLE001 - not found or unreadable: the loader reports it where it matters
        return False


def _as_configured(kernel_config: Any) -> Any:
    """The kernel config as the user configured it (before :func:`force_marlin_for_cache`)."""
    entry = _FORCED.get(id(kernel_config))
    if entry is None or entry[0] is not kernel_config:
        return kernel_config
    configured = copy.copy(kernel_config)
    configured.linear_backend_per_quant = copy.deepcopy(entry[1])
    configured.moe_backend = entry[2]
    return configured


def _log_hint(e: BaseException) -> None:
    if type(e).__name__ == "UnsupportedQuantForIPCError":
        logger.error(_UNSUPPORTED_HINT)


def _cache_key(original: classmethod) -> classmethod:  # type: ignore[type-arg]
    func = original.__func__

    @functools.wraps(func)
    def from_model_config(cls: type, *args: Any, kernel_config: Any = None, **kwargs: Any) -> Any:
        return func(cls, *args, kernel_config=_as_configured(kernel_config), **kwargs)

    return classmethod(from_model_config)


def _ipc_loader_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """For IpcModelLoader._build_model / _fallback_load(self, vllm_config, model_config, ...)."""

    @functools.wraps(original)
    def wrapper(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        force_marlin_for_cache(vllm_config, model_config, role="ipc_cache engine")
        from marlin_pack.vllm_plugin.engine import freeze_gc_heap

        freeze_gc_heap()  # as the marlin_prepacked loader does: vLLM's later gc.collect() calls stay short
        try:
            with scope.in_use():
                return original(self, vllm_config, model_config, *args, **kwargs)
        except Exception as e:
            _log_hint(e)
            raise

    return wrapper


def _daemons_spawned_for(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``get_draft_daemon_config(vllm_config)``: ``vllm preload``'s last look at the final configuration before
    it spawns its daemons, where marlin-pack plans the page-locking a daemon starts with (:mod:`.preload`)."""

    @functools.wraps(original)
    def get_draft_daemon_config(vllm_config: Any) -> Any:
        draft = original(vllm_config)
        preload.export(vllm_config, draft=draft is not None)
        return draft

    return get_draft_daemon_config


def _daemon_get_model(original: Callable[[Any], nn.Module]) -> Callable[[Any], nn.Module]:
    @functools.wraps(original)
    def get_model(self: Any) -> nn.Module:
        role = f"weight-cache {self.role} daemon rank {self.global_rank}"
        force_marlin_for_cache(self.vllm_config, self.model_config, role=role)
        from marlin_pack.vllm_plugin.engine import freeze_gc_heap

        # As in engines: the daemon calls the loader's create_model/load_weights, not its load_model (which
        # freezes), and full collections during the construction would walk every object of the imports.
        freeze_gc_heap()
        from marlin_pack.gpu.helpers import exit_in_background

        t0 = time.perf_counter()
        try:
            # The loader's copy helpers: no memory is measured after a daemon's fill.
            with scope.in_use(), exit_in_background():
                model = original(self)
        except Exception as e:
            _log_hint(e)
            raise
        finally:
            preload.stop()  # the bundle's pages, page-locked as the daemon started, are not needed any more
        began = daemon_process.started()
        logger.info(
            "marlin-pack: %s filled its model in %.2f s (load format %s)%s",
            role,
            time.perf_counter() - t0,
            self.vllm_config.load_config.load_format,
            f"; the fill began {t0 - began:.2f} s after the daemon process began its run" if began is not None else "",
        )
        return model

    return get_model


def _ct_kv_cache_post_processing(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CompressedTensorsKVCacheMethod.process_weights_after_loading`` for an ``ipc_cache`` engine.

    Every compressed-tensors model gives its attention layers this method, even without a KV-cache
    scheme. vLLM's override reads the ``k_scale``/``v_scale``/``q_scale`` placeholders with
    ``.item()``, which in an engine built on ``meta`` and filled from the daemon never received
    data (the daemon consumed and deleted them; it exported the ``_k_scale``... buffers). The
    base class has the pre-processed branch for exactly this; use it, and drop the placeholders that never received
    data (still on ``meta``): up to 0.33 the daemon deleted them all (so did stock post-processing); from 0.34 stock keeps
    them, the daemon exports them and the engine's hold data, which stays as stock leaves it.
    """

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        if not scope.pre_processed_here():  # elsewhere (0.34's kernel-format reload too) as without the plugin
            return original(self, layer)
        BaseKVCacheMethod.process_weights_after_loading(self, layer)
        for name in ("k_scale", "v_scale", "q_scale", "prob_scale", "k_zero_point", "v_zero_point", "q_zero_point"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.is_meta:
                delattr(layer, name)
        return None

    return process_weights_after_loading


PATCHES = catalog.patches(
    __name__,
    {
        f"{_CT_KV_CACHE_METHOD}.process_weights_after_loading": _ct_kv_cache_post_processing,
        f"{_KEY}.from_model_config": _cache_key,
        f"{_IPC_LOADER}._build_model": _ipc_loader_step,
        f"{_IPC_LOADER}._fallback_load": _ipc_loader_step,
        f"{DAEMON_MODULE}:WeightCacheDaemon.get_model": _daemon_get_model,
        f"{DAEMON_MODULE}:get_draft_daemon_config": _daemons_spawned_for,
        RUN_DAEMON: stands_in_for,
    },
)
