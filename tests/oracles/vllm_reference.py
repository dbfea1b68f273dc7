"""Independent reference ("oracle") for the CPU tests, built from vLLM's own code.

``reference_rank_tensors(model_dir, tp_size, rank, dtype)`` returns what stock vLLM
holds, on one tensor-parallel rank, for every AWQ/GPTQ Marlin linear layer of a checkpoint
after ``process_weights_after_loading`` with ``MarlinLinearKernel`` and 16-bit activations.

It deliberately does not import or mirror marlin-pack. Everything that decides the result is
vLLM's real code, run on the CPU:

real (unmodified) vLLM code
  * configuration: ``ModelConfig(model_dir, dtype, trust_remote_code=True)`` (transformers'
    config class for the checkpoint, vLLM's quantization detection incl. ``quantize_config.json``,
    ``override_quantization_method``) and ``VllmConfig`` (the quant config through
    ``from_config`` and ``maybe_update_config``);
  * the model: ``initialize_model(vllm_config)``, i.e. **the model class vLLM's registry picks
    for the checkpoint's architecture** (``LlamaForCausalLM``, ``Gemma2ForCausalLM``,
    ``Phi3ForCausalLM``, ``Qwen2_5_VLForConditionalGeneration``, ...; for an architecture the registry does not
    list, the Transformers backend class its fallback to transformers' class resolves under ``model_impl`` "auto",
    ``TransformersForCausalLM`` for Helium), built under
    ``set_default_torch_dtype(dtype)`` with ``configure_quant_config`` / ``SupportsQuant``'s
    mappings; every linear layer's ``quant_method`` comes from the real quant config
    (AWQ's Marlin/Triton choice, ``check_marlin_supports_layer``, ``modules_to_not_convert``);
  * loading: the model's own ``load_weights`` over every tensor of the checkpoint files that
    vLLM's default loader reads (``filter_duplicate_safetensors_files``): its
    ``hf_to_vllm_mapper``, stacked-parameter mapping, fused-in-checkpoint sharding (Phi3's
    ``qkv_proj``), KV-head replication, tied embeddings;
  * post-processing: ``model_loader.utils.process_weights_after_loading(model, ...)`` (AWQ:
    ``_convert_awq_to_standard_format``; ``MarlinLinearKernel.process_weights_after_loading``
    with ``marlin_padded_nk``, padding, ``marlin_permute_scales``, ``marlin_zero_points``,
    ``marlin_make_empty``, ``marlin_permute_bias``).

patched, for the duration of one call only (everything is restored afterwards)
  * TP/PP: ``parallel_state._TP`` / ``_PP`` are stand-in groups saying "rank ``rank`` of
    ``tp_size``" / "the only pipeline stage" (no process group; nothing communicates while
    a model is built and loaded);
  * platform, as seen by the quantization code only (``auto_awq``, ``auto_gptq``,
    ``marlin_utils`` and the Marlin kernel module): CUDA, capability 9.0 (an H200). The rest of
    vLLM keeps this machine's platform, so activations and norms pick their native forwards;
  * attention: ``get_attn_backend`` returns vLLM's CPU attention backend (it holds no weights;
    the CUDA selector refuses a machine without a GPU);
  * kernel choice: ``choose_mp_linear_kernel`` (as looked up by ``auto_awq`` / ``auto_gptq``)
    returns ``MarlinLinearKernel`` after running its real ``get_min_capability`` and
    ``can_implement`` checks, i.e. ``--linear-backend marlin`` without the fallback to another
    kernel; if Marlin cannot implement the layer, :class:`VllmRefusedError` is raised;
  * ``ops.gptq_marlin_repack`` (CUDA only) as looked up by the Marlin kernel module: replaced
    by vLLM's pure-torch test reference ``marlin_utils_test.marlin_weights(codes, size_k,
    size_n, num_bits, get_weight_perm(num_bits, is_a_8bit), is_a_8bit)`` over the codes
    unpacked with ``quant_utils.unpack_quantized_values_into_int32`` (bit-identical to the
    CUDA op);
  * environment: ``VLLM_MARLIN_INPUT_DTYPE`` (int8/fp8 activations) and
    ``VLLM_BATCH_INVARIANT`` (no Marlin) are removed from ``os.environ`` while the model is
    built, so the reference is always the 16-bit-activation Marlin layout; vLLM's logger is
    lowered to ERROR.

If vLLM itself refuses a case (a group straddling the TP shard, heads not divisible by the TP
size, AWQ falling back to its Triton method, AWQ ``group_size=-1`` on a row-parallel layer at
TP > 1, a quantization config it rejects, ...), :class:`VllmRefusedError` is raised with
vLLM's own message chained.

``_build_layers`` / ``_quant_config`` / ``_model_facts`` build only the four linear layers of a
Llama decoder (vLLM's real layer classes, Llama's arguments); the loader and weight-cache
tests use that smaller tree as a stand-in for ``create_model``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["VllmRefusedError", "reference_rank_tensors", "vllm_layer_names", "vllm_model"]


class VllmRefusedError(RuntimeError):
    """Stock vLLM would not serve this layer with MarlinLinearKernel (or fails on it)."""


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
    import vllm.model_executor.kernels.linear.mixed_precision.machete as machete_mod
    import vllm.model_executor.kernels.linear.mixed_precision.marlin as marlin_mod
    import vllm.model_executor.layers.attention.attention as attention_mod
    import vllm.model_executor.layers.linear as linear_mod
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq
    import vllm.model_executor.layers.quantization.auto_gptq as auto_gptq
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors as ct_config
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as ct_wna16
    import vllm.model_executor.layers.quantization.utils.marlin_utils as marlin_utils
    import vllm.model_executor.parameter as parameter_mod
    from vllm import envs
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import (
        filter_duplicate_safetensors_files,
    )
    from vllm.model_executor.models import llama, qwen2, qwen3
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.scalar_type import scalar_types
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

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
        attention=attention_mod,
        cpu_attention_backend=CPUAttentionBackend,
        marlin_utils=marlin_utils,
        parallel_state=parallel_state,
        ModelConfig=ModelConfig,
        VllmConfig=VllmConfig,
        DeviceConfig=DeviceConfig,
        LoadConfig=LoadConfig,
        initialize_model=initialize_model,
        process_weights_after_loading=process_weights_after_loading,
        envs=envs,
        marlin_mod=marlin_mod,
        machete_mod=machete_mod,
        linear=linear_mod,
        parameter=parameter_mod,
        auto_awq=auto_awq,
        auto_gptq=auto_gptq,
        ct_config=ct_config,
        ct_wna16=ct_wna16,
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
    if is_a_8bit:
        raise _OracleBug("gptq_marlin_repack stand-in: 8-bit activations are not a bundle's")
    return reference_marlin_weights(v.marlin_utils_test, codes.contiguous(), size_k, size_n, num_bits)


def reference_marlin_weights(mut: Any, codes: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """vLLM's pure-torch ``marlin_weights`` (module ``mut``: its ``marlin_utils_test``) for 16-bit activations, in the
    signature of the installed release (up to 0.33 it also takes ``is_a_8bit``, which 0.34.0 dropped with W4A8)."""
    if "is_a_8bit" in inspect.signature(mut.marlin_weights).parameters:
        return mut.marlin_weights(codes, size_k, size_n, num_bits, mut.get_weight_perm(num_bits, False), False)
    return mut.marlin_weights(codes, size_k, size_n, num_bits, mut.get_weight_perm(num_bits))


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


def _stand_in_machete_prepack_B(b_q_weight: torch.Tensor, a_type: Any, b_type: Any, group_scales_type: Any = None) -> torch.Tensor:
    """Stand-in for the CUDA op: marlin-pack's engine-free Machete layout (``marlin_pack.machete.layout``), whose
    bytes the GPU suite checks against the real op (``tests/on_gpu/test_machete_golden_gpu.py``) and the CPU
    suite against golden files of it (``tests/machete/test_golden.py``). Everything around it (the AWQ conversion,
    the sharding, the scale and zero-point transforms, which parameters the layer keeps) is vLLM's own code."""
    from marlin_pack.machete.layout import prepack_b

    bits = b_type.size_bits
    if b_q_weight.dtype != torch.int32 or b_q_weight.stride(0) != 1 or a_type not in (torch.float16, torch.bfloat16):
        raise _OracleBug(f"machete_prepack_B stand-in got {b_q_weight.dtype} strides {b_q_weight.stride()}, a_type {a_type}")
    return prepack_b(b_q_weight, bits)


