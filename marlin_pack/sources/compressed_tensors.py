"""compressed-tensors (llm-compressor) ``pack-quantized`` checkpoints: weight-only integer (WNA16) schemes.

Per linear: ``weight_packed`` int32 ``[N, K/P]`` packed along K (value ``i`` of a word at bits
``bits*i``, stored ``+2**(bits-1)``, so codes read like GPTQ's), ``weight_scale`` ``[N, G]``,
``weight_shape`` ``[2]`` (the unpacked ``[N, K]``) and, for asymmetric schemes,
``weight_zero_point`` int32 ``[N/P, G]`` packed along N (also stored ``+2**(bits-1)``).
vLLM serves them with ``CompressedTensorsWNA16`` through ``choose_mp_linear_kernel``;
on Marlin: 4-bit symmetric (uint4b8), 8-bit symmetric (uint8b128), 4-bit with zero points
(uint4), group sizes -1 (channel), 32, 64, 128; ``actorder`` group/dynamic is refused by vLLM.
"""

from __future__ import annotations

import re

import torch

from marlin_pack.errors import SERVE_WITHOUT, CheckpointError, UnsupportedCheckpointError
from marlin_pack.marlin.packed_codes import PackedCodes
from marlin_pack.schemas import CompressedTensorsSettings, CompressedTensorsWeights, QuantScheme, SourceFormat, WeightType
from marlin_pack.sources.base import ModuleTensors
from marlin_pack.sources.checkpoint import Checkpoint
from marlin_pack.sources.expect import check_group_size, check_regex, expect, expect_scales, num_groups

__all__ = ["CompressedTensorsSource", "unpack_ct", "FUSED_SHARDS"]

# vLLM's fused layers and their checkpoint shards (the models' packed_modules_mapping).
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PACK_FORMAT = "pack-quantized"


