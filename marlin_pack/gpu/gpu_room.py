"""The GPU's free and total memory, and how many GPUs this process sees, asked of NVML: no CUDA context, no driver
initialisation (vLLM finds its CUDA platform through NVML too).

The I/O plan is made where CUDA must not be initialised yet: in ``vllm preload``'s process before it
spawns its daemon, and in an engine's GPU worker before vLLM sets its device up. The CUDA ordinal is
mapped to NVML's device as vLLM's own NVML platform maps it: through ``CUDA_VISIBLE_DEVICES`` (an index
or a ``GPU-``/``MIG-`` UUID), else the ordinal itself.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

from marlin_pack.gpu.plan import GpuRoom

__all__ = ["gpu_room", "physical_device", "visible_gpus"]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def physical_device(ordinal: int, environ: Mapping[str, str] | None = None) -> int | str:
    """NVML's name for CUDA device ``ordinal``: an index, or a UUID string.

    Raises:
        ValueError: ``CUDA_VISIBLE_DEVICES`` lists fewer devices.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ordinal
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has no device {ordinal}")
    entry = entries[ordinal]
    return int(entry) if entry.isdigit() else entry


def gpu_room(ordinal: int) -> GpuRoom | None:
    """Free and total bytes of CUDA device ``ordinal``; None where NVML cannot say (no GPU, no NVML)."""
    try:
        device = physical_device(ordinal)
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except (ValueError, OSError):
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if isinstance(device, int):
            err = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(handle))
        else:
            err = nvml.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle))
        memory = _Memory()
        if err != 0 or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return GpuRoom(free=int(memory.free), total=int(memory.total))
    finally:
        nvml.nvmlShutdown()


def _cuda_visible(entries: list[str], count: int) -> int:
    """How many of ``CUDA_VISIBLE_DEVICES``'s entries CUDA shows: those before the first that names no device."""
    shown = 0
    for e in entries:
        if (e.isdigit() and int(e) < count) or e.startswith(("GPU-", "MIG-")):
            shown += 1
        else:
            break
    return shown


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """How many NVIDIA GPUs CUDA would show this process, and where none, why (one clause for a message)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = None if visible is None else [e.strip() for e in visible.split(",") if e.strip()]
    if entries == []:
        return 0, f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0, "no NVIDIA driver here (libnvidia-ml.so.1 cannot be loaded)"
    if nvml.nvmlInit_v2() != 0:
        return 0, "the NVIDIA driver does not answer (nvmlInit failed)"
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0, "the NVIDIA driver does not answer (nvmlDeviceGetCount failed)"
    finally:
        nvml.nvmlShutdown()
    n = count.value if entries is None else _cuda_visible(entries, count.value)
    if n == 0:
        return 0, "the NVIDIA driver sees no GPU" if entries is None else f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU of this machine"
    return n, ""
