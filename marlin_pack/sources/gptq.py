"""AutoGPTQ / GPTQModel checkpoints (``checkpoint_format`` gptq or gptq_v2): symmetric 4/8-bit."""

from __future__ import annotations

import re

import torch

from marlin_pack.errors import SERVE_WITHOUT, CheckpointError, UnsupportedCheckpointError
from marlin_pack.marlin.packed_codes import PackedCodes, repeated_word
from marlin_pack.schemas import GptqSettings, QuantScheme, SourceFormat, WeightType
from marlin_pack.sources.base import ModuleTensors
from marlin_pack.sources.checkpoint import Checkpoint
from marlin_pack.sources.expect import check_group_size, check_regex, expect, expect_scales, num_groups

__all__ = ["GptqV1Source"]


class GptqV1Source:
    """Reader for ``quant_method: gptq``, ``sym: true``, bits 4 or 8, no act-order groups.

    vLLM ignores GPTQ ``qzeros`` (the weight type carries the symmetric zero)
    and drops ``g_idx``; both are checked to be what that assumes, so a checkpoint that
    vLLM would silently serve wrong is refused instead.
    """

    format = SourceFormat.gptq_v1
    packed_weight = "qweight"  # the tensor whose presence marks a quantized module
    # One row of the README's source-format table (marlin_pack/_docs.py).
    support = (
        "AutoGPTQ / GPTQModel / optimum",
        "`quant_method: gptq`, `sym: true`, `checkpoint_format` gptq or gptq_v2 (config.json or quantize_config.json)",
        "4, 8",
        "uint4b8 / uint8b128 (symmetric)",
    )

    def __init__(self, bits: int, group_size: int, zero_offset: int, dynamic: dict[str, dict] | None = None) -> None:
        self.bits = bits
        self.dynamic = dynamic or {}
        self.group_size = group_size
        # Stored zero point: v1 stores zero - 1, v2 the zero itself.
        self.stored_zero = (1 << (bits - 1)) - zero_offset
        wt = WeightType.uint4b8 if bits == 4 else WeightType.uint8b128
        self.scheme = QuantScheme(weight_type=wt, bits=bits, group_size=group_size, zero_points=False)

    @classmethod
    def from_settings(cls, s: GptqSettings) -> GptqV1Source:
        """The reader for these settings, or a one-line refusal if vLLM would not serve them through Marlin."""
        if s.bits not in (4, 8):
            raise UnsupportedCheckpointError(f"GPTQ bits is {s.bits!r}, expected 4 or 8 (vLLM Marlin); {SERVE_WITHOUT}")
        if s.sym is not True:
            raise UnsupportedCheckpointError(
                f"GPTQ sym is {s.sym!r}, expected true: vLLM does not serve asymmetric GPTQ; use a symmetric checkpoint"
            )
        gs = check_group_size(s.group_size, "GPTQ")
        if s.desc_act and gs != -1:
            raise UnsupportedCheckpointError(
                "GPTQ desc_act is true with group_size "
                f"{gs}: vLLM no longer supports act-order groups; use a checkpoint quantized with desc_act=false"
            )
        if s.lm_head:  # GPTQModel writes a quantized lm_head as a dynamic override too: name the cause
            raise UnsupportedCheckpointError(
                "GPTQ lm_head is true (a quantized lm_head), expected false: marlin-pack prepacks decoder-layer linears "
                "only; serve this checkpoint without --load-format marlin_prepacked, or quantize it without lm_head=True"
            )
        if s.checkpoint_format not in ("gptq", "gptq_v2"):
            raise UnsupportedCheckpointError(
                f"GPTQ checkpoint_format is {s.checkpoint_format!r}, expected 'gptq' or 'gptq_v2'; {SERVE_WITHOUT}"
            )
        _check_uniform(s, gs)
        return cls(s.bits, gs, 1 if s.checkpoint_format == "gptq" else 0, s.dynamic)

    def check_layer(self, name: str, quantized: bool, *, ckpt: Checkpoint | None = None, parts: tuple[str, ...] = (),
                    modules: tuple[str, ...] = ()) -> None:
        """Refuse a quantized layer that a ``dynamic`` exclusion ('-:REGEX') leaves unquantized in vLLM.

        ``name`` is vLLM's layer name, which is what vLLM matches the rules against (the
        first matching rule decides).
        """
        rule = next((p for p in self.dynamic if re.match(p.removeprefix("-:").removeprefix("+:"), name)), None)
        if quantized and rule is not None and rule.startswith("-:"):
            raise UnsupportedCheckpointError(
                f"GPTQ dynamic rule {rule!r} leaves {name} unquantized in vLLM, but the checkpoint stores it "
                "quantized; vLLM could not load it either, fix the rule or the checkpoint"
            )

    def describe(self) -> str:
        return f"GPTQ {self.bits}-bit symmetric, group size {self.group_size}"


    def tensor_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.qweight", f"{prefix}.qzeros", f"{prefix}.scales", f"{prefix}.g_idx"]

    def validate(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int) -> None:
        per_word = 32 // self.bits
        if size_k % per_word or size_n % per_word:
            raise UnsupportedCheckpointError(f"{prefix}: shape ({size_k}, {size_n}) is not a multiple of {per_word} (GPTQ packing)")
        g = num_groups(size_k, self.group_size, prefix)
        expect(ckpt, f"{prefix}.qweight", (size_k // per_word, size_n), (torch.int32,))
        expect(ckpt, f"{prefix}.qzeros", (g, size_n // per_word), (torch.int32,))
        expect_scales(ckpt, f"{prefix}.scales", (g, size_n))
        if f"{prefix}.g_idx" in ckpt.tensors:
            expect(ckpt, f"{prefix}.g_idx", (size_k,), (torch.int32, torch.int64))

    def _check_side_tensors(self, ckpt: Checkpoint, prefix: str, size_k: int, device: torch.device) -> None:
        qzeros = ckpt.get(f"{prefix}.qzeros").to(device)
        if not bool((qzeros == repeated_word(self.stored_zero, self.bits)).all()):
            raise CheckpointError(
                f"{prefix}.qzeros holds zero points other than {self.stored_zero} although sym is true; "
                "vLLM ignores GPTQ zero points, so this checkpoint would be served wrong; re-quantize it"
            )
        if f"{prefix}.g_idx" in ckpt.tensors:
            g_idx = ckpt.get(f"{prefix}.g_idx").to(device)
            if self.group_size == -1:
                ok = bool((g_idx == 0).all())
            else:
                ok = torch.equal(g_idx.long(), torch.arange(size_k, device=device) // self.group_size)
            if not ok:
                raise UnsupportedCheckpointError(
                    f"{prefix}.g_idx reorders input channels (act-order); vLLM drops g_idx and would serve it wrong"
                )

    def read(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int, device: torch.device) -> ModuleTensors:
        self._check_side_tensors(ckpt, prefix, size_k, device)
        bias = ckpt.get(f"{prefix}.bias").to(device) if f"{prefix}.bias" in ckpt.tensors else None
        return ModuleTensors(
            codes=PackedCodes(ckpt.get(f"{prefix}.qweight").to(device), self.bits, "k"),
            scales=ckpt.get(f"{prefix}.scales").to(device),
            zeros=None,
            bias=bias,
        )


# dynamic override keys vLLM applies per layer (gptq_utils.override_config).
_OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")


def _check_uniform(s: GptqSettings, group_size: int) -> None:
    """Accept ``dynamic`` rules only where every quantized layer keeps the base scheme.

    Exclusions ('-:REGEX') are fine (those layers stay unquantized, checked per layer by
    ``check_layer``); an override that restates the base value is a no-op; one that changes it
    would give layers different Marlin schemes, which a bundle does not hold.
    """
    base = {"bits": s.bits, "group_size": group_size, "desc_act": bool(s.desc_act), "sym": s.sym}
    for pattern, overrides in s.dynamic.items():
        check_regex(pattern.removeprefix("-:").removeprefix("+:"), f"GPTQ dynamic rule {pattern!r}")
        if pattern.startswith("-:"):
            continue
        for key in _OVERRIDABLE:
            value = overrides.get(key)
            if value is not None and value != base[key] and not (key == "desc_act" and group_size == -1):
                raise UnsupportedCheckpointError(
                    f"GPTQ dynamic rule {pattern!r} sets {key} {value!r} for some layers (the rest use {base[key]!r}); "
                    "layers with different schemes are not supported, use a uniform checkpoint"
                )