class _MacheteOpsProxy(_OpsProxy):
    """``vllm._custom_ops`` with ``machete_prepack_B`` replaced (the Machete kernel module's ``ops``)."""

    machete_prepack_B = staticmethod(_stand_in_machete_prepack_B)


def _choose_on_hopper(config: Any, compute_capability: int | None = None) -> type:
    """vLLM's default choice on an SM90 GPU for 16-bit activations: Machete where its real ``can_implement``
    takes the layer, else Marlin (``_POSSIBLE_KERNELS``' order; ``CutlassW4A8`` needs fp8 activations and
    is never chosen here)."""
    machete = _vllm().machete_mod.MacheteLinearKernel
    ok, _ = machete.can_implement(config)
    return machete if ok else _choose_marlin(config, compute_capability)


class _CudaView:
    """The platform as the quantization code sees it in the oracle: an H200 (CUDA, SM 9.0).

    Everything else is this machine's platform object, so only the Marlin support checks and
    AWQ's Marlin choice see CUDA; activations, norms and rotary embeddings stay native.
    """

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> Any:
        return _vllm().DeviceCapability(*_CAPABILITY)

    def is_device_capability(self, capability: Any, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return _CAPABILITY[0] * 10 + _CAPABILITY[1] == capability

    def has_device_capability(self, capability: Any, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return _CAPABILITY[0] * 10 + _CAPABILITY[1] >= capability


class _Group:
    """Stand-in for a vLLM GroupCoordinator: rank ``rank`` of ``size``; no communication."""

    def __init__(self, size: int, rank: int) -> None:
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1

    def __getattr__(self, name: str) -> Any:
        raise _OracleBug(f"the oracle's stand-in process group has no {name!r} (vLLM communicated at load time?)")


_H200_SMS = 132  # what num_compute_units answers on the H200 the platform stand-in claims (capability 9.0)


@contextlib.contextmanager
def _patched(tp_size: int, rank: int, kernel: str = "marlin", pp: tuple[int, int] = (1, 0)):
    v = _vllm()
    saved: list[tuple[Any, str, Any]] = []

    def setattr_saved(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    env_saved = {k: os.environ.pop(k) for k in _ENV_OFF if k in os.environ}
    # vLLM warns once per row-parallel layer that fp16 checkpoint scales are loaded into
    # bf16 parameters, and about tile padding; both are expected here.
    vllm_logger = logging.getLogger("vllm")
    old_level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        setattr_saved(v.parallel_state, "_TP", _Group(tp_size, rank))
        setattr_saved(v.parallel_state, "_PP", _Group(*pp))  # (size, rank): the pipeline stage this rank is
        view = _CudaView(v.platform)
        for mod in (v.auto_awq, v.auto_gptq, v.marlin_utils, v.marlin_mod, v.machete_mod, v.ct_config, v.ct_wna16):
            if "current_platform" in mod.__dict__:
                setattr_saved(mod, "current_platform", view)
        chooser = {"marlin": _choose_marlin, "machete": _choose_on_hopper}[kernel]
        for mod in (v.auto_awq, v.auto_gptq, v.ct_wna16):
            setattr_saved(mod, "choose_mp_linear_kernel", chooser)
        setattr_saved(v.marlin_mod, "ops", _OpsProxy(v.marlin_mod.ops))
        setattr_saved(v.machete_mod, "ops", _MacheteOpsProxy(v.machete_mod.ops))
        setattr_saved(v.attention, "get_attn_backend", lambda *a, **k: v.cpu_attention_backend)
        if "num_compute_units" in v.marlin_utils.__dict__:  # 0.30's Marlin workspace is sized by the GPU's SM count
            setattr_saved(v.marlin_utils, "num_compute_units", lambda *a, **k: _H200_SMS)
        # vLLM caches each model's pipeline-missing layers by id(model) for the life of the process (one model per
        # engine process). The oracles build many: a new model at a dead one's address would get the dead one's
        # list, and its load_weights would skip (or fail on) the wrong layers. Each oracle model gets a fresh cache.
        import vllm.model_executor.models.utils as model_utils

        setattr_saved(model_utils, "_model_to_pp_missing_layer_names", {})
        if getattr(v.envs, "VLLM_MARLIN_INPUT_DTYPE", None) is not None or v.envs.VLLM_BATCH_INVARIANT:  # gone in 0.34
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
    name = "compressed-tensors" if hf_quant.get("quant_method") == "compressed-tensors" else None
    for cls in (v.auto_gptq.AutoGPTQConfig, v.auto_awq.AutoAWQConfig):
        if name is not None:
            break
        name = cls.override_quantization_method(dict(hf_quant), None)
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


def _all_tensors(model_dir: Path):
    """Every tensor of the files vLLM's default loader reads, in file order (as it streams them)."""
    from safetensors import safe_open

    for f in _weight_files(model_dir):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, fh.get_tensor(name)


_REFUSALS = (AssertionError, ValueError, RuntimeError, KeyError, NotImplementedError, TypeError, AttributeError)


def vllm_model(model_dir: Path, tp_size: int, rank: int, dtype: torch.dtype, v: Any) -> Any:
    """vLLM's own model for the checkpoint, built (not loaded) for TP rank ``rank`` of ``tp_size``.

    Call inside ``_patched(tp_size, rank)`` and ``set_default_torch_dtype(dtype)``.
    """
    try:
        model_config = v.ModelConfig(
            model=str(model_dir),
            dtype=str(dtype).removeprefix("torch."),
            trust_remote_code=True,
            skip_tokenizer_init=True,
            enforce_eager=True,
        )
        vllm_config = v.VllmConfig(
            model_config=model_config, device_config=v.DeviceConfig("cpu"), load_config=v.LoadConfig()
        )
        with torch.device("cpu"):
            model = v.initialize_model(vllm_config)
    except VllmRefusedError as e:
        raise VllmRefusedError(f"tp_size={tp_size}: {e}") from e
    except _OracleBug:
        raise
    except _REFUSALS as e:
        raise VllmRefusedError(
            f"vLLM refuses to build the model at tp_size={tp_size}: {type(e).__name__}: {e}"
        ) from e
    return model, model_config


# Quant methods whose layers hold Marlin tensors, and where their kernel sits ("scheme": on layer.scheme).
_MARLIN_METHODS = {"AutoAWQMarlinLinearMethod": "method", "AutoGPTQLinearMethod": "method",
                   "CompressedTensorsLinearMethod": "scheme"}


def _kernel(module: torch.nn.Module) -> Any:
    method = type(module.quant_method).__name__
    if _MARLIN_METHODS[method] == "scheme":
        scheme = getattr(module, "scheme", None)
        if type(scheme).__name__ != "CompressedTensorsWNA16":
            raise VllmRefusedError(f"vLLM would use {type(scheme).__name__}, not CompressedTensorsWNA16 (Marlin)")
        return getattr(scheme, "kernel", None)
    return getattr(module.quant_method, "kernel", None)


def named_modules_as_built(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's modules under the names vLLM built them with: the plugin's own rule
    (:func:`marlin_pack.vllm_plugin.engine.named_modules_as_built`). Only names come from it; every tensor compared
    is still vLLM's own post-processing."""
    from marlin_pack.vllm_plugin.engine import named_modules_as_built as as_built

    return as_built(model)


def _marlin_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules vLLM gave an AWQ/GPTQ/compressed-tensors WNA16 method; refuses where that method is not Marlin."""
    out = {}
    for name, module in named_modules_as_built(model):
        method = type(getattr(module, "quant_method", None)).__name__
        if method in ("NoneType",) or method.startswith("Unquantized") or "KVCache" in method:
            continue
        if method not in _MARLIN_METHODS:
            raise VllmRefusedError(f"{name}: vLLM would use {method}, not MarlinLinearKernel")
        try:
            kernel = _kernel(module)
        except VllmRefusedError as e:
            raise VllmRefusedError(f"{name}: {e}") from e
        if type(kernel).__name__ not in ("MarlinLinearKernel", "MacheteLinearKernel"):
            raise VllmRefusedError(f"{name}: kernel is {type(kernel).__name__}")
        out[name] = module
    return out


def reference_rank_tensors(
    model_dir: Path, tp_size: int, rank: int, dtype: torch.dtype, *, model_class: list[str] | None = None,
    kernel: str = "marlin", kernels: dict[str, str] | None = None, pp: tuple[int, int] = (1, 0),
    states: dict[str, dict[str, Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """What stock vLLM holds, on TP rank ``rank`` of ``tp_size``, for every AWQ/GPTQ
    Marlin linear layer of the checkpoint in ``model_dir``, after
    ``process_weights_after_loading``: ``{"<layer>.qweight", "<layer>.scales",
    "<layer>.qzeros" (AWQ: Marlin zero points; GPTQ: the empty ``int32[0]`` placeholder),
    "<layer>.bias" (if the layer has one)}`` under vLLM's parameter names (compressed-tensors
    WNA16: ``weight_packed``, ``weight_scale``, ``weight_zero_point`` (empty when symmetric)
    and the untouched ``weight_shape``) (e.g.
    ``model.layers.0.self_attn.qkv_proj``, ``language_model.model.layers.0.mlp.gate_up_proj``).
    Tensors are CPU copies. If ``model_class`` is a list, the name of the vLLM model class
    that was instantiated is appended to it.

    ``kernel="machete"``: vLLM's own choice on an SM90 GPU instead of Marlin forced (Machete where it implements
    the layer, :func:`_choose_on_hopper`); then every parameter a Machete layer keeps is returned (its
    ``weight``/``scales``/zero points as Machete leaves them, and what it leaves untouched, e.g. GPTQ's
    ``qzeros`` and ``g_idx``), and ``kernels`` (if a dict) receives each layer's kernel class name.

    ``states`` (if a dict) receives each layer's whole state after post-processing (:func:`layer_state`).

    Raises :class:`VllmRefusedError` where vLLM would not use Marlin for a layer or fails.
    """
    model_dir = Path(model_dir)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"serving dtype must be float16 or bfloat16, not {dtype}")
    if not (isinstance(tp_size, int) and tp_size >= 1 and 0 <= rank < tp_size):
        raise ValueError(f"bad tp_size/rank {tp_size}/{rank}")
    with _LOCK, _patched(tp_size, rank, kernel, pp) as v, v.set_default_torch_dtype(dtype):
        model, model_config = vllm_model(model_dir, tp_size, rank, dtype, v)
        if model_class is not None:
            model_class.append(type(model).__name__)
        marlin_layers = _marlin_layers(model)
        if not marlin_layers:
            raise ValueError(f"vLLM builds no AWQ/GPTQ layer for {model_dir}")
        try:
            loaded = set(model.load_weights(_all_tensors(model_dir)) or ())
        except _OracleBug:
            raise
        except _REFUSALS as e:
            raise VllmRefusedError(
                f"vLLM's weight loading fails for tp_size={tp_size}, rank={rank}: {type(e).__name__}: {e}"
            ) from e
        expected = {f"{n}.{p}" for n, layer in marlin_layers.items() for p, _ in layer.named_parameters(recurse=False)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {sorted(missing)[:4]}")
        try:
            v.process_weights_after_loading(model, model_config, torch.device("cpu"))
        except _OracleBug:
            raise
        except _REFUSALS as e:
            raise VllmRefusedError(
                f"vLLM's process_weights_after_loading fails (tp_size={tp_size}, rank={rank}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if states is not None:
            states.update({name: layer_state(layer) for name, layer in marlin_layers.items()})
        out: dict[str, torch.Tensor] = {}
        for name, layer in marlin_layers.items():
            kernel = _kernel(layer)
            if kernels is not None:
                kernels[name] = type(kernel).__name__
            if type(kernel).__name__ == "MacheteLinearKernel":
                for pname, param in layer.named_parameters(recurse=False):
                    out[f"{name}.{pname}"] = param.data.detach().clone()
                continue
            # The kernel's parameter names: qweight/scales/qzeros (AWQ, GPTQ) or weight_packed/
            # weight_scale/weight_zero_point (compressed-tensors, which also keeps weight_shape).
            for pname in (kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name):
                out[f"{name}.{pname}"] = getattr(layer, pname).data.detach().clone()
            if isinstance(getattr(layer, "weight_shape", None), torch.Tensor):
                out[f"{name}.weight_shape"] = layer.weight_shape.data.detach().clone()
            if layer.bias is not None:
                out[f"{name}.bias"] = layer.bias.data.detach().clone()
            if getattr(layer, "input_global_scale", None) is not None:  # int8 activations only
                raise RuntimeError(f"{name}: unexpected input_global_scale")
        return out


def layer_state(layer: torch.nn.Module) -> dict[str, Any]:
    """Everything post-processing leaves on a quantized layer, for an attribute-for-attribute comparison: each
    registered parameter (class, dtype, shape, whether vLLM retired it, a CPU copy of its data), the plain attributes
    it sets (``input_global_scale``), and the kernel's parameter names and Python-side state (a workspace)."""
    kernel = _kernel(layer)
    params = {
        n: {"class": type(t).__name__, "dtype": t.dtype, "shape": tuple(t.shape), "retired": bool(getattr(t, "retired", False)),
            "data": t.data.detach().cpu().clone()}
        for n, t in layer._parameters.items() if t is not None
    }
    plain = {n: layer.__dict__[n] for n in ("input_global_scale",) if n in layer.__dict__}
    names = {a: getattr(kernel, a, None) for a in ("w_q_name", "w_s_name", "w_zp_name", "w_gidx_name")}
    return {"params": params, "plain": plain, "kernel": type(kernel).__name__, "names": names,
            "workspace": getattr(kernel, "workspace", None) is not None}
