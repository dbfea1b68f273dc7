"""GPU: mixture-of-experts models served from their bundles, against stock vLLM.

For a tiny Mixtral (AWQ, fp16; compressed-tensors W4A16_ASYM, fp16), a tiny Qwen3-MoE (GPTQ 4-bit, bf16;
compressed-tensors W4A16, bf16) and tiny DeepSeek-V2-Lite-shaped
(AWQ, fp16: MLA attention with q_proj, a dense first layer, shared experts) and DeepSeek-V3-shaped
(GPTQ 4-bit, bf16: fused_qkv_a_proj, sigmoid grouped routing) models, all TP 1: engine (a) loads
the checkpoint the ordinary way with Marlin forced for linears (``linear_backend="marlin"``) and
experts (``moe_backend="marlin"``: on SM90 ``auto`` picks Humming when the ``humming`` package is
installed); engine (b) uses ``--load-format marlin_prepacked`` with ``moe_backend`` left at
``auto`` (the loader resolves it to Marlin). Every parameter of (b) is bit-identical to (a)
(sha256 of each), the experts run ``MarlinExperts`` on the MARLIN backend in both, and the
generated tokens and logprobs of both engines are equal. Checkpoints come from
``tests/moe_checkpoints.py`` (transformers' model classes for the unquantized parts, router
included, with a tokenizer).

DeepSeek runs vLLM's MLA attention, which TRITON_ATTN cannot serve: its engines use the MLA decode
backend ``MARLIN_PACK_TEST_MLA_ATTN`` (default TRITON_MLA: Triton, any head size and GPU, like
TRITON_ATTN for the dense models; ``auto`` lets vLLM choose, FLASH_ATTN_MLA on an H200) and the
MLA prefill backend ``MARLIN_PACK_TEST_MLA_PREFILL`` (default CPU: vLLM's pure-torch prefill,
which runs on the GPU's tensors too; on Hopper vLLM's only automatic choice is FLASH_ATTN, whose
binaries the project's GPU machine does not carry; ``auto`` lets vLLM choose). Both engines of a
case use the same backends, so the comparison does not depend on which. The checkpoints keep
DeepSeek-V2-Lite's MLA head sizes (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim and
v_head_dim 128), the sizes vLLM's MLA kernels take. The parameter digests include the
``W_UK_T`` / ``W_UV`` tensors vLLM's MLA post-processing derives from ``kv_b_proj`` (through its
Marlin GEMM) after the prepacked layers are finished.

Run on the GPU machine::

    python -m pytest tests/on_gpu/test_moe_gpu.py -m gpu -v -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _harness import MLA_ENGINE_KWARGS, assert_engines_identical, ordinary_and_prepacked

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for moe_checkpoints
pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

ATTENTION = "model.layers.0.self_attn.qkv_proj"
MLA = "model.layers.0.self_attn.kv_b_proj"  # DeepSeek: its Marlin GEMM also feeds vLLM's MLA post-processing
# case -> (architecture, format, bits, serving dtype, vLLM's experts module of the first sparse layer,
#          the Marlin linear whose kernel is reported, engine arguments of both engines)
CASES = {
    "mixtral-awq": ("MixtralForCausalLM", "awq", 4, "float16", "model.layers.0.block_sparse_moe.experts.routed_experts",
                    ATTENTION, {}),
    "qwen3moe-gptq4": ("Qwen3MoeForCausalLM", "gptq", 4, "bfloat16", "model.layers.0.mlp.experts.routed_experts", ATTENTION, {}),
    "deepseekv2-awq": ("DeepseekV2ForCausalLM", "awq", 4, "float16", "model.layers.1.mlp.experts.routed_experts", MLA,
                       MLA_ENGINE_KWARGS),
    "deepseekv3-gptq4": ("DeepseekV3ForCausalLM", "gptq", 4, "bfloat16", "model.layers.1.mlp.experts.routed_experts", MLA,
                         MLA_ENGINE_KWARGS),
    # compressed-tensors (CompressedTensorsWNA16MoEMethod): W4A16 and W4A16_ASYM, as llm-compressor writes them.
    "qwen3moe-ct-w4a16": ("Qwen3MoeForCausalLM", "ct", 4, "bfloat16", "model.layers.0.mlp.experts.routed_experts",
                          ATTENTION, {}),
    "mixtral-ct-w4a16-asym": ("MixtralForCausalLM", "ct-asym", 4, "float16",
                              "model.layers.0.block_sparse_moe.experts.routed_experts", ATTENTION, {}),
}
# The experts' quantized weights per format (vLLM's parameter names).
_W13 = {"ct": "w13_weight_packed", "ct-asym": "w13_weight_packed"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_moe_equals_ordinary(workdir: Path, case: str) -> None:
    from moe_checkpoints import write_moe_checkpoint

    import marlin_pack

    arch, fmt, bits, dtype, experts, linear, engine = CASES[case]
    ct = {"fmt": "compressed-tensors", "symmetric": fmt == "ct"} if fmt.startswith("ct") else {"fmt": fmt}
    model = write_moe_checkpoint(workdir / case, arch, bits=bits, dtype=getattr(torch, dtype), tokenizer=True, **ct)
    manifest = marlin_pack.convert(model, tp=(1,), kernel="marlin").manifest
    assert manifest.serving_dtype.value == dtype  # what --dtype auto picks, as the engines below
    tp1 = manifest.tensor_parallel[0]
    assert experts in {e.name for e in tp1.moe_layers}
    a, b = ordinary_and_prepacked(workdir, case, model, linear, extra_layers=(experts,), ordinary={"moe_backend": "marlin"},
                                  dtype=dtype, **engine)
    n = assert_engines_identical(a, b, linear)
    if linear == MLA:  # vLLM's MLA post-processing derived W_UK_T / W_UV from the finished kv_b_proj (digests equal above)
        derived = {name.rsplit(".", 1)[1] for name in a["layers"]["digests"] if name.startswith("model.layers.0.self_attn.")}
        assert {"W_UK_T", "W_UV"} <= derived, sorted(derived)
    for r in (a, b):
        k = r["layers"]["kernels"][experts]
        assert (k["kernel"], k["moe_backend"], k["act_type"]) == ("MarlinExperts", "MARLIN", f"torch.{dtype}"), k
        assert k["method"] == {"awq": "AutoAWQMoEMethod", "gptq": "AutoGPTQMoEMethod"}.get(fmt, "CompressedTensorsWNA16MoEMethod")
        tensors = r["layers"]["tensors"]
        leaves = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales") if fmt in ("awq", "gptq") else (
            "w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale", "w13_weight_shape")
        assert {f"{experts}.{leaf}" for leaf in leaves} <= tensors.keys()
        assert (f"{experts}.w13_weight_zero_point" in tensors) is (fmt == "ct-asym")
    digests = a["layers"]["digests"]
    moe_names = {e.name for e in tp1.moe_layers}
    assert {name.rsplit(".", 1)[0] for name in digests if name.endswith(f".{_W13.get(fmt, 'w13_qweight')}")} == moe_names
    assert not any(name.endswith("_bias") and ".experts." in name for name in digests)  # unloaded biases dropped
    print(f"{case}: {n} parameters bit-identical, {len(tp1.layers)} prepacked linears and {len(moe_names)} experts layers, "
          f"tokens and logprobs equal; start {a['start_s']:.1f} s ordinary vs {b['start_s']:.1f} s prepacked")
