"""Which layers vLLM fuses, and how it splits each across tensor-parallel ranks.

This mirrors, for the supported decoder architectures, what vLLM 0.33.0's
``QKVParallelLinear``, ``MergedColumnParallelLinear`` and ``RowParallelLinear`` load on
each rank, and where ``MarlinLinearKernel`` refuses a shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.repack import padded_nk
from marlin_pack.schemas import LayerEntry, LayerKind, LayerPart

if TYPE_CHECKING:
    import torch

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
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a dense decoder that decide its layers' shapes, from ``config.json``."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int


@dataclass(frozen=True)
class PartSpec:
    """One checkpoint module, e.g. ``model.layers.0.self_attn.k_proj``: full shape."""

    name: str  # short name: q_proj, k_proj, ...
    prefix: str
    size_k: int
    size_n: int


@dataclass(frozen=True)
class LayerSpec:
    """One vLLM layer (after fusion) and the checkpoint modules it is made of."""

    name: str
    kind: LayerKind
    parts: tuple[PartSpec, ...]


@dataclass
class ModuleTensors:
    """One checkpoint linear module in canonical form (natural ``[K, N]`` order).

    ``codes`` are unsigned weights (uint8); ``zeros`` the unsigned zero points (AWQ)
    or None; ``scales`` and ``bias`` as stored in the checkpoint. When ``column_slots``
    is set, the columns of ``codes`` and ``zeros`` are in that order within each aligned
    8 (AWQ's packing order, left in place to save a pass; see ``repack.AWQ_SLOTS``).
    Source readers (``marlin_pack.sources``) produce it; :func:`fuse_rank_slices` consumes it.
    """

    codes: torch.Tensor  # [K, N] uint8
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor | None  # [G, N] uint8
    bias: torch.Tensor | None  # [N]
    column_slots: tuple[int, ...] | None = None


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
        raise UnsupportedCheckpointError(f"config.json {key} is {value!r}, expected a positive integer")
    if value > _MAX_CONFIG_DIM:
        raise UnsupportedCheckpointError(f"config.json {key} is {value}, expected at most {_MAX_CONFIG_DIM}; the config is corrupt")
    return value


def model_dims(config: dict) -> ModelDims:
    """Dimensions of a supported dense decoder from ``config.json``."""
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if any(config.get(k) for k in _MOE_KEYS):
        raise UnsupportedCheckpointError(
            f"{arch or 'this model'} is a mixture-of-experts model; marlin-pack converts dense models only"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"architecture is {arch!r}, expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    head_dim = _int(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
    return ModelDims(
        architecture=arch,
        model_type=str(config.get("model_type", "")),
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads,
        head_dim=int(head_dim),
        num_layers=_int(config, "num_hidden_layers"),
    )


def layer_specs(d: ModelDims, layer: int) -> list[LayerSpec]:
    """The four fused linear layers of decoder layer ``layer``, in vLLM's names."""
    attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    h, i = d.hidden_size, d.intermediate_size
    return [
        LayerSpec(f"{attn}.qkv_proj", LayerKind.qkv, (
            PartSpec("q_proj", f"{attn}.q_proj", h, q),
            PartSpec("k_proj", f"{attn}.k_proj", h, kv),
            PartSpec("v_proj", f"{attn}.v_proj", h, kv),
        )),
        LayerSpec(f"{attn}.o_proj", LayerKind.row, (PartSpec("o_proj", f"{attn}.o_proj", q, h),)),
        LayerSpec(f"{mlp}.gate_up_proj", LayerKind.merged_column, (
            PartSpec("gate_proj", f"{mlp}.gate_proj", h, i),
            PartSpec("up_proj", f"{mlp}.up_proj", h, i),
        )),
        LayerSpec(f"{mlp}.down_proj", LayerKind.row, (PartSpec("down_proj", f"{mlp}.down_proj", i, h),)),
    ]


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
    out = []
    for p in spec.parts:
        if spec.kind is LayerKind.qkv and p.name != "q_proj":
            reps = kv_replicas(d, tp)
            heads = max(1, d.num_kv_heads // tp)
            shard = rank // reps if reps > 1 else rank
            n = heads * d.head_dim
            out.append(RankSlice(p, 0, p.size_k, shard * n, n))
        else:
            n = _divide(p.size_n, tp, f"{p.prefix} output features")
            out.append(RankSlice(p, 0, p.size_k, rank * n, n))
    return out


def layer_entry(spec: LayerSpec, d: ModelDims, tp: int, group_size: int, awq: bool, has_bias: bool) -> LayerEntry:
    """Per-rank shapes of a layer; refuses shards Marlin in vLLM 0.33.0 would not take."""
    slices = rank_slices(spec, d, tp, 0)
    size_k = slices[0].k
    size_n = sum(s.n for s in slices)
    full_k = slices[0].part.size_k
    if group_size != -1 and group_size < full_k and size_k % group_size:
        raise UnsupportedCheckpointError(
            f"{spec.name}: {size_k} input features per rank at --tp {tp} split a quantization group of {group_size}; "
            "vLLM 0.33.0 cannot serve this layer with Marlin, choose a smaller --tp"
        )
    if spec.kind is LayerKind.row and tp > 1 and (group_size >= full_k or (group_size == -1 and awq)):
        raise UnsupportedCheckpointError(
            f"{spec.name}: group_size {group_size} leaves no whole group per rank at --tp {tp} "
            f"(vLLM 0.33.0 allocates zero scale rows there); use --tp 1"
        )
    if spec.kind is LayerKind.row and size_k % 8:
        raise UnsupportedCheckpointError(f"{spec.name}: {size_k} input features per rank are not a multiple of 8; choose another --tp")
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


FusedSlices = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None", "torch.Tensor | None"]


def fuse_rank_slices(slices: list[RankSlice], parts: dict[str, ModuleTensors], group_size: int) -> FusedSlices:
    """One rank's ``(codes, scales, zeros, bias)`` of a fused layer: its slices concatenated along N."""
    import torch

    def rows(t: torch.Tensor, s: RankSlice) -> torch.Tensor:  # scale/zero rows of a K slice
        return t if group_size == -1 else t[s.k0 // group_size : (s.k0 + s.k) // group_size]

    codes = torch.cat([parts[s.part.name].codes[s.k0 : s.k0 + s.k, s.n0 : s.n0 + s.n] for s in slices], 1)
    scales = torch.cat([rows(parts[s.part.name].scales, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)
    zeros = None
    if parts[slices[0].part.name].zeros is not None:
        zeros = torch.cat([rows(parts[s.part.name].zeros, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)  # type: ignore[arg-type]
    bias = None
    if parts[slices[0].part.name].bias is not None:
        bias = torch.cat([parts[s.part.name].bias[s.n0 : s.n0 + s.n] for s in slices])  # type: ignore[index]
    return codes, scales, zeros, bias
