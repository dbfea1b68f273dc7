"""Mixture-of-experts layers: the stacked Marlin expert tensors vLLM holds per rank.

vLLM serves AWQ (GEMM, zero points) and symmetric GPTQ (4/8-bit) experts through
``AutoAWQMoEMethod`` / ``AutoGPTQMoEMethod`` on the Marlin MoE backend (``--moe-backend
marlin``; also what ``auto`` picks on SM90 without the optional ``humming`` package). With
tensor parallelism and no expert parallelism every rank holds **all** experts and a slice of
each expert's intermediate size ``I``: ``I_r = I / tp`` rows of ``gate``/``up`` output and of
``down`` input. Per experts layer it keeps, stacked over experts ``E``:

- ``w13_qweight`` int32 ``[E, H/16, 2*Ip*bits/2]``: per expert the Marlin repack of
  ``[gate_r | up_r]`` (``[H, 2*Ip]`` codes), each shard zero-padded from ``I_r`` to ``Ip``;
- ``w2_qweight`` int32 ``[E, Ip/16, H*bits/2]``: the Marlin repack of ``down_r`` (``[Ip, H]``,
  rows zero-padded);
- ``w13_scales`` / ``w2_scales`` (serving dtype) ``[E, G13, 2*Ip]`` / ``[E, G2, H]``, padded like
  the weights and Marlin-permuted per expert;
- ``w13_qzeros`` / ``w2_qzeros`` int32 ``[E, G13, 2*Ip*bits/32]`` / ``[E, G2, H*bits/32]``: the
  checkpoint zero points in Marlin's zero-point layout, **for GPTQ too** (vLLM converts and
  keeps symmetric GPTQ's stored zero points although its kernel does not read them);
- no bias (the supported architectures have none; vLLM drops the never-loaded placeholders).

compressed-tensors pack-quantized experts (``CompressedTensorsWNA16MoEMethod``, llm-compressor's
W4A16 / W4A16_ASYM / W8A16) run the same Marlin post-processing on the same GPTQ-like codes
(packed along K, stored ``+2**(bits-1)``) under other names (:data:`CT_MOE_NAMES`):
``w13_weight_packed``, ``w2_weight_packed``, ``w13_weight_scale``, ``w2_weight_scale``, the zero
points ``w13_weight_zero_point`` / ``w2_weight_zero_point`` **only** for the asymmetric scheme,
and two more parameters vLLM keeps as loaded: ``w2_weight_shape`` / ``w13_weight_shape``
(serving dtype ``[E, 2]``, each expert's whole-model ``[N, K]`` of down / of gate-and-up).

``Ip`` is ``I_r`` rounded up to a multiple of ``lcm(64, group_size)``. The scale permutation
(64-column or 32-column "single") is chosen by ``group_size < size_k`` with vLLM's own
``size_k``: ``I_r`` for ``w13`` (not the hidden size, an upstream quirk kept for bit-identity),
``Ip`` for GPTQ's ``w2`` and ``I_r`` for AWQ's ``w2``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from marlin_pack.errors import SERVE_WITHOUT, UnsupportedCheckpointError
from marlin_pack.marlin.packed_codes import PackedCodes, cat_columns
from marlin_pack.marlin.repack import pack_marlin_zero_points, pad2d, permute_scales, unpack_cols
from marlin_pack.marlin.sharding import ModuleTensors
from marlin_pack.marlin.word_repack import marlin_weights
from marlin_pack.schemas import MoeLayerEntry, QuantScheme, SourceFormat

__all__ = [
    "MoeParamNames",
    "AUTO_MOE_NAMES",
    "CT_MOE_NAMES",
    "moe_param_names",
    "ExpertNaming",
    "MoeArchitecture",
    "expert_naming",
    "naming_paths",
    "MOE_ARCHITECTURES",
    "MoeRankShape",
    "ExpertTensors",
    "moe_padded_intermediate",
    "moe_rank_shape",
    "moe_tensor_specs",
    "moe_entry_shape",
    "moe_entry_specs",
    "moe_layer_entry",
    "build_moe_rank_tensors",
    "read_expert",
]

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]
_MARLIN_GROUPS = (-1, 32, 64, 128)


@dataclass(frozen=True)
class MoeParamNames:
    """The parameter names of an experts layer after vLLM's Marlin MoE post-processing, per quant method."""

    w13: str
    w2: str
    scales13: str
    scales2: str
    zeros13: str
    zeros2: str
    zeros_always: bool  # AWQ/GPTQ keep zero points even when symmetric; compressed-tensors only when asymmetric
    shapes: tuple[str, ...] = ()  # compressed-tensors' per-expert weight_shape parameters, in registration order

    def has_zeros(self, scheme: QuantScheme) -> bool:
        return self.zeros_always or scheme.zero_points


