"""Synthetic AWQ / GPTQ / unquantized HuggingFace checkpoints with random but valid weights.

The files follow what AutoAWQ (GEMM) and AutoGPTQ / GPTQModel write: tensor names, dtypes,
shapes, packing and the config's ``quantization_config``. Every int32 word is valid packed
data, so ``qweight`` (and non-symmetric ``qzeros``) are plain random words.

Writing streams: each tensor is drawn, written and dropped before the next one, so memory
stays at one tensor even for a 40 GB single-file checkpoint. Each tensor has its own
generator seeded by ``(seed, name)``: values do not depend on sharding or writing order, and
the same seed on the same device gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "ModelShape", "PRESETS", "write_awq_checkpoint", "write_gptq_checkpoint", "write_compressed_tensors_checkpoint",
    "write_unquantized_checkpoint", "write_tokenizer", "compressed_tensors_config",
]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-like decoder (``model_type`` llama, mistral, qwen2 or qwen3)."""

    model_type: str = "llama"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    vocab_size: int = 512
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """``(module suffix, in_features K, out_features N, has_bias)`` of one decoder layer."""
        h, i, d = self.hidden_size, self.intermediate_size, self.resolved_head_dim
        q, kv, bias = self.num_attention_heads * d, self.num_key_value_heads * d, self.model_type == "qwen2"
        return [("self_attn.q_proj", h, q, bias), ("self_attn.k_proj", h, kv, bias),
                ("self_attn.v_proj", h, kv, bias), ("self_attn.o_proj", q, h, False),
                ("mlp.gate_proj", h, i, False), ("mlp.up_proj", h, i, False), ("mlp.down_proj", i, h, False)]


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    # K=320, N=480 miss Marlin's tiles, so TP=1 already pads. 480 = 15*32: use group_size 32 or -1.
    "tiny-padded": ModelShape(
        hidden_size=320, intermediate_size=480, num_attention_heads=5, num_key_value_heads=1),
    "tiny-qwen2": ModelShape(model_type="qwen2"),  # q/k/v biases
    "tiny-qwen3": ModelShape(model_type="qwen3", head_dim=128),  # q/k norms; heads * head_dim != hidden
    # An embedding and a head of 20.5 MB each in float16: "large" common tensors for the loader (16 MB on).
    "tiny-vocab": ModelShape(vocab_size=40000),
    "llama-1gb": ModelShape(  # TinyLlama widths, 32 layers: 0.99 GB at 4-bit g128
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000),
    "llama-8b": ModelShape(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "llama-70b": ModelShape(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_ROPE_THETA = {"llama": 500000.0, "mistral": 1000000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# safetensors' writer orders tensors by dtype (descending in its enum), then name; doing the
# same makes our files byte-identical to what ``safetensors.torch.save_file`` would write.
_ST_DTYPES = {torch.int64: ("I64", 4), torch.float32: ("F32", 3), torch.int32: ("I32", 2), torch.bfloat16: ("BF16", 1),
              torch.float16: ("F16", 0)}


class _Spec(NamedTuple):
    """One tensor to write, drawn by `_fill` only when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # words | normal | near_one | scales | const | g_idx | g_idx_perm
    arg: int = 0  # the word of "const", the group size of "g_idx*"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _fill(s: _Spec, g: torch.Generator) -> torch.Tensor:
    kw: dict[str, Any] = {"dtype": s.dtype, "generator": g, "device": g.device}
    if s.kind == "words":
        return torch.randint(-(2**31), 2**31, s.shape, **kw)
    if s.kind == "normal":
        return torch.randn(s.shape, **kw).mul_(0.02)
    if s.kind == "near_one":
        return torch.randn(s.shape, **kw).mul_(0.02).add_(1.0)
    if s.kind == "scales":
        # |code - zero| <= 15 keeps |w| <= 0.045: a K=8192 dot product with RMS-normed inputs
        # stays O(1), so even 80 layers keep fp16 activations finite.
        return torch.rand(s.shape, **kw).mul_(2.5e-3).add_(0.5e-3)
    if s.kind == "const":
        return torch.full(s.shape, s.arg, dtype=s.dtype, device=g.device)
    if s.kind == "shape":  # compressed-tensors' weight_shape [N, K], packed into arg as N << 24 | K
        return torch.tensor([s.arg >> 24, s.arg & ((1 << 24) - 1)], dtype=s.dtype, device=g.device)
    k = s.shape[0]
    idx = torch.arange(k, dtype=s.dtype, device=g.device) // (k if s.arg == -1 else s.arg)
    # act-order: a permutation of the static g_idx, so every group still holds g rows.
    return idx[torch.randperm(k, generator=g, device=g.device)] if s.kind == "g_idx_perm" else idx


def _sym_zero_word(bits: int, checkpoint_format: str) -> int:
    """The packed zero points of symmetric GPTQ as a signed int32; v1 stores ``zero - 1``."""
    zero = (1 << (bits - 1)) - (1 if checkpoint_format == "gptq" else 0)
    word = sum(zero << (bits * i) for i in range(32 // bits))
    return word - 2**32 if word >= 2**31 else word


def _ct_params(qc: dict[str, Any]) -> dict[str, Any]:
    """bits, group_size and sym of a compressed-tensors config written by this module (its one config group)."""
    w = next(iter(qc["config_groups"].values()))["weights"]
    return {"quant_method": "compressed-tensors", "bits": w["num_bits"], "sym": w["symmetric"],
            "group_size": -1 if w["strategy"] == "channel" else w["group_size"]}


def _linear_specs(p: str, k: int, n: int, bias: bool, qc: dict[str, Any] | None,
                  dtype: torch.dtype) -> list[_Spec]:
    if qc is None:
        specs = [_Spec(f"{p}.weight", (n, k), dtype, "normal")]
    elif qc["quant_method"] == "compressed-tensors":  # llm-compressor pack-quantized: [N, K] like nn.Linear
        q = _ct_params(qc)
        groups, pack = 1 if q["group_size"] == -1 else k // q["group_size"], 32 // q["bits"]
        specs = [_Spec(f"{p}.weight_packed", (n, k // pack), torch.int32, "words"),
                 _Spec(f"{p}.weight_scale", (n, groups), dtype, "scales"),
                 _Spec(f"{p}.weight_shape", (2,), torch.int64, "shape", n << 24 | k)]
        if not q["sym"]:
            specs.append(_Spec(f"{p}.weight_zero_point", (n // pack, groups), torch.int32, "words"))
    else:
        g, bits, i32 = qc["group_size"], qc["bits"], torch.int32
        groups, pack = 1 if g == -1 else k // g, 32 // bits
        # AutoAWQ and AutoGPTQ both keep scales and biases in fp16, whatever the model dtype.
        scales, dtype = _Spec(f"{p}.scales", (groups, n), torch.float16, "scales"), torch.float16
        if qc["quant_method"] == "awq":  # both packed along N, AWQ nibble order
            specs = [_Spec(f"{p}.qweight", (k, n // 8), i32, "words"),
                     _Spec(f"{p}.qzeros", (groups, n // 8), i32, "words"), scales]
        else:  # qweight packed along K, qzeros along N
            word = _sym_zero_word(bits, qc["checkpoint_format"])
            zeros = _Spec(f"{p}.qzeros", (groups, n // pack), i32, "const" if qc["sym"] else "words", word)
            specs = [_Spec(f"{p}.qweight", (k // pack, n), i32, "words"), zeros, scales,
                     _Spec(f"{p}.g_idx", (k,), i32, "g_idx_perm" if qc["desc_act"] else "g_idx", g)]
    if bias:
        specs.append(_Spec(f"{p}.bias", (n,), dtype, "normal"))
    return specs


def _model_specs(shape: ModelShape, qc: dict[str, Any] | None, dtype: torch.dtype) -> list[_Spec]:
    """Every tensor, in HF state-dict (module registration) order, which sharding follows."""
    h, v, d = shape.hidden_size, shape.vocab_size, shape.resolved_head_dim
    specs = [_Spec("model.embed_tokens.weight", (v, h), dtype, "normal")]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}"
        for suffix, k, n, bias in shape.linears():
            specs += _linear_specs(f"{p}.{suffix}", k, n, bias, qc, dtype)
            if suffix == "self_attn.o_proj" and shape.model_type == "qwen3":
                specs += [_Spec(f"{p}.self_attn.{x}_norm.weight", (d,), dtype, "near_one") for x in "qk"]
        specs += [_Spec(f"{p}.{x}.weight", (h,), dtype, "near_one")
                  for x in ("input_layernorm", "post_attention_layernorm")]
    specs.append(_Spec("model.norm.weight", (h,), dtype, "near_one"))
    if not shape.tie_word_embeddings:
        specs.append(_Spec("lm_head.weight", (v, h), dtype, "normal"))
    return specs


def _check(shape: ModelShape, qc: dict[str, Any]) -> None:
    if qc["quant_method"] == "compressed-tensors":
        qc = _ct_params(qc)
    method, bits, g = qc["quant_method"], qc["bits"], qc["group_size"]
    pack, ks = 32 // bits, sorted({k for _, k, _, _ in shape.linears()})
    for suffix, k, n, _ in shape.linears():
        where = f"model.layers.0.{suffix} (in_features={k}, out_features={n})"
        if g != -1 and (g <= 0 or k % g):
            raise ValueError(f"group_size={g} does not divide the in_features of {where}; "
                             f"use -1 or a group size dividing every in_features {ks}")
        if n % pack or (method != "awq" and k % pack):
            raise ValueError(f"{bits}-bit {method} packs {pack} values per int32, but {where} "
                             f"is not a multiple of {pack}")


def _generator(seed: int, name: str, device: str | torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _write_safetensors(path: Path, specs: list[_Spec], seed: int, device: str | torch.device,
                       advance: Callable[[int], None]) -> None:
    """Writes one file tensor by tensor: the header needs only the specs."""
    ordered = sorted(specs, key=lambda s: (-_ST_DTYPES[s.dtype][1], s.name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in ordered:
        header[s.name] = {"dtype": _ST_DTYPES[s.dtype][0], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if torch.device(device).type == "meta":  # headers only: a sparse file of the full size, every value zero
            f.truncate(8 + len(raw) + offset)
            advance(offset)
            return
        for s in ordered:
            t = _fill(s, _generator(seed, s.name, device)).to("cpu").contiguous()
            assert t.shape == s.shape and t.dtype == s.dtype, s.name
            # Raw bytes via the buffer protocol (no copy); safetensors is little-endian, as are our hosts.
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t  # before the next tensor is drawn: peak memory is one tensor, not two
            advance(s.nbytes)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _hf_config(shape: ModelShape, dtype: torch.dtype) -> dict[str, Any]:
    t = shape.model_type
    if t not in _ARCHITECTURES:
        raise ValueError(f"Unknown model_type {t!r}; expected one of {sorted(_ARCHITECTURES)}")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[t]], "model_type": t, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6 if t.startswith("qwen") else 1e-5, "rope_theta": _ROPE_THETA[t],
        "hidden_act": "silu", "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": _DTYPE_NAMES[dtype], "bos_token_id": 1, "eos_token_id": 2,
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
    }
    if shape.head_dim is not None or t == "qwen3":
        cfg["head_dim"] = shape.resolved_head_dim
    if t in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if t == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1, rope_scaling=None)
    else:
        cfg["sliding_window"] = None
    if t.startswith("qwen"):
        cfg.update(use_sliding_window=False, max_window_layers=shape.num_hidden_layers)
    return cfg


def _write_checkpoint(out_dir: str | Path, shape: ModelShape, qc: dict[str, Any] | None, dtype: torch.dtype,
                      seed: int, max_shard_bytes: int | None, device: str | torch.device, tokenizer: bool,
                      progress: Progress | None) -> Path:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not a checkpoint dtype; expected one of {list(_DTYPE_NAMES)}")
    config = _hf_config(shape, dtype)
    if qc is not None:
        _check(shape, qc)
        config["quantization_config"] = qc
    specs = _model_specs(shape, qc, dtype)
    names, shards = plan_shards(specs, max_shard_bytes)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):  # stale shards of another sharding would be loaded too
        old.unlink()
    total, done = sum(s.nbytes for s in specs), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(out / name, shard, seed, device, advance)
    if len(shards) > 1:
        weight_map = {s.name: name for name, shard in zip(names, shards, strict=True) for s in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": 1,
                                                 "eos_token_id": 2})
    if tokenizer:
        write_tokenizer(out, shape.vocab_size, model_max_length=shape.max_position_embeddings)
    return out


def write_awq_checkpoint(out_dir: str | Path, shape: ModelShape, *, group_size: int = 128,
                         dtype: torch.dtype = torch.float16, seed: int = 0,
                         max_shard_bytes: int | None = None, device: str | torch.device = "cpu",
                         tokenizer: bool = True, progress: Progress | None = None) -> Path:
    """Writes a random 4-bit AutoAWQ (GEMM) checkpoint.

    Per linear: ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``, packed along N
    in AWQ order (nibble ``s`` of word ``j`` holds column ``8j + [0,2,4,6,1,3,5,7][s]``), and
    ``scales`` fp16 ``[G, N]``. ``model*.safetensors*`` files already in ``out_dir`` are replaced.

    Args:
        out_dir: directory to write (created if missing).
        shape: model dimensions, e.g. ``PRESETS["tiny"]``.
        group_size: quantization group size along K, or -1 for one group per column.
        dtype: the config's ``torch_dtype`` and the dtype of the non-quantized tensors.
        seed: seeds every tensor together with its name; same seed and device, same bytes.
        max_shard_bytes: above this many tensor bytes, write ``model-0000i-of-0000n.safetensors``
            and ``model.safetensors.index.json``; None writes one ``model.safetensors``.
        device: where tensors are drawn (``"cuda"`` is much faster for 40 GB); values differ
            between devices. ``"meta"`` draws nothing: each file is its header followed by a
            hole (a sparse file of the full size that reads as zeros), for code that reads
            only headers and configs (e.g. building a vLLM model on ``meta``).
        tokenizer: also write a byte-level tokenizer (needs the ``tokenizers`` package).
        progress: called as ``progress(done_bytes, total_bytes)`` after each tensor.

    Returns:
        The checkpoint directory.
    """
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    return _write_checkpoint(out_dir, shape, qc, dtype, seed, max_shard_bytes, device, tokenizer, progress)


def write_gptq_checkpoint(out_dir: str | Path, shape: ModelShape, *, bits: int = 4, group_size: int = 128,
                          desc_act: bool = False, sym: bool = True, dtype: torch.dtype = torch.float16,
                          seed: int = 0, max_shard_bytes: int | None = None,
                          device: str | torch.device = "cpu", tokenizer: bool = True,
                          checkpoint_format: str = "gptq", progress: Progress | None = None) -> Path:
    """Writes a random AutoGPTQ / GPTQModel checkpoint, with ``quantize_config.json``.

    Per linear: ``qweight`` int32 ``[K/P, N]`` (P = 32/bits; bit slot ``i`` of row ``r`` holds
    input row ``rP + i``), ``qzeros`` int32 ``[G, N/P]`` packed along N, ``scales`` fp16
    ``[G, N]`` and ``g_idx`` int32 ``[K]``. Format ``"gptq"`` (v1) stores ``zero - 1`` (symmetric
    4-bit: every word is ``0x77777777``), ``"gptq_v2"`` the zero itself (``0x88888888``).

    Args:
        out_dir: directory to write (created if missing).
        shape: model dimensions, e.g. ``PRESETS["tiny"]``.
        bits: 2, 4 or 8 (vLLM serves 4 and 8, symmetric only).
        group_size: quantization group size along K, or -1 for one group per column.
        desc_act: write an act-order ``g_idx`` (a random permutation of the static one).
        sym: zero points ``2**(bits-1)``; False draws random zero points.
        checkpoint_format: ``"gptq"`` (v1) or ``"gptq_v2"``.
        dtype, seed, max_shard_bytes, device, tokenizer, progress: as in `write_awq_checkpoint`.

    Returns:
        The checkpoint directory.
    """
    if bits not in (2, 4, 8) or checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"Unsupported GPTQ bits={bits}, checkpoint_format={checkpoint_format!r}; "
                         "expected bits 2, 4 or 8 and checkpoint_format 'gptq' or 'gptq_v2'")
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
          "checkpoint_format": checkpoint_format, "model_name_or_path": None, "model_file_base_name": None}
    out = _write_checkpoint(out_dir, shape, qc, dtype, seed, max_shard_bytes, device, tokenizer, progress)
    _write_json(out / "quantize_config.json", qc)  # AutoGPTQ reads this file, not config.json
    return out


def compressed_tensors_config(bits: int = 4, group_size: int = 128, symmetric: bool = True,
                              ignore: list[str] | None = None, actorder: str | None = None) -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor writes for a pack-quantized WNA16 scheme (one config group)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "block_structure": None,
               "dynamic": False, "actorder": actorder, "scale_dtype": None,
               "zp_dtype": None if symmetric else "torch.int8", "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"] if ignore is None else ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {},
            "version": "0.19.0"}


def write_compressed_tensors_checkpoint(out_dir: str | Path, shape: ModelShape, *, bits: int = 4,
                                        group_size: int = 128, symmetric: bool = True,
                                        dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                                        max_shard_bytes: int | None = None, device: str | torch.device = "cpu",
                                        tokenizer: bool = True, progress: Progress | None = None) -> Path:
    """Writes a random compressed-tensors ``pack-quantized`` checkpoint, as llm-compressor saves W4A16/W8A16.

    Per linear: ``weight_packed`` int32 ``[N, K/P]`` (P = 32/bits; bits ``bits*i`` of word ``j`` hold
    input column ``jP + i``, stored ``+2**(bits-1)``), ``weight_scale`` ``[N, G]`` in the model dtype,
    ``weight_shape`` int64 ``[N, K]`` and, when not ``symmetric``, ``weight_zero_point`` int32
    ``[N/P, G]`` packed along N.

    Args:
        bits: 4 or 8 (vLLM's Marlin: 4 and 8 symmetric, 4 asymmetric).
        group_size: group size along K, or -1 for channel-wise (strategy ``channel``).
        symmetric: False writes random zero points.
        out_dir, shape, dtype, seed, max_shard_bytes, device, tokenizer, progress: as in `write_awq_checkpoint`.

    Returns:
        The checkpoint directory.
    """
    qc = compressed_tensors_config(bits, group_size, symmetric)
    return _write_checkpoint(out_dir, shape, qc, dtype, seed, max_shard_bytes, device, tokenizer, progress)


def write_unquantized_checkpoint(out_dir: str | Path, shape: ModelShape, *,
                                 dtype: torch.dtype = torch.float16, seed: int = 0,
                                 tokenizer: bool = True) -> Path:
    """Writes a random unquantized checkpoint (``weight [N, K]`` per linear) as one file.

    Args:
        out_dir: directory to write (created if missing).
        shape: model dimensions.
        dtype: dtype of every tensor and the config's ``torch_dtype``.
        seed: seeds every tensor together with its name.
        tokenizer: also write a byte-level tokenizer.

    Returns:
        The checkpoint directory.
    """
    return _write_checkpoint(out_dir, shape, None, dtype, seed, None, "cpu", tokenizer, None)


def write_tokenizer(out_dir: str | Path, vocab_size: int, *, model_max_length: int = 4096,
                    named_tokens: dict[str, int] | None = None) -> None:
    """Writes a byte-level BPE tokenizer of exactly ``vocab_size`` tokens.

    Ids 0-2 are ``<unk>``, ``<s>``, ``</s>``; then the 256 symbols of GPT-2's byte-level
    alphabet, so any text round-trips exactly; then ``<extra_i>`` fillers that encoding never
    produces. Encoding prepends ``<s>``. ``AutoTokenizer`` loads it offline.

    Args:
        out_dir: directory for ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json``.
        vocab_size: number of tokens, at least 259.
        model_max_length: written to ``tokenizer_config.json``.
        named_tokens: special tokens put in place of fillers at the given ids (e.g. a multimodal
            model's ``<|image_pad|>``), so a processor finds them.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    specials = ["<unk>", "<s>", "</s>"]
    symbols = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(symbols):
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer; "
                         f"need >= {len(symbols)}")
    names = {i: t for t, i in (named_tokens or {}).items()}
    if any(not len(symbols) <= i < vocab_size for i in names):
        raise ValueError(f"named_tokens ids must be in [{len(symbols)}, {vocab_size})")
    fillers = [names.get(i, f"<extra_{i}>") for i in range(len(symbols), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(symbols + fillers)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in [*specials, *names.values()]])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _write_json(out / "special_tokens_map.json", special_map)
    _write_json(out / "tokenizer_config.json", {**special_map, "tokenizer_class": "PreTrainedTokenizerFast",
                                                "model_max_length": model_max_length,
                                                "clean_up_tokenization_spaces": False})


def quantized_linear_tensors(prefix: str, in_features: int, out_features: int, qc: dict[str, Any],
                             seed: int = 0, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The quantized tensors (no bias) of one linear module as the quantizer named in ``qc`` writes them.

    For writers of other architectures (``tests/arch_checkpoints.py``): the same tensors, dtypes,
    packing and per-name seeding as :func:`write_awq_checkpoint` / :func:`write_gptq_checkpoint`.
    ``qc`` holds ``quant_method`` (awq/gptq), ``bits``, ``group_size`` and for GPTQ ``sym``,
    ``desc_act`` and ``checkpoint_format``; or a :func:`compressed_tensors_config`, whose scales are in
    ``dtype`` (llm-compressor keeps them in the model's dtype; AWQ/GPTQ scales are always fp16).
    """
    specs = [s for s in _linear_specs(prefix, in_features, out_features, False, qc, dtype)]
    return {s.name: _fill(s, _generator(seed, s.name, "cpu")) for s in specs}


def plan_shards(specs: list[Any], max_shard_bytes: int | None) -> tuple[list[str], list[list[Any]]]:
    """Shard file names and the specs (anything with ``nbytes``) each holds: greedy, in state-dict
    order, like transformers' ``save_pretrained``."""
    shards: list[list[Any]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and max_shard_bytes is not None and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    return names, shards
