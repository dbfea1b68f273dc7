"""Independent reference ("oracle") for mixture-of-experts checkpoints, from vLLM's own code.

``reference_moe_rank_tensors(model_dir, tp_size, rank, dtype)`` returns what stock vLLM
holds on one tensor-parallel rank after ``process_weights_after_loading``, for every AWQ/GPTQ
layer of an MoE checkpoint (Mixtral, Qwen3-MoE, Qwen2-MoE): the dense Marlin linear layers exactly as
:func:`vllm_reference.reference_rank_tensors` reports them, plus every parameter of each
routed-experts layer run by ``AutoAWQMoEMethod`` / ``AutoGPTQMoEMethod`` on the Marlin MoE
backend (``w13_qweight``, ``w2_qweight``, ``w13_scales``, ``w2_scales``, ``w13_qzeros``,
``w2_qzeros`` and, when the checkpoint has them, ``w13_bias`` / ``w2_bias``).

Everything that decides the result is vLLM's real code, run on the CPU, with the patches of
``vllm_reference._patched`` plus, for the duration of one call only:

  * process groups: ``parallel_state._EP`` is a stand-in "rank ``rank`` of ``tp_size``" (the
    group vLLM builds over DP x PCP x TP; expert parallelism stays off, as by default), ``_DP``
    and ``_PCP`` are single-rank stand-ins;
  * platform, as seen by the MoE backend selection and the Marlin experts class
    (``fused_moe.oracle.int_wna16``, ``fused_moe.experts.marlin_moe``, ``fused_moe.config``,
    the Humming priority helper where the release has one): CUDA, capability 9.0, as for the
    dense layers;
  * MoE backend: ``KernelConfig(moe_backend="marlin")`` (``--moe-backend marlin``), the MoE
    counterpart of ``--linear-backend marlin``: vLLM's explicit-backend branch of
    ``select_wna16_moe_backend`` runs its real compatibility checks and raises rather than
    falling back. (With ``auto`` on SM90, vLLM walks RDNA3, FLASHINFER_TRTLLM (skipped: AWQ/GPTQ
    may carry zero points and bias), MARLIN; HUMMING is moved ahead of MARLIN on SM90 by
    ``prioritize_humming`` (0.32+; 0.30 and 0.31 list it after MARLIN) but needs the optional
    ``humming`` package.) Layers vLLM hands to ``MoeWNA16`` (a group straddling the per-rank
    intermediate size) raise :class:`VllmRefusedError`;
  * the CUDA op ``torch.ops._C.gptq_marlin_repack`` / ``torch.ops._C.awq_marlin_repack``, as
    called by vLLM's own per-expert wrappers ``_custom_ops.gptq_marlin_moe_repack`` /
    ``awq_marlin_moe_repack`` (which run unmodified, with ``torch`` in their globals swapped for
    a view whose ``ops._C`` holds the stand-ins): GPTQ is
    ``marlin_utils_test.marlin_weights`` over the codes unpacked along K (as in
    ``vllm_reference``); AWQ unpacks along N with ``quant_utils.unpack_cols``, undoes the AWQ
    nibble order with the inverse of ``[0, 2, 4, 6, 1, 3, 5, 7]`` (as vLLM's own
    ``awq_to_marlin_zero_points`` does) and then takes the same ``marlin_weights``. The two are
    checked against each other and against ``auto_awq._convert_awq_to_standard_format`` in the
    tests.

Everything else (``marlin_moe_padded_intermediate`` padding, ``marlin_moe_permute_scales``,
``moe_awq_to_marlin_zero_points``, ``moe_packed_to_marlin_zero_points``, ``marlin_permute_bias``,
building the ``MarlinExperts`` kernel) is vLLM's unmodified code.
"""

from __future__ import annotations

import contextlib
import functools
import types
from pathlib import Path
from typing import Any

import torch

from . import vllm_reference as vr
from .vllm_reference import VllmRefusedError

__all__ = ["MOE_METHODS", "VllmRefusedError", "moe_layers", "reference_moe_rank_tensors"]

MOE_METHODS = ("AutoAWQMoEMethod", "AutoGPTQMoEMethod", "CompressedTensorsWNA16MoEMethod")
_SM90 = vr._CAPABILITY[0] * 10 + vr._CAPABILITY[1]


