"""Tiny AWQ/GPTQ checkpoints of every supported architecture, for the oracle and GPU tests.

The unquantized part of each checkpoint (embeddings, norms, vision tower, projector, their
names and shapes) comes from **transformers' own model class** for the architecture, built
from a tiny config with random weights and saved under its state-dict names (as
``save_pretrained`` writes them). The decoder's linear modules are then replaced by random
AWQ (GEMM) or GPTQ tensors (``marlin_pack.testing.synthetic.quantized_linear_tensors``).
Which modules are quantized is decided here, independently of marlin-pack's architecture
table: every ``nn.Linear`` inside the language model's decoder layers.

InternLM2 is not in transformers (remote code): its tensors are listed by hand from the
published ``modeling_internlm2.py`` and a minimal ``configuration_internlm2.py`` is written
next to ``config.json`` for ``trust_remote_code``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from marlin_pack.testing.synthetic import compressed_tensors_config, quantized_linear_tensors, write_tokenizer

__all__ = ["ARCH_CONFIGS", "BACKEND_CONFIGS", "write_arch_checkpoint", "quant_config"]

_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)

# architecture -> config.json (without quantization_config); tiny, but each arch's quirks kept:
# Gemma's explicit head_dim differs from hidden/heads, Gemma 3's text_config omits defaults.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "GemmaForCausalLM": dict(model_type="gemma", **_TEXT, head_dim=128, tie_word_embeddings=True),
    "Gemma2ForCausalLM": dict(model_type="gemma2", **_TEXT, head_dim=128, tie_word_embeddings=True,
                              query_pre_attn_scalar=128, sliding_window=64),
    "Gemma3ForCausalLM": dict(model_type="gemma3_text", **_TEXT, head_dim=128, tie_word_embeddings=True,
                              query_pre_attn_scalar=128, sliding_window=64),
    "Phi3ForCausalLM": dict(model_type="phi3", **_TEXT, tie_word_embeddings=False, pad_token_id=0),
    "GraniteForCausalLM": dict(model_type="granite", **_TEXT, tie_word_embeddings=True),
    "CohereForCausalLM": dict(model_type="cohere", **_TEXT, tie_word_embeddings=True),
    "Cohere2ForCausalLM": dict(model_type="cohere2", **_TEXT, tie_word_embeddings=True, sliding_window=64,
                               layer_types=["sliding_attention", "full_attention"]),
    "InternLM2ForCausalLM": dict(model_type="internlm2", **_TEXT, tie_word_embeddings=False, bias=False,
                                 rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                                 auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"}),
    "Qwen2_5_VLForConditionalGeneration": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=True,
        text_config=dict(model_type="qwen2_5_vl_text", **_TEXT, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=256,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0], in_chans=3),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503),
    "Qwen2VLForConditionalGeneration": dict(
        model_type="qwen2_vl", tie_word_embeddings=False,
        text_config=dict(model_type="qwen2_vl_text", **_TEXT, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=1, embed_dim=64, hidden_size=256, mlp_ratio=2, num_heads=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503),
    "Gemma3ForConditionalGeneration": dict(
        model_type="gemma3", mm_tokens_per_image=4, image_token_index=500, boi_token_index=501, eoi_token_index=502,
        text_config=dict(model_type="gemma3_text", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         vocab_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         query_pre_attn_scalar=128, sliding_window=64),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=4, image_size=56, patch_size=14)),
    "Mistral3ForConditionalGeneration": dict(
        model_type="mistral3", image_token_index=500, spatial_merge_size=2, projector_hidden_act="gelu",
        vision_feature_layer=-1, multimodal_projector_bias=False,
        text_config=dict(model_type="mistral", **_TEXT, head_dim=64, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, head_dim=16, image_size=56, patch_size=14, num_channels=3)),
}


# Architectures vLLM serves through its Transformers backend (marlin.transformers_backend): special token ids inside
# the tiny vocabulary (transformers refuses a padding index outside it); each one's layout quirks kept (biases, tied
# embeddings, GPTBigCode's multi-query attention under GPT-2's key names, GPT-NeoX without KV heads).
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
BACKEND_CONFIGS: dict[str, dict[str, Any]] = {
    "OlmoForCausalLM": dict(model_type="olmo", **_TEXT, **_IDS),
    "Olmo2ForCausalLM": dict(model_type="olmo2", **_TEXT, **_IDS),
    "Olmo3ForCausalLM": dict(model_type="olmo3", **_TEXT, **_IDS, sliding_window=64),
    "Starcoder2ForCausalLM": dict(model_type="starcoder2", **_TEXT, **_IDS, use_bias=True, tie_word_embeddings=True),
    "GPTBigCodeForCausalLM": dict(model_type="gpt_bigcode", n_embd=256, n_layer=2, n_head=4, n_inner=512, vocab_size=512,
                                  n_positions=4096, multi_query=True, bos_token_id=1, eos_token_id=2),
    "GPTNeoXForCausalLM": dict(model_type="gpt_neox", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=512, max_position_embeddings=4096, rotary_pct=0.25, **_IDS),
    "PhiForCausalLM": dict(model_type="phi", **_TEXT, **_IDS, partial_rotary_factor=0.5),
    "SmolLM3ForCausalLM": dict(model_type="smollm3", **_TEXT, **_IDS, tie_word_embeddings=True),
    "StableLmForCausalLM": dict(model_type="stablelm", **_TEXT, **_IDS, partial_rotary_factor=0.25, use_qkv_bias=True),
    "GlmForCausalLM": dict(model_type="glm", **_TEXT, **_IDS, head_dim=64),
    "ArceeForCausalLM": dict(model_type="arcee", **_TEXT, **_IDS),
    "SeedOssForCausalLM": dict(model_type="seed_oss", **_TEXT, **_IDS, head_dim=64),
    "HunYuanDenseV1ForCausalLM": dict(model_type="hunyuan_v1_dense", **_TEXT, **_IDS, head_dim=64),
    "VaultGemmaForCausalLM": dict(model_type="vaultgemma", **_TEXT, **_IDS, head_dim=64),
    "CwmForCausalLM": dict(model_type="cwm", **_TEXT, **_IDS, head_dim=64,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Jais2ForCausalLM": dict(model_type="jais2", **_TEXT, **_IDS),
    # no registry entry: vLLM's registry falls back to the backend (transformers has the class). Helium's head_dim
    # defaults to 128 (its o_proj is hidden x hidden), Ministral's to null; NanoChat's MLP is fc1, relu2, fc2
    "HeliumForCausalLM": dict(model_type="helium", **_TEXT, **_IDS, head_dim=64),
    "MinistralForCausalLM": dict(model_type="ministral", **_TEXT, **_IDS, head_dim=64, sliding_window=64),
    "NanoChatForCausalLM": dict(model_type="nanochat", **_TEXT, **_IDS),
}
ARCH_CONFIGS.update(BACKEND_CONFIGS)

# Unquantized vision parts of multimodal checkpoints (AutoAWQ lists them in modules_to_not_convert).
_VISION_MODULES = {
    "Qwen2_5_VLForConditionalGeneration": ("visual",),
    "Qwen2VLForConditionalGeneration": ("visual",),
    "Gemma3ForConditionalGeneration": ("vision_tower", "multi_modal_projector"),
    "Mistral3ForConditionalGeneration": ("vision_tower", "multi_modal_projector"),
}


# The special tokens and image processor a multimodal processor needs (ids as in ARCH_CONFIGS).
_MM_TOKENS = {
    "Qwen2_5_VLForConditionalGeneration": {"<|image_pad|>": 500, "<|video_pad|>": 501,
                                           "<|vision_start|>": 502, "<|vision_end|>": 503},
}
_PROCESSORS = {
    "Qwen2_5_VLForConditionalGeneration": {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136, "max_pixels": 50176,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 0.00392156862745098,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]},
}


def quant_config(fmt: str, bits: int = 4, group_size: int = 128) -> dict[str, Any]:
    """The quantization_config AutoAWQ (GEMM) or GPTQModel (v1, symmetric) writes."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}