def unpack_ct(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' ``unpack_from_int32`` without the signed shift: unsigned codes (uint8), ``dim`` unpacked."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if dim == 1:
        vals = (packed.unsqueeze(-1) >> shifts) & mask  # [R, C, per]
        return vals.reshape(packed.shape[0], packed.shape[1] * per).to(torch.uint8)
    vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & mask  # [R, per, C]
    return vals.reshape(packed.shape[0] * per, packed.shape[1]).to(torch.uint8)


def _match(value: str, target: str, contains: bool = False) -> bool:
    """vLLM's ``is_equal_or_regex_match``."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains:
        return target.lower() in value.lower()
    return target == value


def _check_patterns(s: CompressedTensorsSettings) -> None:
    """Refuse a ``re:`` entry of ``ignore`` or of a group's ``targets`` that does not compile, naming the setting."""
    entries = [(f"compressed-tensors ignore entry {t!r}", t) for t in s.ignore]
    for name, g in s.config_groups.items():
        entries += [(f"compressed-tensors config_groups[{name!r}] targets entry {t!r}", t) for t in g.targets]
    for setting, entry in entries:
        if entry.startswith("re:"):
            check_regex(entry[3:], setting)


def _shards(name: str) -> list[str]:
    proj = name.split(".")[-1]
    return [name.replace(proj, s) for s in FUSED_SHARDS.get(proj, ())]


class CompressedTensorsSource:
    """Reader for ``quant_method: compressed-tensors``, ``format: pack-quantized``, weight-only int (WNA16)."""

    format = SourceFormat.compressed_tensors
    packed_weight = "weight_packed"
    # One row of the README's source-format table (marlin_pack/_docs.py).
    support = (
        "llm-compressor (compressed-tensors)",
        (
            "`quant_method: compressed-tensors`, `format: pack-quantized`, int weights, no activation quantization, "
            "`actorder` none or static"
        ),
        "4, 8",
        "uint4b8 / uint8b128 (symmetric), uint4 with zero points (4-bit asymmetric)",
    )

    def __init__(self, bits: int, group_size: int, symmetric: bool, s: CompressedTensorsSettings) -> None:
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.settings = s
        wt = (WeightType.uint4b8 if bits == 4 else WeightType.uint8b128) if symmetric else WeightType.uint4
        self.scheme = QuantScheme(weight_type=wt, bits=bits, group_size=group_size, zero_points=not symmetric)

    @classmethod
    def from_settings(cls, s: CompressedTensorsSettings) -> CompressedTensorsSource:
        """The reader for these settings, or a one-line refusal naming the setting vLLM would not serve on Marlin."""
        if s.sparsity:
            raise UnsupportedCheckpointError(
                "compressed-tensors sparsity_config has targets: vLLM removed sparsity support and refuses the checkpoint"
            )
        if s.transform:
            raise UnsupportedCheckpointError(
                "compressed-tensors transform_config (rotations) is set: vLLM wraps such layers in a transform method; "
                "marlin-pack converts plain Marlin layers only"
            )
        _check_patterns(s)
        schemes: dict[tuple[int, int, bool], list[str]] = {}
        for name, g in s.config_groups.items():
            if g.weights is None:
                continue
            key = _check_group(name, g.weights, g.format or s.format, g.input_activations, g.output_activations)
            schemes.setdefault(key, []).append(name)
        if not schemes:
            raise UnsupportedCheckpointError("compressed-tensors config_groups quantize no weights; nothing to convert")
        if len(schemes) > 1:
            desc = "; ".join(f"{', '.join(repr(n) for n in names)}: {_describe(*k)}" for k, names in schemes.items())
            raise UnsupportedCheckpointError(
                f"compressed-tensors config_groups use different weight schemes ({desc}); a bundle holds one scheme, "
                "use a checkpoint whose quantized linears share one scheme"
            )
        bits, group_size, symmetric = next(iter(schemes))
        return cls(bits, group_size, symmetric, s)

    def _targets(self) -> list[str]:
        return [t for g in self.settings.config_groups.values() if g.weights is not None for t in g.targets]

    def vllm_quantizes(self, name: str, class_name: str = "Linear", extra_targets: tuple[str, ...] = ()) -> bool:
        """Whether vLLM gives the layer (vLLM's name) a compressed-tensors scheme.

        As ``CompressedTensorsConfig.get_scheme_dict``: the ``ignore`` list (every shard of a fused
        layer must match), then ``targets`` by name or regex, by all shards, or contained in the
        layer's class name (``Linear`` matches vLLM's ``QKVParallelLinear`` etc.).
        """
        ignore = self.settings.ignore
        direct = [t for t in ignore if _match(name, t)]
        if direct:
            return False
        shards = _shards(name)
        if shards:
            hits = [any(_match(sh, t) for t in ignore) for sh in shards]
            if all(hits):
                return False
            if any(hits):
                raise UnsupportedCheckpointError(
                    f"compressed-tensors ignore leaves some shards of {name} unquantized but not others; "
                    "vLLM requires one scheme for all shards of a fused layer and refuses the checkpoint"
                )
        targets = [*self._targets(), *extra_targets]
        if any(_match(name, t) for t in targets):
            return True
        if shards and all(any(_match(sh, t) for t in targets) for sh in shards):
            return True
        return any(_match(class_name, t, contains=True) for t in targets)

    def vllm_quantizes_experts(self, names: tuple[str, ...]) -> bool:
        """Whether vLLM quantizes an experts layer, as ``CompressedTensorsMoEMethod.get_moe_method`` decides.

        ``names``: vLLM's names of expert 0's gate, up and down projections (``{experts}.0.{leaf}``),
        each looked up like a linear of class ``RoutedExperts`` (which a ``Linear`` target also
        matches: ``_add_fused_moe_to_target_scheme_map``). All three must agree.

        Raises:
            UnsupportedCheckpointError: some projections ignored and others not (vLLM refuses the layer).
        """
        extra = ("RoutedExperts",) if "Linear" in self._targets() else ()
        answers = {n: self.vllm_quantizes(n, "RoutedExperts", extra) for n in names}
        if len(set(answers.values())) > 1:
            ignored = next(n for n, q in answers.items() if not q)
            raise UnsupportedCheckpointError(
                f"compressed-tensors ignore/targets leave {ignored} unquantized but not its sibling expert projections; "
                "vLLM requires one scheme for all MoE projections and refuses the checkpoint"
            )
        return next(iter(answers.values()))

    def check_layer(self, name: str, quantized: bool, *, ckpt: Checkpoint | None = None, parts: tuple[str, ...] = (),
                    modules: tuple[str, ...] = ()) -> None:
        """Refuse a layer whose stored form contradicts what vLLM's ``ignore``/``targets`` make of it."""
        wanted = self.vllm_quantizes(name)
        if wanted != quantized:
            stored = "quantized" if quantized else "unquantized"
            served = "quantized" if wanted else "unquantized"
            raise UnsupportedCheckpointError(
                f"compressed-tensors ignore/targets make {name} {served} in vLLM, but the checkpoint stores it "
                f"{stored}; vLLM could not load it either, fix the config or the checkpoint"
            )

    def describe(self) -> str:
        return f"compressed-tensors pack-quantized {_describe(self.bits, self.group_size, self.symmetric)}"

    def tensor_names(self, prefix: str) -> list[str]:
        names = [f"{prefix}.weight_packed", f"{prefix}.weight_scale", f"{prefix}.weight_shape"]
        if not self.symmetric:
            names.append(f"{prefix}.weight_zero_point")
        return names

    def validate(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int) -> None:
        per_word = 32 // self.bits
        if size_k % per_word or (not self.symmetric and size_n % per_word):
            raise UnsupportedCheckpointError(
                f"{prefix}: shape ({size_k}, {size_n}) is not a multiple of {per_word} (compressed-tensors packing)"
            )
        g = num_groups(size_k, self.group_size, prefix)
        expect(ckpt, f"{prefix}.weight_packed", (size_n, size_k // per_word), (torch.int32,))
        expect_scales(ckpt, f"{prefix}.weight_scale", (size_n, g))
        expect(ckpt, f"{prefix}.weight_shape", (2,), (torch.int64, torch.int32))
        if not self.symmetric:
            expect(ckpt, f"{prefix}.weight_zero_point", (size_n // per_word, g), (torch.int32,))
        if f"{prefix}.weight_g_idx" in ckpt.tensors:
            raise UnsupportedCheckpointError(
                f"{prefix}.weight_g_idx is stored (group activation ordering): vLLM no longer supports "
                "compressed-tensors group/dynamic activation ordering"
            )

    def read(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int, device: torch.device) -> ModuleTensors:
        shape = ckpt.get(f"{prefix}.weight_shape")
        if [int(x) for x in shape.tolist()] != [size_n, size_k]:
            raise CheckpointError(
                f"tensor {prefix}.weight_shape is {shape.tolist()}, expected [{size_n}, {size_k}] from config.json; "
                "the checkpoint does not match its config"
            )
        # weight_packed [N, K/per] is GPTQ's packing along K, transposed: a view, no copy.
        codes = PackedCodes(ckpt.get(f"{prefix}.weight_packed").to(device).t(), self.bits, "k")
        zeros = None
        if not self.symmetric:
            zeros = unpack_ct(ckpt.get(f"{prefix}.weight_zero_point").to(device), self.bits, 0).t()
        bias = ckpt.get(f"{prefix}.bias").to(device) if f"{prefix}.bias" in ckpt.tensors else None
        return ModuleTensors(
            codes=codes,
            scales=ckpt.get(f"{prefix}.weight_scale").to(device).t(),
            zeros=zeros,
            bias=bias,
            weight_shape=shape,
        )


def _describe(bits: int, group_size: int, symmetric: bool) -> str:
    groups = "channel-wise" if group_size == -1 else f"group size {group_size}"
    return f"{bits}-bit {'symmetric' if symmetric else 'asymmetric (zero points)'}, {groups}"


def _check_group(name: str, w: CompressedTensorsWeights, fmt: str | None, input_act: bool, output_act: bool) -> tuple[int, int, bool]:
    """(bits, group_size, symmetric) of one config group, or the refusal vLLM's Marlin path implies."""
    where = f"compressed-tensors config_groups[{name!r}]"
    if input_act or output_act:
        which = "input_activations" if input_act else "output_activations"
        raise UnsupportedCheckpointError(
            f"{where} quantizes {which}: not a weight-only (WNA16) scheme, vLLM serves it with another "
            "scheme than Marlin; marlin-pack converts weight-only int schemes"
        )
    if w.type != "int":
        raise UnsupportedCheckpointError(
            f"{where} weights type is {w.type!r}, expected 'int': vLLM serves float weights with other kernels"
        )
    if fmt != _PACK_FORMAT:
        raise UnsupportedCheckpointError(
            f"{where} format is {fmt!r}, expected {_PACK_FORMAT!r}: vLLM uses CompressedTensorsWNA16 (Marlin) only "
            "for pack-quantized weights"
        )
    if w.dynamic:
        raise UnsupportedCheckpointError(f"{where} weights dynamic is true: vLLM has no dynamic weight-only scheme; {SERVE_WITHOUT}")
    if w.actorder == "group":
        raise UnsupportedCheckpointError(
            f"{where} actorder is 'group' (or 'dynamic'/true): vLLM no longer supports compressed-tensors "
            "group/dynamic activation ordering; use a checkpoint with static (weight) activation ordering or none"
        )
    if w.strategy not in ("channel", "group"):
        raise UnsupportedCheckpointError(
            f"{where} weights strategy is {w.strategy!r}, expected 'channel' or 'group' (vLLM's WNA16 scheme); "
            f"{SERVE_WITHOUT}"
        )
    if w.num_bits not in (4, 8):
        raise UnsupportedCheckpointError(
            f"{where} num_bits is {w.num_bits!r}, expected 4 or 8: vLLM's Marlin runs only 4- and 8-bit weights; "
            f"{SERVE_WITHOUT}"
        )
    if w.symmetric is False and w.num_bits != 4:
        raise UnsupportedCheckpointError(
            f"{where} is {w.num_bits}-bit asymmetric: vLLM's Marlin runs zero points only for 4-bit (uint4); "
            f"{SERVE_WITHOUT}"
        )
    if w.strategy == "channel":
        gs = -1
    else:
        gs = check_group_size(w.group_size, where)
        if gs == -1:
            raise UnsupportedCheckpointError(f"{where} strategy is 'group' with group_size -1; use strategy 'channel'")
    return int(w.num_bits), gs, bool(w.symmetric)
