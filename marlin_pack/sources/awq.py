"""AutoAWQ GEMM checkpoints: 4-bit, zero points, qweight ``[K, N/8]`` in AWQ nibble order."""

from __future__ import annotations

import torch

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.packed_codes import PackedCodes
from marlin_pack.marlin.repack import AWQ_SLOTS, unpack_awq_cols
from marlin_pack.schemas import AwqSettings, QuantScheme, SourceFormat, WeightType
from marlin_pack.sources.awq_skips import float_only_modules, skipping_entry
from marlin_pack.sources.base import ModuleTensors
from marlin_pack.sources.checkpoint import Checkpoint
from marlin_pack.sources.expect import check_group_size, expect, expect_scales, num_groups

__all__ = ["AwqGemmSource"]


class AwqGemmSource:
    """Reader for ``quant_method: awq``, ``version: gemm``, ``zero_point: true``, 4-bit."""

    format = SourceFormat.awq_gemm
    packed_weight = "qweight"  # the tensor whose presence marks a quantized module
    # One row of the README's source-format table (marlin_pack/_docs.py).
    support = ("AutoAWQ GEMM", "`quant_method: awq`, `version: gemm`, `zero_point: true`", "4", "uint4 with zero points")

    def __init__(self, group_size: int, modules_to_not_convert: tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert
        self._derived: tuple[int, tuple[str, ...]] | None = None  # (id of the checkpoint, its float-only modules)
        self.scheme = QuantScheme(weight_type=WeightType.uint4, bits=4, group_size=group_size, zero_points=True)

    @classmethod
    def from_settings(cls, s: AwqSettings) -> AwqGemmSource:
        """The reader for these settings, or a one-line refusal if vLLM would not serve them through Marlin."""
        if s.bits != 4:
            raise UnsupportedCheckpointError(f"AWQ bits is {s.bits!r}, expected 4: vLLM serves only 4-bit AWQ through Marlin")
        if s.version != "gemm":
            raise UnsupportedCheckpointError(
                f"AWQ version is {s.version!r}, expected 'gemm'; re-export the model with AutoAWQ's GEMM kernel"
            )
        if s.zero_point is not True:
            raise UnsupportedCheckpointError(
                f"AWQ zero_point is {s.zero_point!r}, expected true: vLLM does not run AWQ without zero points on Marlin"
            )
        if s.dynamic:
            raise UnsupportedCheckpointError(
                "AWQ 'dynamic' per-module overrides (written by GPTQModel): vLLM's AutoAWQ ignores them and "
                "cannot load such a checkpoint; use a uniform checkpoint"
            )
        return cls(check_group_size(s.group_size, "AWQ"), tuple(s.modules_to_not_convert))

    def check_layer(self, name: str, quantized: bool, *, ckpt: Checkpoint | None = None, parts: tuple[str, ...] = (),
                    modules: tuple[str, ...] = ()) -> None:
        """Refuse a layer whose stored form contradicts what ``modules_to_not_convert`` makes of it in vLLM.

        ``parts`` are vLLM's names of a fused layer's parts and ``modules`` the checkpoint modules
        it is read from (entries may be written in either naming).
        """
        entries = self.modules_to_not_convert
        if not entries:
            if ckpt is None:
                return
            if self._derived is None or self._derived[0] != id(ckpt):
                self._derived = (id(ckpt), float_only_modules(ckpt))
            entries = self._derived[1]
        hit = skipping_entry(name, parts, entries)
        if quantized and hit is not None:
            where = "modules_to_not_convert entry" if self.modules_to_not_convert else "unquantized checkpoint module"
            raise UnsupportedCheckpointError(
                f"AWQ {where} {hit!r} is a substring of {name}, so vLLM leaves it unquantized, but the checkpoint "
                "stores it quantized; vLLM could not load it either, fix modules_to_not_convert"
            )
        if not quantized and hit is None and self.modules_to_not_convert and _first_hit_any(modules, entries) is None:
            raise UnsupportedCheckpointError(
                f"{name} is stored unquantized, but no AWQ modules_to_not_convert entry matches it, so vLLM would "
                "expect it quantized and could not load it; add it to modules_to_not_convert"
            )

    def describe(self) -> str:
        return f"AWQ GEMM 4-bit, group size {self.group_size}, zero points"

    def tensor_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.qweight", f"{prefix}.qzeros", f"{prefix}.scales"]

    def validate(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int) -> None:
        if size_n % 8:
            raise UnsupportedCheckpointError(f"{prefix}: {size_n} output features are not a multiple of 8 (AWQ packing)")
        g = num_groups(size_k, self.group_size, prefix)
        expect(ckpt, f"{prefix}.qweight", (size_k, size_n // 8), (torch.int32,))
        expect(ckpt, f"{prefix}.qzeros", (g, size_n // 8), (torch.int32,))
        expect_scales(ckpt, f"{prefix}.scales", (g, size_n))

    def read(self, ckpt: Checkpoint, prefix: str, size_k: int, size_n: int, device: torch.device) -> ModuleTensors:
        qweight = ckpt.get(f"{prefix}.qweight").to(device)
        qzeros = ckpt.get(f"{prefix}.qzeros").to(device)
        bias = ckpt.get(f"{prefix}.bias").to(device) if f"{prefix}.bias" in ckpt.tensors else None
        return ModuleTensors(
            codes=PackedCodes(qweight, 4, "n", AWQ_SLOTS),
            scales=ckpt.get(f"{prefix}.scales").to(device),
            zeros=unpack_awq_cols(qzeros),
            bias=bias,
            column_slots=AWQ_SLOTS,
        )


def _first_hit_any(names: tuple[str, ...], entries: tuple[str, ...]) -> str | None:
    return next((e for n in names for e in entries if e in n), None)