def _hf_state_dict(config: dict[str, Any], dtype: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """In this process, or, where vLLM is loaded, in a fresh one: vLLM's Transformers backend decorates the transformers
    decoder classes it builds for torch.compile in place (``support_torch_compile``, for the life of the process), and
    such a class no longer builds outside a vLLM engine; the oracle tests write checkpoints after building backend models.
    """
    if decorated_by_vllm(config["architectures"][0]):
        sd, linears = in_clean_process("arch_checkpoints", "_hf_state_dict_here", config, dtype, seed)
        return sd, {k: tuple(v) for k, v in linears.items()}
    return _hf_state_dict_here(config, dtype, seed)


def decorated_by_vllm(architecture: str) -> bool:
    """Whether vLLM's Transformers backend decorated the transformers classes of ``architecture``'s modeling module in
    this process (``support_torch_compile`` adds a base class; such a class then builds only inside a vLLM engine)."""
    import sys

    import transformers

    module = sys.modules[getattr(transformers, architecture).__module__]
    return any(isinstance(c, type) and any(b.__name__ == "TorchCompileWithNoGuardsWrapper" for b in c.__bases__)
               for c in vars(module).values())


def in_clean_process(module: str, function: str, config: dict[str, Any], dtype: torch.dtype, seed: int) -> tuple[dict, Any]:
    """``module.function(config, dtype, seed)`` (a state dict, or a state dict and a JSON-able extra) run in a fresh
    Python process of this interpreter (no vLLM imported), its tensors brought back through a safetensors file."""
    import subprocess
    import sys
    import tempfile

    from safetensors.torch import load_file

    code = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from safetensors.torch import save_file\n"
        f"from {module} import {function} as make\n"
        "config, dtype, seed, out = json.loads(sys.argv[1]), getattr(torch, sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
        "made = make(config, dtype, seed)\n"
        "sd, extra = made if isinstance(made, tuple) else (made, None)\n"
        "save_file({k: v.contiguous() for k, v in sd.items()}, out + '/sd.safetensors')\n"
        "open(out + '/extra.json', 'w').write(json.dumps(extra))\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", code, json.dumps(config), str(dtype).removeprefix("torch."), str(seed), tmp],
                       check=True, timeout=600)
        return load_file(str(Path(tmp) / "sd.safetensors")), json.loads((Path(tmp) / "extra.json").read_text())


