"""``MarlinPrepackedLoader``: vLLM 0.33.0 model loader for ``--load-format marlin_prepacked``.

Three steps, usable separately (the weight-cache daemon calls the first two itself):

``create_model``
    Validates the bundle against the engine (cheap, before any GPU allocation), then
    builds the model with ``linear_backend_per_quant["mixed_precision"] = "marlin"``
    on the engine's ``KernelConfig`` so every AWQ/GPTQ layer gets ``MarlinLinearKernel``
    (on SM90 vLLM would pick Machete), and checks each quantized layer's kernel and
    configuration against the manifest. The override stays set: the engine does run
    Marlin, and vLLM's compile-cache hashes must not collide with a Machete run.
``load_weights``
    Replaces each quantized layer's placeholder tensors with the rank file's tensors
    (new device tensors bound to the same Parameter objects, GPTQ ``qzeros`` replaced
    by the empty ``int32[0]`` placeholder, ``input_global_scale = None``), marks the
    layers prepacked (see :mod:`.prepacked`), and feeds ``common.safetensors`` through
    the model's own ``load_weights`` (sharding, stacking, tied embeddings).
``load_model``
    The engine path: both steps, vLLM's ``process_weights_after_loading`` (a no-op for
    the marked layers), timings in one INFO line.

With ``{"fallback": true}`` a bundle that does not fit is reported with a warning and the
checkpoint is loaded by vLLM's ``DefaultModelLoader``; without it the load stops with a
:class:`~marlin_pack.vllm_plugin.checks.LoadRefusedError` naming the field.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import vllm
import vllm.envs as envs
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from marlin_pack._constants import KERNEL_NAME, LOAD_FORMAT
from marlin_pack.errors import BundleError
from marlin_pack.layout import tensor_specs
from marlin_pack.vllm_plugin.checks import (
    TORCH_DTYPES,
    BundlePlan,
    Decision,
    EngineFacts,
    LayerFacts,
    check_layers,
    check_rank_header,
    decide,
    parse_extra_config,
    refusal,
)
from marlin_pack.vllm_plugin.prepacked import install_patches, is_patched, is_prepacked, mark_prepacked
from marlin_pack.vllm_plugin.reader import CopyItem, ParallelReader, SafetensorsHeader, read_header

__all__ = ["MarlinPrepackedLoader", "engine_facts", "force_marlin", "layer_facts", "quantized_layers"]

# A child of "vllm" so vLLM's logging configuration (handler, level, format) applies.
logger = init_logger("vllm.marlin_pack")


def engine_facts(vllm_config: VllmConfig, model_config: ModelConfig) -> EngineFacts:
    """What the bundle must fit, read from vLLM (this worker's TP rank once distributed is up)."""
    from vllm.distributed import parallel_state as ps

    parallel = vllm_config.parallel_config
    if ps.model_parallel_is_initialized():
        tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    else:
        tp_size, tp_rank = parallel.tensor_parallel_size, 0
    kc = vllm_config.kernel_config
    return EngineFacts(
        model=str(model_config.model),
        vllm_version=vllm.__version__.split("+")[0],
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=parallel.pipeline_parallel_size,
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization,
        marlin_input_dtype=envs.VLLM_MARLIN_INPUT_DTYPE,
        batch_invariant=bool(envs.VLLM_BATCH_INVARIANT),
        disabled_kernels=tuple(envs.VLLM_DISABLED_KERNELS or ()),
        linear_backend=str(kc.linear_backend),
        linear_backend_per_quant=dict(kc.linear_backend_per_quant or {}) or None,
    )


def force_marlin(kernel_config: object) -> None:
    """Make vLLM choose MarlinLinearKernel for mixed-precision (AWQ/GPTQ) layers.

    Same effect as ``--kernel-config '{"linear_backend_per_quant": {"mixed_precision": "marlin"}}'``:
    ``choose_mp_linear_kernel`` reads it from the current vLLM config, and it leaves the
    other layer types' backend choice alone.
    """
    per_quant = getattr(kernel_config, "linear_backend_per_quant", None) or {}
    kernel_config.linear_backend_per_quant = {**per_quant, "mixed_precision": "marlin"}  # type: ignore[attr-defined]


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Modules with a quantization method that is not an unquantized or KV-cache one."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    found = {}
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if not isinstance(qm, QuantizeMethodBase) or isinstance(qm, BaseKVCacheMethod):
            continue
        if type(qm).__name__.startswith("Unquantized"):
            continue
        found[name] = module
    return found


def layer_facts(module: nn.Module) -> LayerFacts:
    """The kernel configuration vLLM chose for one quantized layer."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_padded_nk

    qm = module.quant_method
    kernel = getattr(qm, "kernel", None)
    c = getattr(kernel, "config", None)
    has_bias = getattr(module, "bias", None) is not None
    if c is None:
        return LayerFacts(method=type(qm).__name__, has_bias=has_bias, skips_when_marked=is_patched(qm))
    size_k, size_n = c.partition_weight_shape
    return LayerFacts(
        method=type(qm).__name__,
        kernel=type(kernel).__name__,
        partition_shape=(int(size_k), int(size_n)),
        padded_nk=tuple(marlin_padded_nk(size_n, size_k, c.group_size)),
        group_size=int(c.group_size),
        weight_type=str(c.weight_type),
        act_dtype=str(c.act_type).removeprefix("torch."),
        zero_points=bool(c.zero_points),
        has_bias=has_bias,
        skips_when_marked=is_patched(qm),
    )


@dataclass
class _ModelState:
    plan: BundlePlan | None  # None: loaded the ordinary way
    layers: dict[str, nn.Module] = field(default_factory=dict)


@dataclass
class _Timings:
    validate: float = 0.0
    create: float = 0.0
    copy: float = 0.0
    copy_bytes: int = 0
    common: float = 0.0
    post: float = 0.0

    def line(self, plan: BundlePlan, layers: int) -> str:
        rate = self.copy_bytes / self.copy / 1e9 if self.copy > 0 else 0.0
        total = self.validate + self.create + self.copy + self.common + self.post
        return (
            f"marlin-pack: validate {self.validate:.2f} s, create {self.create:.2f} s, "
            f"read+copy {self.copy:.2f} s ({self.copy_bytes / 1e9:.2f} GB, {rate:.1f} GB/s), "
            f"load common {self.common:.2f} s, post-process {self.post:.2f} s, total {total:.2f} s "
            f"({layers} prepacked layers, tp {plan.tp_set.tp_size} rank {plan.rank}, "
            f"bundle {plan.bundle_dir})"
        )


class MarlinPrepackedLoader(BaseModelLoader):
    """Serve an AWQ/GPTQ checkpoint from its marlin-pack bundle (no repack at start).

    Extra config (``--model-loader-extra-config``): ``bundle``, ``fallback``, ``verify``,
    ``io_threads``, ``chunk_mb``; see :class:`~marlin_pack.vllm_plugin.checks.LoaderOptions`.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Cheap and side-effect free: vLLM also instantiates loaders at worker init.
        self.options = parse_extra_config(load_config.model_loader_extra_config, str(load_config.load_format))
        self._decisions: dict[tuple[object, ...], Decision] = {}
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        self._timings = _Timings()

    # -- helpers -------------------------------------------------------------------------

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(
            dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        )

    @staticmethod
    def _is_draft(vllm_config: VllmConfig, model_config: ModelConfig) -> bool:
        spec = vllm_config.speculative_config
        return spec is not None and model_config is getattr(spec, "draft_model_config", None)

    def _decide(self, vllm_config: VllmConfig, model_config: ModelConfig) -> Decision:
        facts = engine_facts(vllm_config, model_config)
        key = (facts.model, facts.tp_size, facts.tp_rank, facts.dtype)
        if key not in self._decisions:
            t0 = time.perf_counter()
            decision = decide(self.options, facts)
            self._timings.validate = time.perf_counter() - t0
            if decision.fallback:
                logger.warning(
                    "marlin-pack: not using the bundle for %s ([%s] %s); loading the checkpoint the "
                    "ordinary way because fallback is on",
                    facts.model,
                    decision.field,
                    decision.reason,
                )
            self._decisions[key] = decision
        return self._decisions[key]

    # -- BaseModelLoader API ---------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        self._default_loader().download_model(model_config)

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Build the model with Marlin forced for mixed-precision layers and check its layers."""
        install_patches()
        if self._is_draft(vllm_config, model_config):
            logger.info("marlin-pack: loading the draft model %s the ordinary way", model_config.model)
            model = super().create_model(vllm_config, model_config, prefix)
            self._models[model] = _ModelState(None)
            return model
        decision = self._decide(vllm_config, model_config)
        if decision.plan is None:
            model = super().create_model(vllm_config, model_config, prefix)
            self._models[model] = _ModelState(None)
            return model
        plan = decision.plan
        t0 = time.perf_counter()
        force_marlin(vllm_config.kernel_config)
        model = super().create_model(vllm_config, model_config, prefix)
        layers = quantized_layers(model)
        try:
            check_layers(plan.manifest, plan.tp_set, {name: layer_facts(m) for name, m in layers.items()})
        except BundleError as e:
            reason, fld = str(e), getattr(e, "field", None) or "layers"
            if not self.options.fallback:
                raise refusal(fld, reason, str(model_config.model), plan.bundle_dir) from e
            # The model vLLM built is valid for ordinary loading (Marlin stays forced).
            logger.warning(
                "marlin-pack: not using the bundle %s ([%s] %s); loading the checkpoint the ordinary way "
                "because fallback is on",
                plan.bundle_dir,
                fld,
                reason,
            )
            self._models[model] = _ModelState(None)
            return model
        self._timings.create = time.perf_counter() - t0
        logger.info(
            "marlin-pack: %d quantized layers use %s (linear_backend_per_quant mixed_precision=marlin set by "
            "the %s loader)",
            len(layers),
            KERNEL_NAME,
            LOAD_FORMAT,
        )
        self._models[model] = _ModelState(plan, layers)
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Place the rank file's tensors and mark the layers; load the common tensors via vLLM."""
        state = self._models.get(model)
        if state is None:
            raise RuntimeError(
                f"the {LOAD_FORMAT} loader can only load weights into a model built by its own create_model"
            )
        if state.plan is None:
            self._default_loader().load_weights(model, model_config)
            return
        plan = state.plan
        with ParallelReader(self.options.io_threads, self.options.chunk_mb << 20) as reader:
            t0 = time.perf_counter()
            header = read_header(plan.rank_file)
            check_rank_header(
                plan, {n: (i.dtype, i.shape) for n, i in header.tensors.items()}, header.metadata
            )
            items = self._place(state, header)
            self._timings.copy_bytes = reader.copy(plan.rank_file, items)
            for layer in state.layers.values():
                mark_prepacked(layer)
            t1 = time.perf_counter()
            device = next(iter(state.layers.values())).qweight.device
            model.load_weights(self._common_weights(reader, plan, device))
            t2 = time.perf_counter()
        self._timings.copy, self._timings.common = t1 - t0, t2 - t1
        # Also the daemon's path (it calls create_model/load_weights, not load_model): say which file.
        logger.info(
            "marlin-pack: placed %d tensors (%.2f GB) from %s for tp %d rank %d",
            len(items),
            self._timings.copy_bytes / 1e9,
            plan.rank_file,
            plan.tp_set.tp_size,
            plan.rank,
        )

    def _place(self, state: _ModelState, header: SafetensorsHeader) -> list[CopyItem]:
        """Bind new device tensors of the bundle's shapes to the layers' parameters."""
        plan = state.plan
        assert plan is not None
        dtype = TORCH_DTYPES[plan.manifest.serving_dtype.value]
        items: list[CopyItem] = []
        for entry in plan.tp_set.layers:
            layer = state.layers[entry.name]
            for name, tdtype, shape in tensor_specs(entry, plan.manifest.quant, dtype):
                param = getattr(layer, name.rsplit(".", 1)[1])
                if not isinstance(param, nn.Parameter) or param.dtype != tdtype:
                    raise BundleError(
                        f"layer {entry.name}: parameter {name} is {type(param).__name__} "
                        f"{getattr(param, 'dtype', None)}, the bundle holds {tdtype}"
                    )
                # Keep the Parameter object (and its loader attributes), as vLLM's replace_parameter does.
                # Same element count (no padding): reuse the placeholder's storage; else bind a new
                # tensor, which frees the checkpoint-shaped placeholder.
                cur = param.data
                if cur.is_contiguous() and cur.numel() == math.prod(shape):
                    param.data = cur.view(shape)
                else:
                    param.data = torch.empty(shape, dtype=tdtype, device=param.device)
                info = header.tensors[name]
                items.append(CopyItem(info.start, info.nbytes, param.data))
            if not plan.manifest.quant.zero_points:
                # What MarlinLinearKernel does for GPTQ: marlin_make_empty(device).
                device = layer.qweight.device
                layer.qzeros = nn.Parameter(
                    torch.empty(0, dtype=torch.int, device=device), requires_grad=False
                )
            layer.input_global_scale = None
        return items

    @staticmethod
    def _common_weights(
        reader: ParallelReader, plan: BundlePlan, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``common.safetensors`` in file order: via GPU staging at TP=1, else as CPU tensors."""
        header = read_header(plan.common_file)
        ordered = sorted(header.tensors.items(), key=lambda kv: kv[1].start)
        if device.type == "cuda" and plan.tp_set.tp_size == 1:
            # Whole tensors are used at TP=1, so read them straight to the GPU (pinned, threaded).
            for name, info in ordered:
                if info.torch_dtype is None:
                    raise BundleError(f"{plan.common_file}: tensor {name} has unsupported dtype {info.dtype}")
                t = torch.empty(info.shape, dtype=info.torch_dtype, device=device)
                reader.copy(plan.common_file, [CopyItem(info.start, info.nbytes, t)])
                yield name, t
            return
        # At TP > 1 each rank copies only its shard: let vLLM's weight loaders narrow CPU tensors.
        from safetensors import safe_open

        with safe_open(str(plan.common_file), framework="pt") as f:
            for name, _ in ordered:
                yield name, f.get_tensor(name)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """The engine path: create, place, vLLM post-processing (no-op for prepacked layers), timings."""
        if self._is_draft(vllm_config, model_config) or self._decide(vllm_config, model_config).fallback:
            return self._default_loader().load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
        load_device = (
            vllm_config.device_config.device if self.load_config.device is None else self.load_config.device
        )
        target_device = torch.device(load_device)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = self.create_model(vllm_config, model_config, prefix)
            self.load_weights(model, model_config)
            gc.collect()
            torch.accelerator.empty_cache()
            t0 = time.perf_counter()
            process_weights_after_loading(model, model_config, target_device)
            self._timings.post = time.perf_counter() - t0
            state = self._models[model]
            left = [name for name, layer in state.layers.items() if is_prepacked(layer)]
            if left:
                raise RuntimeError(
                    f"marlin-pack: vLLM's post-processing did not run the patched method for {len(left)} "
                    f"prepacked layers (e.g. {left[0]}); their tensors may be corrupt"
                )
            gc.collect()
            torch.accelerator.empty_cache()
        if state.plan is not None:
            logger.info(self._timings.line(state.plan, len(state.layers)))
        return model.eval()
