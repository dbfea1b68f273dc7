"""Which layers vLLM fuses, and how it splits each across tensor-parallel ranks.

This mirrors, for the architectures of :mod:`marlin_pack.marlin.architectures`, what vLLM
0.33.0's ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear`` and
``RowParallelLinear`` load on each rank, and where ``MarlinLinearKernel`` refuses a shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from marlin_pack.errors import RESTORE_CONFIG, SERVE_WITHOUT, UnsupportedCheckpointError
from marlin_pack.marlin.architectures import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    UNSUPPORTED_ARCHITECTURES,
    Architecture,
    Linear,
    architecture_for,
    config_architecture,
)
from marlin_pack.marlin.hf_config import language_config, top_config
from marlin_pack.marlin.repack import padded_nk
from marlin_pack.schemas import LayerEntry, LayerKind, LayerPart

if TYPE_CHECKING:
    import torch

    from marlin_pack.marlin.packed_codes import ColumnParts, PackedCodes

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelDims",
    "PartSpec",
    "LayerSpec",
    "RankSlice",
    "ModuleTensors",
    "model_dims",
    "layer_specs",
    "kv_replicas",
    "rank_slices",
    "fuse_rank_slices",
    "layer_entry",
    "read_layer_parts",
    "checkpoint_modules",
    "vllm_part_names",
]

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a dense decoder that decide its layers' shapes, from ``config.json``."""

    architecture: str
    model_type: str
    arch: Architecture
    checkpoint_layers: str  # prefix of decoder layer i in the checkpoint: f"{checkpoint_layers}.{i}"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    tie_word_embeddings: bool = False
    # More size symbols (DeepSeek's MLA: marlin.deepseek.mla_sizes) and, when the layers differ,
    # each decoder layer's linears (empty: every layer has arch.linears).
    sizes: Mapping[str, int] = field(default_factory=dict)
    layer_linears: tuple[tuple[Linear, ...], ...] = ()
    # Checkpoint prefixes vLLM's model never loads (DeepSeek-V3's multi-token-prediction layers).
    skipped_prefixes: tuple[str, ...] = ()

    def linears(self, layer: int) -> tuple[Linear, ...]:
        """The quantized linears of decoder layer ``layer``."""
        return self.layer_linears[layer] if self.layer_linears else self.arch.linears


@dataclass(frozen=True)
class PartSpec:
    """One part of a fused layer: full shape, and where it is in the checkpoint.

    Usually a whole checkpoint module (``model.layers.0.self_attn.k_proj``); for modules the
    checkpoint stores fused (Phi-3's ``qkv_proj``) the output columns
    ``[offset, offset + size_n)`` of a module with ``module_n`` outputs.
    """

    name: str  # manifest name: the module's leaf (k_proj), or module[role] for a fused module (qkv_proj[k])
    role: str  # q / k / v / gate / up / out
    prefix: str  # checkpoint module
    size_k: int
    size_n: int
    offset: int = 0
    module_n: int = 0  # 0: size_n (the part is the whole module)

    @property
    def module_size_n(self) -> int:
        return self.module_n or self.size_n


@dataclass(frozen=True)
class LayerSpec:
    """One vLLM layer (after fusion) and the checkpoint modules it is made of."""

    name: str
    kind: LayerKind
    parts: tuple[PartSpec, ...]


@dataclass
class ModuleTensors:
    """One checkpoint linear module in canonical form (``[K, N]``: input rows, output columns).

    ``codes`` are the unsigned weights, still in the checkpoint's int32 words (see
    :class:`~marlin_pack.marlin.packed_codes.PackedCodes`); ``zeros`` the unsigned zero points
    (uint8) or None; ``scales`` and ``bias`` as stored in the checkpoint. When ``column_slots``
    is set, the columns of ``zeros`` are in that order within each aligned 8 (AWQ's packing
    order, left in place to save a pass; see ``repack.AWQ_SLOTS``).
    Source readers (``marlin_pack.sources``) produce it; :func:`fuse_rank_slices` consumes it.
    """

    codes: PackedCodes  # [K, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor | None  # [G, N] uint8
    bias: torch.Tensor | None  # [N]
    column_slots: tuple[int, ...] | None = None
    # compressed-tensors' weight_shape as stored (vLLM keeps it as a parameter); None for other formats.
    weight_shape: torch.Tensor | None = None

    def columns(self, n0: int, n: int, where: str) -> ModuleTensors:
        """Output columns ``[n0, n0 + n)``: one part of a module the checkpoint stores fused."""
        if self.column_slots is not None and (n0 % 8 or n % 8):
            raise UnsupportedCheckpointError(
                f"{where}: a fused part starts at column {n0} with {n} columns, not whole 8-column AWQ words; "
                "vLLM cannot split this module either"
            )
        return ModuleTensors(
            codes=self.codes.block(0, self.codes.shape[0], n0, n),
            scales=self.scales[:, n0 : n0 + n],
            zeros=None if self.zeros is None else self.zeros[:, n0 : n0 + n],
            bias=None if self.bias is None else self.bias[n0 : n0 + n],
            column_slots=self.column_slots,
            weight_shape=self.weight_shape,
        )


