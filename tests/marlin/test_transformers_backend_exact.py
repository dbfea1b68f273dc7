"""Architectures vLLM serves through its Transformers backend convert bit-exactly to what the backend holds.

Checkpoints come from transformers' own model classes (``arch_checkpoints.BACKEND_CONFIGS``: random init, tiny
config, AWQ/GPTQ tensors for the decoder's linears); the reference (``oracles.vllm_reference``) builds the model class
the installed vLLM's registry picks, here ``TransformersForCausalLM`` (the backend's real ``recursive_replace``, fusers
and tp_plan, over the installed transformers), loads every tensor through its ``load_weights`` and runs its
post-processing on the CPU. On a release that builds its own class for an architecture instead (Phi on 0.30.0), the
case is skipped with the loader's refusal as its reason; Gemma's row serves both paths and is compared with whichever
the release takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marlin_pack import convert, verify
from marlin_pack.marlin.architectures import ARCHITECTURES

pytest.importorskip("vllm")
from arch_checkpoints import BACKEND_CONFIGS, write_arch_checkpoint  # noqa: E402
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402

# The architectures: each meets AWQ and GPTQ, float16 and bfloat16, TP 1 and 2.
NAMED = ("Olmo2ForCausalLM", "Starcoder2ForCausalLM", "GPTBigCodeForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM",
         "SmolLM3ForCausalLM", "GemmaForCausalLM")
# No registry entry: vLLM's registry falls back to the backend because transformers has the class (releases.py's
# backend_fallback); the oracle builds what that fallback resolves. Each meets AWQ and GPTQ too.
FALLBACK = ("HeliumForCausalLM", "MinistralForCausalLM", "NanoChatForCausalLM")
FORMATS = {"awq": dict(fmt="awq"), "gptq4": dict(fmt="gptq", bits=4), "gptq8": dict(fmt="gptq", bits=8)}


def _cases() -> list:
    cases = []
    for i, arch in enumerate(NAMED + FALLBACK):
        for dtype, fmt in ((torch.float16, ("awq", "gptq4")[i % 2]), (torch.bfloat16, ("gptq4", "awq")[i % 2])):
            cases.append(pytest.param(arch, fmt, dtype, id=f"{arch}-{fmt}-{str(dtype)[6:]}"))
    for i, arch in enumerate(a for a in BACKEND_CONFIGS if a not in NAMED + FALLBACK):  # every other row once
        fmt, dtype = ("gptq8", "awq", "gptq4")[i % 3], (torch.bfloat16, torch.float16)[i % 2]
        cases.append(pytest.param(arch, fmt, dtype, id=f"{arch}-{fmt}-{str(dtype)[6:]}"))
    return cases


def _skip_where_another_path(arch: str) -> str:
    """The class the running release builds for ``arch``; skips where the loader refuses the row's bundle there."""
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    row = ARCHITECTURES[arch]
    problem = releases.path_problem(vllm_version(), arch, row.paths)
    if problem is not None:
        pytest.skip(problem)
    if releases.serving_path(vllm_version(), arch) == "transformers":
        return "TransformersForCausalLM"
    return row.vllm_class.split(".")[1]


_CASE = "MARLIN_PACK_BACKEND_CASE"


def _ran_in_own_process(request: pytest.FixtureRequest) -> bool:
    """Run this case in a fresh pytest process and say so (True), unless this is that process (False).

    vLLM's Transformers backend keeps state for the life of a process: fusers cached per module class and
    forwards rewritten in place, on transformers' own classes. After the rest of the suite has built models in the
    same process, a backend model can come out with another layer unquantized (seen: Glm's ``gate_up_proj`` under
    GPTQ 8-bit); in a process of its own each case builds what a fresh engine builds.
    """
    if os.environ.get(_CASE) == request.node.nodeid:
        return False
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid], cwd=root,
                          env={**os.environ, _CASE: request.node.nodeid}, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return True


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,dtype", _cases())
def test_transformers_backend_bit_exact_tp_1_2(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, fmt: str, dtype: torch.dtype
) -> None:
    vllm_class = _skip_where_another_path(arch)
    if _ran_in_own_process(request):
        return
    # 4 heads, 2 KV heads (GPTBigCode: 1, replicated at TP 2; GPT-NeoX: 4); group 32 keeps whole groups per rank
    model = write_arch_checkpoint(tmp_path / "model", arch, group_size=32, dtype=dtype, **FORMATS[fmt])
    manifest = convert(model, tp=(1, 2), dtype=str(dtype).removeprefix("torch.")).manifest
    seen: list[str] = []
    n = assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype, model_class=seen)
    assert n >= 4 * 2 * 3 * 2  # 3 ranks, 4 layers x 2 decoder layers, 2+ tensors each
    assert set(seen) == {vllm_class}
    assert manifest.target.transformers == "5.16-5.22"
    assert verify(model / "marlin-pack").ok


