"""Independent reference ("oracle") for the CPU tests, built from vLLM 0.33.0's own code.

``reference_rank_tensors(model_dir, tp_size, rank, dtype)`` returns what stock vLLM 0.33.0
holds, on one tensor-parallel rank, for every AWQ/GPTQ Marlin linear layer of a checkpoint
after ``process_weights_after_loading`` with ``MarlinLinearKernel`` and 16-bit activations.

It deliberately does not import or mirror marlin-pack. Everything that decides the result is
vLLM's real code, run on the CPU:

real (unmodified) vLLM code
  * quant config: ``AutoGPTQConfig`` / ``AutoAWQConfig`` chosen through their own
    ``override_quantization_method`` and built with ``from_config(quantization_config)``,
    ``maybe_update_config(model_dir)`` (safetensors metadata -> quantized-module lists),
    ``apply_vllm_mapper`` and the model class's ``packed_modules_mapping``, as ``VllmConfig``
    and ``SupportsQuant`` do;
  * layers: ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear`` built
    with the same arguments as ``LlamaAttention`` / ``LlamaMLP`` (Qwen2 identical), under
    ``set_default_torch_dtype(dtype)``; their ``quant_method`` comes from
    ``resolve_quant_method`` -> ``get_quant_method`` (including AWQ's Marlin/Triton choice and
    ``check_marlin_supports_layer``), and ``create_weights`` creates the real vLLM parameters;
  * loading: vLLM's ``AutoWeightsLoader`` with the model class's ``hf_to_vllm_mapper``
    (``.q_proj -> (.qkv_proj, "q")`` ... ``.up_proj -> (.gate_up_proj, 1)``) and the quant
    config's checkpoint mapper (drops ``g_idx``); it dispatches to the layers'
    ``load_weights`` / ``weight_loader`` / ``weight_loader_v2`` and the parameters'
    ``load_qkv_weight`` / ``load_merged_column_weight`` / ``load_row_parallel_weight``;
    checkpoint files are selected with ``filter_duplicate_safetensors_files``;
  * post-processing: ``quant_method.process_weights_after_loading(layer)`` (AWQ:
    ``_convert_awq_to_standard_format``; then ``MarlinLinearKernel.process_weights_after_loading``
    with ``marlin_padded_nk``, padding, ``marlin_permute_scales``, ``marlin_zero_points``,
    ``marlin_make_empty``, ``marlin_permute_bias``), then ``update_param_tp_status`` as in
    ``model_loader.utils.process_weights_after_loading``.

patched, for the duration of one call only (everything is restored afterwards)
  * TP: ``get_tensor_model_parallel_rank`` / ``get_tensor_model_parallel_world_size`` as
    looked up by ``vllm.model_executor.layers.linear`` and ``vllm.model_executor.parameter``
    return ``rank`` / ``tp_size`` (no process group is created). The layers' own
    ``update_param_tp_status`` re-stamps every parameter from the layer, so the rank that
    matters is the one ``linear.py`` sees;
  * platform: ``current_platform._enum = PlatformEnum.CUDA`` and
    ``current_platform.get_device_capability() -> DeviceCapability(9, 0)`` (an H200), so
    ``is_cuda()`` is true and ``is_cpu()`` / ``is_xpu()`` / ``is_rocm()`` false for
    ``verify_marlin_supported``, ``query_marlin_supported_quant_types``,
    ``AutoAWQConfig.get_quant_method`` and ``MarlinLinearKernel.can_implement``;
  * kernel choice: ``choose_mp_linear_kernel`` (as looked up by ``auto_awq`` / ``auto_gptq``)
    returns ``MarlinLinearKernel`` after running its real ``get_min_capability`` and
    ``can_implement`` checks, i.e. ``--linear-backend marlin`` without the fallback to another
    kernel; if Marlin cannot implement the layer, :class:`VllmRefusedError` is raised;
  * ``ops.gptq_marlin_repack`` (CUDA only) as looked up by
    ``vllm.model_executor.kernels.linear.mixed_precision.marlin.ops``: replaced by vLLM's
    pure-torch test reference ``marlin_utils_test.marlin_weights(codes, size_k, size_n,
    num_bits, get_weight_perm(num_bits, is_a_8bit), is_a_8bit)`` over the codes unpacked with
    ``quant_utils.unpack_quantized_values_into_int32`` (reported bit-identical to the CUDA op);
  * environment: ``VLLM_MARLIN_INPUT_DTYPE`` (int8/fp8 activations) and
    ``VLLM_BATCH_INVARIANT`` (no Marlin) are removed from ``os.environ`` while the layers are
    built, so the reference is always the 16-bit-activation Marlin layout; vLLM's logger is
    lowered to ERROR (it warns about fp16 scales loaded into bf16 and about tile padding).

written here (not vLLM code): the ``nn.Module`` tree that stands for
``LlamaForCausalLM``/``LlamaModel``/decoder layer (only the four linear layers, built with
Llama's arguments; ``bias`` from the presence of ``<module>.bias`` in the checkpoint), the
choice of checkpoint tensors fed to the loader (``qweight``/``qzeros``/``scales``/``g_idx``/
``bias`` of quantized q/k/v/o/gate/up/down projections) and the final ``.clone()``.

If vLLM itself refuses a case (a group straddling the TP shard, heads not divisible by the TP
size, AWQ falling back to its Triton method, AWQ ``group_size=-1`` on a row-parallel layer at
TP > 1, ...), :class:`VllmRefusedError` is raised with vLLM's own message chained.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["VllmRefusedError", "reference_rank_tensors", "vllm_layer_names"]


class VllmRefusedError(RuntimeError):
    """Stock vLLM 0.33.0 would not serve this layer with MarlinLinearKernel (or fails on it)."""


class _OracleBug(Exception):
    """An internal consistency check of this harness failed (never a vLLM refusal)."""


# The target vLLM checkpoint/kernel conditions this oracle mirrors.
_CAPABILITY = (9, 0)  # H200
_ENV_OFF = ("VLLM_MARLIN_INPUT_DTYPE", "VLLM_BATCH_INVARIANT")
_LOCK = threading.RLock()

# vLLM fused layer -> (checkpoint modules, kind)
_ATTN = ("self_attn", {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",)})
_MLP = ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")


@functools.lru_cache(maxsize=1)
def _vllm() -> Any:
    """Import the vLLM modules once (about 5 s) and keep them."""
    import types

    import vllm  # noqa: F401
    import vllm.model_executor.kernels.linear.mixed_precision.marlin as marlin_mod
    import vllm.model_executor.layers.linear as linear_mod
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq
    import vllm.model_executor.layers.quantization.auto_gptq as auto_gptq
    import vllm.model_executor.parameter as parameter_mod
    from vllm import envs
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.model_executor.model_loader.weight_utils import (
        filter_duplicate_safetensors_files,
    )
    from vllm.model_executor.models import llama, qwen2, qwen3
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.scalar_type import scalar_types
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Resolve the platform object now (it is lazy) so every module shares it, and run the
    # lazy imports of the code paths used below while the platform is still unpatched
    # (some modules probe CUDA ops at import time when they think they are on CUDA).
    _ = current_platform._enum
    get_quantization_config("auto_gptq")
    import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401
    import vllm.model_executor.layers.quantization.online.moe_base  # noqa: F401
    import vllm.model_executor.model_loader.reload.torchao_decorator  # noqa: F401
    return types.SimpleNamespace(
        version=vllm.__version__,
        envs=envs,
        marlin_mod=marlin_mod,
        linear=linear_mod,
        parameter=parameter_mod,
        auto_awq=auto_awq,
        auto_gptq=auto_gptq,
        get_quantization_config=get_quantization_config,
        marlin_utils_test=marlin_utils_test,
        unpack=unpack_quantized_values_into_int32,
        filter_dup=filter_duplicate_safetensors_files,
        model_classes={
            "LlamaForCausalLM": llama.LlamaForCausalLM,
            "MistralForCausalLM": llama.LlamaForCausalLM,
            "Qwen2ForCausalLM": qwen2.Qwen2ForCausalLM,
            "Qwen3ForCausalLM": qwen3.Qwen3ForCausalLM,
        },
        default_model_class=llama.LlamaForCausalLM,
        AutoWeightsLoader=AutoWeightsLoader,
        PlatformEnum=PlatformEnum,
        platform=current_platform,
        DeviceCapability=DeviceCapability,
        scalar_types=scalar_types,
        set_default_torch_dtype=set_default_torch_dtype,
    )


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------


def _reference_gptq_marlin_repack(
    b_q_weight: torch.Tensor,
    size_k: int,
    size_n: int,
    num_bits: int,
    is_a_8bit: bool = False,
) -> torch.Tensor:
    """Pure-torch stand-in for the CUDA op, from vLLM's own test reference."""
    v = _vllm()
    pack = 32 // num_bits
    if (
        num_bits not in (4, 8)
        or b_q_weight.dtype != torch.int32
        or tuple(b_q_weight.shape) != (size_k // pack, size_n)
        or size_k % 16
        or size_n % 64
    ):
        raise _OracleBug(
            f"gptq_marlin_repack stand-in got {b_q_weight.dtype} {tuple(b_q_weight.shape)}, "
            f"size_k={size_k}, size_n={size_n}, num_bits={num_bits}"
        )
    wtype = {4: v.scalar_types.uint4b8, 8: v.scalar_types.uint8b128}[num_bits]
    codes = v.unpack(b_q_weight, wtype, packed_dim=0)  # [size_k, size_n], GPTQ order
    mut = v.marlin_utils_test
    return mut.marlin_weights(
        codes.contiguous(),
        size_k,
        size_n,
        num_bits,
        mut.get_weight_perm(num_bits, is_a_8bit),
        is_a_8bit,
    )


class _OpsProxy:
    """``vllm._custom_ops`` with ``gptq_marlin_repack`` replaced; everything else forwards."""

    def __init__(self, real: Any) -> None:
        self._real = real

    gptq_marlin_repack = staticmethod(_reference_gptq_marlin_repack)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _choose_marlin(config: Any, compute_capability: int | None = None) -> type:
    """``choose_mp_linear_kernel`` restricted to MarlinLinearKernel (real checks, no fallback)."""
    kernel = _vllm().marlin_mod.MarlinLinearKernel
    cc = compute_capability
    if cc is None:
        cc = _CAPABILITY[0] * 10 + _CAPABILITY[1]
    if kernel.get_min_capability() > cc:
        raise VllmRefusedError(f"MarlinLinearKernel needs capability {kernel.get_min_capability()}")
    ok, reason = kernel.can_implement(config)
    if not ok:
        raise VllmRefusedError(f"MarlinLinearKernel cannot implement {config}: {reason}")
    return kernel


@contextlib.contextmanager
def _patched(tp_size: int, rank: int):
    v = _vllm()
    saved: list[tuple[Any, str, Any]] = []

    def setattr_saved(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    env_saved = {k: os.environ.pop(k) for k in _ENV_OFF if k in os.environ}
    plat = v.platform
    # vLLM warns once per row-parallel layer that fp16 checkpoint scales are loaded into
    # bf16 parameters, and about tile padding; both are expected here.
    vllm_logger = logging.getLogger("vllm")
    old_level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        for mod in (v.linear, v.parameter):
            setattr_saved(mod, "get_tensor_model_parallel_rank", lambda: rank)
            setattr_saved(mod, "get_tensor_model_parallel_world_size", lambda: tp_size)
        setattr_saved(plat, "_enum", v.PlatformEnum.CUDA)
        setattr_saved(
            plat,
            "get_device_capability",
            lambda device_id=0: v.DeviceCapability(*_CAPABILITY),
        )
        for mod in (v.auto_awq, v.auto_gptq):
            setattr_saved(mod, "choose_mp_linear_kernel", _choose_marlin)
        setattr_saved(v.marlin_mod, "ops", _OpsProxy(v.marlin_mod.ops))
        if v.envs.VLLM_MARLIN_INPUT_DTYPE is not None or v.envs.VLLM_BATCH_INVARIANT:
            raise RuntimeError("could not clear VLLM_MARLIN_INPUT_DTYPE / VLLM_BATCH_INVARIANT")
        yield v
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
        os.environ.update(env_saved)
        vllm_logger.setLevel(old_level)


_MISSING = object()


# --------------------------------------------------------------------------------------
# Checkpoint reading
# --------------------------------------------------------------------------------------


def _weight_files(model_dir: Path) -> list[str]:
    """The safetensors files vLLM's default loader reads (top-level glob, index-filtered)."""
    v = _vllm()
    files = sorted(glob.glob(os.path.join(str(model_dir), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return v.filter_dup(files, str(model_dir), "model.safetensors.index.json")


def _read_checkpoint(model_dir: Path, wanted_modules: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                module, _, suffix = name.rpartition(".")
                if module in wanted_modules and suffix in _QUANT_SUFFIXES:
                    out[name] = fh.get_tensor(name)
    return out


def _model_facts(cfg: dict[str, Any]) -> dict[str, int]:
    text = cfg.get("text_config") or {}

    def get(key: str, default: Any = None) -> Any:
        val = cfg.get(key)
        if val is None:
            val = text.get(key, default)
        return val

    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    kv = get("num_key_value_heads")
    head_dim = get("head_dim")
    return {
        "hidden_size": hidden,
        "intermediate_size": int(get("intermediate_size")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv) if kv is not None else heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "num_hidden_layers": int(get("num_hidden_layers")),
    }


def _quant_config(v: Any, model_dir: Path, hf_quant: dict[str, Any], model_cls: type) -> Any:
    """As ``ModelConfig._verify_quantization`` + ``get_quant_config`` + ``VllmConfig``."""
    name = None
    for cls in (v.auto_gptq.AutoGPTQConfig, v.auto_awq.AutoAWQConfig):
        name = cls.override_quantization_method(dict(hf_quant), None)
        if name is not None:
            break
    if name is None:
        raise ValueError(
            f"quantization_config.quant_method={hf_quant.get('quant_method')!r} is not AWQ/GPTQ"
        )
    quant_cls = v.get_quantization_config(name)
    try:
        qc = quant_cls.from_config(dict(hf_quant))
    except (ValueError, KeyError, AssertionError) as e:
        raise VllmRefusedError(f"vLLM rejects quantization_config {hf_quant}: {e}") from e
    # VllmConfig._get_quantization_config, then SupportsQuant._maybe_apply_model_mapping
    # at model construction (Llama/Qwen2 are SupportsQuant).
    qc.maybe_update_config(str(model_dir))
    qc.apply_vllm_mapper(model_cls.hf_to_vllm_mapper.get_rename_mapper())
    qc.packed_modules_mapping.update(getattr(model_cls, "packed_modules_mapping", {}))
    return qc


# --------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------


def vllm_layer_names(num_hidden_layers: int) -> list[str]:
    """vLLM's fused linear-layer names for a Llama/Qwen2-style decoder."""
    names = []
    for i in range(num_hidden_layers):
        for block, fused in (_ATTN, _MLP):
            for layer in fused:
                names.append(f"model.layers.{i}.{block}.{layer}")
    return names


def _build_layers(v: Any, facts: dict[str, int], qc: Any, biases: set[str], tp_size: int):
    """The four linear layers per decoder layer, with LlamaAttention/LlamaMLP's arguments."""
    L = v.linear
    hidden = facts["hidden_size"]
    head_dim = facts["head_dim"]
    heads = facts["num_attention_heads"]
    kv = facts["num_key_value_heads"]
    inter = facts["intermediate_size"]

    def make(prefix: str, cls: type, **kwargs: Any) -> torch.nn.Module:
        try:
            return cls(bias=prefix in biases, quant_config=qc, prefix=prefix, **kwargs)
        except VllmRefusedError as e:
            raise VllmRefusedError(f"{prefix} (tp_size={tp_size}): {e}") from e
        except (AssertionError, ValueError) as e:
            raise VllmRefusedError(
                f"{prefix}: vLLM refuses to build the layer at tp_size={tp_size}: "
                f"{type(e).__name__}: {e}"
            ) from e

    root = torch.nn.Module()  # stands for LlamaForCausalLM
    model = torch.nn.Module()  # stands for LlamaModel
    model.quant_config = qc
    layers = torch.nn.ModuleList()
    for i in range(facts["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        dec, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = make(
            f"{pre}.self_attn.qkv_proj",
            L.QKVParallelLinear,
            hidden_size=hidden,
            head_size=head_dim,
            total_num_heads=heads,
            total_num_kv_heads=kv,
        )
        attn.o_proj = make(
            f"{pre}.self_attn.o_proj", L.RowParallelLinear, input_size=heads * head_dim, output_size=hidden
        )
        mlp.gate_up_proj = make(
            f"{pre}.mlp.gate_up_proj",
            L.MergedColumnParallelLinear,
            input_size=hidden,
            output_sizes=[inter] * 2,
        )
        mlp.down_proj = make(
            f"{pre}.mlp.down_proj", L.RowParallelLinear, input_size=inter, output_size=hidden
        )
        dec.self_attn, dec.mlp = attn, mlp
        layers.append(dec)
    model.layers = layers
    root.model = model
    return root


def reference_rank_tensors(
    model_dir: Path, tp_size: int, rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What stock vLLM 0.33.0 holds, on TP rank ``rank`` of ``tp_size``, for every AWQ/GPTQ
    Marlin linear layer of the checkpoint in ``model_dir``, after
    ``process_weights_after_loading``: ``{"<layer>.qweight", "<layer>.scales",
    "<layer>.qzeros" (AWQ: Marlin zero points; GPTQ: the empty ``int32[0]`` placeholder),
    "<layer>.bias" (if the layer has one)}`` under vLLM's fused names (``qkv_proj``,
    ``o_proj``, ``gate_up_proj``, ``down_proj``). Tensors are CPU copies.

    Raises :class:`VllmRefusedError` where vLLM would not use Marlin for a layer or fails.
    """
    model_dir = Path(model_dir)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"serving dtype must be float16 or bfloat16, not {dtype}")
    if not (isinstance(tp_size, int) and tp_size >= 1 and 0 <= rank < tp_size):
        raise ValueError(f"bad tp_size/rank {tp_size}/{rank}")
    cfg = json.loads((model_dir / "config.json").read_text())
    hf_quant = cfg.get("quantization_config")
    if not hf_quant:
        raise ValueError(f"{model_dir}/config.json has no quantization_config")
    facts = _model_facts(cfg)
    v = _vllm()
    arch = (cfg.get("architectures") or [None])[0]
    model_cls = v.model_classes.get(arch, v.default_model_class)

    # Which checkpoint modules are quantized (have qweight) and which have a bias.
    names = vllm_layer_names(facts["num_hidden_layers"])
    ckpt_modules: dict[str, tuple[str, ...]] = {}
    for fused in names:
        parent, _, layer = fused.rpartition(".")
        parts = {**_ATTN[1], **_MLP[1]}[layer]
        ckpt_modules[fused] = tuple(f"{parent}.{p}" for p in parts)
    wanted = {m for parts in ckpt_modules.values() for m in parts}

    with _LOCK:
        tensors = _read_checkpoint(model_dir, wanted)
        quantized = {m for m in wanted if f"{m}.qweight" in tensors}
        if not quantized:
            raise ValueError(f"no quantized q/k/v/o/gate/up/down_proj in {model_dir}")
        biases = set()
        for fused, parts in ckpt_modules.items():
            has_q = [p in quantized for p in parts]
            if any(has_q) and not all(has_q):
                raise VllmRefusedError(f"{fused}: only some of {parts} are quantized")
            has_b = [f"{p}.bias" in tensors for p in parts]
            if all(has_b):
                biases.add(fused)
            elif any(has_b):
                # vLLM's layers take one `bias` flag per fused layer; a missing part's bias
                # would stay uninitialised (torch.empty) in vLLM.
                raise ValueError(f"{fused}: only some of {parts} have a bias")

        with _patched(tp_size, rank), v.set_default_torch_dtype(dtype):
            qc = _quant_config(v, model_dir, hf_quant, model_cls)
            root = _build_layers(v, facts, qc, biases, tp_size)

            marlin_layers: dict[str, torch.nn.Module] = {}
            for fused in names:
                layer = root.get_submodule(fused)
                if ckpt_modules[fused][0] not in quantized:
                    continue  # not quantized in the checkpoint: not a Marlin layer
                method = type(layer.quant_method).__name__
                if method not in ("AutoAWQMarlinLinearMethod", "AutoGPTQLinearMethod"):
                    raise VllmRefusedError(
                        f"{fused}: vLLM would use {method}, not MarlinLinearKernel"
                    )
                kernel = getattr(layer.quant_method, "kernel", None)
                if type(kernel).__name__ != "MarlinLinearKernel":
                    raise VllmRefusedError(f"{fused}: kernel is {type(kernel).__name__}")
                marlin_layers[fused] = layer

            # Real loading path: LlamaForCausalLM.load_weights -> AutoWeightsLoader ->
            # LlamaModel.load_weights(mapper=hf_to_vllm_mapper) -> layer.load_weights /
            # param.weight_loader(param, w[, shard_id]).
            mapper = model_cls.hf_to_vllm_mapper

            def model_load_weights(weights, _model=root.model):
                return v.AutoWeightsLoader(_model).load_weights(weights, mapper=mapper)

            root.model.load_weights = model_load_weights
            weights = [
                (n, t)
                for n, t in tensors.items()
                if n.rpartition(".")[0] in quantized
            ]
            try:
                loaded = v.AutoWeightsLoader(root).load_weights(iter(weights))
            except AssertionError as e:
                raise VllmRefusedError(
                    f"vLLM's weight loader fails for tp_size={tp_size}, rank={rank}: {e!r}"
                ) from e

            expected = set()
            for fused, layer in marlin_layers.items():
                for pname, _ in layer.named_parameters(recurse=False):
                    expected.add(f"{fused}.{pname}")
            missing = expected - set(loaded)
            if missing:
                raise ValueError(f"checkpoint lacks tensors for {sorted(missing)}")

            out: dict[str, torch.Tensor] = {}
            for fused, layer in marlin_layers.items():
                try:
                    layer.quant_method.process_weights_after_loading(layer)
                except _OracleBug:
                    raise
                except (AssertionError, ValueError, RuntimeError) as e:
                    raise VllmRefusedError(
                        f"{fused}: vLLM's process_weights_after_loading fails "
                        f"(tp_size={tp_size}, rank={rank}): {type(e).__name__}: {e}"
                    ) from e
                layer.update_param_tp_status()
                out[f"{fused}.qweight"] = layer.qweight.data.detach().clone()
                out[f"{fused}.scales"] = layer.scales.data.detach().clone()
                out[f"{fused}.qzeros"] = layer.qzeros.data.detach().clone()
                if layer.bias is not None:
                    out[f"{fused}.bias"] = layer.bias.data.detach().clone()
                extra = getattr(layer, "input_global_scale", None)
                if extra is not None:  # int8 activations only; must not happen here
                    raise RuntimeError(f"{fused}: unexpected input_global_scale")
            return out
