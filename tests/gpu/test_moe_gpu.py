"""GPU: mixture-of-experts models served from their bundles, against stock vLLM 0.33.0.

For a tiny Mixtral (AWQ, fp16) and a tiny Qwen3-MoE (GPTQ 4-bit, bf16), both TP 1: engine (a) loads
the checkpoint the ordinary way with Marlin forced for linears (``linear_backend="marlin"``) and
experts (``moe_backend="marlin"``: on SM90 ``auto`` picks Humming when the ``humming`` package is
installed); engine (b) uses ``--load-format marlin_prepacked`` with ``moe_backend`` left at
``auto`` (the loader resolves it to Marlin). Every parameter of (b) is bit-identical to (a)
(sha256 of each), the experts run ``MarlinExperts`` on the MARLIN backend in both, and the
generated tokens and logprobs of both engines are equal. Checkpoints come from
``tests/moe_checkpoints.py`` (transformers' model classes for the unquantized parts, router
included, with a tokenizer).

Run on the GPU machine::

    python -m pytest tests/gpu/test_moe_gpu.py -m gpu -v -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _harness import assert_engines_identical, ordinary_and_prepacked

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for moe_checkpoints
pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# case -> (architecture, format, bits, serving dtype, vLLM's experts module of decoder layer 0)
CASES = {
    "mixtral-awq": ("MixtralForCausalLM", "awq", 4, "float16", "model.layers.0.block_sparse_moe.experts.routed_experts"),
    "qwen3moe-gptq4": ("Qwen3MoeForCausalLM", "gptq", 4, "bfloat16", "model.layers.0.mlp.experts.routed_experts"),
}
ATTENTION = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_moe_equals_ordinary(workdir: Path, case: str) -> None:
    from moe_checkpoints import write_moe_checkpoint

    import marlin_pack

    arch, fmt, bits, dtype, experts = CASES[case]
    model = write_moe_checkpoint(workdir / case, arch, fmt, bits=bits, dtype=getattr(torch, dtype), tokenizer=True)
    manifest = marlin_pack.convert(model, tp_sizes=(1,))
    assert manifest.serving_dtype.value == dtype  # what --dtype auto picks, as the engines below
    tp1 = manifest.tensor_parallel[0]
    assert experts in {e.name for e in tp1.moe_layers}
    a, b = ordinary_and_prepacked(workdir, case, model, ATTENTION, extra_layers=(experts,), ordinary={"moe_backend": "marlin"},
                                  dtype=dtype)
    n = assert_engines_identical(a, b, ATTENTION)
    for r in (a, b):
        k = r["layers"]["kernels"][experts]
        assert (k["kernel"], k["moe_backend"], k["act_type"]) == ("MarlinExperts", "MARLIN", f"torch.{dtype}"), k
        assert k["method"] == ("AutoAWQMoEMethod" if fmt == "awq" else "AutoGPTQMoEMethod")
        tensors = r["layers"]["tensors"]
        assert {f"{experts}.{leaf}" for leaf in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales")} <= tensors.keys()
    digests = a["layers"]["digests"]
    moe_names = {e.name for e in tp1.moe_layers}
    assert {name.rsplit(".", 1)[0] for name in digests if name.endswith(".w13_qweight")} == moe_names
    assert not any(name.endswith("_bias") and ".experts." in name for name in digests)  # unloaded biases dropped
    print(f"{case}: {n} parameters bit-identical, {len(tp1.layers)} prepacked linears and {len(moe_names)} experts layers, "
          f"tokens and logprobs equal; start {a['start_s']:.1f} s ordinary vs {b['start_s']:.1f} s prepacked")
