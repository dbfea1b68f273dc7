"""Regenerate the third-party fixtures in this folder with the real quantizers (NOT run by the tests).

Each fixture is a tiny randomly initialised decoder (fixed seed, no downloads) quantized on the
CPU by a real third-party quantizer, then trimmed to the files vLLM reads: ``config.json``,
``generation_config.json``, ``quantize_config.json`` (when the quantizer writes one),
``model*.safetensors`` (and the index when sharded). Tokenizer files are dropped.

The quantizers do not share dependencies, so each runs in its own venv outside the repo:

``/work/qenv-gptqmodel`` (Python 3.11): GPTQModel 7.7.0, optimum 2.3.0, transformers 5.24.0,
torch 2.14.1 (CPU wheel)::

    python -m venv /work/qenv-gptqmodel
    /work/qenv-gptqmodel/bin/pip install torch==2.14.1 gptqmodel==7.7.0 optimum==2.3.0
    GPTQMODEL_CPU_WORKERS=2 /work/qenv-gptqmodel/bin/python tests/data/thirdparty/make_fixtures.py gptqmodel

``/work/qenv-autoawq`` (Python 3.11): AutoAWQ 0.2.9 (sdist, pure Python), transformers 4.51.3
(AutoAWQ 0.2.9 breaks with transformers 5), torch 2.14.1 CPU::

    python -m venv /work/qenv-autoawq
    /work/qenv-autoawq/bin/pip install torch==2.14.1 autoawq==0.2.9 transformers==4.51.3
    /work/qenv-autoawq/bin/python tests/data/thirdparty/make_fixtures.py autoawq

(``autoawq-mixtral-4bit-g128`` was made in a venv on top of the system torch 2.14.0, about a minute to install:
``python3 -m venv --system-site-packages /work/qenv-autoawq`` then ``pip install torch==2.14.0 autoawq==0.2.9
transformers==4.51.3 "tokenizers<0.22" "huggingface_hub<1.0" accelerate``.)

Workarounds (CPU, no hub access):

* GPTQModel: ``GPTQMODEL_CPU_WORKERS=2`` (its device thread pool otherwise sizes itself from the
  host); ``act_group_aware=False`` whenever ``group_size=-1`` (its default act-group-aware
  ordering needs ``group_size > 0``); calibration is a list of ``{"input_ids", "attention_mask"}``
  dicts of random token ids, so no tokenizer is used for calibration. GPTQModel still loads a
  tokenizer with the model: a tiny word-level ``PreTrainedTokenizerFast`` is written next to the
  random model (never committed).
* GPTQModel, Mixtral: ``offload_to_disk=False`` (its lazy loader maps the base model's per-expert
  ``block_sparse_moe.experts.N.w1`` to transformers 5's fused ``experts.gate_up_proj`` and fails to reshape it).
* AutoAWQ: transformers 4.51.3; ``calib_data`` is a list of random token-id lists (AutoAWQ uses
  ``list[list[int]]`` as is, no dataset download), ``max_calib_seq_len=64``; ``device_map="cpu"``.

Usage: ``python make_fixtures.py {gptqmodel,autoawq,optimum} [NAME ...]`` (default: every fixture
of that quantizer); writes into this folder, replacing the fixture's directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 1234
VOCAB = 128  # small embeddings keep each fixture near 0.5-1 MB
KEEP = ("config.json", "generation_config.json", "quantize_config.json", "model.safetensors.index.json")

# hidden 256, 8 heads (head_dim 32), 2 KV heads, 2 layers, vocab 128, fp16.
LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _tokenizer(out: Path) -> None:
    """A tiny word-level tokenizer (tokens "t0".."t127"), built locally: no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    )
    fast.save_pretrained(out)


def random_model(out: Path, arch: str = "llama", dtype: str = "float16", **overrides) -> Path:
    """A randomly initialised fp16 (or ``dtype``) model (fixed seed) saved with its tiny tokenizer."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    kw = {**LLAMA, **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "phi3":
        cfg = transformers.Phi3Config(**kw)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen3_moe":  # 4 experts of 256 (Marlin MoE: hidden a multiple of 128, I/tp a multiple of the group)
        moe = dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, head_dim=32)
        cfg = transformers.Qwen3MoeConfig(**{**kw, **moe, **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**{**kw, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
                                            **overrides})
        cls = transformers.MixtralForCausalLM
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=kw["hidden_size"] // kw["num_attention_heads"], **kw)
        cls = transformers.Gemma2ForCausalLM
    else:
        raise ValueError(arch)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 3
    model = cls(cfg)
    with torch.no_grad():  # a little spread, so the quantizers see non-trivial weights
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    _tokenizer(out)
    return out


def calibration(n: int = 16, seqlen: int = 64) -> list[list[int]]:
    """Random token ids (fixed seed): a tokenizer-free calibration set."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(4, VOCAB, (seqlen,), generator=g).tolist() for _ in range(n)]


