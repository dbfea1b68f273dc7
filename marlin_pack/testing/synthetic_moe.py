"""Random AWQ / GPTQ / compressed-tensors Qwen3-MoE checkpoints of any size, for benchmarks and GPU tests (no download).

Like :mod:`marlin_pack.testing.synthetic` (whose tensor drawing and streaming writer
:mod:`.moe_writer`, the core shared with :mod:`.synthetic_deepseek`, reuses), every tensor is
drawn only when its turn comes (on ``device``: a GPU draws 17 GB of random words in seconds) and
written straight to its shard, so peak memory is one tensor. The layout is what transformers'
``Qwen3MoeForCausalLM.save_pretrained`` writes: per decoder layer the attention (with q/k
norms), the router ``mlp.gate`` (16-bit, never quantized) and ``mlp.experts.<e>.{gate,up,down}_proj``.
compressed-tensors checkpoints are llm-compressor's pack-quantized ones (``weight_packed`` /
``weight_scale`` in the model dtype / ``weight_shape`` / ``weight_zero_point`` when asymmetric) with
its ``quantization_config`` (one config group targeting ``Linear``, ``ignore`` = ``lm_head`` and the
router regex ``re:.*mlp[.]gate$``, as its Qwen3-MoE examples write).
This module holds only those layers, the shape and the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marlin_pack.testing.moe_writer import Linear, Plain, base_config, quant_config, write_layout, write_specs

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

    def decoder_layer(self, layer: int) -> list[Linear | Plain]:
        """One decoder layer's tensors in state-dict order (every layer is the same)."""
        h, d, i = self.hidden_size, self.head_dim, self.moe_intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = [Linear(f"self_attn.{x}", k, n) for x, k, n in (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv),
                                                                ("o_proj", q, h))]
        experts = [Linear(f"mlp.experts.{e}.{x}", k, n) for e in range(self.num_experts)
                   for x, k, n in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))]
        return [*attn, *(Plain(f"self_attn.{x}_norm.weight", (d,), "near_one") for x in "qk"),
                Plain("mlp.gate.weight", (self.num_experts, h), "normal"), *experts,
                *(Plain(f"{x}.weight", (h,), "near_one") for x in ("input_layernorm", "post_attention_layernorm"))]


MOE_PRESETS: dict[str, MoeShape] = {
    "tiny-qwen3moe": MoeShape(),
    # Qwen3-30B-A3B's widths: 48 layers x 128 experts; about 17 GB at 4 bits, g128.
    "qwen3-30b-a3b": MoeShape(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              vocab_size=151936, max_position_embeddings=40960),
}


def _config(shape: MoeShape, qc: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        **base_config(shape, qc, dtype, architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe"),
        "intermediate_size": shape.moe_intermediate_size * shape.num_experts_per_tok * 2,
        "moe_intermediate_size": shape.moe_intermediate_size, "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim, "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
    }


def write_moe_checkpoint(out_dir: str | Path, shape: MoeShape, fmt: str = "gptq", *, bits: int = 4, group_size: int = 128,
                         dtype: torch.dtype = torch.float16, seed: int = 0, max_shard_bytes: int | None = 5 << 30,
                         device: str | torch.device = "cpu", tokenizer: bool = False, symmetric: bool = True) -> Path:
    """Write a random Qwen3-MoE AWQ (GEMM), symmetric GPTQ or compressed-tensors (``fmt="compressed-tensors"``:
    W4A16 / W8A16, or W4A16_ASYM with ``symmetric=False``) checkpoint to ``out_dir``; returns it.

    Example:
        >>> write_moe_checkpoint("/tmp/q3moe", MOE_PRESETS["qwen3-30b-a3b"], "gptq", device="cuda")
        >>> write_moe_checkpoint("/tmp/q3moe-ct", MOE_PRESETS["qwen3-30b-a3b"], "compressed-tensors", symmetric=False)
    """
    return write_layout(out_dir, shape, _config, fmt, bits=bits, group_size=group_size, dtype=dtype, seed=seed,
                        max_shard_bytes=max_shard_bytes, device=device, tokenizer=tokenizer, symmetric=symmetric)
