"""vLLM's weight cache (``vllm preload`` / ``--load-format ipc_cache``) for AWQ/GPTQ Marlin layers.

vLLM 0.33.0's weight-cache daemon keeps post-processed weights in GPU memory and engines
started with ``--load-format ipc_cache`` map them through CUDA IPC. It refuses every layer
whose quantization method does not declare ``supports_pre_processed_weights``, which
``AutoAWQMarlinLinearMethod`` and ``AutoGPTQLinearMethod`` do not. :func:`install` (called by
``register()``, so in every vLLM process that loads the plugin) patches, once per process:

* the two quant methods: ``supports_pre_processed_weights`` becomes a property, True only
  when ``self.kernel`` is exactly ``MarlinLinearKernel`` with fp16/bf16 activations; under
  ``weights_already_processed()`` their ``process_weights_after_loading`` only restores the
  state the daemon does not export (``input_global_scale = None``; GPTQ's empty ``qzeros``
  if it is missing), checks the layout, and returns: no AWQ conversion, no repack.
  Other kernels (Machete, Exllama, Conch, ...), 8-bit activations and AWQ/GPTQ MoE stay
  refused with vLLM's ``UnsupportedQuantForIPCError``.
* Marlin for weight-cache processes: ``IpcModelLoader`` (its IPC build and its disk
  fallback) and the daemon's ``get_model`` resolve an ``auto`` mixed-precision backend to
  Marlin for AWQ/GPTQ models (as ``--kernel-config
  '{"linear_backend_per_quant": {"mixed_precision": "marlin"}}'`` would), because Marlin is
  the only kernel whose processed weights can be shared: on Hopper vLLM would otherwise
  build Machete layers on the engine side for Marlin tensors. An explicit backend is kept
  (and refused if not Marlin). ``WeightCacheKey`` keeps seeing the backend settings as
  configured, so daemon and engine keys still match on what the user typed.
* vLLM's daemon spawn: ``vllm preload`` starts its daemons with the ``spawn`` method and
  they never call ``load_general_plugins()``. ``_run_daemon`` of
  ``vllm.model_executor.model_loader.weight_cache.daemon`` is replaced (at import, through
  a one-module import hook, or at once if already imported) by :func:`run_daemon`, a
  module-level function that pickles by reference: every spawned daemon first registers
  marlin-pack, then runs vLLM's own ``_run_daemon``.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

__all__ = [
    "DAEMON_MODULE",
    "CACHE_QUANTIZATIONS",
    "install",
    "supports_pre_processed",
    "restore_pre_processed",
    "force_marlin_for_cache",
    "patch_daemon_module",
    "run_daemon",
    "is_ours",
]

logger = logging.getLogger("vllm.marlin_pack")

DAEMON_MODULE = "vllm.model_executor.model_loader.weight_cache.daemon"
_QUANT_TARGETS = (
    ("vllm.model_executor.layers.quantization.auto_awq", "AutoAWQMarlinLinearMethod"),
    ("vllm.model_executor.layers.quantization.auto_gptq", "AutoGPTQLinearMethod"),
)
# ModelConfig.quantization of AWQ/GPTQ checkpoints (vLLM resolves them to auto_awq/auto_gptq).
CACHE_QUANTIZATIONS = frozenset({"auto_awq", "auto_gptq", "awq", "awq_marlin", "gptq", "gptq_marlin"})
_ORIGINAL_RUN_DAEMON = "_marlin_pack_original_run_daemon"
_UNSUPPORTED_HINT = (
    "marlin-pack: the weight cache shares AWQ/GPTQ linear layers only when vLLM serves them with "
    "MarlinLinearKernel and 16-bit activations. Check --linear-backend / --kernel-config "
    "(an explicit non-Marlin backend is kept), VLLM_MARLIN_INPUT_DTYPE (must be unset), "
    "VLLM_DISABLED_KERNELS and VLLM_BATCH_INVARIANT; AWQ/GPTQ MoE layers are never shared"
)

# Functions created here, to find our layer in a chain of functools.wraps wrappers (the
# prepacked patch may wrap ours, or we may wrap it).
_WRAPPERS: set[Callable[..., Any]] = set()
# id(KernelConfig) -> (the config, its linear_backend_per_quant before we forced Marlin).
_FORCED: dict[int, tuple[Any, Any]] = {}


def is_ours(fn: object) -> bool:
    """Whether ``fn`` is, or wraps (``__wrapped__`` chain), a wrapper installed by this module."""
    for _ in range(32):
        if fn is None:
            return False
        if fn in _WRAPPERS:  # type: ignore[comparison-overlap]
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _ours(fn: Callable[..., Any]) -> Callable[..., Any]:
    _WRAPPERS.add(fn)
    return fn


# --- the quant methods ---------------------------------------------------------------------


def supports_pre_processed(quant_method: Any) -> bool:
    """True when the layer's kernel is exactly MarlinLinearKernel with fp16/bf16 activations."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel

    kernel = getattr(quant_method, "kernel", None)
    if type(kernel) is not MarlinLinearKernel:
        return False
    return getattr(getattr(kernel, "config", None), "act_type", None) in (torch.float16, torch.bfloat16)