def keep_only_vllm_files(src: Path, name: str) -> Path:
    dst = HERE / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for f in sorted(src.iterdir()):
        if f.name in KEEP or (f.suffix == ".safetensors" and f.name.startswith("model")):
            shutil.copy2(f, dst / f.name)
    total = sum(f.stat().st_size for f in dst.iterdir())
    print(f"{name}: {sorted(p.name for p in dst.iterdir())} {total / 1e6:.2f} MB")
    return dst


# --------------------------------------------------------------------------------------
# GPTQModel
# --------------------------------------------------------------------------------------

GPTQMODEL = {
    # name: (arch, model overrides, QuantizeConfig kwargs[, save kwargs])
    "gptqmodel-llama-4bit-g128": ("llama", {}, dict(bits=4, group_size=128, desc_act=False)),
    "gptqmodel-llama-4bit-g128-descact": ("llama", {"num_hidden_layers": 1}, dict(bits=4, group_size=128, desc_act=True)),
    "gptqmodel-llama-4bit-gch-descact": (
        "llama", {}, dict(bits=4, group_size=-1, desc_act=True, act_group_aware=False)
    ),
    "gptqmodel-llama-8bit-g32": (
        "llama", {"tie_word_embeddings": True, "num_hidden_layers": 1}, dict(bits=8, group_size=32, desc_act=False)
    ),
    # intermediate 688 (= 16 * 43): Marlin pads down_proj's K at every TP size
    "gptqmodel-llama-8bit-gch-688": (
        "llama", {"intermediate_size": 688, "num_hidden_layers": 1}, dict(bits=8, group_size=-1, desc_act=False, act_group_aware=False)
    ),
    # sharded: model-0000N-of-0000M.safetensors + model.safetensors.index.json
    "gptqmodel-qwen2-4bit-g64": ("qwen2", {}, dict(bits=4, group_size=64, desc_act=False), {"max_shard_size": "300KB"}),
    "gptqmodel-phi3-4bit-g64": ("phi3", {}, dict(bits=4, group_size=64, desc_act=False)),
    # One decoder layer each from here on (size).
    # bf16 model: bf16 scales and bias-free bf16 tensors, config dtype bfloat16
    "gptqmodel-llama-4bit-g64-bf16": (
        "llama", {"num_hidden_layers": 1, "dtype": "bfloat16"}, dict(bits=4, group_size=64, desc_act=False)
    ),
    # sym=False: real zero points, which vLLM's GPTQ Marlin path does not serve
    "gptqmodel-llama-4bit-g128-asym": ("llama", {"num_hidden_layers": 1}, dict(bits=4, group_size=128, sym=False)),
    # AWQ written by GPTQModel (method awq, format gemm): sym=False gives zero points ...
    "gptqmodel-awq-llama-4bit-g128": (
        "llama", {"num_hidden_layers": 1}, dict(method="awq", format="gemm", bits=4, group_size=128, sym=False)
    ),
    # ... its default (sym=True) writes zero_point: false, which vLLM does not serve with Marlin
    "gptqmodel-awq-llama-4bit-g128-nozp": (
        "llama", {"num_hidden_layers": 1}, dict(method="awq", format="gemm", bits=4, group_size=128)
    ),
    "gptqmodel-gemma2-4bit-g64": ("gemma2", {"num_hidden_layers": 1}, dict(bits=4, group_size=64, desc_act=False)),
    # quantized lm_head (GPTQ lm_head: true): vLLM serves it, marlin-pack converts decoder layers only
    "gptqmodel-llama-4bit-g128-lmhead": ("llama", {"num_hidden_layers": 1}, dict(bits=4, group_size=128, lm_head=True)),
    # Mixture of experts, 1 layer, 4 experts of 256: transformers 5 writes num_local_experts for Qwen3-MoE ...
    "gptqmodel-qwen3moe-4bit-g128": ("qwen3_moe", {"num_hidden_layers": 1}, dict(bits=4, group_size=128, desc_act=False)),
    # ... and Mixtral's experts under mlp.experts.N.{gate,up,down}_proj (router mlp.gate), which vLLM's Mixtral refuses
    # (offload_to_disk=False: GPTQModel's lazy loader maps Mixtral's per-expert w1/w2/w3 to a fused tensor and fails)
    "gptqmodel-mixtral-4bit-g128": (
        "mixtral", {"num_hidden_layers": 1}, dict(bits=4, group_size=128, desc_act=False, offload_to_disk=False)
    ),
}


