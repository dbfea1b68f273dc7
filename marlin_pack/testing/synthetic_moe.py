"""Random AWQ / GPTQ Qwen3-MoE checkpoints of any size, for benchmarks and GPU tests (no download).

Like :mod:`marlin_pack.testing.synthetic` (whose tensor drawing and streaming writer this reuses),
every tensor is drawn only when its turn comes (on ``device``: a GPU draws 17 GB of random words
in seconds) and written straight to its shard, so peak memory is one tensor. The layout is what
transformers' ``Qwen3MoeForCausalLM.save_pretrained`` writes: per decoder layer the attention
(with q/k norms), the router ``mlp.gate`` (16-bit, never quantized) and ``mlp.experts.<e>.{gate,up,down}_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marlin_pack.testing import synthetic as s

__all__ = ["MoeShape", "MOE_PRESETS", "write_moe_checkpoint", "write_specs", "quant_config"]


@dataclass(frozen=True)
class MoeShape:
    """The dimensions of a Qwen3-MoE decoder (every layer sparse)."""

    hidden_size: int = 512
    moe_intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 4096


MOE_PRESETS: dict[str, MoeShape] = {
    "tiny-qwen3moe": MoeShape(),
    # Qwen3-30B-A3B's widths: 48 layers x 128 experts; about 17 GB at 4 bits, g128.
    "qwen3-30b-a3b": MoeShape(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              vocab_size=151936, max_position_embeddings=40960),
}


def _specs(shape: MoeShape, qc: dict[str, Any], dtype: torch.dtype) -> list[Any]:
    h, d, i = shape.hidden_size, shape.head_dim, shape.moe_intermediate_size
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    specs = [s._Spec("model.embed_tokens.weight", (shape.vocab_size, h), dtype, "normal")]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}"
        for suffix, k, n in (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)):
            specs += s._linear_specs(f"{p}.self_attn.{suffix}", k, n, False, qc, dtype)
        specs += [s._Spec(f"{p}.self_attn.{x}_norm.weight", (d,), dtype, "near_one") for x in "qk"]
        specs.append(s._Spec(f"{p}.mlp.gate.weight", (shape.num_experts, h), dtype, "normal"))
        for e in range(shape.num_experts):
            for suffix, k, n in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)):
                specs += s._linear_specs(f"{p}.mlp.experts.{e}.{suffix}", k, n, False, qc, dtype)
        specs += [s._Spec(f"{p}.{x}.weight", (h,), dtype, "near_one") for x in ("input_layernorm", "post_attention_layernorm")]
    specs.append(s._Spec("model.norm.weight", (h,), dtype, "near_one"))
    specs.append(s._Spec("lm_head.weight", (shape.vocab_size, h), dtype, "normal"))
    return specs


def _config(shape: MoeShape, qc: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": shape.hidden_size,
        "intermediate_size": shape.moe_intermediate_size * shape.num_experts_per_tok * 2,
        "moe_intermediate_size": shape.moe_intermediate_size, "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": shape.num_hidden_layers,
        "torch_dtype": s._DTYPE_NAMES[dtype], "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
        "use_cache": True, "quantization_config": qc,
    }


def quant_config(fmt: str, bits: int, group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` AutoAWQ (GEMM) or GPTQModel (symmetric, v1) writes."""
    if fmt == "awq":
        if bits != 4:
            raise ValueError("AWQ checkpoints are 4-bit")
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    raise ValueError(f"format {fmt!r}: expected awq or gptq")


def write_moe_checkpoint(out_dir: str | Path, shape: MoeShape, fmt: str = "gptq", *, bits: int = 4, group_size: int = 128,
                         dtype: torch.dtype = torch.float16, seed: int = 0, max_shard_bytes: int | None = 5 << 30,
                         device: str | torch.device = "cpu", tokenizer: bool = False) -> Path:
    """Write a random Qwen3-MoE AWQ (GEMM) or symmetric GPTQ checkpoint to ``out_dir``; returns it.

    Example:
        >>> write_moe_checkpoint("/tmp/q3moe", MOE_PRESETS["qwen3-30b-a3b"], "gptq", device="cuda")
    """
    qc = quant_config(fmt, bits, group_size)
    return write_specs(out_dir, _specs(shape, qc, dtype), _config(shape, qc, dtype), seed=seed, max_shard_bytes=max_shard_bytes,
                       device=device, tokenizer=tokenizer)


def write_specs(out_dir: str | Path, specs: list[Any], config: dict[str, Any], *, seed: int, max_shard_bytes: int | None,
                device: str | torch.device, tokenizer: bool) -> Path:
    """Write the tensors ``specs`` describe (drawn one at a time) in shards, with ``config`` as config.json."""
    names, shards = s.plan_shards(specs, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for name, shard in zip(names, shards, strict=True):
        s._write_safetensors(out / name, shard, seed, device, lambda n: None)
    if len(shards) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard}
        s._write_json(out / "model.safetensors.index.json",
                      {"metadata": {"total_size": sum(x.nbytes for x in specs)}, "weight_map": weight_map})
    s._write_json(out / "config.json", config)
    s._write_json(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2})
    if tokenizer:
        s.write_tokenizer(out, config["vocab_size"], model_max_length=config["max_position_embeddings"])
    return out
