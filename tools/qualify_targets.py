"""What ``tools/qualify_release.py`` fingerprints in a vLLM wheel: the one list, as data.

Four kinds of rows, each compared between two wheels:

* :data:`LAYOUT`: the Python that defines a bundle's bytes (16-bit activations): Marlin dense, Machete dense, Marlin
  MoE and compressed-tensors WNA16 layout helpers, the ``process_weights_after_loading`` steps that call them, the
  parameter shapes they are created with, kernel choice and TP sharding. Paths are those of the newest supported
  release; a name found elsewhere in a wheel is reported as moved.
* :data:`KERNELS`: the CUDA kernels that lay the bytes out (Marlin repack, Machete prepack), by family; every
  instantiation with 16-bit activations that a wheel ships is fingerprinted (PTX and SASS).
* the plugin's surface: every target of ``marlin_pack/vllm_plugin/patches/catalog.py`` (read from the catalog
  itself, not copied here), plus :data:`PLUGIN_READS` (vLLM functions the plugin calls or subclasses) and
  :data:`PLUGIN_ENV` (vLLM environment variables it reads).

A function is named ``"module:qualname"``. ``qualname`` may be a dotted path through classes
(``Class.method``), a module-level assignment (``NAME``), one entry of a dict literal assigned at module level
(``NAME[key expression]``), or ``*`` for the whole module.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Item", "KernelFamily", "LAYOUT", "KERNELS", "KERNEL_LIBRARIES", "PLUGIN_READS", "PLUGIN_ENV"]


@dataclass(frozen=True)
class Item:
    """One Python fingerprint: ``target`` is ``"module:qualname"``; ``group`` says what it belongs to."""

    target: str
    group: str


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family: ``symbol`` is a substring of its mangled name; ``parser`` names the rule in
    ``qualify_kernels`` that turns a mangled name into a key (or drops an instantiation that is not for 16-bit
    activations)."""

    name: str
    symbol: str
    parser: str
    group: str


_Q = "vllm.model_executor.layers.quantization"
_MU = f"{_Q}.utils.marlin_utils"
_QU = f"{_Q}.utils.quant_utils"
_MP = "vllm.model_executor.kernels.linear.mixed_precision"
_OR = "vllm.model_executor.layers.fused_moe.oracle.int_wna16"
_OPS = "vllm._custom_ops"
_LIN = "vllm.model_executor.layers.linear"
_PAR = "vllm.model_executor.parameter"


def _items(group: str, module: str, *names: str) -> tuple[Item, ...]:
    return tuple(Item(f"{module}:{n}", group) for n in names)