def make_gptqmodel(names: list[str]) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    for name in names:
        arch, over, qkw, *save_kw = GPTQMODEL[name]
        with tempfile.TemporaryDirectory() as tmp:
            base = random_model(Path(tmp) / "base", arch, **over)
            qc = QuantizeConfig(**qkw)
            dtype = getattr(torch, over.get("dtype", "float16"))
            model = GPTQModel.load(str(base), qc, device="cpu", torch_dtype=dtype)
            calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration()]
            model.quantize(calib, batch_size=4)
            out = Path(tmp) / "out"
            model.save(str(out), **(save_kw[0] if save_kw else {}))
            keep_only_vllm_files(out, name)


# --------------------------------------------------------------------------------------
# AutoAWQ
# --------------------------------------------------------------------------------------

AUTOAWQ = {
    "autoawq-llama-4bit-g128": ("llama", {}, 128),
    # intermediate 640: down_proj has 320 input features per rank at TP 2, padded by Marlin
    # ... and sharded by AutoAWQ (shard_size), with its index
    "autoawq-llama-4bit-g64": ("llama", {"intermediate_size": 640}, 64, {"shard_size": "300KB"}),
    # q/k/v biases next to AWQ tensors
    "autoawq-qwen2-4bit-g64": ("qwen2", {"num_hidden_layers": 1}, 64),
    # Mixtral, 1 layer, 4 experts of 256: block_sparse_moe.experts.N.{w1,w2,w3} (transformers 4.51's names)
    "autoawq-mixtral-4bit-g128": ("mixtral", {"num_hidden_layers": 1}, 128),
}


def make_autoawq(names: list[str]) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    for name in names:
        arch, over, gs, *save_kw = AUTOAWQ[name]
        with tempfile.TemporaryDirectory() as tmp:
            base = random_model(Path(tmp) / "base", arch, **over)
            model = AutoAWQForCausalLM.from_pretrained(str(base), device_map="cpu")
            tok = AutoTokenizer.from_pretrained(str(base))
            model.quantize(
                tok,
                quant_config={"zero_point": True, "q_group_size": gs, "w_bit": 4, "version": "GEMM"},
                calib_data=calibration(),  # token ids: AutoAWQ takes list[list[int]] as is
                max_calib_samples=16,
                max_calib_seq_len=64,
            )
            out = Path(tmp) / "out"
            model.save_quantized(str(out), **(save_kw[0] if save_kw else {}))
            keep_only_vllm_files(out, name)


# --------------------------------------------------------------------------------------
# optimum / transformers GPTQConfig
# --------------------------------------------------------------------------------------

OPTIMUM = {
    # intermediate 576: down_proj K 576 (TP 1) and 288 (TP 2) are padded by Marlin
    "optimum-llama-4bit-g32": ("llama", {"intermediate_size": 576}, 32),
}


def make_optimum(names: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

    for name in names:
        arch, over, gs = OPTIMUM[name]
        with tempfile.TemporaryDirectory() as tmp:
            base = random_model(Path(tmp) / "base", arch, **over)
            tok = AutoTokenizer.from_pretrained(str(base))
            text = [" ".join(f"t{i}" for i in ids) for ids in calibration()]
            cfg = GPTQConfig(bits=4, group_size=gs, dataset=text, tokenizer=tok, desc_act=False, sym=True)
            model = AutoModelForCausalLM.from_pretrained(
                str(base), quantization_config=cfg, device_map="cpu", torch_dtype=torch.float16
            )
            out = Path(tmp) / "out"
            model.save_pretrained(str(out))
            keep_only_vllm_files(out, name)


def main(argv: list[str]) -> None:
    which = {"gptqmodel": (GPTQMODEL, make_gptqmodel), "autoawq": (AUTOAWQ, make_autoawq),
             "optimum": (OPTIMUM, make_optimum)}
    if not argv or argv[0] not in which:
        raise SystemExit(f"usage: make_fixtures.py {{{','.join(which)}}} [NAME ...]")
    table, make = which[argv[0]]
    names = argv[1:] or list(table)
    for n in names:
        if n not in table:
            raise SystemExit(f"unknown fixture {n!r}; one of {sorted(table)}")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # GPTQModel writes ./logs/gptq_log_*.log into the working directory
        make(names)
    print(json.dumps({"made": names}))


if __name__ == "__main__":
    main(sys.argv[1:])
