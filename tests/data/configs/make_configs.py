"""Write the ``config.json`` of a tiny model of every supported architecture, as one transformers version saves it (NOT run by the tests).

``tests/marlin/test_hf_config.py`` reads each file the way marlin-pack does and the way vLLM
does (the installed transformers' config classes) and compares what the two make of it. The files
are what ``PretrainedConfig.save_pretrained`` writes, so each carries its version's key names
(transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``, transformers 4
``num_experts``; transformers >= 4.52 nests Qwen2-VL's text keys under ``text_config``).

    /work/qenv-autoawq/bin/python tests/data/configs/make_configs.py tests/data/configs/transformers4   # 4.51.3
    python3 tests/data/configs/make_configs.py tests/data/configs/transformers5                       # 5.x

InternLM2 has no transformers class (its config is remote code) and is not written here; neither is
DeepSeek-V2 by transformers 4.51 (no class yet: its checkpoints carried the config as remote code).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import transformers

# Small dimensions, different from every class default, so a default taken by mistake shows.
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=128)
MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DIMS),
    "mistral": ("MistralConfig", "MistralForCausalLM", DIMS),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DIMS),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**DIMS, "head_dim": 32}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**DIMS, "head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**DIMS, "head_dim": 32}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**DIMS, "head_dim": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", DIMS),
    "granite": ("GraniteConfig", "GraniteForCausalLM", DIMS),
    "cohere": ("CohereConfig", "CohereForCausalLM", DIMS),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", DIMS),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**DIMS, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**DIMS, **MOE, "num_experts": 4, "head_dim": 32}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**DIMS, **MOE, "num_experts": 4,
                                                             "shared_expert_intermediate_size": 256}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **DIMS, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": None,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "num_key_value_heads": 8}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **DIMS, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "num_key_value_heads": 8,
        "n_group": 1, "topk_group": 1}),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {"text_config": DIMS}),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {"text_config": DIMS}),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", {"text_config": {**DIMS, "head_dim": 32}}),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {"text_config": {**DIMS, "model_type": "mistral"}}),
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_type, (cls_name, arch, kw) in CONFIGS.items():
        cls = getattr(transformers, cls_name, None)
        if cls is None:  # transformers 4.51 has no DeepseekV2Config (checkpoints then carried it as remote code)
            print(f"{model_type}: transformers {transformers.__version__} has no {cls_name}; skipped")
            continue
        if "text_config" in kw and transformers.__version__.startswith("4.") and model_type.startswith("qwen2"):
            kw = dict(kw["text_config"])  # transformers 4.51's Qwen2-VL configs are flat
        cfg = cls(**kw)
        cfg.architectures = [arch]
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            (out / f"{model_type}.json").write_text((Path(tmp) / "config.json").read_text())
    (out / "VERSION").write_text(transformers.__version__ + "\n")
    print(f"{len(list(out.glob('*.json')))} configs written by transformers {transformers.__version__} to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
