"""AutoAWQ GEMM checkpoints: 4-bit, zero points, qweight ``[K, N/8]`` in AWQ nibble order."""

from __future__ import annotations

import torch

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.packed_codes import PackedCodes
from marlin_pack.marlin.repack import AWQ_SLOTS, unpack_awq_cols
from marlin_pack.schemas import AwqSettings, QuantScheme, SourceFormat, WeightType
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

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.scheme = QuantScheme(weight_type=WeightType.uint4, bits=4, group_size=group_size, zero_points=True)

    @classmethod
    def from_settings(cls, s: AwqSettings) -> AwqGemmSource:
        """The reader for these settings, or a one-line refusal if vLLM 0.33.0 would not serve them through Marlin."""
        if s.bits != 4:
            raise UnsupportedCheckpointError(f"AWQ bits is {s.bits!r}, expected 4: vLLM 0.33.0 serves only 4-bit AWQ through Marlin")
        if s.version != "gemm":
            raise UnsupportedCheckpointError(
                f"AWQ version is {s.version!r}, expected 'gemm'; re-export the model with AutoAWQ's GEMM kernel"
            )
        if s.zero_point is not True:
            raise UnsupportedCheckpointError(
                f"AWQ zero_point is {s.zero_point!r}, expected true: vLLM 0.33.0 does not run AWQ without zero points on Marlin"
            )
        if s.dynamic:
            raise UnsupportedCheckpointError(
                "AWQ 'dynamic' per-module overrides (written by GPTQModel): vLLM 0.33.0's AutoAWQ ignores them and "
                "cannot load such a checkpoint; use a uniform checkpoint"
            )
        return cls(check_group_size(s.group_size, "AWQ"))

    def check_layer(self, name: str, quantized: bool) -> None:
        """AutoAWQ has no per-module rules marlin-pack accepts (``dynamic`` is refused up front)."""

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