@functools.lru_cache(maxsize=1)
def _moe_vllm() -> Any:
    v = vr._vllm()
    import vllm._custom_ops as custom_ops
    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.model_executor.layers.fused_moe.config as moe_config_mod
    import vllm.model_executor.layers.fused_moe.experts.marlin_moe as marlin_moe
    import vllm.model_executor.layers.fused_moe.oracle.int_wna16 as int_wna16
    import vllm.model_executor.layers.quantization.moe_wna16 as moe_wna16
    from vllm.config import KernelConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    return types.SimpleNamespace(base=v, custom_ops=custom_ops, int_wna16=int_wna16, marlin_moe=marlin_moe,
                                 moe_config=moe_config_mod, moe_wna16=moe_wna16, mla_attention=mla_attention,
                                 cpu_mla_backend=CPUMLABackend,
                                 cpu_mla_prefill=CPUSDPAMLAPrefillBackend, KernelConfig=KernelConfig, unpack_cols=unpack_cols)


# --------------------------------------------------------------------------------------
# CUDA-op stand-ins
# --------------------------------------------------------------------------------------

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def reference_awq_marlin_repack(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int,
                                is_a_8bit: bool = False) -> torch.Tensor:
    """Pure-torch stand-in for ``torch.ops._C.awq_marlin_repack`` (AWQ packs 8 nibbles along N)."""
    m = _moe_vllm()
    if (num_bits != 4 or b_q_weight.dtype != torch.int32 or tuple(b_q_weight.shape) != (size_k, size_n // 8)
            or size_k % 16 or size_n % 64):
        raise vr._OracleBug(f"awq_marlin_repack stand-in got {b_q_weight.dtype} {tuple(b_q_weight.shape)}, "
                            f"size_k={size_k}, size_n={size_n}, num_bits={num_bits}")
    interleaved = m.unpack_cols(b_q_weight, num_bits, size_k, size_n)  # [K, N], AWQ nibble order
    undo = torch.argsort(torch.tensor(_AWQ_ORDER))
    codes = interleaved.reshape(-1, 8)[:, undo].reshape(size_k, size_n)
    if is_a_8bit:
        raise vr._OracleBug("awq_marlin_repack stand-in: 8-bit activations are not a bundle's")
    return vr.reference_marlin_weights(m.base.marlin_utils_test, codes.contiguous(), size_k, size_n, num_bits)


class _C:
    gptq_marlin_repack = staticmethod(vr._reference_gptq_marlin_repack)
    awq_marlin_repack = staticmethod(reference_awq_marlin_repack)

    def __getattr__(self, name: str) -> Any:
        raise vr._OracleBug(f"vLLM's MoE path called the CUDA op torch.ops._C.{name}, which has no stand-in")


class _TorchView:
    """The ``torch`` module as vLLM's MoE repack wrappers see it: ``torch.ops._C`` holds the stand-ins."""

    ops = types.SimpleNamespace(_C=_C())

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _with_stand_in_ops(fn: Any) -> Any:
    """vLLM's own wrapper function (same code object), resolving ``torch`` to :class:`_TorchView`."""
    g = dict(fn.__globals__)
    g["torch"] = _TorchView()
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


class _MoEOpsProxy:
    """``vllm._custom_ops`` as ``int_wna16`` sees it: the two MoE repack wrappers run with stand-in CUDA ops."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.gptq_marlin_moe_repack = _with_stand_in_ops(real.gptq_marlin_moe_repack)
        self.awq_marlin_moe_repack = _with_stand_in_ops(real.awq_marlin_moe_repack)

    def __getattr__(self, name: str) -> Any:
        if name in ("marlin_int4_fp8_preprocess",):
            raise vr._OracleBug(f"vLLM's MoE path called ops.{name} (fp8 activations are out of scope)")
        return getattr(self._real, name)


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------


class _ProcessGroupInfo:
    """What MoE layers read of a torch ProcessGroup at build time: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _GroupWithDevice(vr._Group):
    """A stand-in group with a ``device_group`` that answers size/rank (nothing communicates), and for the EP group
    across data-parallel replicas the size/rank of an all2all manager (what vLLM's MoE kernel set-up reads of it)."""

    def __init__(self, size: int, rank: int, dp_size: int = 1) -> None:
        super().__init__(size, rank)
        self.device_group = _ProcessGroupInfo(size, rank)
        self.device_communicator = types.SimpleNamespace(
            all2all_manager=types.SimpleNamespace(world_size=size, rank=rank, dp_world_size=dp_size))


def _mla_post_processing_recorder(calls: list[tuple[str, tuple[int, ...]]]) -> Any:
    """Stand-in for ``MLAAttention.process_weights_after_loading``: records which layer ran it and the
    shape ``kv_b_proj.qweight`` had then (Marlin's, if vLLM ran it after the quant methods). The real
    step dequantizes ``kv_b_proj`` through its Marlin GEMM (a CUDA op) into ``W_UK``/``W_UV``, which
    are derived tensors no bundle holds; the GPU tests compare them."""

    def process_weights_after_loading(self: Any, act_dtype: torch.dtype | None = None) -> None:  # (0.34: no argument)
        q = getattr(self.kv_b_proj, "qweight", None)
        calls.append((self.layer_name, tuple(q.shape) if isinstance(q, torch.Tensor) else ()))

    return process_weights_after_loading


@contextlib.contextmanager
def _moe_patched(tp_size: int, rank: int, humming_installed: bool = False, mla_calls: list | None = None,
                 pp: tuple[int, int] = (1, 0), dp: tuple[int, int] = (1, 0)):
    m = _moe_vllm()
    v = m.base
    saved: list[tuple[Any, str, Any]] = []

    def setattr_saved(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, obj.__dict__.get(name, vr._MISSING)))
        setattr(obj, name, value)

    with vr._patched(tp_size, rank, pp=pp):  # pp: (size, stage), as in vllm_reference
        try:
            ps = v.parallel_state
            # vLLM's EP group spans the TP ranks of every data-parallel replica (rank dp_rank * tp + tp_rank)
            setattr_saved(ps, "_EP", _GroupWithDevice(tp_size * dp[0], dp[1] * tp_size + rank, dp[0]))
            setattr_saved(ps, "_DP", _GroupWithDevice(*dp))  # (size, rank): the data-parallel replica
            setattr_saved(ps, "_PCP", _GroupWithDevice(1, 0))
            view = vr._CudaView(v.platform)
            for mod in (m.int_wna16, m.marlin_moe, m.moe_config, m.moe_wna16):
                if "current_platform" in mod.__dict__:
                    setattr_saved(mod, "current_platform", view)
            setattr_saved(m.int_wna16, "ops", _MoEOpsProxy(m.custom_ops))
            # Humming's priority asks the real platform for the capability (a local import): give it SM90's. Releases
            # without the helper in the backend selection (0.30, 0.31) list Humming after Marlin and ask nothing.
            real_priority = m.int_wna16.__dict__.get("prioritize_humming")
            if real_priority is not None:
                setattr_saved(m.int_wna16, "prioritize_humming",
                              lambda kernels, cc=None: real_priority(kernels, cc or _SM90))
            if humming_installed:
                import vllm.model_executor.layers.fused_moe.experts.fused_humming_moe as humming_moe

                setattr_saved(humming_moe, "current_platform", view)
                setattr_saved(humming_moe, "has_humming", lambda: True)
            # MLA (DeepSeek): vLLM's CPU MLA decode and prefill backends (this machine's platform names
            # none that import without a GPU); they hold no weights.
            setattr_saved(m.mla_attention, "get_attn_backend", lambda *a, **k: m.cpu_mla_backend)
            setattr_saved(m.mla_attention, "get_mla_prefill_backend", lambda *a, **k: m.cpu_mla_prefill)
            setattr_saved(m.mla_attention.MLAAttention, "process_weights_after_loading",
                          _mla_post_processing_recorder([] if mla_calls is None else mla_calls))
            yield m
        finally:
            for obj, name, old in reversed(saved):
                if old is vr._MISSING:
                    with contextlib.suppress(AttributeError):
                        delattr(obj, name)
                else:
                    setattr(obj, name, old)


