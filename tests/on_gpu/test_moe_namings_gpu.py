"""GPU: mixture-of-experts checkpoints as the real quantizers name them, served from their bundles against stock vLLM.

* ``gptqmodel-qwen3moe-4bit-g128`` (GPTQModel 7.7, transformers-5 config: ``num_local_experts``), bf16 and fp16;
* ``autoawq-mixtral-4bit-g128`` (AutoAWQ 0.2.9: ``block_sparse_moe.experts.N.{w1,w2,w3}``), fp16;
* a tiny Mixtral whose experts are named ``block_sparse_moe.experts.N.{gate,up,down}_proj`` (llm-compressor's
  naming; GPTQ 4-bit; vLLM's ``MixtralModel.hf_to_vllm_mapper`` renames them to w1/w3/w2);

each at TP 1: engine (a) loads the checkpoint the ordinary way with Marlin forced for linears and experts
(``linear_backend="marlin"``, ``moe_backend="marlin"``), engine (b) ``--load-format marlin_prepacked``.
Every parameter of (b) is bit-identical to (a) and the tokens and logprobs of both are equal (``_harness``).
The fixtures are committed under ``tests/data/thirdparty`` without tokenizer: a word-level tokenizer of
their 128 tokens is written next to a copy. GPTQModel's Mixtral (``mlp.experts.N.*``) is not here: stock
vLLM refuses it (``tests/sources/test_thirdparty_moe_fixtures.py``), so there is nothing to compare.

Run on the GPU machine::

    python -m pytest tests/on_gpu/test_moe_namings_gpu.py -m gpu -v -s
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import assert_engines_identical, ordinary_and_prepacked

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for moe_checkpoints
pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

DATA = Path(__file__).resolve().parents[1] / "data" / "thirdparty"
ATTENTION = "model.layers.0.self_attn.qkv_proj"
# case -> (fixture or "synthetic", serving dtype, vLLM's experts module, quant method of the experts)
CASES = {
    "gptqmodel-qwen3moe-bf16": ("gptqmodel-qwen3moe-4bit-g128", "bfloat16", "model.layers.0.mlp.experts.routed_experts",
                                "AutoGPTQMoEMethod"),
    "gptqmodel-qwen3moe-fp16": ("gptqmodel-qwen3moe-4bit-g128", "float16", "model.layers.0.mlp.experts.routed_experts",
                                "AutoGPTQMoEMethod"),
    "autoawq-mixtral-fp16": ("autoawq-mixtral-4bit-g128", "float16", "model.layers.0.block_sparse_moe.experts.routed_experts",
                             "AutoAWQMoEMethod"),
    "mixtral-gate-up-down-proj": ("synthetic", "float16", "model.layers.0.block_sparse_moe.experts.routed_experts",
                                  "AutoGPTQMoEMethod"),
}


def _word_tokenizer(out: Path, vocab: int) -> None:
    """Tokens "t0".."t{vocab-1}" (what the fixtures' make_fixtures.py used): no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t3").save_pretrained(out)


def _model(workdir: Path, case: str, source: str) -> Path:
    model = workdir / case
    if source == "synthetic":
        from moe_checkpoints import write_moe_checkpoint
        from safetensors.torch import load_file, save_file

        write_moe_checkpoint(model, "MixtralForCausalLM", "gptq", tokenizer=True)
        tensors = load_file(model / "model.safetensors")
        renames = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
        out = {}
        for k, v in tensors.items():
            for old, new in renames:
                k = k.replace(old, new)
            out[k] = v
        save_file(out, str(model / "model.safetensors"), metadata={"format": "pt"})
        return model
    shutil.copytree(DATA / source, model)
    _word_tokenizer(model, 128)
    return model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-namings-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_equals_ordinary(workdir: Path, case: str) -> None:
    import marlin_pack

    source, dtype, experts, method = CASES[case]
    model = _model(workdir, case, source)
    manifest = marlin_pack.convert(model, tp=(1,), dtype=dtype, kernel="marlin").manifest
    tp1 = manifest.tensor_parallel[0]
    assert experts in {e.name for e in tp1.moe_layers}
    # The fixtures' max_position_embeddings is 256: the harness's 512 would be refused by vLLM.
    a, b = ordinary_and_prepacked(workdir, case, model, ATTENTION, extra_layers=(experts,), ordinary={"moe_backend": "marlin"},
                                  dtype=dtype, max_model_len=256)
    n = assert_engines_identical(a, b, ATTENTION)
    for r in (a, b):
        k = r["layers"]["kernels"][experts]
        assert (k["kernel"], k["moe_backend"], k["act_type"]) == ("MarlinExperts", "MARLIN", f"torch.{dtype}"), k
        assert k["method"] == method
    digests = a["layers"]["digests"]
    assert {name.rsplit(".", 1)[0] for name in digests if name.endswith(".w13_qweight")} == {e.name for e in tp1.moe_layers}
    print(f"{case}: {n} parameters bit-identical, tokens and logprobs equal; "
          f"start {a['start_s']:.1f} s ordinary vs {b['start_s']:.1f} s prepacked")
