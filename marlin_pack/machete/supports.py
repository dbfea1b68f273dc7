"""Whether vLLM serves a linear layer with ``MacheteLinearKernel``, from plain facts, without vLLM.

A bundle holds one post-processed layout per layer; on an SM90 GPU that layout is Machete's
prepacked one for exactly the layers vLLM's ``choose_mp_linear_kernel`` gives to Machete. This
module restates that decision (read from the 0.33.0 wheel; ``tests/machete/test_supports.py``
checks every rule against vLLM's own ``can_implement`` and ``choose_mp_linear_kernel`` on a grid).

The rules, in the order vLLM applies them:

1. ``--linear-backend`` (``kernel_config.linear_backend``, or its ``linear_backend_per_quant``
   entry ``"mixed_precision"``, which wins): ``auto`` keeps the CUDA list
   ``[CutlassW4A8, Machete, Marlin, Conch, Exllama, TritonW4A16, Humming]``; a backend naming one of
   those kernels (cutlass, machete, marlin, conch, exllama, triton, humming) keeps only that one,
   so anything but ``machete`` excludes Machete (and ``machete`` leaves no fallback: vLLM raises
   when Machete cannot take the layer); a backend naming none of them falls back to ``auto``.
2. ``VLLM_DISABLED_KERNELS`` (split on ``,`` with no trimming) contains ``MacheteLinearKernel``.
3. Compute capability below 9.0 (``get_min_capability() == 90``), then not exactly 9.0
   (``is_device_capability(90)``): SM100/SM120 never get Machete.
4. Weight type: ``uint4b8``/``uint8b128`` without zero points, ``uint4``/``uint8`` with them.
5. Group size: -1, 64 or 128 for float16/bfloat16 activations; -1 or 128 for any other act dtype.
6. Shape of the *partition*: per-rank input features % 64 and per-rank output features % 128,
   where the output width of a fused layer (qkv, gate_up) is the sum of its parts on this rank
   (``sum(output_partition_sizes)``), checked as one. No padding.

``CutlassW4A8`` comes before Machete but needs ``int4`` weights, a type Machete never accepts, so
it never takes a layer Machete would. The act dtype is the one vLLM passes (``params_dtype``, or
``VLLM_MARLIN_INPUT_DTYPE``'s override for AWQ/GPTQ): vLLM does not test it for 16-bitness, yet
``machete_prepack_B`` only has float16/bfloat16 variants, so such a pick is flagged in the reason.
Format-level gates (AWQ's Marlin-compatibility check, batch invariance) come before all this and
are not modelled here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

KERNEL_NAME = "MacheteLinearKernel"
MACHETE_ACT_DTYPES = (torch.float16, torch.bfloat16)
QUANT_TYPES = {False: ("uint4b8", "uint8b128"), True: ("uint4", "uint8")}
# --linear-backend values that name a CUDA mixed-precision kernel (vLLM's _LINEAR_BACKEND_KERNEL_MAP)
BACKEND_KERNELS = {
    "cutlass": "CutlassW4A8LinearKernel",
    "machete": KERNEL_NAME,
    "marlin": "MarlinLinearKernel",
    "conch": "ConchLinearKernel",
    "exllama": "ExllamaLinearKernel",
    "triton": "TritonW4A16LinearKernel",
    "humming": "HummingLinearKernel",
}
PREPACKED_BLOCK_K, PREPACKED_BLOCK_N = 64, 128  # MACHETE_PREPACKED_BLOCK_SHAPE


def group_sizes(act_dtype: torch.dtype) -> tuple[int, ...]:
    """``query_machete_supported_group_sizes``."""
    return (-1, 64, 128) if act_dtype in MACHETE_ACT_DTYPES else (-1, 128)


def _capability(cc: int | tuple[int, int] | None) -> int | None:
    if cc is None:
        return None
    if isinstance(cc, tuple):
        major, minor = cc
        return major * 10 + minor
    return int(cc)


def machete_supports(
    *,
    capability: int | tuple[int, int] | None,
    weight_type: str,
    zero_points: bool,
    group_size: int,
    act_dtype: torch.dtype,
    in_features: int,
    out_features: int,
    disabled_kernels: str | Sequence[str] = (),
    linear_backend: str | None = "auto",
    linear_backend_per_quant: Mapping[str, str] | None = None,
) -> tuple[bool, str]:
    """Whether vLLM on a CUDA GPU of ``capability`` picks Machete for this layer, and why (not).

    ``weight_type`` is vLLM's scalar type name (``str(scalar_types.uint4b8)`` = ``"uint4b8"``);
    ``in_features``/``out_features`` are the per-rank partition sizes (fused width for qkv and
    gate_up); ``capability`` is ``(major, minor)`` or ``major*10 + minor``, None for no CUDA device;
    ``disabled_kernels`` is ``VLLM_DISABLED_KERNELS`` as a string or as its list.
    """
    backend = linear_backend or "auto"
    if linear_backend_per_quant and linear_backend_per_quant.get("mixed_precision"):
        backend = linear_backend_per_quant["mixed_precision"]
    if backend != "auto" and backend in BACKEND_KERNELS and backend != "machete":
        return False, f"--linear-backend {backend} selects {BACKEND_KERNELS[backend]} only"

    disabled = disabled_kernels.split(",") if isinstance(disabled_kernels, str) else list(disabled_kernels)
    if KERNEL_NAME in disabled:
        return False, f"{KERNEL_NAME} is in VLLM_DISABLED_KERNELS"

    cc = _capability(capability)
    if cc is None:
        return False, "no CUDA device capability (Machete is CUDA only)"
    if cc < 90:
        return False, f"{KERNEL_NAME} requires capability 90, the device has {cc}"
    if cc != 90:
        return False, f"Machete requires compute capability exactly 9.0 (Hopper), the device has {cc // 10}.{cc % 10}"

    allowed = QUANT_TYPES[bool(zero_points)]
    if str(weight_type) not in allowed:
        zp = "with" if zero_points else "without"
        return False, f"weight type {weight_type} {zp} zero points is not one of Machete's {allowed}"

    sizes = group_sizes(act_dtype)
    if group_size not in sizes:
        return False, f"group size {group_size} is not one of Machete's {sizes} for {act_dtype}"

    if in_features % PREPACKED_BLOCK_K:
        return False, f"per-rank input features {in_features} not divisible by {PREPACKED_BLOCK_K}"
    if out_features % PREPACKED_BLOCK_N:
        return False, f"per-rank output features {out_features} not divisible by {PREPACKED_BLOCK_N}"

    if act_dtype not in MACHETE_ACT_DTYPES:
        return True, (
            f"{KERNEL_NAME} is picked, but machete_prepack_B has no variant for act dtype {act_dtype}: "
            "vLLM would fail to load this layer"
        )
    return True, f"{KERNEL_NAME} is picked"
