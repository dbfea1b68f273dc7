"""Tiny AWQ/GPTQ/compressed-tensors mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek; and through
vLLM's Transformers backend Olmoe, FlexOlmo, HunYuan-MoE, Kolibri 1, Mellum), for the MoE oracle.

As in ``arch_checkpoints``, the unquantized tensors (embeddings, norms, router) and all
names come from **transformers' own model class**, built from a tiny config and saved with
``save_pretrained`` (which writes one tensor per expert: ``experts.<e>.w1`` / ``gate_proj``
...). Then every decoder ``nn.Linear``-shaped weight except the router is replaced by random
AWQ (GEMM) or GPTQ tensors, as the quantizers write them: attention and each expert's
gate/up/down projections quantized, the router (``block_sparse_moe.gate`` / ``mlp.gate``)
kept in 16-bit. ``fmt="compressed-tensors"`` writes llm-compressor's pack-quantized tensors and
``quantization_config`` (``symmetric``; scales in the model dtype), with the ``ignore`` list
llm-compressor's MoE examples use: ``lm_head`` and the routers as regexes (:data:`CT_IGNORE`).

``random_gptq_zeros``: symmetric GPTQ checkpoints carry constant zero points that vLLM's
kernel ignores, but vLLM's MoE path still permutes and keeps them; random words make a
wrong zero-point permutation visible in comparisons.
"""

from __future__ import annotations

import json
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from arch_checkpoints import quant_config
from safetensors.torch import load_file, save_file

from marlin_pack.testing.synthetic import compressed_tensors_config, quantized_linear_tensors, write_tokenizer

__all__ = ["MOE_CONFIGS", "ROUTERS", "CT_IGNORE", "write_moe_checkpoint"]

_TEXT = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=512, max_position_embeddings=4096)

MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": dict(model_type="mixtral", **_TEXT, intermediate_size=512, num_local_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False),
    "Qwen3MoeForCausalLM": dict(model_type="qwen3_moe", **_TEXT, head_dim=64, intermediate_size=512,
                                moe_intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                tie_word_embeddings=False),
    # Qwen2-MoE: routed experts plus one dense shared expert (gate_proj/up_proj/down_proj) behind a
    # sigmoid gate with one output (shared_expert_gate, never quantized).
    "Qwen2MoeForCausalLM": dict(model_type="qwen2_moe", **_TEXT, intermediate_size=512, moe_intermediate_size=512,
                                shared_expert_intermediate_size=1024, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                                tie_word_embeddings=False),
    # DeepSeek-V2-Lite's attention (MLA: q_proj, no q_lora_rank; kv_lora_rank 512 and the 128/64/128
    # head dims FlashMLA and vLLM's MLA prefill kernels take), 2 shared experts and a dense first layer,
    # shrunk: 4 heads, 4 routed experts, 3 decoder layers.
    "DeepseekV2ForCausalLM": dict(model_type="deepseek_v2", hidden_size=512, intermediate_size=768, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                  max_position_embeddings=4096, moe_intermediate_size=256, n_routed_experts=4,
                                  n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
                                  kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                                  routed_scaling_factor=1.0, scoring_func="softmax", tie_word_embeddings=False),
    # DeepSeek-V3's routing (sigmoid scores with e_score_correction_bias, grouped top-k, scaled) and
    # q_lora_rank (vLLM fuses q_a_proj with kv_a_proj_with_mqa), shrunk like the V2 config.
    "DeepseekV3ForCausalLM": dict(model_type="deepseek_v3", hidden_size=512, intermediate_size=768, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                  max_position_embeddings=4096, moe_intermediate_size=256, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512,
                                  q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False),
    # vLLM's Transformers backend (0.34.0 for Olmoe): the experts' width is intermediate_size
    "OlmoeForCausalLM": dict(model_type="olmoe", **_TEXT, intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "FlexOlmoForCausalLM": dict(model_type="flex_olmo", **_TEXT, intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # HunYuan-MoE: a shared expert (mlp.shared_mlp) beside the experts, both intermediate_size wide; the router an
    # nn.Linear (mlp.gate.wg, float32 in transformers' class), never quantized
    "HunYuanMoEV1ForCausalLM": dict(model_type="hunyuan_v1_moe", **_TEXT, head_dim=64, intermediate_size=512, num_experts=4,
                                    moe_topk=2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Kolibri 1: experts moe_intermediate_size wide, a shared expert (mlp.shared_experts) shared_expert_intermediate_size
    "Kolibri1ForCausalLM": dict(model_type="kolibri1", **_TEXT, head_dim=64, moe_intermediate_size=256,
                                shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2, sliding_window=64,
                                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Mellum: a dense first layer (mlp.{gate,up,down}_proj, intermediate_size) and a sparse one (moe_intermediate_size)
    "MellumForCausalLM": dict(model_type="mellum", **_TEXT, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                              num_experts=4, num_experts_per_tok=2, sliding_window=64, mlp_layer_types=["dense", "sparse"],
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

# The router modules' last names per architecture: never quantized by AutoAWQ / GPTQModel.
ROUTERS = {"MixtralForCausalLM": ("block_sparse_moe.gate",), "Qwen3MoeForCausalLM": ("mlp.gate",),
           "Qwen2MoeForCausalLM": ("mlp.gate", "mlp.shared_expert_gate"), "DeepseekV2ForCausalLM": ("mlp.gate",),
           "DeepseekV3ForCausalLM": ("mlp.gate",), "OlmoeForCausalLM": ("mlp.gate",), "FlexOlmoForCausalLM": ("mlp.gate",),
           "HunYuanMoEV1ForCausalLM": ("mlp.gate.wg",), "Kolibri1ForCausalLM": ("mlp.gate",), "MellumForCausalLM": ("mlp.gate",)}


# llm-compressor's MoE examples: ignore lm_head and the routers (as regexes), quantize everything else.
CT_IGNORE = {arch: ["lm_head", *(f"re:.*{r.replace('.', '[.]')}$" for r in routers)] for arch, routers in ROUTERS.items()}


def _hf_state_dict(config: dict[str, Any], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    from arch_checkpoints import decorated_by_vllm, in_clean_process

    if decorated_by_vllm(config["architectures"][0]):  # vLLM's Transformers backend built this model class here
        return in_clean_process("moe_checkpoints", "_hf_state_dict_here", config, dtype, seed)[0]
    return _hf_state_dict_here(config, dtype, seed)


def _hf_state_dict_here(config: dict[str, Any], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**config)
    cfg.architectures = config["architectures"]
    model = getattr(transformers, config["architectures"][0])._from_config(cfg, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            sd.update(load_file(str(f)))
    return sd


def write_moe_checkpoint(out: Path, architecture: str, fmt: str = "gptq", *, bits: int = 4, group_size: int = 128,
                         dtype: torch.dtype = torch.float16, seed: int = 0, random_gptq_zeros: bool = False,
                         quant_overrides: dict[str, Any] | None = None, sharded: bool = False,
                         tokenizer: bool = False, mtp_layers: int = 0, symmetric: bool = True,
                         **config_overrides: Any) -> Path:
    """Write a tiny quantized MoE checkpoint of ``architecture`` to ``out``; returns ``out``.

    ``sharded``: two safetensors files (tensors alternating by name) and a ``model.safetensors.index.json``.
    ``tokenizer``: also a byte-level BPE tokenizer of the vocabulary size (for engines on a GPU).
    ``mtp_layers``: DeepSeek-V3 multi-token-prediction layers after the decoder layers, as DeepSeek's
    checkpoints store them (``num_nextn_predict_layers``; a decoder layer, quantized like the others,
    plus ``enorm``/``hnorm``/``eh_proj``/``shared_head``; transformers' class has none, so the last
    decoder layer's tensors are copied).
    ``symmetric``: compressed-tensors only (False: 4-bit with zero points, W4A16_ASYM).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(MOE_CONFIGS[architecture]))
    config.update(config_overrides)
    config["architectures"] = [architecture]
    config["torch_dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    sd = _hf_state_dict(config, dtype, seed)
    if fmt == "compressed-tensors":
        qc = compressed_tensors_config(bits, group_size, symmetric, ignore=CT_IGNORE[architecture])
        qc.update(quant_overrides or {})
    else:
        qc = {**quant_config(fmt, bits, group_size), **(quant_overrides or {})}
    routers = ROUTERS[architecture]
    tensors: dict[str, torch.Tensor] = {}
    n_quantized = 0
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        is_linear = (leaf == "weight" and t.dim() == 2 and re.search(r"(^|\.)layers\.\d+\.", module)
                     and "norm" not in module and not module.endswith(routers))
        if not is_linear:
            tensors[name] = t
            continue
        n, k = t.shape
        q = quantized_linear_tensors(module, k, n, qc, seed, dtype)
        if random_gptq_zeros and fmt == "gptq":
            g = torch.Generator().manual_seed(zlib.crc32(module.encode()) + seed)
            z = q[f"{module}.qzeros"]
            q[f"{module}.qzeros"] = torch.randint(-2**31, 2**31 - 1, z.shape, generator=g, dtype=torch.int32)
        tensors.update(q)
        n_quantized += 1
    assert n_quantized and any(".experts." in n for n in tensors), "no experts quantized"
    if mtp_layers:
        n, h = config["num_hidden_layers"], config["hidden_size"]
        last = f"model.layers.{n - 1}."
        g = torch.Generator().manual_seed(seed + 1)
        for j in range(mtp_layers):
            mtp = f"model.layers.{n + j}."
            tensors.update({mtp + k[len(last):]: t.clone() for k, t in tensors.items() if k.startswith(last)})
            for leaf, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                                ("shared_head.norm.weight", (h,))):
                tensors[mtp + leaf] = torch.randn(shape, generator=g).to(dtype)
        config["num_nextn_predict_layers"] = mtp_layers
    if sharded:
        names = sorted(tensors)
        files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for fn, ns in files.items():
            save_file({n: tensors[n] for n in ns}, str(out / fn), metadata={"format": "pt"})
        wm = {n: fn for fn, ns in files.items() for n in ns}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        write_tokenizer(out, config["vocab_size"])
    return out
