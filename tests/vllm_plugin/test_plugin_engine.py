"""``engine``: the facts read from vLLM, and forcing vLLM to choose MarlinLinearKernel."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import plugin_fakes as fakes
import pytest
import torch


def test_force_marlin_makes_vllm_choose_marlin(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config as vllm_config_mod
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS, _resolve_backend_kernels
    from vllm.platforms import PlatformEnum

    from marlin_pack.vllm_plugin.engine import force_marlin

    kc = KernelConfig()
    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: SimpleNamespace(kernel_config=kc))

    def candidates() -> list[str]:
        kernels = _resolve_backend_kernels(
            list(_POSSIBLE_KERNELS[PlatformEnum.CUDA]),
            "mixed-precision",
            quantization="mixed_precision",
            compute_capability=90,
        )
        return [k.__name__ for k in kernels]

    assert candidates().index("MacheteLinearKernel") < candidates().index("MarlinLinearKernel")  # H200 default
    kc.linear_backend_per_quant = {"fp8": "cutlass"}
    force_marlin(kc)
    assert kc.linear_backend_per_quant == {"fp8": "cutlass", "mixed_precision": "marlin"}
    assert candidates() == ["MarlinLinearKernel"]
    # what vLLM's compile cache keys on (compute_hash up to 0.33, compile_factors from 0.34)
    def compile_key(c: KernelConfig) -> object:
        return c.compute_hash() if hasattr(c, "compute_hash") else c.compile_factors()

    assert compile_key(kc) != compile_key(KernelConfig(linear_backend_per_quant={"fp8": "cutlass"}))


def test_engine_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.config.kernel import KernelConfig

    from marlin_pack.vllm_plugin.decision import EngineFacts
    from marlin_pack.vllm_plugin.engine import engine_facts

    for name in ("VLLM_MARLIN_INPUT_DTYPE", "VLLM_BATCH_INVARIANT", "VLLM_DISABLED_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    installed = vllm.__version__.split("+")[0]
    monkeypatch.setattr(vllm, "__version__", f"{installed}+cu130")
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
        kernel_config=KernelConfig(linear_backend_per_quant={"fp8": "cutlass"}),
    )
    model_config = SimpleNamespace(model="/m", dtype=torch.bfloat16, quantization="auto_gptq")
    assert engine_facts(vllm_config, model_config) == EngineFacts(  # type: ignore[arg-type]
        model="/m",
        vllm_version=installed,
        tp_size=2,
        tp_rank=0,  # distributed not initialised: rank 0 of the configured size
        pp_size=1,
        dtype="bfloat16",
        quantization="auto_gptq",
        linear_backend="auto",
        linear_backend_per_quant={"fp8": "cutlass"},
        transformers_version=importlib.metadata.version("transformers"),  # what vLLM's Transformers backend builds from
    )


def test_engine_facts_of_a_pipeline_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """With distributed up, the TP rank, the pipeline stage, the replica and the prefill-context rank are the groups' (as
    vLLM's make_layers and FusedMoEParallelConfig.make ask them); the sizes and the expert-parallel settings are the
    configuration's."""
    from vllm.config.kernel import KernelConfig
    from vllm.distributed import parallel_state as ps

    from marlin_pack.vllm_plugin.engine import engine_facts

    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(world_size=3, rank_in_group=2))
    monkeypatch.setattr(ps, "get_dp_group", lambda: SimpleNamespace(world_size=4, rank_in_group=3))
    monkeypatch.setattr(ps, "get_pcp_group", lambda: SimpleNamespace(world_size=2, rank_in_group=1))
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=4, data_parallel_rank=0, prefill_context_parallel_size=2,
        enable_expert_parallel=True, expert_placement_strategy="round_robin"), kernel_config=KernelConfig())
    model_config = SimpleNamespace(model="/m", dtype=torch.float16, quantization=None)
    f = engine_facts(vllm_config, model_config)  # type: ignore[arg-type]
    assert (f.tp_size, f.tp_rank, f.pp_size, f.pp_rank, f.dp_size, f.dp_rank) == (2, 1, 3, 2, 4, 3)
    assert (f.pcp_size, f.pcp_rank, f.expert_parallel, f.expert_placement) == (2, 1, True, "round_robin")
    vllm_config.parallel_config.pipeline_parallel_size = 1  # PP=1: the PP group is not asked
    monkeypatch.setattr(ps, "get_pp_group", lambda: pytest.fail("asked the PP group at PP=1"))
    f = engine_facts(vllm_config, model_config)  # type: ignore[arg-type]
    assert (f.pp_size, f.pp_rank) == (1, 0)


@pytest.mark.parametrize(
    ("kernel", "act", "ok"),
    [
        ("Marlin", torch.float16, True),
        ("Marlin", torch.bfloat16, True),
        ("Marlin", torch.int8, False),
        ("Marlin", torch.float8_e4m3fn, False),
        ("Machete", torch.float16, False),
        ("Exllama", torch.float16, False),
    ],
)
def test_is_marlin_16bit(kernel: str, act: torch.dtype, ok: bool) -> None:
    from marlin_pack.vllm_plugin.engine import is_marlin_16bit

    method = fakes.quant_method("gptq", fakes.fake_kernel(fakes.kernel_cls(kernel), fakes.mp_config("uint4b8", act)))
    assert is_marlin_16bit(method) is ok
    assert not is_marlin_16bit(SimpleNamespace())  # no kernel yet


def test_built_parameters_maps_checkpoint_names_as_the_model_does() -> None:
    """A multimodal model loads ``model.language_model.*`` into ``language_model.model.*`` (its hf_to_vllm_mapper);
    a name is built where its mapped name is a parameter (a pipeline stage's PPMissingLayer holds none)."""
    from torch import nn
    from vllm.model_executor.models.utils import WeightsMapper

    from marlin_pack.vllm_plugin.engine import built_parameters

    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.model = nn.Module()
    model.language_model.model.norm = nn.LayerNorm(4)
    names = ["model.language_model.norm.weight", "model.language_model.embed_tokens.weight", "language_model.model.norm.bias"]
    assert built_parameters(model, names) == ["language_model.model.norm.bias"]  # no mapper: names as they are
    model.hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model."})
    assert built_parameters(model, names) == ["model.language_model.norm.weight", "language_model.model.norm.bias"]