MOE_CASES = [("OlmoeForCausalLM", "awq", torch.float16), ("OlmoeForCausalLM", "gptq4", torch.bfloat16),
             ("FlexOlmoForCausalLM", "gptq4", torch.float16), ("FlexOlmoForCausalLM", "awq", torch.bfloat16),
             # a shared expert beside the experts (HunYuan's mlp.shared_mlp, Kolibri 1's mlp.shared_experts): Marlin
             # linears; Mellum's first layer dense (mlp_layer_types), its second sparse
             ("HunYuanMoEV1ForCausalLM", "awq", torch.float16), ("HunYuanMoEV1ForCausalLM", "gptq4", torch.bfloat16),
             ("Kolibri1ForCausalLM", "gptq4", torch.float16), ("Kolibri1ForCausalLM", "awq", torch.bfloat16),
             ("MellumForCausalLM", "awq", torch.float16), ("MellumForCausalLM", "gptq4", torch.bfloat16)]
# The decoder layers with experts in the tiny checkpoints (moe_checkpoints.MOE_CONFIGS)
SPARSE = {"MellumForCausalLM": (1,)}


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,dtype", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{str(c[2])[6:]}") for c in MOE_CASES])
def test_transformers_backend_moe_bit_exact_tp_1_2(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, fmt: str, dtype: torch.dtype
) -> None:
    """Sparse MoE blocks through the backend (MoEMixin): attention (and a shared expert, or a dense layer's MLP) as Marlin
    linears, the routed experts one FusedMoE (``mlp.experts.routed_experts``) on Marlin MoE, as in vLLM's own MoE
    classes."""
    from moe_checkpoints import write_moe_checkpoint
    from oracles.vllm_moe_reference import assert_moe_bundle_equals_vllm

    _skip_where_another_path(arch)
    if _ran_in_own_process(request):
        return
    model = write_moe_checkpoint(tmp_path / "m", arch, FORMATS[fmt]["fmt"], group_size=32, dtype=dtype)
    manifest = convert(model, tp=(1, 2), dtype=str(dtype).removeprefix("torch.")).manifest
    sparse = SPARSE.get(arch, (0, 1))
    assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype) >= 3 * (2 * 2 + 4 * len(sparse))
    assert [e.name for e in manifest.tensor_parallel[0].moe_layers] == [
        f"model.layers.{i}.mlp.experts.routed_experts" for i in sparse]
    assert manifest.target.transformers == "5.16-5.22"
    assert verify(model / "marlin-pack").ok


# llm-compressor's pack-quantized W4A16 (symmetric) and W4A16_ASYM (zero points): dense rows and sparse MoE blocks
CT_CASES = [("Olmo2ForCausalLM", True, torch.bfloat16), ("Olmo2ForCausalLM", False, torch.float16),
            ("OlmoeForCausalLM", True, torch.float16), ("OlmoeForCausalLM", False, torch.bfloat16),
            ("HunYuanMoEV1ForCausalLM", False, torch.bfloat16), ("MellumForCausalLM", True, torch.float16)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,symmetric,dtype", [
    pytest.param(*c, id=f"{c[0]}-{'w4a16' if c[1] else 'w4a16_asym'}-{str(c[2])[6:]}") for c in CT_CASES])