# The layout-defining Python (docs/qualifying-a-release.md says what a change here means).
LAYOUT: tuple[Item, ...] = (
    *_items(
        "marlin",
        _MU,
        "marlin_padded_nk",
        "marlin_pad_qweight",
        "marlin_pad_scales",
        "marlin_pad_dim",
        "get_scale_perms",
        "marlin_permute_bias",
        "marlin_moe_padded_intermediate",
        "check_marlin_supports_layer",
        "MARLIN_SUPPORTED_GROUP_SIZES",
        "marlin_permute_scales",
        "marlin_zero_points",
        "awq_to_marlin_zero_points",
    ),
    *_items("marlin_moe", _MU, "moe_awq_to_marlin_zero_points", "marlin_moe_permute_scales"),
    *_items(
        "marlin",
        _QU,
        "pack_cols",
        "unpack_cols",
        "pack_quantized_values_into_int32",
        "unpack_quantized_values_into_int32",
    ),
    Item(f"{_Q}.utils.machete_utils:*", "machete"),
    Item(f"{_OPS}:machete_prepack_B", "machete"),
    *_items("marlin", _OPS, "gptq_marlin_repack", "awq_marlin_repack"),
    *_items("marlin_moe", _OPS, "gptq_marlin_moe_repack", "awq_marlin_moe_repack"),
    Item(f"{_MP}.marlin:MarlinLinearKernel.process_weights_after_loading", "marlin"),
    Item(f"{_MP}.machete:MacheteLinearKernel.process_weights_after_loading", "machete"),
    Item(f"{_MP}.machete:MacheteLinearKernel.can_implement", "machete"),
    Item(f"{_Q}.auto_awq:_convert_awq_to_standard_format", "marlin"),
    Item(f"{_Q}.auto_awq:AutoAWQMarlinLinearMethod.create_weights", "marlin"),
    Item(f"{_Q}.auto_gptq:AutoGPTQLinearMethod.create_weights", "marlin"),
    Item(f"{_Q}.compressed_tensors.schemes.compressed_tensors_wNa16:CompressedTensorsWNA16.create_weights", "ct_wna16"),
    Item(
        f"{_Q}.compressed_tensors.schemes.compressed_tensors_wNa16:CompressedTensorsWNA16.process_weights_after_loading",
        "ct_wna16",
    ),
    *_items("marlin_moe", _OR, "_process_weights_marlin", "_process_awq_weights_marlin", "_pad_w13_shard_cols", "_pad_rows"),
    Item("vllm.model_executor.kernels.linear:_POSSIBLE_KERNELS[PlatformEnum.CUDA]", "kernel_choice"),
    Item("vllm.model_executor.kernels.linear:_resolve_backend_kernels", "kernel_choice"),
    *_items(
        "sharding",
        _LIN,
        "adjust_marlin_shard",
        "ColumnParallelLinear.weight_loader_v2",
        "MergedColumnParallelLinear.weight_loader_v2",
        "QKVParallelLinear.weight_loader_v2",
        "RowParallelLinear.weight_loader_v2",
    ),
    *_items(
        "sharding",
        _PAR,
        "_ColumnvLLMParameter.load_column_parallel_weight",
        "_ColumnvLLMParameter.load_merged_column_weight",
        "_ColumnvLLMParameter.load_qkv_weight",
        "RowvLLMParameter.load_row_parallel_weight",
        "PackedvLLMParameter.adjust_shard_indexes_for_packing",
        "permute_param_layout_",
        "_adjust_shard_indexes_for_marlin",
        "_adjust_shard_indexes_for_packing",
    ),
)

# The shared objects searched for kernels (a family found in another one of them is reported with its library).
KERNEL_LIBRARIES = r"^vllm/_(moe_)?C[^/]*\.so$"

KERNELS: tuple[KernelFamily, ...] = (
    KernelFamily("marlin::gptq_marlin_repack_kernel", "gptq_marlin_repack_kernelI", "marlin_repack", "marlin"),
    KernelFamily("marlin::awq_marlin_repack_kernel", "awq_marlin_repack_kernelI", "marlin_repack", "marlin_moe"),
    KernelFamily("machete::prepack_B_kernel", "machete16prepack_B_kernelI", "machete_prepack", "machete"),
)

# vLLM functions the plugin calls, wraps or overrides outside its patches (each has a row besides the catalog's).
PLUGIN_READS: tuple[Item, ...] = (
    *_items(
        "plugin",
        "vllm.model_executor.utils",
        "weights_already_processed",
        "is_weights_pre_processed",
        "replace_parameter",
        "retire_parameter",
    ),
    *_items("plugin", _MU, "marlin_make_empty", "marlin_make_workspace_new", "get_marlin_workspace"),
    *_items(
        "plugin",
        "vllm.model_executor.model_loader.base_loader",
        "BaseModelLoader.create_model",
        "BaseModelLoader.get_external_weight_memory",
        "BaseModelLoader.load_model",
    ),
    Item("vllm.model_executor.model_loader:register_model_loader", "plugin"),
    Item("vllm.model_executor.model_loader.utils:process_weights_after_loading", "plugin"),
    Item(f"{_Q}.kv_cache:BaseKVCacheMethod.process_weights_after_loading", "plugin"),
)

# vLLM environment variables the plugin reads (vllm/envs.py ``environment_variables``).
PLUGIN_ENV: tuple[str, ...] = ("VLLM_MARLIN_INPUT_DTYPE", "VLLM_BATCH_INVARIANT", "VLLM_DISABLED_KERNELS")
