"""GPU: architectures vLLM serves through its Transformers backend, from their bundles, against stock vLLM.

For each case, tiny checkpoints written by transformers' own classes (``tests/arch_checkpoints.py``,
``tests/moe_checkpoints.py``): engine (a) loads the checkpoint the ordinary way with vLLM's own kernel choice
(no ``--linear-backend``, no ``--moe-backend``: Machete for group size 128 on SM90, Marlin elsewhere; experts on
Marlin MoE), engine (b) with ``--load-format marlin_prepacked``. Every parameter of (b) is bit-identical to (a)
(sha256 of each), the generated tokens and logprobs are equal, and both built the backend's model class. Cases whose
architecture the running release serves with a class of its own are skipped (the CPU suite covers that path).
``test_daemon_gpu.py`` (model ``olmo2-awq-backend``) starts one of them through the weight-cache daemon.

Run on the GPU machine: ``bash tests/on_gpu/device.sh tests/on_gpu/test_transformers_backend_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import assert_engines_identical, ordinary_and_prepacked

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for arch_checkpoints, moe_checkpoints
pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# case -> (architecture, format, bits, serving dtype); the first three dense, the last one experts
CASES = {
    "olmo2-awq": ("Olmo2ForCausalLM", "awq", 4, "float16"),
    "gpt_neox-gptq8": ("GPTNeoXForCausalLM", "gptq", 8, "float16"),
    "gemma-gptq4": ("GemmaForCausalLM", "gptq", 4, "bfloat16"),
    "olmoe-gptq4": ("OlmoeForCausalLM", "gptq", 4, "float16"),
}
MOE = {"OlmoeForCausalLM"}
EXPERTS = "model.layers.0.mlp.experts.routed_experts"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("backend-gpu")


def _backend_or_skip(arch: str) -> None:
    from marlin_pack.marlin.architectures import ARCHITECTURES
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    problem = releases.path_problem(vllm_version(), arch, ARCHITECTURES[arch].paths)
    if problem is not None:
        pytest.fail(problem)  # the loader would refuse this bundle here: the test's premise is broken
    if releases.serving_path(vllm_version(), arch) != "transformers":
        pytest.skip(f"vLLM {vllm_version()} serves {arch} with a class of its own")


@pytest.mark.parametrize("case", list(CASES))
def test_backend_model_prepacked_equals_vllm_default(workdir: Path, case: str) -> None:
    import marlin_pack

    arch, fmt, bits, dtype = CASES[case]
    _backend_or_skip(arch)
    tdtype = getattr(torch, dtype)
    if arch in MOE:
        from moe_checkpoints import write_moe_checkpoint

        model = write_moe_checkpoint(workdir / case, arch, fmt, bits=bits, group_size=128, dtype=tdtype, tokenizer=True)
    else:
        from arch_checkpoints import write_arch_checkpoint

        model = write_arch_checkpoint(workdir / case, arch, fmt, bits=bits, group_size=128, dtype=tdtype, tokenizer=True)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    manifest = marlin_pack.convert(model, tp=(1,), kernel="machete" if hopper else "marlin").manifest
    assert manifest.serving_dtype.value == dtype
    assert manifest.target.transformers, "a backend bundle names the transformers releases it was made against"
    layer = manifest.tensor_parallel[0].layers[0].name  # the first linear of the first decoder layer
    extra = (EXPERTS,) if arch in MOE else ()
    a, b = ordinary_and_prepacked(workdir, case, model, layer, extra_layers=extra, vllm_default=True, dtype=dtype)
    linear_kernel = "MacheteLinearKernel" if hopper else "MarlinLinearKernel"
    n = assert_engines_identical(a, b, layer, linear_kernel)
    expected = "TransformersMoEForCausalLM" if arch in MOE else "TransformersForCausalLM"
    assert a["model_class"] == b["model_class"] == expected, (a["model_class"], b["model_class"])
    if arch in MOE:
        for res in (a, b):
            k = res["layers"]["kernels"][EXPERTS]
            assert (k["kernel"], k["moe_backend"]) == ("MarlinExperts", "MARLIN"), k
    print(f"{case} ({arch}, {expected}): {n} parameters bit-identical to vLLM's default engine, "
          f"{layer} on {linear_kernel}{', experts on MarlinExperts' if extra else ''}; tokens and logprobs equal; "
          f"start {a['start_s']:.1f} s default vs {b['start_s']:.1f} s prepacked")