AUTO_MOE_NAMES = MoeParamNames("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros", True)
CT_MOE_NAMES = MoeParamNames("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale",
                             "w13_weight_zero_point", "w2_weight_zero_point", False, ("w2_weight_shape", "w13_weight_shape"))


def moe_param_names(fmt: SourceFormat | None = None) -> MoeParamNames:
    """The experts' parameter names for checkpoints of ``fmt`` (AWQ/GPTQ when None)."""
    return CT_MOE_NAMES if fmt is SourceFormat.compressed_tensors else AUTO_MOE_NAMES


@dataclass(frozen=True)
class ExpertNaming:
    """One way a checkpoint names an experts layer's modules: ``{block}.experts.{e}.{gate|up|down}``."""

    block: str  # checkpoint module of the sparse block under a decoder layer
    gate: str  # per-expert leaf names under f"{block}.experts.{e}"
    up: str
    down: str
    why: str = ""  # how vLLM loads it (docs)
    # The serving paths ("native", "transformers") whose model class loads this naming, where not every path of the
    # architecture's row does (None: all of them); a bundle made from it records them (``target.paths``)
    paths: frozenset[str] | None = None

    def expert(self, layers: str, layer: int, expert: int) -> str:
        return f"{layers}.{layer}.{self.block}.experts.{expert}"

    def describe(self) -> str:
        return f"{self.block}.experts.N.{{{self.gate},{self.up},{self.down}}}"

    def leaf_dims(self, hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
        """Each leaf's ``(input features, output features)``: gate and up map hidden to intermediate, down back."""
        return {self.gate: (hidden, intermediate), self.up: (hidden, intermediate), self.down: (intermediate, hidden)}


@dataclass(frozen=True)
class MoeArchitecture:
    """Where one architecture's routed experts live, in the checkpoint and in vLLM.

    ``namings``: every checkpoint naming vLLM's model class loads into its experts (its
    ``hf_to_vllm_mapper`` and the ``RoutedExperts`` expert mapping built from ``ckpt_names``), the
    one transformers writes first. ``refused``: namings real quantizers write that vLLM does not
    load, each with the reason (:func:`expert_naming` names it instead of calling the checkpoint
    incomplete).
    """

    name: str
    vllm_class: str
    namings: tuple[ExpertNaming, ...]
    num_experts_key: str
    intermediate_key: str
    vllm_experts: str  # vLLM's experts module under a decoder layer
    refused: tuple[tuple[ExpertNaming, str], ...] = ()

    def vllm_prefix(self, layers: str, layer: int) -> str:
        return f"{layers}.{layer}.{self.vllm_experts}"


_GATE_UP_DOWN = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj", "RoutedExperts' default ckpt_names")
_MIXTRAL_W = ExpertNaming("block_sparse_moe", "w1", "w3", "w2", "MixtralMoE's ckpt_names (w1, w2, w3)")
_MIXTRAL_PROJ = ExpertNaming("block_sparse_moe", "gate_proj", "up_proj", "down_proj",
                             "MixtralModel.hf_to_vllm_mapper renames .gate_proj./.up_proj./.down_proj. to .w1./.w3./.w2.")
_MLP_W = ExpertNaming("mlp", "w1", "w3", "w2")
# Olmoe: vLLM 0.34.0's Transformers backend (TransformersRoutedExperts) maps Mixtral's names as gate, up and down;
# olmoe.py (0.30.0-0.33.0) maps gate_proj/up_proj/down_proj only, and refuses such a checkpoint
_OLMOE_W = replace(_MLP_W, paths=frozenset({"transformers"}),
                   why="the Transformers backend's TransformersRoutedExperts; vLLM's olmoe.py maps gate_proj/up_proj/down_proj only")
_TF5_MIXTRAL = (
    "transformers 5's module names (GPTQModel 7 writes them); vLLM's MixtralForCausalLM loads "
    "block_sparse_moe.experts.N.{w1,w3,w2} or {gate_proj,up_proj,down_proj} (its hf_to_vllm_mapper renames the "
    "projections, not mlp to block_sparse_moe) and stock vLLM refuses this checkpoint; rename mlp. to "
    "block_sparse_moe. in the tensor names"
)
_W_NAMES = ("vLLM's {cls} loads experts as mlp.experts.N.{{gate_proj,up_proj,down_proj}} only (no mapping from "
            "w1/w3/w2); rename them to gate_proj/up_proj/down_proj")


def _qwen_like(name: str, vllm_class: str, num_experts_key: str) -> MoeArchitecture:
    cls = vllm_class.split(".")[-1]
    return MoeArchitecture(name, vllm_class, (_GATE_UP_DOWN,), num_experts_key, "moe_intermediate_size",
                           "mlp.experts.routed_experts", refused=((_MLP_W, _W_NAMES.format(cls=cls)),))


def _backend(name: str, num_experts_key: str, intermediate_key: str) -> MoeArchitecture:
    """An architecture every supported release serves through the Transformers backend: its experts module
    (``TransformersRoutedExperts``) maps both namings, ``gate_proj/up_proj/down_proj`` and Mixtral's ``w1/w3/w2``."""
    return MoeArchitecture(name, "transformers.TransformersMoEForCausalLM", (_GATE_UP_DOWN, _MLP_W), num_experts_key,
                           intermediate_key, "mlp.experts.routed_experts")


MOE_ARCHITECTURES: dict[str, MoeArchitecture] = {
    a.name: a
    for a in (
        MoeArchitecture("MixtralForCausalLM", "mixtral.MixtralForCausalLM", (_MIXTRAL_W, _MIXTRAL_PROJ),
                        "num_local_experts", "intermediate_size", "block_sparse_moe.experts.routed_experts",
                        refused=((ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"), _TF5_MIXTRAL),
                                 (ExpertNaming("mlp", "w1", "w3", "w2"), _TF5_MIXTRAL))),
        _qwen_like("Qwen3MoeForCausalLM", "qwen3_moe.Qwen3MoeForCausalLM", "num_experts"),
        # Qwen2-MoE's shared expert (mlp.shared_expert.*) is a dense MLP: ordinary Marlin linears.
        _qwen_like("Qwen2MoeForCausalLM", "qwen2_moe.Qwen2MoeForCausalLM", "num_experts"),
        # DeepSeek: only some decoder layers have routed experts (marlin.deepseek.sparse_layers); the
        # shared experts (mlp.shared_experts.*) are one dense MLP: ordinary Marlin linears.
        _qwen_like("DeepseekV2ForCausalLM", "deepseek_v2.DeepseekV2ForCausalLM", "n_routed_experts"),
        _qwen_like("DeepseekV3ForCausalLM", "deepseek_v2.DeepseekV3ForCausalLM", "n_routed_experts"),
        # Olmoe (olmoe.py, which maps gate_proj/up_proj/down_proj only; 0.34.0 the Transformers backend, which maps w1/w3/w2
        # too: such a bundle serves the backend only): the experts' width is intermediate_size
        MoeArchitecture("OlmoeForCausalLM", "olmoe.OlmoeForCausalLM", (_GATE_UP_DOWN, _OLMOE_W), "num_experts",
                        "intermediate_size", "mlp.experts.routed_experts"),
        # FlexOlmo and HunYuan-MoE (the backend): intermediate_size (HunYuan's shared expert, mlp.shared_mlp.*, too:
        # ordinary Marlin linears); Kolibri 1 and Mellum (the backend): moe_intermediate_size; Kolibri's shared expert
        # (mlp.shared_experts.*) and Mellum's dense layers (mlp.*) are ordinary Marlin linears
        _backend("FlexOlmoForCausalLM", "num_experts", "intermediate_size"),
        _backend("HunYuanMoEV1ForCausalLM", "num_experts", "intermediate_size"),
        _backend("Kolibri1ForCausalLM", "num_experts", "moe_intermediate_size"),
        _backend("MellumForCausalLM", "num_experts", "moe_intermediate_size"),
    )
}

# Fused expert tensors vLLM's RoutedExperts also maps (per expert experts.N.gate_up_proj / w13, or all
# experts stacked in experts.gate_up_proj): it splits them as unquantized [2I, H] weights, which an
# AWQ/GPTQ qweight is not.
_FUSED = ("gate_up_proj", "w13")


def expert_naming(arch: MoeArchitecture, names: Iterable[str], layers: str, layer: int) -> ExpertNaming:
    """The naming of decoder layer ``layer``'s experts in a checkpoint holding tensors ``names``.

    Raises:
        UnsupportedCheckpointError: a naming vLLM does not load (naming why), fused expert
            tensors, or more than one naming in one layer.
    """
    here = f"{layers}.{layer}."
    names = [t for t in names if t.startswith(here)]

    def present(n: ExpertNaming) -> bool:
        base = f"{here}{n.block}.experts."
        leaves = (f".{n.gate}.", f".{n.up}.", f".{n.down}.")
        return any(t.startswith(base) and any(leaf in t[len(base) - 1:] for leaf in leaves) for t in names)

    for block in dict.fromkeys(n.block for n in (*arch.namings, *(r for r, _ in arch.refused))):
        base = f"{layers}.{layer}.{block}.experts."
        fused = next((t for t in names if t.startswith(base) and any(f".{f}." in f"{t[len(base) - 1:]}." for f in _FUSED)),
                     None)
        if fused is not None:
            raise UnsupportedCheckpointError(
                f"{fused}: fused expert tensors (gate and up in one module) are not supported; vLLM splits them as "
                f"unquantized weights; marlin-pack converts one module per expert and projection ({arch.namings[0].describe()})"
            )
    found = [n for n in arch.namings if present(n)]
    if len(found) > 1:
        raise UnsupportedCheckpointError(
            f"decoder layer {layer} names its experts both {found[0].describe()} and {found[1].describe()}; "
            "expected one naming per layer: the checkpoint is inconsistent, restore it"
        )
    if found:
        return found[0]
    for n, why in arch.refused:
        if present(n):
            raise UnsupportedCheckpointError(f"{arch.name} checkpoint stores its experts as {n.describe()}: {why}")
    return arch.namings[0]  # nothing recognisable: the per-expert checks name the first missing tensor


def naming_paths(row_paths: frozenset[str], naming: ExpertNaming | None) -> tuple[str, ...] | None:
    """The serving paths a bundle whose experts the checkpoint names ``naming`` is for (``target.paths``), where fewer
    than its architecture row's ``row_paths`` (an Olmoe checkpoint of w1/w3/w2: the backend's only); None: all of them."""
    if naming is None or naming.paths is None or row_paths <= naming.paths:
        return None
    return tuple(sorted(row_paths & naming.paths))


def moe_padded_intermediate(i_part: int, group_size: int) -> int:
    """The per-rank intermediate size after Marlin MoE tile padding (a multiple of 64 and of the group)."""
    unit = math.lcm(64, group_size if group_size > 0 else 1)
    return -(-i_part // unit) * unit


@dataclass(frozen=True)
class MoeRankShape:
    """Per-rank shapes of one experts layer (identical on every rank of a TP set)."""

    num_experts: int
    hidden: int
    intermediate: int  # per expert, whole model
    tp: int
    i_part: int  # I / tp
    padded: int  # i_part after tile padding

    def groups(self, scheme: QuantScheme) -> tuple[int, int]:
        """Scale rows of w13 and w2."""
        g = scheme.group_size
        return (1, 1) if g == -1 else (self.hidden // g, self.padded // g)


def moe_rank_shape(num_experts: int, hidden: int, intermediate: int, tp: int, scheme: QuantScheme, awq: bool,
                   ct: bool = False) -> MoeRankShape:
    """The shapes of an experts layer at ``--tp tp``; refuses what vLLM would not run on Marlin MoE
    (``ct``: compressed-tensors experts, whose method refuses a group split across ranks outright)."""
    g = scheme.group_size
    if g not in _MARLIN_GROUPS:
        raise UnsupportedCheckpointError(f"experts: group_size {g} is not one of {_MARLIN_GROUPS} (Marlin MoE); {SERVE_WITHOUT}")
    if awq and g == -1:
        raise UnsupportedCheckpointError("experts: AWQ with group_size -1 cannot be loaded by vLLM's AutoAWQMoEMethod; "
                                         "quantize with group size 32, 64 or 128")
    if hidden % 128:
        raise UnsupportedCheckpointError(
            f"experts: hidden_size {hidden} is not a multiple of 128; vLLM's Marlin MoE refuses it; {SERVE_WITHOUT}"
        )
    if intermediate % tp:
        raise UnsupportedCheckpointError(
            f"experts: intermediate size {intermediate} is not divisible by --tp {tp}; choose a --tp that divides it"
        )
    i_part = intermediate // tp
    if g > 0 and i_part % g and ct:
        raise UnsupportedCheckpointError(
            f"experts: {i_part} intermediate features per rank at --tp {tp} split a quantization group of {g}; "
            "vLLM's CompressedTensorsWNA16MoEMethod refuses it, choose a smaller --tp"
        )
    if g > 0 and i_part % g:
        raise UnsupportedCheckpointError(
            f"experts: {i_part} intermediate features per rank at --tp {tp} split a quantization group of {g}; "
            "vLLM would use its MoeWNA16 kernels, not Marlin, choose a smaller --tp"
        )
    per_word = 8 if awq else 32 // scheme.bits
    if i_part % per_word:
        raise UnsupportedCheckpointError(
            f"experts: {i_part} intermediate features per rank are not a multiple of {per_word} (packing); choose another --tp"
        )
    return MoeRankShape(num_experts, hidden, intermediate, tp, i_part, moe_padded_intermediate(i_part, g))


def moe_tensor_specs(prefix: str, s: MoeRankShape, scheme: QuantScheme, dtype: torch.dtype,
                     fmt: SourceFormat | None = None) -> list[TensorSpec]:
    """Names, dtypes and shapes of one experts layer's tensors in a rank file, in vLLM's parameter order
    (names: :func:`moe_param_names` of ``fmt``)."""
    e, h, ip, b = s.num_experts, s.hidden, s.padded, scheme.bits
    g13, g2 = s.groups(scheme)
    pn = moe_param_names(fmt)
    specs = [
        (f"{prefix}.{pn.w13}", torch.int32, (e, h // 16, 2 * ip * b // 2)),
        (f"{prefix}.{pn.w2}", torch.int32, (e, ip // 16, h * b // 2)),
        (f"{prefix}.{pn.scales13}", dtype, (e, g13, 2 * ip)),
        (f"{prefix}.{pn.scales2}", dtype, (e, g2, h)),
    ]
    if pn.has_zeros(scheme):
        specs += [(f"{prefix}.{pn.zeros13}", torch.int32, (e, g13, 2 * ip * b // 32)),
                  (f"{prefix}.{pn.zeros2}", torch.int32, (e, g2, h * b // 32))]
    return specs + [(f"{prefix}.{name}", dtype, (e, 2)) for name in pn.shapes]


def moe_layer_entry(name: str, s: MoeRankShape) -> MoeLayerEntry:
    """The manifest's record of one experts layer at one TP size."""
    return MoeLayerEntry(name=name, num_experts=s.num_experts, hidden_size=s.hidden, intermediate_size=s.i_part,
                         padded_intermediate=s.padded)


def moe_entry_shape(entry: MoeLayerEntry, tp: int) -> MoeRankShape:
    """The rank shape a manifest entry records (the inverse of :func:`moe_layer_entry`)."""
    return MoeRankShape(entry.num_experts, entry.hidden_size, entry.intermediate_size * tp, tp, entry.intermediate_size,
                        entry.padded_intermediate)


def moe_entry_specs(entry: MoeLayerEntry, scheme: QuantScheme, dtype: torch.dtype,
                    fmt: SourceFormat | None = None) -> list[TensorSpec]:
    """Names, dtypes and shapes of a manifest experts layer's tensors (TP size does not change them)."""
    return moe_tensor_specs(entry.name, moe_entry_shape(entry, 1), scheme, dtype, fmt)


@dataclass
class ExpertTensors:
    """One expert's three checkpoint modules in canonical form (``zeros``: uint8 ``[G, N]``, required but for
    symmetric compressed-tensors; ``weight_shape``: compressed-tensors only)."""

    gate: ModuleTensors
    up: ModuleTensors
    down: ModuleTensors


def _pad_code_cols(codes: PackedCodes, n: int) -> PackedCodes:
    rows = codes.words.shape[0]
    cols = n // codes.per_word if codes.along == "n" else n
    return PackedCodes(pad2d(codes.words, rows, cols), codes.bits, codes.along, codes.slots)


def _shard_cols(m: ModuleTensors, s: MoeRankShape, rank: int) -> tuple[PackedCodes, torch.Tensor, torch.Tensor | None]:
    """gate or up: this rank's output columns, zero-padded to ``s.padded`` (zero points None when there are none)."""
    n0, n = rank * s.i_part, s.i_part
    codes = _pad_code_cols(m.codes.block(0, m.codes.shape[0], n0, n), s.padded)
    scales = pad2d(m.scales[:, n0 : n0 + n], m.scales.shape[0], s.padded)
    zeros = None if m.zeros is None else pad2d(m.zeros[:, n0 : n0 + n], m.zeros.shape[0], s.padded)
    return codes, scales, zeros


def _into(dst: torch.Tensor, result: torch.Tensor) -> None:
    """``dst[...] = result`` unless the repack already wrote ``dst`` itself."""
    if result.data_ptr() != dst.data_ptr():
        dst.copy_(result)


def build_moe_rank_tensors(prefix: str, s: MoeRankShape, scheme: QuantScheme, dtype: torch.dtype, rank: int,
                           experts: Iterable[ExpertTensors], awq: bool,
                           empty: Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor] | None = None,
                           fmt: SourceFormat | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one experts layer on rank ``rank``, expert by expert (names: :func:`moe_tensor_specs`).

    ``empty(name, dtype, shape)``: the memory to build each stacked tensor in (a writer's recycled
    buffer, or device memory on the experts' device); None for fresh CPU memory. ``fmt``: the
    source format (compressed-tensors: its names, zero points only when asymmetric, and the
    ``weight_shape`` parameters, each expert's stored ``[N, K]`` cast to ``dtype`` as vLLM's loader does).
    """
    specs = moe_tensor_specs(prefix, s, scheme, dtype, fmt)
    pn = moe_param_names(fmt)
    zeros = pn.has_zeros(scheme)
    out = {name: empty(name, dt, shape) if empty else torch.empty(shape, dtype=dt) for name, dt, shape in specs}
    g, b = scheme.group_size, scheme.bits
    _, g2 = s.groups(scheme)
    w2_size_k = s.i_part if awq else s.padded  # vLLM's size_k for the w2 scale permutation
    slots = None
    n_experts = 0
    for e, ex in enumerate(experts):
        if e >= s.num_experts:
            raise UnsupportedCheckpointError(f"{prefix}: more than {s.num_experts} experts")
        gate, up = _shard_cols(ex.gate, s, rank), _shard_cols(ex.up, s, rank)
        slots = ex.gate.column_slots
        codes13 = cat_columns([gate[0], up[0]])
        w13 = out[f"{prefix}.{pn.w13}"][e]
        _into(w13, marlin_weights(codes13, s.hidden, 2 * s.padded, w13 if w13.device == codes13.words.device else None))
        scales13 = torch.cat([gate[1], up[1]], 1).to(dtype)
        out[f"{prefix}.{pn.scales13}"][e] = permute_scales(scales13, g, s.i_part)
        if zeros:
            zeros13 = torch.cat([gate[2], up[2]], 1)
            out[f"{prefix}.{pn.zeros13}"][e] = pack_marlin_zero_points(zeros13, b, slots)

        down, k0, k = ex.down, rank * s.i_part, s.i_part
        codes2 = down.codes.block(k0, k, 0, s.hidden)
        w2 = out[f"{prefix}.{pn.w2}"][e]
        _into(w2, marlin_weights(codes2, s.padded, s.hidden, w2 if w2.device == codes2.words.device else None))
        rows = slice(None) if g == -1 else slice(k0 // g, (k0 + k) // g)
        scales2 = pad2d(down.scales[rows], g2, s.hidden).to(dtype)
        out[f"{prefix}.{pn.scales2}"][e] = permute_scales(scales2, g, w2_size_k)
        if zeros:
            assert down.zeros is not None
            out[f"{prefix}.{pn.zeros2}"][e] = pack_marlin_zero_points(pad2d(down.zeros[rows], g2, s.hidden), b, down.column_slots)
        if pn.shapes:  # compressed-tensors: w2's, then w13's (gate's equals up's: the reader checked both)
            for name, module in zip(pn.shapes, (down, ex.up), strict=True):
                assert module.weight_shape is not None
                out[f"{prefix}.{name}"][e] = module.weight_shape  # vLLM's loader assigns the stored int64 [N, K]
        n_experts += 1
    if n_experts != s.num_experts:
        raise UnsupportedCheckpointError(f"{prefix}: {n_experts} experts read, expected {s.num_experts}")
    return out


def read_expert(source: Any, ckpt: Any, naming: ExpertNaming, prefix: str, hidden: int, intermediate: int,
                device: torch.device) -> ExpertTensors:
    """One expert's gate/up/down through the format's reader (its checks included), with zero points.

    ``naming``: the checkpoint's names of the expert's leaves.

    GPTQ readers drop ``qzeros`` (dense Marlin ignores them); vLLM's MoE path keeps them in
    Marlin layout, so they are unpacked here (the reader has already checked they are the
    symmetric constant).
    """
    dims = naming.leaf_dims(hidden, intermediate)
    mods = {}
    for leaf, (k, n) in dims.items():
        name = f"{prefix}.{leaf}"
        source.validate(ckpt, name, k, n)
        m = source.read(ckpt, name, k, n, device)
        if m.bias is not None:
            raise UnsupportedCheckpointError(f"{name}.bias: expert biases are not supported; {SERVE_WITHOUT}")
        if source.format is SourceFormat.gptq_v1:
            m.zeros = unpack_cols(ckpt.get(f"{name}.qzeros").to(device), source.bits)
        mods[leaf] = m
    return ExpertTensors(mods[naming.gate], mods[naming.up], mods[naming.down])
