"""Fixtures for the Machete tests: vLLM's own kernel-selection code run on the CPU.

``fake_cuda`` makes vLLM's ``current_platform`` (as held by every loaded ``vllm`` module) answer
like a CUDA device of a chosen compute capability, so ``MacheteLinearKernel.can_implement`` and
``choose_mp_linear_kernel`` run here unchanged. Tests that use vLLM skip when it is not installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def vllm_linear():
    """vLLM's mixed-precision kernel package (skips without vLLM)."""
    pytest.importorskip("vllm")
    import vllm.model_executor.kernels.linear as linear
    import vllm.model_executor.kernels.linear.mixed_precision.machete  # noqa: F401

    return linear


@pytest.fixture
def fake_cuda(vllm_linear, monkeypatch: pytest.MonkeyPatch) -> Callable[[int | None], None]:
    """Call with a capability (e.g. 90) to make vLLM see a CUDA GPU of it; None: a CUDA platform without a device."""
    from vllm.platforms import PlatformEnum
    from vllm.platforms.interface import DeviceCapability

    real = vllm_linear.current_platform

    class FakeCuda:
        _enum = PlatformEnum.CUDA

        def __init__(self, cc: int | None) -> None:
            self.cc = cc

        def is_cuda(self) -> bool:
            return True

        def is_rocm(self) -> bool:
            return False

        def get_device_capability(self, device_id: int = 0):
            return None if self.cc is None else DeviceCapability(self.cc // 10, self.cc % 10)

        def is_device_capability(self, capability, device_id: int = 0) -> bool:
            cap = self.get_device_capability()
            if cap is None:
                return False
            return cap == capability if isinstance(capability, tuple) else cap.to_int() == capability

        def has_device_capability(self, capability, device_id: int = 0) -> bool:
            cap = self.get_device_capability()
            if cap is None:
                return False
            want = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability
            return cap.to_int() >= want

        def __getattr__(self, name: str):
            return getattr(real, name)

    holders = [
        mod
        for name, mod in list(sys.modules.items())
        if name.startswith("vllm.") and mod is not None and getattr(mod, "current_platform", None) is real
    ]

    def use(cc: int | None) -> None:
        fake = FakeCuda(cc)
        for mod in holders:
            monkeypatch.setattr(mod, "current_platform", fake)

    return use
