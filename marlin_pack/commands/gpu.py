"""Which GPU a command is for: ``--compute-capability MAJOR.MINOR`` as named, else this machine's GPU, if one is visible.

``convert`` takes the kernel layout of that GPU (SM90: Machete where vLLM gives a layer Machete, Marlin elsewhere; any
other: Marlin) and says which and why in one line; ``check`` decides the kernel fit for it, or says it could not.

One spelling is read, the one ``nvidia-smi --query-gpu=compute_cap`` and ``TORCH_CUDA_ARCH_LIST`` use: ``9.0``,
``8.0``, ``8.6``, ``12.0``. ``80``, ``sm_90`` or ``9`` are refused, naming the spelling meant (``80`` was once read as
80.0, a GPU that does not exist, and "90" next to "9.0" would be two words for one GPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import typer

from marlin_pack.commands.console import BadParameter

__all__ = ["CapabilityOpt", "Gpu", "engine_gpu", "parse_capability", "kernel_for_gpu"]

CapabilityOpt = Annotated[
    str | None,
    typer.Option(
        "--compute-capability", metavar="X.Y",
        help="The engine's GPU as MAJOR.MINOR: 9.0 (H100/H200), 8.0 (A100), 8.6/8.9 (A10, L4, L40S) "
        "\\[default: this machine's GPU, if one is visible].",
    ),
]
_OPTION = "--compute-capability"
_SPELLED = re.compile(r"(\d{1,2})\.(\d)")


@dataclass(frozen=True)
class Gpu:
    """The engine's GPU: its compute capability (major*10 + minor) and how the command knows it, for its lines."""

    capability: int
    named: bool  # --compute-capability; else the GPU visible here
    name: str = ""  # the visible GPU's name

    @property
    def text(self) -> str:
        """``9.0``."""
        return f"{self.capability // 10}.{self.capability % 10}"

    @property
    def said(self) -> str:
        """``--compute-capability 9.0 (SM90)`` or ``this machine's NVIDIA H100 80GB HBM3 (SM90)``."""
        where = f"{_OPTION} {self.text}" if self.named else f"this machine's {self.name}"
        return f"{where} (SM{self.capability})"


def parse_capability(text: str) -> int:
    """``9.0`` as 90. Anything else is a usage error naming the spelling meant where one is plain (``80``: 8.0)."""
    m = _SPELLED.fullmatch(text.strip())
    if m is not None:
        return int(m[1]) * 10 + int(m[2])
    digits = text.strip().lower().removeprefix("sm").lstrip("_").removesuffix("a")
    meant = ""
    if digits.isdigit() and 1 <= len(digits) <= 3:
        guess = f"{digits}.0" if len(digits) == 1 else f"{digits[:-1]}.{digits[-1]}"
        meant = f"; for SM{digits if len(digits) > 1 else digits + '0'} pass {_OPTION} {guess}"
    raise BadParameter(
        f"{text!r}: expected MAJOR.MINOR as nvidia-smi --query-gpu=compute_cap prints it, e.g. 9.0 (H100/H200) or 8.0 (A100)"
        f"{meant}",
        param_hint=_OPTION,
    )


def engine_gpu(text: str | None) -> Gpu | None:
    """The GPU ``--compute-capability`` names; without it, the one visible here (torch); None if neither."""
    if text is not None:
        return Gpu(parse_capability(text), named=True)
    from marlin_pack.kernel_choice import visible_gpu

    seen = visible_gpu()
    return None if seen is None else Gpu(seen[1], named=False, name=seen[0])


def kernel_for_gpu(kernel: str | None, gpu: Gpu | None) -> tuple[str, str | None]:
    """``convert``'s kernel for ``gpu`` and the line saying which and why (None: ``--kernel`` chose it, and fits).

    Raises:
        typer.BadParameter: ``--kernel machete`` for a GPU other than SM90 (the loader would refuse the bundle there).
    """
    from marlin_pack.kernel_choice import kernel_for

    if kernel is not None:
        if gpu is None or not gpu.named or kernel_for(gpu.capability).value == kernel:
            return kernel, None  # converted here for another GPU (--kernel machete on an A100 for H100 engines)
        if kernel == "machete":
            raise BadParameter(
                f"--kernel machete for {gpu.said}: Machete's layout runs on SM90 (H100/H200) only, and the loader refuses "
                "it elsewhere; drop --kernel (Marlin's layout for this GPU) or name the engine's GPU",
                param_hint="--kernel",
            )
        return kernel, (f"--kernel marlin for {gpu.said}: loads there with Marlin forced where vLLM's default runs Machete "
                        "(slower prefill); drop --kernel for vLLM's own choice")
    if gpu is None:
        return "marlin", (f"--kernel marlin: no GPU visible and none named: Marlin's layout, for every GPU but SM90; for "
                          f"H100/H200 engines pass {_OPTION} 9.0 (Machete where vLLM runs it)")
    chosen = kernel_for(gpu.capability).value
    if chosen == "machete":
        return chosen, f"--kernel machete: {gpu.said}: vLLM serves these layers with Machete where it implements them, Marlin elsewhere"
    return chosen, f"--kernel marlin: {gpu.said}: vLLM serves these layers with Marlin"
