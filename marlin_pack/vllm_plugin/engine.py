"""Every read (and the few writes) of vLLM internals the loader and the patches need, for every release served.

Facts are returned as the plain dataclasses of ``decision.py``; layer state is finished the
way ``MarlinLinearKernel.process_weights_after_loading`` (or, on SM90, ``MacheteLinearKernel``'s) leaves it in the
running release. What differs between releases is read from the release's entry (:mod:`.releases`), never from a
version comparison here. Importing this module imports vLLM: only vLLM processes (the loader, the patches) import it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
import vllm.envs as envs
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.kernels.linear.mixed_precision.machete import MacheteLinearKernel
from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_empty, marlin_padded_nk

from marlin_pack.vllm_plugin import releases
from marlin_pack.vllm_plugin.decision import EngineFacts
from marlin_pack.vllm_plugin.layer_check import SUPPORTED_METHODS, LayerFacts
from marlin_pack.vllm_plugin.stubs import is_stub
from marlin_pack.vllm_plugin.version_guard import vllm_version

__all__ = [
    "built_parameters",
    "freeze_gc_heap",
    "engine_facts",
    "marlin_kernel",
    "method_name",
    "force_marlin",
    "quantized_layers",
    "layer_facts",
    "is_marlin_16bit",
    "is_prepackable_16bit",
    "check_layout",
    "check_marlin_layout",
    "check_machete_layout",
    "finish_layer",
    "finish_marlin_layer",
    "keep_loaded_zero_points",
    "running_release",
]


def engine_facts(vllm_config: VllmConfig, model_config: ModelConfig) -> EngineFacts:
    """What the bundle must fit, read from vLLM (this worker's TP rank and pipeline stage once distributed is up)."""
    from vllm.distributed import parallel_state as ps

    parallel = vllm_config.parallel_config
    pp_size, pp_rank = parallel.pipeline_parallel_size, 0
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)  # each replica's workers see the whole DP size
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0) if dp_size > 1 else 0  # set per replica before distributed
    pcp_size, pcp_rank = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1), 0
    if ps.model_parallel_is_initialized():
        tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if pp_size > 1:  # the stage this worker builds (vLLM's make_layers asks the same group)
            pp_group = ps.get_pp_group()
            pp_size, pp_rank = pp_group.world_size, pp_group.rank_in_group
        if dp_size > 1:  # the replica vLLM's FusedMoEParallelConfig.make places experts for
            dp_rank = ps.get_dp_group().rank_in_group
        if pcp_size > 1:
            pcp_rank = ps.get_pcp_group().rank_in_group
    else:
        tp_size, tp_rank = parallel.tensor_parallel_size, 0
    kc = vllm_config.kernel_config
    return EngineFacts(
        model=str(model_config.model),
        vllm_version=vllm_version(),
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        dp_size=dp_size,
        dp_rank=dp_rank,
        expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)),
        expert_placement=str(getattr(parallel, "expert_placement_strategy", "linear")),
        all2all_backend=str(getattr(parallel, "all2all_backend", "allgather_reducescatter")),
        pcp_size=pcp_size,
        pcp_rank=pcp_rank,
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization,
        marlin_input_dtype=_env("VLLM_MARLIN_INPUT_DTYPE"),  # gone in 0.34.0 (8-bit activations left Marlin)
        batch_invariant=bool(envs.VLLM_BATCH_INVARIANT),
        disabled_kernels=tuple(envs.VLLM_DISABLED_KERNELS or ()),
        linear_backend=str(kc.linear_backend),
        transformers_version=_installed("transformers"),
        linear_backend_per_quant=dict(kc.linear_backend_per_quant or {}) or None,
        revision=getattr(model_config, "revision", None),
        capability=_capability(),
    )


def running_release() -> releases.Release:
    """The running vLLM release's entry (the plugin's loader and patches run only on a release served).

    Raises:
        RuntimeError: marlin-pack does not serve it.
    """
    entry = releases.release(vllm_version())
    if entry is None:
        raise RuntimeError(releases.unsupported_reason(vllm_version()))
    return entry


