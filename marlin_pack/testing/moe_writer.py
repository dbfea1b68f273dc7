"""The writer core of the synthetic mixture-of-experts checkpoints (:mod:`.synthetic_moe`, :mod:`.synthetic_deepseek`).

A model module describes only what differs: its shape dataclass lists one decoder layer's tensors,
in transformers' state-dict order (:class:`Linear` for a quantized linear, :class:`Plain` for a
16-bit tensor: norms, the router), and a ``config(shape, qc, dtype)`` adds its own keys to
:func:`base_config`. This module builds the tensor list around those layers (embeddings first,
final norm and head last), checks the group size, and writes the shards (each tensor drawn only
when its turn comes, on ``device``, with :mod:`.synthetic`'s drawing and streaming writer), the
index, ``config.json``, ``generation_config.json`` and optionally a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from marlin_pack.testing import synthetic as s

__all__ = ["Linear", "Plain", "MoeLayout", "quant_config", "group_size_of", "layout_specs", "base_config", "write_layout",
           "write_specs"]


class Linear(NamedTuple):
    """A quantized linear of a decoder layer: ``model.layers.<i>.<suffix>``, ``[in_features K] -> [out_features N]``."""

    suffix: str
    in_features: int
    out_features: int


class Plain(NamedTuple):
    """A 16-bit tensor of a decoder layer (a norm: ``near_one``; the router: ``normal``), never quantized."""

    suffix: str
    shape: tuple[int, ...]
    kind: str


class MoeLayout(Protocol):
    """What the core reads of a model's shape dataclass."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int

    def decoder_layer(self, layer: int) -> list[Linear | Plain]:
        """The tensors of decoder layer ``layer``, in state-dict order (which sharding follows)."""
        ...


ConfigFn = Callable[[Any, dict[str, Any], torch.dtype], dict[str, Any]]


def quant_config(fmt: str, bits: int, group_size: int, *, symmetric: bool = True,
                 ignore: list[str] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` AutoAWQ (GEMM) or GPTQModel (symmetric, v1) writes; for ``compressed-tensors``
    llm-compressor's pack-quantized W4A16 / W4A16_ASYM (``symmetric=False``) / W8A16 one, ``ignore`` its
    ignore list (default: ``lm_head`` and the routers ``mlp.gate``, as llm-compressor's MoE examples write them)."""
    if fmt == "compressed-tensors":
        if not symmetric and bits != 4:
            raise ValueError("asymmetric compressed-tensors experts are 4-bit (vLLM's Marlin runs zero points for uint4 only)")
        return s.compressed_tensors_config(bits, group_size, symmetric,
                                           ignore=["lm_head", "re:.*mlp[.]gate$"] if ignore is None else ignore)
    if not symmetric:
        raise ValueError("symmetric=False is for compressed-tensors checkpoints (AWQ has zero points, GPTQ here is symmetric)")
    if fmt == "awq":
        if bits != 4:
            raise ValueError("AWQ checkpoints are 4-bit")
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    raise ValueError(f"format {fmt!r}: expected awq, gptq or compressed-tensors")


def group_size_of(qc: dict[str, Any]) -> int:
    """The group size of a config :func:`quant_config` wrote (compressed-tensors keeps it in its one config group)."""
    return s._ct_params(qc)["group_size"] if qc["quant_method"] == "compressed-tensors" else qc["group_size"]


def _check_group_size(shape: MoeLayout, g: int) -> None:
    """``g`` divides every quantized linear's in_features; else name the first one and the group sizes that fit."""
    if g == -1:
        return
    layers = [(f"model.layers.{i}", shape.decoder_layer(i)) for i in range(shape.num_hidden_layers)]
    linears = [(p, t) for p, items in layers for t in items if isinstance(t, Linear)]
    bad = next(((p, t) for p, t in linears if t.in_features % g), None)
    if bad is not None:
        fits = [str(x) for x in (128, 64, 32) if all(t.in_features % x == 0 for _, t in linears)]
        hint = f"use {', '.join(fits)} or -1" if fits else "use -1"
        p, t = bad
        raise ValueError(f"group_size {g} does not divide the {t.in_features} in_features of {p}.{t.suffix}; {hint}")


def layout_specs(shape: MoeLayout, qc: dict[str, Any], dtype: torch.dtype) -> list[Any]:
    """Every tensor of the checkpoint, in state-dict order: the embeddings, each decoder layer, the final norm, the head."""
    _check_group_size(shape, group_size_of(qc))
    h = shape.hidden_size
    specs = [s._Spec("model.embed_tokens.weight", (shape.vocab_size, h), dtype, "normal")]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}"
        for t in shape.decoder_layer(layer):
            if isinstance(t, Linear):
                specs += s._linear_specs(f"{p}.{t.suffix}", t.in_features, t.out_features, False, qc, dtype)
            else:
                specs.append(s._Spec(f"{p}.{t.suffix}", t.shape, dtype, t.kind))
    specs.append(s._Spec("model.norm.weight", (h,), dtype, "near_one"))
    specs.append(s._Spec("lm_head.weight", (shape.vocab_size, h), dtype, "normal"))
    return specs


def base_config(shape: MoeLayout, qc: dict[str, Any], dtype: torch.dtype, *, architecture: str, model_type: str,
                dtype_key: str = "torch_dtype") -> dict[str, Any]:
    """The config.json keys both models share (``dtype_key``: ``torch_dtype`` or, newer transformers, ``dtype``)."""
    return {
        "architectures": [architecture], "model_type": model_type, "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, dtype_key: s._DTYPE_NAMES[dtype],
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "use_cache": True, "quantization_config": qc,
    }


def write_layout(out_dir: str | Path, shape: MoeLayout, config: ConfigFn, fmt: str, *, bits: int, group_size: int,
                 dtype: torch.dtype, seed: int, max_shard_bytes: int | None, device: str | torch.device,
                 tokenizer: bool, symmetric: bool = True) -> Path:
    """Write the random AWQ (GEMM), symmetric GPTQ or compressed-tensors checkpoint of ``shape``,
    ``config(shape, qc, dtype)`` its config.json; returns ``out_dir``."""
    qc = quant_config(fmt, bits, group_size, symmetric=symmetric)
    return write_specs(out_dir, layout_specs(shape, qc, dtype), config(shape, qc, dtype), seed=seed,
                       max_shard_bytes=max_shard_bytes, device=device, tokenizer=tokenizer)


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
