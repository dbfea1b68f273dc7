"""Every patch marlin-pack applies to vLLM, as data: purpose, target, the upstream change that retires it, the releases
it applies to (``first``..``last`` and ``needs``; see :mod:`marlin_pack.vllm_plugin.releases`).

One list read by both the patch modules of this package (each adds the replacement of its own rows:
:func:`patches`) and the plain listing ``marlin-pack env`` prints (:func:`marlin_pack.patch_list.patch_rows`,
which must not import vLLM or torch: importing this module imports neither). Grouped by purpose
(:data:`~.registry.PURPOSES`):

* ``correctness``: a bundle is loaded right. The AWQ/GPTQ/compressed-tensors (WNA16) linear and the
  AWQ/GPTQ MoE quant methods only finish the layers the ``marlin_prepacked`` loader marked, instead of
  re-processing their final tensors (``post_processing``, ``moe_post_processing``); while the loader builds a
  model it fills from a bundle, their placeholders take no memory (``placeholders``). Inert elsewhere: they
  act on a mark or a stub context only the loader sets.
* ``weight_cache``: vLLM's weight cache (``vllm preload`` / ``marlin-pack daemon``, ``--load-format
  ipc_cache``) shares those layers: their methods declare ``supports_pre_processed_weights``, the cache's
  processes resolve an ``auto`` backend to Marlin with an unchanged key, compressed-tensors attention layers
  post-process on ``meta``, spawned daemons register the plugin and page-lock their bundle early. They act
  in weight-cache processes only (under ``weights_already_processed()``, in the daemon and the IPC loader).
* ``speed``: nothing but a faster start; inert outside marlin-pack's paths (:mod:`.scope`).

Each ``remove_when`` names the upstream vLLM change after which the patch can go; once a release ships it, the row's
``last`` is the release before. vLLM 0.34.0 ships the dense AWQ/GPTQ ``supports_pre_processed_weights`` and
pre-processed branch for MarlinLinearKernel only: the rows stay on 0.34.0, which they extend to MacheteLinearKernel
(and to the layers the loader marks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from marlin_pack.vllm_plugin.patches.registry import PURPOSES, Patch

__all__ = [
    "CORRECTNESS",
    "WEIGHT_CACHE",
    "SPEED",
    "PROVIDERS",
    "ROWS",
    "Row",
    "QUANT_METHODS",
    "MOE_QUANT_METHODS",
    "EMBEDDING_METHOD",
    "DAEMON_MODULE",
    "RUN_DAEMON",
    "patches",
]

CORRECTNESS, WEIGHT_CACHE, SPEED = PURPOSES


@dataclass(frozen=True)
class Row:
    """One patch as data: everything but its replacement."""

    purpose: str
    target: str
    remove_when: str
    provider: str  # the module of this package that builds the replacement (``make``)
    deferred: bool = False  # applied when vLLM first imports the target's module (see registry)
    # The releases it applies to, oldest and newest (None: open), as data; releases.applies() resolves them.
    first: str | None = None
    last: str | None = None
    # A feature of the release it needs (releases.FEATURES: "memory_hook", "vllm_preload", "kernel_config_key").
    needs: str | None = None

    def applies_to(self, version: str) -> bool:
        """Whether this row is installed on the vLLM release ``version`` (one of :data:`~..releases.RELEASES`)."""
        from marlin_pack.vllm_plugin import releases

        return releases.applies(version, self.first, self.last, self.needs)


_QUANT = "vllm.model_executor.layers.quantization"
AUTO_AWQ, AUTO_GPTQ = f"{_QUANT}.auto_awq", f"{_QUANT}.auto_gptq"
_CT = f"{_QUANT}.compressed_tensors.compressed_tensors"
# The dense quant methods served by MarlinLinearKernel, as "module:Class" (compressed-tensors delegates to the
# layer's scheme; only CompressedTensorsWNA16 on Marlin is finished or shared).
QUANT_METHODS = (
    f"{AUTO_AWQ}:AutoAWQMarlinLinearMethod",
    f"{AUTO_GPTQ}:AutoGPTQLinearMethod",
    f"{_CT}:CompressedTensorsLinearMethod",
)
# compressed-tensors' WNA16 experts method lives in a module get_moe_method imports on first use; importing it at
# install imports nothing compressed_tensors_moe.py has not already imported.
_CT_MOE = f"{_QUANT}.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16"
MOE_QUANT_METHODS = (f"{AUTO_AWQ}:AutoAWQMoEMethod", f"{AUTO_GPTQ}:AutoGPTQMoEMethod",
                     f"{_CT_MOE}:CompressedTensorsWNA16MoEMethod")
EMBEDDING_METHOD = "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod"
_CT_KV_CACHE_METHOD = f"{_CT}:CompressedTensorsKVCacheMethod"
_LOADER = "vllm.model_executor.model_loader"
_PROTOCOL = f"{_LOADER}.weight_cache.protocol"
_IPC_LOADER = f"{_LOADER}.weight_cache.ipc_loader:IpcModelLoader"
DAEMON_MODULE = f"{_LOADER}.weight_cache.daemon"  # also daemon_process.DAEMON_MODULE (a test keeps them equal)
RUN_DAEMON = f"{DAEMON_MODULE}:_run_daemon"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_GPTQ_UTILS = f"{_QUANT}.utils.gptq_utils"


def _cls(target: str) -> str:
    return target.rsplit(":", 1)[1]


_AUTO_MARLIN = (
    "vLLM's weight cache itself resolves an `auto` mixed-precision (and MoE) backend to Marlin for AWQ/GPTQ/"
    "compressed-tensors models, the only kernels whose processed weights it can share"
)
_WORKER_HOOKS = "vLLM gives model loaders a hook before its GPU worker's init_device and one after its memory profile"
_NO_DEEP_COPY = (
    "stops deep-copying a GPTQ quant config without dynamic rules (and its checkpoint-sized "
    "modules_in_block_to_quantize list) for every layer"
)

ROWS: tuple[Row, ...] = (
    # --- correctness: a bundle is loaded right ------------------------------------------------------------
    *(
        Row(
            CORRECTNESS,
            f"{m}.process_weights_after_loading",
            f"{_cls(m)}.process_weights_after_loading gets a pre-processed branch (under weights_already_processed() "
            "it only sets the Marlin kernel's Python-side state, as Fp8LinearMethod does); the loader then "
            "post-processes a bundle's layers inside weights_already_processed() instead of marking them",
            "post_processing",
        )
        for m in QUANT_METHODS
    ),
    *(
        Row(
            CORRECTNESS,
            f"{m}.process_weights_after_loading",
            f"{_cls(m)}.process_weights_after_loading gets a pre-processed branch that only builds the Marlin MoE "
            "kernel (as Fp8MoEMethod has); the loader then post-processes under weights_already_processed()",
            "moe_post_processing",
        )
        for m in MOE_QUANT_METHODS
    ),
    *(
        Row(
            CORRECTNESS,
            f"{m}.create_weights",
            "vLLM lets a model loader build quantized layers whose parameters it binds afterwards without allocating "
            "them (0.33.0 has only IpcModelLoader's meta build, whose parameters set_data cannot rebind to device "
            "memory)" + (", and CompressedTensorsLinearMethod knows its layer" if m == QUANT_METHODS[2] else ""),
            "placeholders",
        )
        for m in QUANT_METHODS
    ),
    Row(
        CORRECTNESS,
        f"{EMBEDDING_METHOD}.create_weights",
        "vLLM lets a model loader build the embedding and an untied head without allocating their weights "
        "(0.33.0 has only IpcModelLoader's meta build, whose parameters set_data cannot rebind to device memory)",
        "placeholders",
    ),
    # --- weight_cache: vLLM's weight cache shares AWQ/GPTQ/compressed-tensors Marlin layers ----------------
    *(
        Row(
            WEIGHT_CACHE,
            f"{m}.supports_pre_processed_weights",
            f"{_cls(m)} declares supports_pre_processed_weights when MarlinLinearKernel serves it with fp16/bf16 "
            "activations" + (" (for the CompressedTensorsWNA16 scheme of its layer)" if m == QUANT_METHODS[2] else
                             " and when MacheteLinearKernel does (vLLM 0.34.0 declares it for Marlin only)"),
            "post_processing",
        )
        for m in QUANT_METHODS
    ),
    *(
        Row(
            WEIGHT_CACHE,
            f"{m}.supports_pre_processed_weights",
            f"{_cls(m)} declares supports_pre_processed_weights on the Marlin MoE backend with fp16/bf16 activations",
            "moe_post_processing",
        )
        for m in MOE_QUANT_METHODS
    ),
    Row(
        WEIGHT_CACHE,
        f"{_CT_KV_CACHE_METHOD}.process_weights_after_loading",
        "CompressedTensorsKVCacheMethod.process_weights_after_loading takes BaseKVCacheMethod's pre-processed branch "
        "under weights_already_processed() instead of reading its meta scale placeholders with .item()",
        "weight_cache",
    ),
    Row(
        WEIGHT_CACHE,
        f"{_PROTOCOL}:WeightCacheKey.from_model_config",
        f"{_AUTO_MARLIN} (then nothing is forced, and daemon and engine keys match unaided)",
        "weight_cache",
        needs="kernel_config_key",  # the key takes kernel_config from 0.33.0 (0.30-0.32: TypeError, no backend fields)
    ),
    *(
        Row(
            WEIGHT_CACHE,
            f"{_IPC_LOADER}.{step}",
            f"{_AUTO_MARLIN}, and UnsupportedQuantForIPCError names the kernel settings to check",
            "weight_cache",
        )
        for step in ("_build_model", "_fallback_load")
    ),
    Row(
        WEIGHT_CACHE,
        f"{DAEMON_MODULE}:WeightCacheDaemon.get_model",
        f"{_AUTO_MARLIN}, and vLLM gives the loader a hook after a daemon's fill (to end its early page-locking)",
        "weight_cache",
        deferred=True,  # vLLM imports the daemon module only in `vllm preload` processes
        needs="vllm_preload",  # 0.30.0's daemon has neither (python -m ...daemon, get_daemon_model)
    ),
    Row(
        WEIGHT_CACHE,
        f"{DAEMON_MODULE}:get_draft_daemon_config",
        "vllm preload page-locks a bundle ahead of its daemons' fill, or gives plugins a hook before it spawns them",
        "weight_cache",
        deferred=True,
        needs="vllm_preload",
    ),
    Row(
        WEIGHT_CACHE,
        RUN_DAEMON,
        "vllm preload's spawned daemons call load_general_plugins()",
        "weight_cache",
        deferred=True,
        needs="vllm_preload",
    ),
    # --- speed: nothing but a faster start, inert outside marlin-pack's paths (scope) ----------------------
    Row(
        SPEED,
        f"{_WORKER}.load_model",
        "vLLM's model runner stops running full gc.collect() inside the span 'Model loading took' reports "
        "(DeviceMemoryProfiler), and the construct/cache_key patches this one scopes in engines are retired",
        "gc_freeze",
        deferred=True,  # imported by vLLM only in GPU worker processes
    ),
    # The helpers started early are counted in vLLM's memory snapshot only where the loader's memory hook waits for them.
    Row(SPEED, f"{_WORKER}.init_device", _WORKER_HOOKS, "worker_preload", deferred=True, needs="memory_hook"),
    Row(SPEED, f"{_WORKER}.initialize_from_config", _WORKER_HOOKS, "worker_preload", deferred=True, needs="memory_hook"),
    Row(SPEED, f"{_GPTQ_UTILS}:deepcopy", f"gptq_utils.get_linear_quant_method {_NO_DEEP_COPY}", "construct"),
    Row(SPEED, f"{AUTO_GPTQ}:deepcopy", f"auto_gptq.get_moe_quant_method {_NO_DEEP_COPY}", "construct"),
    Row(
        SPEED,
        f"{_GPTQ_UTILS}:is_layer_gptq_quantized",
        "is_layer_gptq_quantized stops testing every quantized module name of the checkpoint as a substring of "
        "the layer's prefixes (a set lookup)",
        "construct",
    ),
    Row(
        SPEED,
        f"{_LOADER}.reload.meta:_parameter_storage_ptrs",
        "record_metadata_for_reloading stops collecting the storage pointers of every parameter below every "
        "module (they are read only for modules with non-persistent buffers)",
        "construct",
    ),
    Row(
        SPEED,
        f"{_LOADER}.utils:record_metadata_for_reloading",
        "record_metadata_for_reloading asks torch.get_default_device() once per model, not twice per module",
        "construct",
    ),
    Row(
        SPEED,
        f"{_PROTOCOL}:filter_duplicate_safetensors_files",
        "filter_duplicate_safetensors_files joins each file name of the index once, not once per tensor",
        "cache_key",
    ),
)

# The modules of this package that build replacements, in installation order (see patches/__init__.py).
PROVIDERS = tuple(dict.fromkeys(row.provider for row in ROWS))


def patches(provider: str, makers: Mapping[str, Callable[[Any], Any]]) -> tuple[Patch, ...]:
    """The :class:`~.registry.Patch` of every row of ``provider`` (a module name; its last part counts), in
    catalog order, each with its replacement from ``makers`` (target -> make).

    Raises:
        RuntimeError: ``makers`` does not cover exactly the provider's rows (a patch without a row, or a row
            without a patch: the catalog and the module disagree).
    """
    name = provider.rsplit(".", 1)[-1]
    rows = [row for row in ROWS if row.provider == name]
    if set(makers) != {row.target for row in rows}:
        raise RuntimeError(
            f"marlin-pack: patches of {name} and the catalog disagree: "
            f"no row for {sorted(set(makers) - {r.target for r in rows})}, "
            f"no patch for {sorted({r.target for r in rows} - set(makers))}"
        )
    return tuple(
        Patch(row.target, makers[row.target], remove_when=row.remove_when, purpose=row.purpose, deferred=row.deferred)
        for row in rows
    )