# --------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------


def _build(model_dir: Path, tp_size: int, dtype: torch.dtype, m: Any, moe_backend: str,
           parallel: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """As ``vllm_reference.vllm_model``, with ``KernelConfig(moe_backend=moe_backend)`` and ``ParallelConfig(**parallel)``
    (e.g. ``enable_expert_parallel``, ``expert_placement_strategy``; the group sizes are the stand-ins')."""
    v = m.base
    try:
        from vllm.config import ParallelConfig

        model_config = v.ModelConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch."),
                                     trust_remote_code=True, skip_tokenizer_init=True, enforce_eager=True)
        vllm_config = v.VllmConfig(model_config=model_config, device_config=v.DeviceConfig("cpu"),
                                   load_config=v.LoadConfig(), kernel_config=m.KernelConfig(moe_backend=moe_backend),
                                   parallel_config=ParallelConfig(**(parallel or {})))
        with torch.device("cpu"):
            model = v.initialize_model(vllm_config)
    except vr._OracleBug:
        raise
    except VllmRefusedError as e:
        raise VllmRefusedError(f"tp_size={tp_size}: {e}") from e
    except vr._REFUSALS as e:
        raise VllmRefusedError(f"vLLM refuses to build the model at tp_size={tp_size}: {type(e).__name__}: {e}") from e
    return model, model_config


