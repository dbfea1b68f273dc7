"""Write the llm-compressor fixtures of this folder (not run by the tests).

Run with a Python that has ``llmcompressor`` installed (a separate venv, outside the repo):

    python -m venv /work/qenv-llmc && /work/qenv-llmc/bin/pip install llmcompressor
    /work/qenv-llmc/bin/python tests/data/llmcompressor/make_fixtures.py tests/data/llmcompressor

A tiny random Llama (hidden 256, vocab 128) is built with transformers and quantized on the
CPU with random token ids as calibration data; only the file format matters to the tests.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # llm-compressor's AWQ pins calibration tensors; pin_memory() needs an accelerator.
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]

from datasets import Dataset  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.awq import AWQModifier  # noqa: E402
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB, SEQ, SAMPLES = 128, 64, 16


def tiny_llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    )
    # oneshot reads the model's config back from model.config.name_or_path: save it and load it from disk.
    base = Path(tempfile.mkdtemp()) / "base"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base)
    return LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)


def calibration() -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (SAMPLES, SEQ), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def tokenizer() -> object:
    """A word-level tokenizer of VOCAB tokens (oneshot wants a processor with a dataset; the ids are pre-tokenized)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make(out: Path, layers: int, recipe: object) -> None:
    quantize_into(tiny_llama(layers), out, recipe)


def quantize_into(model: torch.nn.Module, out: Path, recipe: object) -> None:
    """``recipe`` applied to ``model`` on the random calibration set, saved compressed into ``out`` (replaced)."""
    oneshot(model=model, processor=tokenizer(), dataset=calibration(), recipe=recipe, max_seq_length=SEQ,
            num_calibration_samples=SAMPLES)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True)
    print(out, sum(p.stat().st_size for p in out.iterdir()))


def main(root: Path) -> None:
    ignore = ["lm_head"]
    make(root / "gptq-w4a16-g128", 2, GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore))
    make(root / "awq-w4a16-asym", 2, AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=ignore))
    make(root / "rtn-w8a16-g128", 1, QuantizationModifier(targets="Linear", scheme="W8A16", ignore=ignore))
    # Ignore list and actorder: layer 1's o_proj kept in 16 bits, GPTQ with static activation ordering.
    make(
        root / "gptq-w4a16-actorder-ignore",
        2,
        GPTQModifier(
            config_groups={"g": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64,
                "actorder": "static"}}},
            ignore=["lm_head", "re:.*layers\\.1\\.self_attn\\.o_proj$"],
        ),
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