def _env(name: str) -> Any:
    """vLLM's value of the environment variable ``name``, None where the running release no longer has it."""
    return getattr(envs, name) if running_release().has_env(name) else None


def _capability() -> int | None:
    """This process's GPU's compute capability as vLLM reads it (major*10 + minor); None without one."""
    from vllm.platforms import current_platform

    try:
        cc = current_platform.get_device_capability()
    except Exception:  # noqa: BLE001 - no device: the decision does not check the kernel family
        return None
    return None if cc is None else int(cc[0]) * 10 + int(cc[1])


def freeze_gc_heap() -> None:
    """Move every object the garbage collector tracks to its permanent generation (``gc.freeze``).

    vLLM's ``DeviceMemoryProfiler`` runs ``gc.collect()`` three times inside the span that
    "Model loading took" reports (once before the loader, twice after), and each full
    collection walks the whole heap: ~0.35 s in an engine process on an H200 host, more than
    a prepacked 8 GB load's read+copy. Called at the start of model loading, right after the
    profiler's own collection, this makes the later collections walk only what loading
    created. vLLM freezes the worker heap itself after warm-up (``freeze_gc_heap``) and
    unfreezes it at shutdown; this only does it earlier, for objects that existed before
    the model (imports, configs), which live as long as the process anyway.
    """
    gc.freeze()


def force_marlin(kernel_config: Any) -> None:
    """Make vLLM choose MarlinLinearKernel for mixed-precision (AWQ/GPTQ) layers.

    Same effect as ``--kernel-config '{"linear_backend_per_quant": {"mixed_precision": "marlin"}}'``:
    ``choose_mp_linear_kernel`` reads it from the current vLLM config, and it leaves the
    other layer types' backend choice alone.
    """
    per_quant = getattr(kernel_config, "linear_backend_per_quant", None) or {}
    kernel_config.linear_backend_per_quant = {**per_quant, "mixed_precision": "marlin"}