def _hf_state_dict_here(config: dict[str, Any], dtype: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Random weights of transformers' model class for ``config``, under the names ``save_pretrained``
    writes (tied copies dropped, on-disk renames applied), and the decoder layers' linear modules
    (on-disk names) with their (in, out) features."""
    import tempfile

    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**config)
    cfg.architectures = config["architectures"]
    model_cls = getattr(transformers, config["architectures"][0])
    with torch.device("cpu"):
        model = model_cls._from_config(cfg, torch_dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        sd = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            sd.update(load_file(str(f)))
    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linears = {}
    for name in sd:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or sd[name].dim() != 2 or not re.search(r"(^|\.)(layers|h)\.\d+\.", module):
            continue
        if any(v in module for v in ("vision", "visual", "multi_modal_projector")):
            continue
        if "norm" in module or "embed" in module:
            continue
        n, k = sd[name].shape
        linears[module] = (k, n)
    assert linears and all(kn in shapes.values() for kn in linears.values()), "no decoder linears found"
    return sd, linears


def _internlm2_state_dict(config: dict[str, Any], dtype: torch.dtype, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    sd = {"model.tok_embeddings.weight": rnd(v, h), "model.norm.weight": torch.ones(h, dtype=dtype), "output.weight": rnd(v, h)}
    linears = {}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}"
        sd[f"{p}.attention_norm.weight"] = torch.ones(h, dtype=dtype)
        sd[f"{p}.ffn_norm.weight"] = torch.ones(h, dtype=dtype)
        linears.update({f"{p}.attention.wqkv": (h, qkv), f"{p}.attention.wo": (h, h),
                        f"{p}.feed_forward.w1": (h, i), f"{p}.feed_forward.w3": (h, i), f"{p}.feed_forward.w2": (i, h)})
    sd.update({f"{m}.weight": torch.empty(0) for m in linears})  # replaced by quantized tensors
    return sd, linears


_INTERNLM2_CONFIG_PY = '''from transformers import PretrainedConfig


class InternLM2Config(PretrainedConfig):
    model_type = "internlm2"

    def __init__(self, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                 initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=False, bias=False, rope_theta=10000, rope_scaling=None,
                 attn_implementation="eager", **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.bias, self.rope_theta, self.rope_scaling = bias, rope_theta, rope_scaling
        self.attn_implementation = attn_implementation
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
'''


def write_arch_checkpoint(out: Path, architecture: str, fmt: str = "gptq", *, bits: int = 4, group_size: int = 128,
                          dtype: torch.dtype = torch.float16, seed: int = 0, tokenizer: bool = False,
                          names: str | None = None, symmetric: bool = True, **config_overrides: Any) -> Path:
    """Write a tiny quantized checkpoint of ``architecture`` to ``out``.

    ``fmt``: ``awq``, ``gptq`` or ``compressed-tensors`` (llm-compressor's pack-quantized W4A16/W8A16, scales and biases
    in ``dtype``; ``symmetric`` False: W4A16_ASYM, with zero points).

    ``names``, for multimodal models: the tensor names as the installed transformers saves them
    (None; transformers 5 writes the original, pre-4.52 names back), or, whatever it writes, as
    transformers < 4.52 wrote them ("legacy": ``model.layers`` and ``visual`` for Qwen2-VL /
    Qwen2.5-VL, ``language_model.model.layers``, ``vision_tower`` for Gemma 3 / Mistral 3), as
    transformers 4.52 to 4.57 wrote them ("v4.52": ``model.language_model.layers``,
    ``model.visual`` / ``model.vision_tower``, ``lm_head``), or with the language model under
    ``model.`` ("model": ``model.layers``, the vision tower left as saved).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(ARCH_CONFIGS[architecture]))
    text = config.get("text_config", config)
    text.update({k: v for k, v in config_overrides.items()})
    config["architectures"] = [architecture]
    config["torch_dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    if architecture == "InternLM2ForCausalLM":
        sd, linears = _internlm2_state_dict(config, dtype, seed)
        (out / "configuration_internlm2.py").write_text(_INTERNLM2_CONFIG_PY)
    else:
        sd, linears = _hf_state_dict(config, dtype, seed)
    ct = fmt == "compressed-tensors"
    qc = compressed_tensors_config(bits, group_size, symmetric) if ct else quant_config(fmt, bits, group_size)
    if fmt == "awq" and architecture in _VISION_MODULES:  # as AutoAWQ writes for multimodal models
        qc["modules_to_not_convert"] = list(_VISION_MODULES[architecture])
    tensors: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        if module in linears and leaf == "weight":
            k, n = linears[module]
            tensors.update(quantized_linear_tensors(module, k, n, qc, seed, *((dtype,) if ct else ())))
        elif module in linears and leaf == "bias":
            # AutoAWQ / GPTQModel keep biases in fp16, like scales; llm-compressor in the model's dtype
            tensors[name] = t.to(dtype if ct else torch.float16)
        else:
            tensors[name] = t
    if architecture == "Gemma3ForConditionalGeneration":  # as published Gemma 3 checkpoints name SigLIP
        tensors = {re.sub(r"^(model\.)?vision_tower\.(?!vision_model\.)", r"\1vision_tower.vision_model.", n): t
                   for n, t in tensors.items()}
    if names is not None:
        rename = {"legacy": _legacy, "v4.52": _v4_52, "model": _text_under_model}[names]
        tensors = {rename(architecture, n): t for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        write_tokenizer(out, text["vocab_size"], named_tokens=_MM_TOKENS.get(architecture))
        if architecture in _PROCESSORS:
            (out / "preprocessor_config.json").write_text(json.dumps(_PROCESSORS[architecture], indent=2) + "\n")
    return out


def _legacy(architecture: str, name: str) -> str:
    if architecture.startswith("Qwen2"):
        return name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        return name.removeprefix("model.")
    return name


def _v4_52(architecture: str, name: str) -> str:
    name = _legacy(architecture, name)
    if architecture.startswith("Qwen2"):
        if name.startswith("visual."):
            return f"model.{name}"
        return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith(("vision_tower.", "multi_modal_projector.")):
        return f"model.{name}"
    return name.removeprefix("language_model.")  # language_model.lm_head -> lm_head


def _text_under_model(architecture: str, name: str) -> str:
    name = _legacy(architecture, name)
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    return name.removeprefix("language_model.")
