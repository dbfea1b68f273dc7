"""Which kernel's layout a bundle's layers take: vLLM's per-layer choice on the GPU the bundle is for.

On SM90 (H100/H200) vLLM serves AWQ/GPTQ/compressed-tensors linears with ``MacheteLinearKernel`` where it
implements the layer and with ``MarlinLinearKernel`` elsewhere; on other GPUs with Marlin. A bundle made
for the wrong GPU would force a slower kernel (Marlin on Hopper) or not load (Machete elsewhere), so the
choice is per layer, made by :func:`~marlin_pack.machete.supports.machete_supports`, and defaults to what
this machine's GPU would run.
"""

from __future__ import annotations

import torch

from marlin_pack.errors import MarlinPackError
from marlin_pack.machete.supports import machete_supports
from marlin_pack.schemas import LayerEntry, LayerKernel, QuantScheme

__all__ = ["machete_entry", "visible_gpu", "kernel_for", "default_kernel", "parse_kernel"]


def machete_entry(entry: LayerEntry, scheme: QuantScheme, dtype: torch.dtype) -> LayerEntry:
    """``entry`` in Machete's layout where vLLM on an SM90 GPU (default kernel settings) gives the layer to
    ``MacheteLinearKernel``; else as it is (Marlin, e.g. group size 32, or a per-rank shape Machete does not tile)."""
    ok, _ = machete_supports(
        capability=90, weight_type=scheme.weight_type.value, zero_points=scheme.zero_points, group_size=scheme.group_size,
        act_dtype=dtype, in_features=entry.size_k, out_features=entry.size_n,
    )
    if not ok:
        return entry
    return LayerEntry.model_validate(
        {**entry.model_dump(), "kernel": LayerKernel.machete, "padded_k": entry.size_k, "padded_n": entry.size_n}
    )


def visible_gpu() -> tuple[str, int] | None:
    """This machine's first GPU as torch sees it: its name and compute capability (major*10 + minor); None without one
    (or with a broken CUDA setup)."""
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return torch.cuda.get_device_name(0), major * 10 + minor
    except Exception:  # noqa: BLE001 - a broken CUDA setup: as without a GPU
        pass
    return None


def kernel_for(capability: int) -> LayerKernel:
    """The layout of a bundle for a GPU of ``capability`` (major*10 + minor): ``machete`` for SM90 (each layer then
    Machete's where vLLM gives it Machete, Marlin's elsewhere: :func:`machete_entry`), ``marlin`` for any other."""
    return LayerKernel.machete if capability == 90 else LayerKernel.marlin


def default_kernel() -> tuple[LayerKernel, str]:
    """The kernel vLLM would choose on this machine's GPU, and why: Machete on a visible SM90 (Hopper) GPU, else Marlin."""
    gpu = visible_gpu()
    if gpu is None:
        return LayerKernel.marlin, "no GPU visible: Marlin's layout; for Hopper (H100/H200) engines pass `kernel='machete'`"
    name, cc = gpu
    if cc == 90:
        return LayerKernel.machete, f"{name} is SM90: vLLM serves these layers with Machete where it can"
    return LayerKernel.marlin, f"{name} is SM{cc}: vLLM serves these layers with Marlin"


def parse_kernel(kernel: str | LayerKernel | None) -> LayerKernel:
    """``kernel``'s value (None: :func:`default_kernel`)."""
    if kernel is None:
        return default_kernel()[0]
    try:
        return LayerKernel(kernel)
    except ValueError:
        raise MarlinPackError(f"`kernel={kernel!r}` is not one of 'marlin', 'machete'") from None