def test_transformers_backend_compressed_tensors_bit_exact_tp_1_2(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, symmetric: bool, dtype: torch.dtype
) -> None:
    """compressed-tensors checkpoints of backend architectures: the dense layers as CompressedTensorsWNA16 holds them
    after Marlin's post-processing (``weight_packed``, ``weight_scale``, zero points only when asymmetric, the kept
    ``weight_shape``), the experts as CompressedTensorsWNA16MoEMethod on Marlin MoE holds them."""
    from moe_checkpoints import write_moe_checkpoint
    from oracles.vllm_moe_reference import assert_moe_bundle_equals_vllm

    vllm_class = _skip_where_another_path(arch)
    if _ran_in_own_process(request):
        return
    moe = ARCHITECTURES[arch].moe
    if moe:
        model = write_moe_checkpoint(tmp_path / "m", arch, "compressed-tensors", group_size=32, dtype=dtype,
                                     symmetric=symmetric)
    else:
        model = write_arch_checkpoint(tmp_path / "m", arch, "compressed-tensors", group_size=32, dtype=dtype,
                                      symmetric=symmetric)
    manifest = convert(model, tp=(1, 2), dtype=str(dtype).removeprefix("torch.")).manifest
    assert manifest.source.format.value == "compressed-tensors" and manifest.quant.zero_points is not symmetric
    if moe:
        assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype) >= 3 * (2 * 2 + 4)
        assert manifest.tensor_parallel[0].moe_layers
    else:
        seen: list[str] = []
        assert assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), dtype, model_class=seen) >= 4 * 2 * 3 * 3
        assert set(seen) == {vllm_class}
    assert manifest.target.transformers == "5.16-5.22"
    assert verify(model / "marlin-pack").ok


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt", [("FlexOlmoForCausalLM", "gptq4"), ("HunYuanMoEV1ForCausalLM", "awq"),
                                      ("OlmoeForCausalLM", "awq")])
def test_transformers_backend_moe_w1_w3_w2_naming_bit_exact(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, fmt: str
) -> None:
    """Experts stored as mlp.experts.N.{w1,w3,w2} (Mixtral's names): the backend's TransformersRoutedExperts maps them as
    gate, up and down (its Mixtral expert mapping), so vLLM serves such a checkpoint; so does marlin-pack, bit-exact.
    Olmoe: vLLM 0.30.0-0.33.0 build olmoe.py, which maps gate_proj/up_proj/down_proj only (and leaves such experts
    unloaded); its bundle records the backend as its only path (``target.paths``) and the loader refuses it there in one
    line."""
    from moe_checkpoints import write_moe_checkpoint
    from oracles.vllm_moe_reference import assert_moe_bundle_equals_vllm
    from safetensors.torch import load_file, save_file

    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    _skip_where_another_path(arch)
    if _ran_in_own_process(request):
        return
    model = write_moe_checkpoint(tmp_path / "m", arch, FORMATS[fmt]["fmt"], group_size=32, dtype=torch.float16)
    for path in model.glob("*.safetensors"):
        renamed = {}
        for k, v in load_file(path).items():
            if ".experts." in k:  # only the routed experts' projections (a shared expert keeps its names)
                for old, new in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
                    k = k.replace(old, new)
            renamed[k] = v
        save_file(renamed, str(path), metadata={"format": "pt"})
    assert any(".experts.0.w1." in k for p in model.glob("*.safetensors") for k in load_file(p))
    manifest = convert(model, tp=(1, 2), dtype="float16").manifest
    assert verify(model / "marlin-pack").ok
    if arch == "OlmoeForCausalLM":  # the row serves both paths, this checkpoint the backend's only
        assert manifest.target.paths == ("transformers",)
        assert '"paths": [\n      "transformers"\n    ]' in (model / "marlin-pack" / "manifest.json").read_text()
    else:
        assert manifest.target.paths is None
    if releases.serving_path(vllm_version(), arch) not in (manifest.target.paths or ("transformers",)):
        import transformers

        from marlin_pack.errors import BundleMismatchError
        from marlin_pack.vllm_plugin.decision import EngineFacts, check_engine

        facts = EngineFacts(model=str(model), vllm_version=vllm_version(), quantization="auto_awq",
                            transformers_version=transformers.__version__)
        with pytest.raises(BundleMismatchError) as e:
            check_engine(manifest, facts)
        served = ", ".join(v for v in releases.supported() if releases.serving_path(v, arch) == "transformers")
        assert e.value.field == "vllm_version" and "\n" not in str(e.value)
        assert str(e.value).endswith(
            f"vLLM {vllm_version()} serves OlmoeForCausalLM with its own model class, which does not load the experts named "
            f"mlp.experts.N.{{w1,w3,w2}} of the checkpoint the bundle was made from (only vLLM's Transformers backend "
            f"does); serve it with vLLM {served}")
        return
    assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.float16) >= 3 * (2 * 2 + 4)