@dataclass(frozen=True)
class RankSlice:
    """What one rank holds of one part: input rows ``[k0, k0+k)`` and output columns ``[n0, n0+n)``."""

    part: PartSpec
    k0: int
    k: int
    n0: int
    n: int


# Far above any real model's dimension, far below what would make planning loop for hours.
_MAX_CONFIG_DIM = 1 << 24


def _int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedCheckpointError(
            f"config.json {key} is {value!r}, expected a positive integer; {RESTORE_CONFIG}"
        )
    if value > _MAX_CONFIG_DIM:
        raise UnsupportedCheckpointError(
            f"config.json {key} is {value}, expected at most {_MAX_CONFIG_DIM}; the config is corrupt, restore it"
        )
    return value


def _checkpoint_layers(arch: Architecture, tensor_names: Iterable[str]) -> str:
    """Which of the architecture's accepted checkpoint prefixes this checkpoint uses."""
    names = list(tensor_names)
    for prefix in arch.checkpoint_layers:
        if any(n.startswith(f"{prefix}.0.") for n in names):
            return prefix
    return arch.checkpoint_layers[0]


def model_dims(config: dict, tensor_names: Iterable[str] = ()) -> ModelDims:
    """Dimensions of a supported dense decoder from ``config.json`` read as vLLM reads it (through the
    config class of its model type, :func:`~marlin_pack.marlin.hf_config.language_config`), and the
    checkpoint's tensor names, which say where its decoder layers are."""
    name = config_architecture(config)
    arch = architecture_for(name)
    if name in UNSUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(f"architecture is {name!r}: {UNSUPPORTED_ARCHITECTURES[name]}; {SERVE_WITHOUT}")
    text = language_config(config) if arch and arch.text_config else top_config(config)
    if (arch is None or not arch.moe) and any(text.get(k) or config.get(k) for k in _MOE_KEYS):
        moe = ", ".join(a.name for a in ARCHITECTURES.values() if a.moe)
        raise UnsupportedCheckpointError(
            f"{name or 'this model'} is a mixture-of-experts model marlin-pack does not convert; "
            f"its mixture-of-experts architectures are {moe}"
        )
    if arch is None:
        raise UnsupportedCheckpointError(
            f"architecture is {name!r}, expected one of {', '.join(SUPPORTED_ARCHITECTURES)}; {SERVE_WITHOUT}"
        )
    from marlin_pack.marlin.transformers_backend import config_problem

    problem = config_problem(arch.name, text)
    if problem is not None:
        raise UnsupportedCheckpointError(problem)
    cfg = {k: v for k, v in text.items() if v is not None}
    if "vocab_size" in cfg:  # vLLM sizes the embeddings and lm_head by it (absent: transformers' default)
        _int(cfg, "vocab_size")
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    # hidden / heads is what vLLM computes without config.head_dim (Qwen2 and InternLM2 always do)
    head_dim = hidden // heads if arch.head_dim == "derived" or cfg.get("head_dim") is None else _int(cfg, "head_dim")
    layers = _checkpoint_layers(arch, tensor_names)
    mla = _mla_dims(text, arch, heads, _int(cfg, "num_hidden_layers"), layers) if arch.mla is not None else {}
    if arch.mlp_layer_types is not None:  # Mellum: a dense layer's MLP after the attention, a sparse one's experts
        n = _int(cfg, "num_hidden_layers")
        sparse = set(arch.mlp_layer_types.sparse_layers(text, arch.name, n))
        mla = {"layer_linears": tuple(arch.linears if i in sparse else (*arch.linears, *arch.mlp_layer_types.dense)
                                      for i in range(n))}
    return ModelDims(
        architecture=name,
        model_type=str(text.get("model_type") or config.get("model_type", "")),
        arch=arch,
        checkpoint_layers=layers,
        hidden_size=hidden,
        intermediate_size=_int(cfg, arch.intermediate_key),
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads,
        head_dim=int(head_dim),
        num_layers=_int(cfg, "num_hidden_layers"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        **mla,
    )


def _mla_dims(config: dict, arch: Architecture, heads: int, num_layers: int, checkpoint_layers: str) -> dict:
    """DeepSeek's ModelDims fields: size symbols, per-layer linears, skipped MTP layers (``marlin.deepseek``)."""
    from marlin_pack.marlin import deepseek

    deepseek.check_config(config, arch)
    sparse = set(deepseek.sparse_layers(config, arch, num_layers))
    return {
        "sizes": deepseek.mla_sizes(config, arch, heads),
        "layer_linears": tuple(deepseek.decoder_linears(config, arch, i, i in sparse) for i in range(num_layers)),
        "skipped_prefixes": deepseek.spec_layer_prefixes(config, arch, checkpoint_layers),
    }


def layer_specs(d: ModelDims, layer: int) -> list[LayerSpec]:
    """The quantized vLLM layers of decoder layer ``layer``, in vLLM's names, from the architecture table."""
    sizes = {
        "h": d.hidden_size,
        "i": d.intermediate_size,
        "q": d.num_heads * d.head_dim,
        "kv": d.num_kv_heads * d.head_dim,
        "qkv": (d.num_heads + 2 * d.num_kv_heads) * d.head_dim,  # one projection of q, k and v (GPT-NeoX)
        "2i": 2 * d.intermediate_size,  # gate and up in one projection the model chunks (Glm)
        **d.sizes,
    }
    checkpoint, vllm = f"{d.checkpoint_layers}.{layer}", f"{d.arch.layers}.{layer}"
    specs = []
    for lin in d.linears(layer):
        fused = len(lin.parts) > 1 and len({p.module for p in lin.parts}) == 1  # stored fused in the checkpoint
        module_n = sum(sizes[p.size] for p in lin.parts) if fused else 0
        parts, offset = [], 0
        for p in lin.parts:
            leaf = p.module.rsplit(".", 1)[-1]
            n = sizes[p.size]
            parts.append(PartSpec(
                name=f"{leaf}[{p.role}]" if fused else leaf,
                role=p.role,
                prefix=f"{checkpoint}.{p.module}",
                size_k=sizes[lin.input],
                size_n=n,
                offset=offset if fused else 0,
                module_n=module_n,
            ))
            offset += n
        specs.append(LayerSpec(f"{vllm}.{lin.name}", lin.kind, tuple(parts)))
    return specs


def vllm_part_names(spec: LayerSpec) -> tuple[str, ...]:
    """vLLM's names of the parts it fuses into ``spec`` (``...qkv_proj`` -> ``...q_proj``, ...), as its
    ``packed_modules_mapping`` spells them; empty for a layer read from one checkpoint module."""
    leaves = list(dict.fromkeys(p.prefix.rsplit(".", 1)[-1] for p in spec.parts))
    if len(leaves) < 2:
        return ()
    head = spec.name.rsplit(".", 1)[0]
    return tuple(f"{head}.{leaf}" for leaf in leaves)


def checkpoint_modules(spec: LayerSpec) -> list[PartSpec]:
    """The distinct checkpoint modules of a layer (one per part, or one for a module stored fused),
    each as a PartSpec of the whole module."""
    seen: dict[str, PartSpec] = {}
    for p in spec.parts:
        if p.prefix not in seen:
            seen[p.prefix] = PartSpec(p.prefix.rsplit(".", 1)[-1], p.role, p.prefix, p.size_k, p.module_size_n)
    return list(seen.values())


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise UnsupportedCheckpointError(f"{what} ({a}) is not divisible by tensor-parallel size {b}; choose another --tp")
    return a // b


def kv_replicas(d: ModelDims, tp: int) -> int:
    """How many ranks share one KV head (1 when heads are split, not replicated)."""
    if tp >= d.num_kv_heads:
        if tp % d.num_kv_heads:
            raise UnsupportedCheckpointError(
                f"--tp {tp} is not a multiple of num_key_value_heads ({d.num_kv_heads}); "
                "vLLM cannot replicate KV heads that way, choose another --tp"
            )
        return tp // d.num_kv_heads
    _divide(d.num_kv_heads, tp, "num_key_value_heads")
    return 1


def rank_slices(spec: LayerSpec, d: ModelDims, tp: int, rank: int) -> list[RankSlice]:
    """Per-part slices rank ``rank`` of ``tp`` holds, in fused output order."""
    if spec.kind is LayerKind.row:
        (p,) = spec.parts
        k = _divide(p.size_k, tp, f"{spec.name} input features")
        return [RankSlice(p, rank * k, k, 0, p.size_n)]
    if spec.kind is LayerKind.replicated:  # every rank holds the whole layer
        return [RankSlice(p, 0, p.size_k, 0, p.size_n) for p in spec.parts]
    out = []
    for p in spec.parts:
        if spec.kind is LayerKind.qkv and p.role in ("k", "v"):
            reps = kv_replicas(d, tp)
            heads = max(1, d.num_kv_heads // tp)
            shard = rank // reps if reps > 1 else rank
            n = heads * d.head_dim
            out.append(RankSlice(p, 0, p.size_k, shard * n, n))
        else:
            n = _divide(p.size_n, tp, f"{p.prefix} output features")
            out.append(RankSlice(p, 0, p.size_k, rank * n, n))
    return out


def layer_entry(spec: LayerSpec, d: ModelDims, tp: int, group_size: int, awq: bool, has_bias: bool, bits: int = 4) -> LayerEntry:
    """Per-rank shapes of a layer; refuses shards Marlin in vLLM would not take."""
    if d.arch.mla is not None:
        from marlin_pack.marlin.deepseek import check_tp

        check_tp(d.num_heads, tp, d.arch)
    slices = rank_slices(spec, d, tp, 0)
    size_k = slices[0].k
    size_n = sum(s.n for s in slices)
    full_k = slices[0].part.size_k
    if group_size != -1 and group_size < full_k and size_k % group_size:
        raise UnsupportedCheckpointError(
            f"{spec.name}: {size_k} input features per rank at --tp {tp} split a quantization group of {group_size}; "
            "vLLM cannot serve this layer with Marlin, choose a smaller --tp"
        )
    if spec.kind is LayerKind.row and tp > 1 and (group_size >= full_k or (group_size == -1 and awq)):
        raise UnsupportedCheckpointError(
            f"{spec.name}: group_size {group_size} leaves no whole group per rank at --tp {tp} "
            f"(vLLM allocates zero scale rows there); use --tp 1"
        )
    per_word = 32 // bits  # vLLM packs (or, for AWQ, repacks) input rows this many per int32
    if spec.kind is LayerKind.row and size_k % per_word:
        raise UnsupportedCheckpointError(
            f"{spec.name}: {size_k} input features per rank are not a multiple of {per_word} ({bits}-bit packing); choose another --tp"
        )
    padded_n, padded_k = padded_nk(size_n, size_k, group_size)
    return LayerEntry(
        name=spec.name,
        kind=spec.kind,
        size_k=size_k,
        size_n=size_n,
        padded_k=padded_k,
        padded_n=padded_n,
        parts=[LayerPart(name=s.part.name, size=s.n) for s in slices],
        kv_replicas=kv_replicas(d, tp) if spec.kind is LayerKind.qkv else 1,
        has_bias=has_bias,
    )


FusedSlices = tuple["PackedCodes | ColumnParts", "torch.Tensor", "torch.Tensor | None", "torch.Tensor | None"]


def fuse_rank_slices(slices: list[RankSlice], parts: dict[str, ModuleTensors], group_size: int, lazy: bool = False) -> FusedSlices:
    """One rank's ``(codes, scales, zeros, bias)`` of a fused layer: its slices concatenated along N.

    ``lazy``: the codes stay views of the parts, side by side (:class:`~marlin_pack.marlin.packed_codes.ColumnParts`,
    see :func:`~marlin_pack.marlin.packed_codes.cat_columns`): for a converter that repacks each result at once.
    """
    import torch

    from marlin_pack.marlin.packed_codes import cat_columns

    def rows(t: torch.Tensor, s: RankSlice) -> torch.Tensor:  # scale/zero rows of a K slice
        return t if group_size == -1 else t[s.k0 // group_size : (s.k0 + s.k) // group_size]

    codes = cat_columns([parts[s.part.name].codes.block(s.k0, s.k, s.n0, s.n) for s in slices], lazy)
    scales = torch.cat([rows(parts[s.part.name].scales, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)
    zeros = None
    if parts[slices[0].part.name].zeros is not None:
        zeros = torch.cat([rows(parts[s.part.name].zeros, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)  # type: ignore[arg-type]
    bias = None
    if parts[slices[0].part.name].bias is not None:
        bias = torch.cat([parts[s.part.name].bias[s.n0 : s.n0 + s.n] for s in slices])  # type: ignore[index]
    return codes, scales, zeros, bias


ReadModule = Callable[[str, int, int], ModuleTensors]


def read_layer_parts(spec: LayerSpec, read: ReadModule) -> dict[str, ModuleTensors]:
    """Every part of a layer, by part name, reading each checkpoint module once.

    ``read(prefix, size_k, size_n)`` reads one whole checkpoint module; parts of a module stored
    fused are its column blocks.
    """
    modules = {m.prefix: read(m.prefix, m.size_k, m.size_n) for m in checkpoint_modules(spec)}
    return {
        p.name: modules[p.prefix].columns(p.offset, p.size_n, p.prefix) if p.module_n else modules[p.prefix]
        for p in spec.parts
    }