def built_parameters(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The checkpoint ``names`` that name a parameter of ``model``, through its ``hf_to_vllm_mapper`` where it has one
    (as its ``load_weights`` maps them): for a pipeline stage, what vLLM built there (``PPMissingLayer`` holds none)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # WeightsMapper.map_name is public from 0.31; 0.30 has the same function as _map_name
    map_name = (getattr(mapper, "map_name", None) or mapper._map_name) if mapper is not None else None
    found = []
    for name in names:
        mapped = map_name(name) if map_name is not None else name
        if mapped in params:
            found.append(name)
    return found


def named_modules_as_built(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()``, each module under the name vLLM built it with (its layer ``prefix``) where the tree
    reaches it under more than one: from 0.34 vLLM's Transformers backend hands an MoE block's shared expert to the
    experts' MoERunner (``mlp.experts._shared_experts._layer.shared_experts``), which comes before the block's own
    ``mlp.shared_mlp`` in the tree; the quant config, ``load_weights`` and a bundle name it by the latter."""
    names: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
        modules.setdefault(id(module), module)
    out = []
    for key, found in names.items():
        prefix = getattr(modules[key], "prefix", None)
        out.append((prefix if prefix in found else found[0], modules[key]))
    return out


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with a quantization method that is not an unquantized or KV-cache one (:func:`named_modules_as_built`)."""
    found = {}
    for name, module in named_modules_as_built(model):
        qm = getattr(module, "quant_method", None)
        if not isinstance(qm, QuantizeMethodBase) or isinstance(qm, BaseKVCacheMethod):
            continue
        if type(qm).__name__.startswith("Unquantized"):
            continue
        found[name] = module
    return found


def marlin_kernel(quant_method: Any, layer: nn.Module | None) -> Any:
    """The layer's MPLinear kernel: on the quant method (AWQ/GPTQ), or on ``layer.scheme``
    (compressed-tensors, whose linear method delegates to a per-layer scheme); None if neither has one."""
    kernel = getattr(quant_method, "kernel", None)
    if kernel is None and layer is not None:
        kernel = getattr(getattr(layer, "scheme", None), "kernel", None)
    return kernel


def method_name(quant_method: Any, layer: nn.Module | None) -> str:
    """The quant method's class name; ``Method:Scheme`` where the method delegates to ``layer.scheme``."""
    scheme = getattr(layer, "scheme", None) if layer is not None else None
    name = type(quant_method).__name__
    return f"{name}:{type(scheme).__name__}" if scheme is not None and name.startswith("CompressedTensors") else name


def layer_facts(module: nn.Module, skips_when_marked: bool) -> LayerFacts:
    """The kernel configuration vLLM chose for one quantized layer."""
    qm = module.quant_method
    kernel = marlin_kernel(qm, module)
    c = getattr(kernel, "config", None)
    has_bias = getattr(module, "bias", None) is not None
    if c is None:
        return LayerFacts(method=method_name(qm, module), has_bias=has_bias, skips_when_marked=skips_when_marked)
    size_k, size_n = c.partition_weight_shape
    return LayerFacts(
        method=method_name(qm, module),
        kernel=type(kernel).__name__,
        partition_shape=(int(size_k), int(size_n)),
        padded_nk=tuple(marlin_padded_nk(size_n, size_k, c.group_size)),
        group_size=int(c.group_size),
        weight_type=str(c.weight_type),
        act_dtype=str(c.act_type).removeprefix("torch."),
        zero_points=bool(c.zero_points),
        has_bias=has_bias,
        skips_when_marked=skips_when_marked,
    )


def is_marlin_16bit(quant_method: Any, layer: nn.Module | None = None) -> bool:
    """True when the layer's kernel is exactly MarlinLinearKernel with fp16/bf16 activations
    (compressed-tensors: only its weight-only WNA16 scheme)."""
    scheme = getattr(layer, "scheme", None) if layer is not None else None
    if scheme is not None and method_name(quant_method, layer) not in SUPPORTED_METHODS:
        return False
    kernel = marlin_kernel(quant_method, layer)
    if type(kernel) is not MarlinLinearKernel:
        return False
    return getattr(getattr(kernel, "config", None), "act_type", None) in (torch.float16, torch.bfloat16)


def is_prepackable_16bit(quant_method: Any, layer: nn.Module | None = None) -> bool:
    """True when the layer's kernel is MarlinLinearKernel or MacheteLinearKernel with fp16/bf16 activations: the
    kernels whose post-processed tensors a bundle (or the weight cache) can hand over."""
    if is_marlin_16bit(quant_method, layer):
        return True
    scheme = getattr(layer, "scheme", None) if layer is not None else None
    if scheme is not None and method_name(quant_method, layer) not in SUPPORTED_METHODS:
        return False
    kernel = marlin_kernel(quant_method, layer)
    return type(kernel) is MacheteLinearKernel and kernel.config.act_type in (torch.float16, torch.bfloat16)


def _layer_name(layer: nn.Module) -> str:
    return str(getattr(layer, "prefix", "") or type(layer).__name__)


def check_marlin_layout(quant_method: Any, layer: nn.Module) -> None:
    """Check that a layer's tensors already have the shapes MarlinLinearKernel's post-processing gives.

    Raises:
        RuntimeError: a tensor is missing (still on ``meta``) or not in the Marlin layout
            this layer's kernel configuration implies.
    """
    kernel = marlin_kernel(quant_method, layer)
    c = kernel.config
    size_k, size_n = c.partition_weight_shape
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, c.group_size)
    bits = c.weight_type.size_bits
    where = f"layer {_layer_name(layer)} ({type(quant_method).__name__})"

    def check(name: str, want: tuple[int | None, ...]) -> torch.Tensor:
        t = getattr(layer, name, None)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            raise RuntimeError(f"{where}: the weight cache did not provide {name}")
        got = tuple(t.shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            raise RuntimeError(
                f"{where}: pre-processed {name} has shape {list(got)}, MarlinLinearKernel holds "
                f"{['*' if w is None else w for w in want]} for (K, N)=({size_k}, {size_n}) padded to "
                f"({padded_k}, {padded_n}); the weight cache holds another layout"
            )
        return t

    check(kernel.w_q_name, (padded_k // 16, padded_n * bits // 2))
    w_s = check(kernel.w_s_name, (None, padded_n))
    if c.zero_points:
        check(kernel.w_zp_name, (w_s.shape[0], padded_n * bits // 32))
    if getattr(layer, "bias", None) is not None:
        check("bias", (padded_n,))


def check_machete_layout(quant_method: Any, layer: nn.Module) -> None:
    """Check that a layer's tensors already have the shapes and dtypes MacheteLinearKernel's post-processing gives:
    prepacked weight ``[K*bits/32, N]`` int32, scales ``[G, N]``, pre-scaled zero points ``[G, N]`` (activation dtype).

    Raises:
        RuntimeError: a tensor is missing (still on ``meta``) or not in that layout.
    """
    kernel = marlin_kernel(quant_method, layer)
    c = kernel.config
    size_k, size_n = c.partition_weight_shape
    where = f"layer {_layer_name(layer)} ({type(quant_method).__name__})"

    def check(name: str, want: tuple[int | None, ...], dtype: torch.dtype) -> torch.Tensor:
        t = getattr(layer, name, None)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            raise RuntimeError(f"{where}: the weight cache did not provide {name}")
        got = tuple(t.shape)
        if t.dtype != dtype or len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            raise RuntimeError(
                f"{where}: pre-processed {name} is {t.dtype} {list(got)}, MacheteLinearKernel holds {dtype} "
                f"{['*' if w is None else w for w in want]} for (K, N)=({size_k}, {size_n}); the weight cache holds another layout"
            )
        return t

    check(kernel.w_q_name, (size_k * c.weight_type.size_bits // 32, size_n), torch.int32)
    w_s = check(kernel.w_s_name, (None, size_n), c.act_type)
    if c.zero_points:
        check(kernel.w_zp_name, (w_s.shape[0], size_n), c.act_type)


def check_layout(quant_method: Any, layer: nn.Module) -> None:
    """:func:`check_machete_layout` or :func:`check_marlin_layout`, by the layer's kernel."""
    if type(marlin_kernel(quant_method, layer)) is MacheteLinearKernel:
        check_machete_layout(quant_method, layer)
    else:
        check_marlin_layout(quant_method, layer)


def finish_layer(quant_method: Any, layer: nn.Module) -> None:
    """Finish a layer whose tensors arrived final, as its kernel's post-processing leaves it: Marlin's
    (:func:`finish_marlin_layer`); Machete's sets nothing besides the tensors it transforms."""
    kernel = marlin_kernel(quant_method, layer)
    if running_release().new_params:
        _new_params(kernel, layer)
    if type(kernel) is not MacheteLinearKernel:
        finish_marlin_layer(quant_method, layer)


def _new_params(kernel: Any, layer: nn.Module) -> None:
    """vLLM 0.30-0.32's ``MPLinearKernel._transform_param``: each transformed parameter (``w_q``, ``w_s``, and ``w_zp`` with
    zero points) is re-registered as a plain ``torch.nn.Parameter`` by vLLM's ``replace_parameter`` (the old one's
    ``weight_loader`` kept), its data unchanged; a parameter already plain is left as it is (idempotent)."""
    from vllm.model_executor.layers.quantization.utils import replace_parameter

    names = [kernel.w_q_name, kernel.w_s_name, *([kernel.w_zp_name] if kernel.config.zero_points else [])]
    for name in names:
        param = getattr(layer, name, None) if name is not None else None
        if isinstance(param, torch.Tensor) and type(param) is not nn.Parameter:
            replace_parameter(layer, name, nn.Parameter(param.data, requires_grad=False))


def finish_marlin_layer(quant_method: Any, layer: nn.Module) -> None:
    """Set what MarlinLinearKernel's post-processing sets besides the tensors it transforms, in the running release.

    With 16-bit activations, without zero points (GPTQ, symmetric compressed-tensors), Marlin reads an empty
    ``int32[0]`` zero-point parameter (``marlin_make_empty``). How the release leaves the unused one is its entry's
    ``finish``:

    * ``empty_qzeros`` (0.31-0.33): the kernel's zero-point parameter (``qzeros``) becomes that empty parameter, and
      ``input_global_scale = None``;
    * ``workspace`` (0.30): as ``empty_qzeros``, and the kernel gets its ``workspace`` (``marlin_make_workspace_new``,
      reusing one it has), which its ``apply_weights`` passes to every Marlin GEMM;
    * ``w_zp`` (0.34): a loaded ``qzeros`` is retired (``retire_parameter``: registered, its data kept, read by no
      kernel), and the empty parameter is ``w_zp``, the kernel's zero-point name from then on; no ``input_global_scale``.

    Called for every layer whose tensors arrived final (from a bundle or the weight cache); idempotent.
    """
    kernel = marlin_kernel(quant_method, layer)
    finish = running_release().finish
    if finish == "w_zp":
        _finish_w_zp(kernel, layer)
        return
    if finish not in ("empty_qzeros", "workspace"):
        raise NotImplementedError(f"marlin-pack cannot finish a Marlin layer as vLLM {vllm_version()} does ({finish})")
    if finish == "workspace":
        _finish_workspace(kernel, getattr(layer, kernel.w_q_name).device)
    if kernel.w_zp_name is None:  # as the kernel does: Marlin needs a zero-point parameter
        kernel.w_zp_name = "w_zp"
    if not kernel.config.zero_points:
        device = getattr(layer, kernel.w_q_name).device
        zp = getattr(layer, kernel.w_zp_name, None)
        if not _is_empty_on(zp, device):
            setattr(layer, kernel.w_zp_name, marlin_make_empty(device))
    if "input_global_scale" not in layer._parameters:
        layer.input_global_scale = None


def keep_loaded_zero_points(layer: nn.Module, word: int | None) -> None:
    """Before a layer filled from a bundle is finished: where the running release keeps the loaded zero points its
    Marlin kernel does not read (``finish`` ``w_zp``: retired, data kept), give them the checkpoint's value ``word``
    (every word of symmetric GPTQ's ``qzeros``; None: nothing to keep). Elsewhere finishing replaces them."""
    if word is None or running_release().finish != "w_zp":
        return
    kernel = marlin_kernel(layer.quant_method, layer)
    if type(kernel) is not MarlinLinearKernel or kernel.config.zero_points or kernel.w_zp_name in (None, "w_zp"):
        return
    zp = getattr(layer, kernel.w_zp_name, None)
    if not isinstance(zp, torch.Tensor) or zp.numel() == 0:
        return
    if is_stub(zp):  # still no memory: finishing keeps it, and materialize_stubs then gives it memory with this value
        zp.data = torch.full((1,), word, dtype=torch.int32, device=zp.device).expand(zp.shape)
    else:
        zp.data.fill_(word)


def _finish_workspace(kernel: Any, device: torch.device) -> None:
    """vLLM 0.30.0's MarlinLinearKernel: ``self.workspace = marlin_make_workspace_new(device, existing=...)``."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new

    kernel.workspace = marlin_make_workspace_new(device, existing=getattr(kernel, "workspace", None))


def _is_empty_on(t: Any, device: torch.device) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 0 and t.device == device and t.dtype == torch.int32


def _finish_w_zp(kernel: Any, layer: nn.Module) -> None:
    """vLLM 0.34.0's MarlinLinearKernel: ``_retire_unused_zp``, then ``w_zp`` = ``marlin_make_empty`` (no zero points)."""
    from vllm.model_executor.utils import replace_parameter, retire_parameter

    if kernel.config.zero_points:
        if kernel.w_zp_name is None:
            kernel.w_zp_name = "w_zp"
        return
    device = getattr(layer, kernel.w_q_name).device
    if kernel.w_zp_name not in (None, "w_zp") and getattr(layer, kernel.w_zp_name, None) is not None:
        retire_parameter(layer, kernel.w_zp_name)  # loaded but unused: kept, with its data
    kernel.w_zp_name = "w_zp"
    if not _is_empty_on(getattr(layer, "w_zp", None), device):
        replace_parameter(layer, "w_zp", marlin_make_empty(device))


def _installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None: not installed), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
