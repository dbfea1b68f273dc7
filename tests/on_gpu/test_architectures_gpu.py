"""GPU: architectures beyond Llama served from their bundles, against stock vLLM.

For a tiny Gemma 2 (GPTQ, bf16), Phi-3 (AWQ, fp16; qkv_proj/gate_up_proj stored fused) and
Qwen2.5-VL (AWQ, fp16; text prompts, vision tower in common): engine (a) loads the checkpoint the
ordinary way with Marlin forced, engine (b) with ``--load-format marlin_prepacked``. Every
parameter of (b) is bit-identical to (a) (sha256 of each), and the generated tokens and the
logprobs of both engines are equal. Checkpoints come from ``tests/arch_checkpoints.py``
(transformers' model classes for the unquantized parts, with a tokenizer and, for Qwen2.5-VL,
its image processor).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import assert_engines_identical, ordinary_and_prepacked

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for arch_checkpoints
pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# case -> (architecture, format, serving dtype, a fused layer of the first decoder layer in vLLM's names)
CASES = {
    "gemma2-gptq4": ("Gemma2ForCausalLM", "gptq", "bfloat16", "model.layers.0.self_attn.qkv_proj"),
    "phi3-awq": ("Phi3ForCausalLM", "awq", "float16", "model.layers.0.self_attn.qkv_proj"),
    "qwen2_5_vl-awq": ("Qwen2_5_VLForConditionalGeneration", "awq", "float16",
                       "language_model.model.layers.0.self_attn.qkv_proj"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arch-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_equals_ordinary(workdir: Path, case: str) -> None:
    from arch_checkpoints import write_arch_checkpoint

    import marlin_pack

    arch, fmt, dtype, layer = CASES[case]
    tdtype = getattr(torch, dtype)
    model = write_arch_checkpoint(workdir / case, arch, fmt, group_size=128, dtype=tdtype, tokenizer=True)
    manifest = marlin_pack.convert(model, tp=(1,), kernel="marlin").manifest
    assert manifest.serving_dtype.value == dtype  # what --dtype auto picks, as the engines below
    bundle_layers = {e.name for e in manifest.tensor_parallel[0].layers}
    kw: dict = dict(dtype=dtype)
    if arch.endswith("ConditionalGeneration"):  # flash-attn is not carried to the GPU machine
        kw["mm_encoder_attn_backend"] = os.environ.get("MARLIN_PACK_TEST_MM_ATTN", "TORCH_SDPA")
    a, b = ordinary_and_prepacked(workdir, case, model, layer, **kw)
    n = assert_engines_identical(a, b, layer)
    digests = a["layers"]["digests"]
    assert {name.rsplit(".", 1)[0] for name in digests if name.endswith(".qweight")} == bundle_layers
    if arch.endswith("ConditionalGeneration"):  # the vision tower came from common, bit-identical
        assert any(name.startswith("visual.") for name in digests)
    print(f"{case}: {n} parameters bit-identical, {len(bundle_layers)} prepacked layers, "
          f"tokens and logprobs equal; start {a['start_s']:.1f} s ordinary vs {b['start_s']:.1f} s prepacked")