def _layer_name(layer: nn.Module) -> str:
    return str(getattr(layer, "prefix", "") or type(layer).__name__)


def restore_pre_processed(quant_method: Any, layer: nn.Module) -> None:
    """Pre-processed mode: restore what the daemon does not export, check the layout, nothing else.

    The daemon exports ``qweight``, ``scales``, ``qzeros`` and ``bias`` as
    ``MarlinLinearKernel.process_weights_after_loading`` left them; the plain attribute
    ``input_global_scale = None`` (16-bit activations) is not a tensor, so it is set here.
    GPTQ's ``qzeros`` is an empty ``int32[0]`` parameter; CUDA IPC carries it (an empty CUDA
    storage is rebuilt as an empty tensor on the engine's device), and if it is missing it is
    recreated as ``marlin_make_empty`` would.

    Raises:
        RuntimeError: a tensor is missing (still on ``meta``) or not in the Marlin layout
            this layer's kernel configuration implies.
    """
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_empty, marlin_padded_nk

    kernel = quant_method.kernel
    c = kernel.config
    size_k, size_n = c.partition_weight_shape
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, c.group_size)
    bits = c.weight_type.size_bits
    where = f"layer {_layer_name(layer)} ({type(quant_method).__name__})"

    def tensor(name: str | None) -> torch.Tensor | None:
        t = getattr(layer, name, None) if name else None
        return t if isinstance(t, torch.Tensor) else None

    def check(name: str, t: torch.Tensor | None, want: tuple[int | None, ...]) -> None:
        if t is None or t.is_meta:
            raise RuntimeError(f"{where}: the weight cache did not provide {name}")
        got = tuple(t.shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            raise RuntimeError(
                f"{where}: pre-processed {name} has shape {list(got)}, MarlinLinearKernel holds "
                f"{['*' if w is None else w for w in want]} for (K, N)=({size_k}, {size_n}) padded to "
                f"({padded_k}, {padded_n}); the weight cache holds another layout"
            )

    w_q = tensor(kernel.w_q_name)
    check(kernel.w_q_name, w_q, (padded_k // 16, padded_n * bits // 2))
    assert w_q is not None
    w_s = tensor(kernel.w_s_name)
    check(kernel.w_s_name, w_s, (None, padded_n))
    zp_name = kernel.w_zp_name or "w_zp"
    zp = tensor(zp_name)
    if c.zero_points:
        assert w_s is not None
        check(zp_name, zp, (w_s.shape[0], padded_n * bits // 32))
    elif zp is None or zp.numel() != 0 or zp.device != w_q.device:
        setattr(layer, zp_name, marlin_make_empty(w_q.device))
    bias = getattr(layer, "bias", None)
    if bias is not None:
        check("bias", bias, (padded_n,))
    if "input_global_scale" not in layer._parameters:
        layer.input_global_scale = None


def _wrap_process_weights_after_loading(original: Callable[[Any, nn.Module], None]) -> Callable[..., None]:
    from vllm.model_executor.utils import is_weights_pre_processed

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        if is_weights_pre_processed():
            if not supports_pre_processed(self):  # vLLM checks the flag first; keep the promise anyway
                raise RuntimeError(
                    f"{type(getattr(self, 'kernel', None)).__name__} cannot use pre-processed weights"
                )
            restore_pre_processed(self, layer)
            return
        original(self, layer)

    return _ours(process_weights_after_loading)


_SUPPORTS = property(
    supports_pre_processed,
    doc="marlin-pack: True when served by MarlinLinearKernel with fp16/bf16 activations.",
)


def _patch_quant_methods() -> None:
    for module, name in _QUANT_TARGETS:
        cls = getattr(importlib.import_module(module), name)
        if cls.__dict__.get("supports_pre_processed_weights") is not _SUPPORTS:
            cls.supports_pre_processed_weights = _SUPPORTS
        current = cls.__dict__["process_weights_after_loading"]
        if not is_ours(current):
            # functools.wraps copies the wrapped function's __dict__, so a prepacked-patch
            # marker on `current` stays visible on ours (prepacked.is_patched keeps working).
            cls.process_weights_after_loading = _wrap_process_weights_after_loading(current)


# --- Marlin for weight-cache processes ----------------------------------------------------


def force_marlin_for_cache(vllm_config: Any, model_config: Any, role: str = "weight cache") -> bool:
    """Resolve an ``auto`` mixed-precision backend to Marlin for an AWQ/GPTQ model.

    Returns whether the kernel configuration was changed. An explicit backend (other than
    ``auto``) is kept: if it is not Marlin, the weight cache refuses its layers.
    """
    if getattr(model_config, "quantization", None) not in CACHE_QUANTIZATIONS:
        return False
    kc = vllm_config.kernel_config
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
    if id(kc) not in _FORCED:
        _FORCED[id(kc)] = (kc, copy.deepcopy(kc.linear_backend_per_quant))
    from marlin_pack.vllm_plugin.loader import force_marlin

    force_marlin(kc)
    logger.info(
        "marlin-pack: %s: AWQ/GPTQ linear layers use MarlinLinearKernel, the only kernel whose processed "
        "weights the weight cache shares (linear_backend_per_quant mixed_precision=marlin)",
        role,
    )
    return True


def _as_configured(kernel_config: Any) -> Any:
    """The kernel config as the user configured it (before :func:`force_marlin_for_cache`)."""
    entry = _FORCED.get(id(kernel_config))
    if entry is None or entry[0] is not kernel_config:
        return kernel_config
    configured = copy.copy(kernel_config)
    configured.linear_backend_per_quant = copy.deepcopy(entry[1])
    return configured


def _patch_cache_key() -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    func = WeightCacheKey.__dict__["from_model_config"].__func__
    if is_ours(func):
        return

    @functools.wraps(func)
    def from_model_config(cls: type, *args: Any, kernel_config: Any = None, **kwargs: Any) -> Any:
        return func(cls, *args, kernel_config=_as_configured(kernel_config), **kwargs)

    WeightCacheKey.from_model_config = classmethod(_ours(from_model_config))  # type: ignore[method-assign]


def _log_hint(e: BaseException) -> None:
    if type(e).__name__ == "UnsupportedQuantForIPCError":
        logger.error(_UNSUPPORTED_HINT)


def _with_marlin_for_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """For IpcModelLoader._build_model / _fallback_load(self, vllm_config, model_config, ...)."""

    @functools.wraps(original)
    def wrapper(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        force_marlin_for_cache(vllm_config, model_config, role="ipc_cache engine")
        try:
            return original(self, vllm_config, model_config, *args, **kwargs)
        except Exception as e:
            _log_hint(e)
            raise

    return _ours(wrapper)


def _patch_ipc_loader() -> None:
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader

    for name in ("_build_model", "_fallback_load"):
        current = IpcModelLoader.__dict__[name]
        if not is_ours(current):
            setattr(IpcModelLoader, name, _with_marlin_for_cache(current))


# --- the daemon ------------------------------------------------------------------------------


def _wrap_get_model(original: Callable[[Any], nn.Module]) -> Callable[[Any], nn.Module]:
    @functools.wraps(original)
    def get_model(self: Any) -> nn.Module:
        role = f"weight-cache {self.role} daemon rank {self.global_rank}"
        force_marlin_for_cache(self.vllm_config, self.model_config, role=role)
        t0 = time.perf_counter()
        try:
            model = original(self)
        except Exception as e:
            _log_hint(e)
            raise
        logger.info(
            "marlin-pack: %s filled its model in %.2f s (load format %s)",
            role,
            time.perf_counter() - t0,
            self.vllm_config.load_config.load_format,
        )
        return model

    return _ours(get_model)


def patch_daemon_module(module: ModuleType | None = None) -> ModuleType:
    """Make vLLM's daemon module spawn :func:`run_daemon` and time/force its ``get_model``."""
    if module is None:
        module = importlib.import_module(DAEMON_MODULE)
    current = module.__dict__.get("_run_daemon")
    if current is not None and current is not run_daemon:
        setattr(module, _ORIGINAL_RUN_DAEMON, current)
        module._run_daemon = run_daemon  # type: ignore[attr-defined]
    cls = module.WeightCacheDaemon
    if not is_ours(cls.__dict__["get_model"]):
        cls.get_model = _wrap_get_model(cls.__dict__["get_model"])
    return module


def run_daemon(*args: Any, **kwargs: Any) -> Any:
    """Spawn target standing in for vLLM's ``_run_daemon``: install marlin-pack, then run it.

    ``vllm preload`` pickles the target by reference (``marlin_pack.vllm_plugin.ipc.run_daemon``),
    so the spawned process imports this module and runs this function first.
    """
    from marlin_pack.vllm_plugin import register

    # Spawned daemons start with logging unconfigured; configure it as _run_daemon will, first,
    # so that marlin-pack's own messages (and registration errors) are shown.
    vllm_config = args[2] if len(args) > 2 else kwargs.get("vllm_config")
    if (logging_config := getattr(vllm_config, "logging_config", None)) is not None:
        from vllm.logger import configure_logging

        configure_logging(logging_config)
    register()
    install()
    module = patch_daemon_module()
    original = getattr(module, _ORIGINAL_RUN_DAEMON)
    logger.info(
        "marlin-pack: plugin active in weight-cache daemon process %d (marlin_prepacked load format, "
        "AWQ/GPTQ Marlin layers accept pre-processed weights)",
        os.getpid(),
    )
    return original(*args, **kwargs)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            patch_daemon_module(module)
        except Exception:
            logger.exception(
                "marlin-pack: could not patch %s; its daemons will not load marlin-pack", DAEMON_MODULE
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DaemonImportHook(importlib.abc.MetaPathFinder):
    """Patches vLLM's daemon module right after its import (only ``vllm preload`` imports it)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != DAEMON_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Install every patch of this module (idempotent). Imports vLLM; ``register()`` calls it."""
    _patch_quant_methods()
    _patch_cache_key()
    _patch_ipc_loader()
    module = sys.modules.get(DAEMON_MODULE)
    if module is not None:
        patch_daemon_module(module)
    elif not any(isinstance(f, _DaemonImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DaemonImportHook())
