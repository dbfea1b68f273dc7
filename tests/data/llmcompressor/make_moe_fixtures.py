"""Write the llm-compressor mixture-of-experts fixtures of this folder (not run by the tests).

Run with a Python that has ``llmcompressor`` installed (a separate venv, outside the repo):

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor
    /tmp/llmc/bin/python tests/data/llmcompressor/make_moe_fixtures.py tests/data/llmcompressor

Tiny random Qwen3-MoE and Mixtral models (hidden 256, 4 experts of intermediate 256, 2 layers,
vocab 128, bf16) are built with transformers and quantized on the CPU with random token ids as
calibration data (``make_fixtures.calibration``); the routers are ignored as llm-compressor's MoE
examples do. Only the file format matters to the tests.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from make_fixtures import VOCAB, quantize_into  # this folder (its import also lets AWQ run without a GPU)

_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_moe(arch: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "Qwen3MoeForCausalLM":
        cfg = transformers.Qwen3MoeConfig(**_COMMON, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
                                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=True)
    else:
        cfg = transformers.MixtralConfig(**_COMMON, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
    cls = getattr(transformers, arch)
    # oneshot reads the model's config back from model.config.name_or_path: save it and load it from disk.
    base = Path(tempfile.mkdtemp()) / "base"
    cls(cfg).to(torch.bfloat16).save_pretrained(base)
    return cls.from_pretrained(base, dtype=torch.bfloat16)


def make(out: Path, arch: str, recipe: object) -> None:
    quantize_into(tiny_moe(arch), out, recipe)


def main(root: Path) -> None:
    make(root / "qwen3moe-gptq-w4a16", "Qwen3MoeForCausalLM",
         GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"]))
    make(root / "mixtral-rtn-w4a16-asym", "MixtralForCausalLM",
         QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head", "re:.*block_sparse_moe.gate$"]))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
