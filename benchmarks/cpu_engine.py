"""The CPU stand-in of a GPU engine and its weight-cache daemon, for ``bench_construct.py`` (benchmarks only).

vLLM 0.33.0 refuses to build AWQ/GPTQ Marlin layers without a CUDA device; :func:`setup` makes the
quantization and kernel-selection modules see an SM90 platform and gives attention layers vLLM's
CPU backend, nothing else. :func:`daemon_state` is what a ``marlin_prepacked`` weight-cache daemon
would export for a checkpoint, with shapes only (no tensor memory). Its engines and daemon build the
model with the settings of every GPU test and benchmark engine (``ENGINE_SETTINGS`` of the engine
harness, :mod:`marlin_pack.testing.engine_harness`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_checkpoint", "configs", "daemon_state", "setup"]


def write_checkpoint(workdir: Path, preset: str, fmt: str) -> Path:
    """A sparse checkpoint of ``preset`` (headers only; seconds, no disk space)."""
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint
    from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

    out = workdir / f"{preset}-{fmt}"
    if preset in MOE_PRESETS:
        return write_moe_checkpoint(out, MOE_PRESETS[preset], fmt, group_size=128, max_shard_bytes=5 << 30, device="meta")
    writer = write_awq_checkpoint if fmt == "awq" else write_gptq_checkpoint
    return writer(out, PRESETS[preset], group_size=128, max_shard_bytes=5 << 30, device="meta", tokenizer=False)




def _cpu_stand_ins() -> None:
    """What lets vLLM build CUDA-shaped AWQ/GPTQ Marlin layers on a CPU (see the module docstring)."""
    import importlib

    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability

    class Sm90View:
        _enum = PlatformEnum.CUDA

        def __init__(self, real: object) -> None:
            self._real = real

        def __getattr__(self, name: str) -> object:
            return getattr(self._real, name)

        def is_cuda(self) -> bool:
            return True

        is_cuda_alike = is_cuda

        def is_cpu(self) -> bool:
            return False

        is_rocm = is_xpu = is_cpu

        def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        def has_device_capability(self, capability: object, device_id: int = 0) -> bool:
            c = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability
            return c <= 90  # type: ignore[operator]

    _ = current_platform._enum  # resolve the lazy platform before wrapping it
    view = Sm90View(current_platform)
    for name in ("kernels.linear", "kernels.linear.mixed_precision.marlin", "layers.quantization.utils.marlin_utils",
                 "layers.quantization.auto_awq", "layers.quantization.auto_gptq", "layers.quantization.moe_wna16",
                 "layers.fused_moe.oracle.int_wna16", "layers.fused_moe.experts.marlin_moe", "layers.fused_moe.config"):
        module = importlib.import_module(f"vllm.model_executor.{name}")
        if "current_platform" in vars(module):
            module.current_platform = view
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    attention.get_attn_backend = lambda *a, **k: CPUAttentionBackend


def _engine_settings() -> dict[str, object]:
    """The engine harness's ``ENGINE_SETTINGS``, from this checkout's file: a ``--baseline-tree`` child of
    ``bench_construct.py`` imports another tree's marlin_pack, which may predate the harness (whose import
    runs the standard library only)."""
    import importlib.util
    import sys

    name = "_bench_engine_harness"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "marlin_pack" / "testing" / "engine_harness.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return dict(sys.modules[name].ENGINE_SETTINGS)


def configs(model_dir: str, load_format: str) -> tuple[object, object]:
    from vllm.config import DeviceConfig, KernelConfig, LoadConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, **_engine_settings())
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"), kernel_config=KernelConfig(),
                    load_config=LoadConfig(load_format=load_format, device="cpu:0"))
    return vc, mc


def _stand_in(t: object) -> object:
    import torch

    assert isinstance(t, torch.Tensor)
    return torch.empty((), dtype=t.dtype).expand(t.shape)  # the shape, no memory (a CUDA IPC mapping's stand-in)


def daemon_state(model_dir: str) -> object:
    """What a ``marlin_prepacked`` daemon exports for this checkpoint (shapes of a bundle, stand-in data)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.protocol import TensorEntry, WeightCacheState
    from vllm.utils.torch_utils import set_default_torch_dtype

    from marlin_pack.marlin.rank_tensors import tensor_specs
    from marlin_pack.planning import plan_conversion
    from marlin_pack.sources import Checkpoint, source_from_quant_config
    from marlin_pack.vllm_plugin.engine import quantized_layers
    from marlin_pack.vllm_plugin.patches.post_processing import mark_prepacked
    from marlin_pack.vllm_plugin.patches.weight_cache import force_marlin_for_cache

    ckpt = Checkpoint(Path(model_dir))
    source = source_from_quant_config(ckpt.quantization_config())
    plan = plan_conversion(ckpt, source, [1], torch.float16)
    specs = [s for e in plan.entries[1] for s in tensor_specs(e, source.scheme, torch.float16, source.format)]
    if plan.moe is not None:
        specs += plan.moe.specs(1, source.scheme, torch.float16)
    vc, mc = configs(model_dir, "marlin_prepacked")
    force_marlin_for_cache(vc, mc, role="benchmark daemon")
    with set_current_vllm_config(vc), set_default_torch_dtype(mc.dtype):  # as WeightCacheDaemon.load_model
        with torch.device("meta"):
            model = initialize_model(vllm_config=vc, model_config=mc)
        layers = quantized_layers(model)
        for name, dtype, shape in specs:  # as MarlinPrepackedLoader._place, on meta
            layer, leaf = name.rsplit(".", 1)
            getattr(layers[layer], leaf).data = torch.empty(shape, dtype=dtype, device="meta")
        for layer in layers.values():
            mark_prepacked(layer)
        process_weights_after_loading(model, mc, torch.device("meta"))
    entries, aliases = _export(model)
    return WeightCacheState({n: TensorEntry(e.kind, cpu_tensor=_stand_in(e.cpu_tensor)) for n, e in entries.items()}, aliases, {})


def _export(model: object) -> tuple[dict, dict]:
    """vLLM's ``export_entries``, with meta tensors shipped "by value" (its ``.cpu()`` refuses meta)."""
    from unittest import mock

    import torch
    from vllm.model_executor.model_loader.weight_cache import daemon, protocol

    def from_tensor(cls: type, tensor: torch.Tensor, kind: str) -> object:
        return cls(kind=kind, cpu_tensor=tensor.detach())

    with mock.patch.object(protocol.TensorEntry, "from_tensor", classmethod(from_tensor)):
        return daemon.export_entries(model)


def setup(model_dir: str, variant: str) -> None:
    """CPU stand-ins, marlin-pack registered (``before``: without its construction patches), a 1-rank gloo world."""
    import logging
    import socket

    _cpu_stand_ins()
    logging.getLogger("vllm").setLevel(logging.ERROR)  # per-layer warnings (fp16 scales, padding) are expected
    from marlin_pack.vllm_plugin import patches, register

    register()
    if variant == "before":
        # The patches this benchmark was written to measure (an older tree has none of them).
        skip = {p.target for m in ("construct", "cache_key") for p in getattr(getattr(patches, m, None), "PATCHES", ())}
        patches.uninstall_all()
        from marlin_pack.vllm_plugin.patches import registry
        from marlin_pack.vllm_plugin.version_guard import vllm_version

        registry.install_all([p for p in patches.PATCHES if p.target not in skip], running=vllm_version(), targeted=vllm_version())
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(configs(model_dir, "ipc_cache")[0]):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)
