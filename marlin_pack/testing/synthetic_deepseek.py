"""Random AWQ / GPTQ DeepSeek-V2 checkpoints of any size, for benchmarks and GPU runs (no download).

The sibling of :mod:`marlin_pack.testing.synthetic_moe`; both write through :mod:`.moe_writer`
(each tensor drawn when its turn comes, on ``device``), so this module holds only the layers, the
shape and the config. The layout is what transformers'
``DeepseekV2ForCausalLM.save_pretrained`` writes (``tests/testing/test_synthetic_deepseek.py``
checks names, shapes and config against it): per decoder layer the multi-head latent attention
(``q_proj`` or ``q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), then on the first ``first_k_dense_replace``
layers a dense MLP, on the others the router ``mlp.gate`` (16-bit, never quantized),
``mlp.experts.<e>.{gate,up,down}_proj`` and ``mlp.shared_experts.{gate,up,down}_proj``. Every
linear of the decoder layers is quantized, as GPTQModel's and AutoAWQ's DeepSeek-V2 definitions do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from marlin_pack.testing.moe_writer import Linear, Plain, base_config, write_layout

__all__ = ["DeepseekShape", "DEEPSEEK_PRESETS", "write_deepseek_checkpoint"]


@dataclass(frozen=True)
class DeepseekShape:
    """The dimensions of a DeepSeek-V2 decoder (MLA attention, shared and routed experts)."""

    hidden_size: int = 512
    intermediate_size: int = 768  # the dense first layers' MLP
    moe_intermediate_size: int = 256
    n_routed_experts: int = 4
    n_shared_experts: int = 2
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    kv_lora_rank: int = 512  # 512 + qk_rope_head_dim 64: the 576 head size of vLLM's MLA kernels
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096

    def linears(self, layer: int) -> list[tuple[str, int, int]]:
        """``(module suffix, in_features K, out_features N)`` of one decoder layer's quantized linears."""
        h, heads, rope = self.hidden_size, self.num_attention_heads, self.qk_rope_head_dim
        qh = heads * (self.qk_nope_head_dim + rope)
        q = ([("self_attn.q_proj", h, qh)] if self.q_lora_rank is None else
             [("self_attn.q_a_proj", h, self.q_lora_rank), ("self_attn.q_b_proj", self.q_lora_rank, qh)])
        attn = [*q, ("self_attn.kv_a_proj_with_mqa", h, self.kv_lora_rank + rope),
                ("self_attn.kv_b_proj", self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
                ("self_attn.o_proj", heads * self.v_head_dim, h)]
        if layer < self.first_k_dense_replace:
            return attn + _mlp("mlp", h, self.intermediate_size)
        experts = [x for e in range(self.n_routed_experts) for x in _mlp(f"mlp.experts.{e}", h, self.moe_intermediate_size)]
        return attn + experts + _mlp("mlp.shared_experts", h, self.moe_intermediate_size * self.n_shared_experts)

    def decoder_layer(self, layer: int) -> list[Linear | Plain]:
        """One decoder layer's tensors in state-dict order: its linears, its norms, then (sparse layers) the router."""
        h = self.hidden_size
        norms = [("self_attn.kv_a_layernorm", self.kv_lora_rank), ("input_layernorm", h), ("post_attention_layernorm", h)]
        if self.q_lora_rank is not None:
            norms.append(("self_attn.q_a_layernorm", self.q_lora_rank))
        router = [Plain("mlp.gate.weight", (self.n_routed_experts, h), "normal")] if layer >= self.first_k_dense_replace else []
        return [*(Linear(*x) for x in self.linears(layer)), *(Plain(f"{x}.weight", (n,), "near_one") for x, n in norms), *router]


def _mlp(prefix: str, h: int, i: int) -> list[tuple[str, int, int]]:
    return [(f"{prefix}.gate_proj", h, i), (f"{prefix}.up_proj", h, i), (f"{prefix}.down_proj", i, h)]


DEEPSEEK_PRESETS: dict[str, DeepseekShape] = {
    "tiny-deepseek-v2": DeepseekShape(),
    # DeepSeek-V2-Lite's widths (27 layers x 64 experts, about 9 GB at 4 bits). Its dense MLP's
    # 10944 = 171 x 64 input features take group size 64 or 32, not 128.
    "deepseek-v2-lite": DeepseekShape(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
                                      num_experts_per_tok=6, num_hidden_layers=27, num_attention_heads=16, vocab_size=102400,
                                      max_position_embeddings=163840),
}


def _config(shape: DeepseekShape, qc: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """config.json as transformers' DeepseekV2Config saves it (the keys vLLM reads)."""
    return {
        **base_config(shape, qc, dtype, architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2", dtype_key="dtype"),
        "intermediate_size": shape.intermediate_size, "moe_intermediate_size": shape.moe_intermediate_size,
        "n_routed_experts": shape.n_routed_experts, "n_shared_experts": shape.n_shared_experts,
        "num_experts_per_tok": shape.num_experts_per_tok, "first_k_dense_replace": shape.first_k_dense_replace,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_attention_heads,
        "kv_lora_rank": shape.kv_lora_rank, "q_lora_rank": shape.q_lora_rank, "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim, "qk_head_dim": shape.qk_nope_head_dim + shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim, "head_dim": shape.qk_rope_head_dim, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "mlp_bias": False,
    }


def write_deepseek_checkpoint(out_dir: str | Path, shape: DeepseekShape, fmt: str = "gptq", *, bits: int = 4,
                              group_size: int = 128, dtype: torch.dtype = torch.float16, seed: int = 0,
                              max_shard_bytes: int | None = 5 << 30, device: str | torch.device = "cpu",
                              tokenizer: bool = False) -> Path:
    """Write a random DeepSeek-V2 AWQ (GEMM) or symmetric GPTQ checkpoint to ``out_dir``; returns it.

    Example:
        >>> write_deepseek_checkpoint("/tmp/dsv2", DEEPSEEK_PRESETS["deepseek-v2-lite"], "awq", group_size=64, device="cuda")
    """
    return write_layout(out_dir, shape, _config, fmt, bits=bits, group_size=group_size, dtype=dtype, seed=seed,
                        max_shard_bytes=max_shard_bytes, device=device, tokenizer=tokenizer)