def _backend(method: Any) -> Any:
    """The WNA16 MoE backend a method chose (AWQ/GPTQ: ``wna16_moe_backend``; compressed-tensors: ``wna16_backend``)."""
    return getattr(method, "wna16_moe_backend", None) or getattr(method, "wna16_backend", None)


def moe_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Routed-experts modules that got an AWQ/GPTQ MoE method on the Marlin backend; refuses any other."""
    m = _moe_vllm()
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "moe_config"):
            continue
        cls = type(method).__name__
        if cls not in MOE_METHODS:
            raise VllmRefusedError(f"{name}: vLLM would use {cls}, not one of {MOE_METHODS} (Marlin)")
        if _backend(method) != m.int_wna16.WNA16MoEBackend.MARLIN:
            raise VllmRefusedError(f"{name}: WNA16 MoE backend is {_backend(method)}, not MARLIN")
        out[name] = module
    return out


def _dense_layers(model: torch.nn.Module, experts: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    out = {}
    for name, module in vr.named_modules_as_built(model):
        if name in experts:
            continue
        method = type(getattr(module, "quant_method", None)).__name__
        if method == "NoneType" or method.startswith("Unquantized") or "KVCache" in method:
            continue
        if method not in vr._MARLIN_METHODS:
            raise VllmRefusedError(f"{name}: vLLM would use {method}, not MarlinLinearKernel")
        kernel = vr._kernel(module)
        if type(kernel).__name__ != "MarlinLinearKernel":
            raise VllmRefusedError(f"{name}: kernel is {type(kernel).__name__}")
        out[name] = module
    return out


def reference_moe_rank_tensors(model_dir: Path, tp_size: int, rank: int, dtype: torch.dtype, *,
                               info: dict[str, Any] | None = None, moe_backend: str = "marlin",
                               humming_installed: bool = False, dp: tuple[int, int] = (1, 0),
                               parallel: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """What stock vLLM holds on TP rank ``rank`` of ``tp_size`` for every AWQ/GPTQ layer
    (dense Marlin linears and Marlin MoE experts) of the MoE checkpoint in ``model_dir``, after
    ``process_weights_after_loading``. Expert tensors are every parameter of the experts module
    (``<prefix>.experts.w13_qweight`` ...; the ``w13_weight``/``w2_weight`` aliases vLLM adds for
    its modular kernel are the same tensors and are left out). CPU copies.

    ``info``, if given, receives ``model_class``, per-experts-layer ``method`` / ``backend`` /
    ``experts_class`` / ``intermediate_size_per_partition``, ``aliases`` (alias -> parameter; an
    experts module's parameter owned by another module, as DeepSeek-V3's router bias, is one) and
    ``mla_post_processing`` (MLA layers whose post-processing ran, with ``kv_b_proj.qweight``'s
    shape at that moment).
    ``moe_backend``: vLLM's ``--moe-backend`` ("marlin" by default; "auto" shows vLLM's own
    choice on SM90). ``humming_installed``: pretend the optional ``humming`` package is present
    (as far as the Humming MoE experts' device check asks), to show what ``auto`` picks then.
    ``dp``: (size, rank) of the stand-in data-parallel group; ``parallel``: ``ParallelConfig`` settings, e.g.
    ``{"enable_expert_parallel": True}`` (then ``info`` also receives each experts layer's ``expert_map``).
    Raises :class:`VllmRefusedError` where vLLM would not serve a layer through Marlin or fails.
    """
    model_dir = Path(model_dir)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"serving dtype must be float16 or bfloat16, not {dtype}")
    if not (isinstance(tp_size, int) and tp_size >= 1 and 0 <= rank < tp_size):
        raise ValueError(f"bad tp_size/rank {tp_size}/{rank}")
    mla_calls: list[tuple[str, tuple[int, ...]]] = []
    with vr._LOCK, _moe_patched(tp_size, rank, humming_installed, mla_calls, dp=dp) as m, m.base.set_default_torch_dtype(dtype):
        v = m.base
        model, model_config = _build(model_dir, tp_size, dtype, m, moe_backend, parallel)
        experts = moe_layers(model)
        if not experts:
            raise ValueError(f"vLLM builds no quantized MoE layer for {model_dir}")
        dense = _dense_layers(model, experts)
        try:
            loaded = set(model.load_weights(vr._all_tensors(model_dir)) or ())
        except vr._OracleBug:
            raise
        except vr._REFUSALS as e:
            raise VllmRefusedError(f"vLLM's weight loading fails for tp_size={tp_size}, rank={rank}: "
                                   f"{type(e).__name__}: {e}") from e
        expected = {f"{n}.{p}" for n, layer in dense.items() for p, _ in layer.named_parameters(recurse=False)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {sorted(missing)[:4]}")
        try:
            v.process_weights_after_loading(model, model_config, torch.device("cpu"))
        except vr._OracleBug:
            raise
        except vr._REFUSALS as e:
            raise VllmRefusedError(f"vLLM's process_weights_after_loading fails (tp_size={tp_size}, rank={rank}): "
                                   f"{type(e).__name__}: {e}") from e
        out: dict[str, torch.Tensor] = {}
        for name, layer in dense.items():
            kernel = vr._kernel(layer)
            for pname in (kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name):
                out[f"{name}.{pname}"] = getattr(layer, pname).data.detach().clone()
            if layer.bias is not None:
                out[f"{name}.bias"] = layer.bias.data.detach().clone()
            if isinstance(getattr(layer, "weight_shape", None), torch.Tensor):  # compressed-tensors keeps it
                out[f"{name}.weight_shape"] = layer.weight_shape.data.detach().clone()
        layers_info = {}
        aliases: dict[str, str] = {}
        # Where each parameter object is first registered: DeepSeek-V3's experts also hold the router's
        # e_score_correction_bias (mlp.gate's own parameter, a checkpoint tensor), an alias, not theirs.
        owner: dict[int, str] = {}
        for pname, p in model.named_parameters(remove_duplicate=False):
            owner.setdefault(id(p), pname)
        for name, layer in experts.items():
            seen: dict[int, str] = {}
            for pname, p in layer.named_parameters(recurse=False, remove_duplicate=False):
                key = id(p)
                if key in seen:
                    aliases[f"{name}.{pname}"] = f"{name}.{seen[key]}"
                    continue
                if not owner[key].startswith(f"{name}."):
                    aliases[f"{name}.{pname}"] = owner[key]
                    continue
                seen[key] = pname
                out[f"{name}.{pname}"] = p.data.detach().clone()
            method = layer.quant_method
            layers_info[name] = {
                "method": type(method).__name__,
                "backend": _backend(method).value,
                "input_dtype": getattr(method, "input_dtype", None),
                "experts_class": type(method.moe_kernel.impl.fused_experts).__name__
                if hasattr(getattr(method, "moe_kernel", None), "impl") else type(method.experts_cls).__name__,
                "intermediate_size_per_partition": layer.intermediate_size_per_partition,
                "expert_map": None if layer._expert_map is None else layer._expert_map.tolist(),
                "placement": layer.expert_placement_strategy,
            }
        if info is not None:
            info.update(model_class=type(model).__name__, layers=layers_info, aliases=aliases, mla_post_processing=mla_calls)
        return out


def assert_moe_bundle_equals_vllm(model: Path, bundle: Path, tps: tuple[int, ...], dtype: torch.dtype) -> int:
    """Every rank file of ``bundle`` for ``tps`` equals what stock vLLM holds (:func:`reference_moe_rank_tensors`) for
    the checkpoint ``model``; returns how many tensors were compared."""
    from .oracle_compare import assert_rank_file_equals

    return sum(assert_rank_file_equals(bundle, tp, rank, reference_moe_rank_tensors(model, tp, rank, dtype))
               for tp in tps for rank in range(tp))
