"""The serving dtype, as vLLM reads ``--dtype``: the one normaliser every command and the converter use.

``vllm serve --dtype auto`` runs a checkpoint in its config's dtype where it is float16 or bfloat16
(bfloat16 for float32 configs and for model types vLLM refuses float16 for); a bundle holds scales in
one serving dtype, so ``convert`` and ``check`` must decide it exactly as the engine will.
"""

from __future__ import annotations

from collections.abc import Iterable

from marlin_pack.schemas import ServingDtype

__all__ = ["VLLM_DTYPES", "FLOAT16_UNSUPPORTED_MODEL_TYPES", "default_serving_dtype", "serving_dtype_for"]

# vLLM refuses float16 for these model types (config/model.py _FLOAT16_NOT_SUPPORTED_MODELS).
FLOAT16_UNSUPPORTED_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})
_FLOAT_CODES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def _config_dtype(config: dict) -> str | None:
    """The dtype a HuggingFace config declares: its own, else its text or vision sub-config's (as vLLM reads it)."""
    for cfg in (config, config.get("text_config"), config.get("vision_config")):
        if isinstance(cfg, dict):
            found = cfg.get("dtype") or cfg.get("torch_dtype")
            if isinstance(found, str):
                return found.removeprefix("torch.")
    return None


def default_serving_dtype(config: dict, weight_dtypes: Iterable[str] = ()) -> ServingDtype:
    """The dtype ``vllm serve --dtype auto`` (vLLM) runs a checkpoint in on a bfloat16-capable GPU.

    The config's dtype (``dtype`` or ``torch_dtype``; else the text or vision sub-config's) is kept
    if it is float16 or bfloat16 and the model type allows it; float32 (and anything else) becomes
    bfloat16, vLLM's preferred dtype there; float16 becomes bfloat16 for the model types vLLM refuses
    float16 for (Gemma 2/3, GLM-4). Without a config dtype, vLLM reads the weights' dtypes: here the
    16-bit float dtype of the non-quantized weights, if they agree on one, else bfloat16.

    Args:
        weight_dtypes: safetensors dtype codes of the checkpoint's tensors (used only without a config dtype).
    """
    found = _config_dtype(config)
    if found is None:
        floats = {_FLOAT_CODES[c] for c in weight_dtypes if c in _FLOAT_CODES}
        found = floats.pop() if len(floats) == 1 else "float32"
    model_type = config.get("model_type")  # (not a string: no model type vLLM knows, refused where the model is read)
    if found == "float16" and isinstance(model_type, str) and model_type in FLOAT16_UNSUPPORTED_MODEL_TYPES:
        return ServingDtype.bfloat16
    return ServingDtype(found) if found in {d.value for d in ServingDtype} else ServingDtype.bfloat16


# vLLM's --dtype words (ModelConfig.dtype) and the dtype each names; None: auto (from the config).
VLLM_DTYPES: dict[str, str | None] = {
    "auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32",
}


def serving_dtype_for(word: str | None, config: dict, weight_dtypes: Iterable[str] = ()) -> ServingDtype:
    """The serving dtype of ``vllm serve --dtype WORD`` for this checkpoint: the one dtype normaliser of every command.

    ``word`` is read as vLLM reads ``--dtype`` (``auto`` or None: :func:`default_serving_dtype`; ``half`` is
    float16). Raises ValueError (one line, naming what to pass) for a word vLLM does not take, and for float32:
    vLLM serves AWQ, GPTQ and compressed-tensors WNA16 with 16-bit activations only.
    """
    key = "auto" if word is None else str(word).strip().lower()
    if key not in VLLM_DTYPES:
        close = {"fp16": "float16", "f16": "float16", "bf16": "bfloat16", "fp32": "float32", "f32": "float32"}.get(key)
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"--dtype {word!r} is not one of vLLM's: {', '.join(VLLM_DTYPES)}{hint}")
    found = VLLM_DTYPES[key]
    if found is None:
        return default_serving_dtype(config, weight_dtypes)
    if found == "float32":
        raise ValueError(
            f"--dtype {word}: vLLM serves these quantized layers with float16 or bfloat16 activations only; "
            "pass --dtype auto, float16 or bfloat16"
        )
    return ServingDtype(found)
