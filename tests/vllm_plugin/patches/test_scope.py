"""``patches.scope``: the one switch the speed patches consult, entered where a process loads a model for marlin-pack.

Inactive by default (an ordinary vLLM process); :func:`in_use` nests, survives exceptions and is seen from every
thread of the process; :func:`uses_marlin_pack` is the load-format test an engine's worker enters it by. Where it is
entered: ``Worker.load_model`` (test_gc_freeze.py), the IPC loader's steps and the daemon's ``get_model``
(test_weight_cache.py); what consults it: test_inert.py, test_construct.py, test_cache_key.py, test_placeholders.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from marlin_pack.vllm_plugin.patches import scope


def test_inactive_unless_entered_nested_and_exception_safe() -> None:
    assert not scope.active()
    with scope.in_use():
        assert scope.active()
        with scope.in_use():
            assert scope.active()
        assert scope.active()  # the outer entry still holds
    assert not scope.active()
    with pytest.raises(RuntimeError, match="the load failed"), scope.in_use():
        raise RuntimeError("the load failed")
    assert not scope.active()


def test_process_wide() -> None:
    seen: list[bool] = []
    with scope.in_use():
        t = threading.Thread(target=lambda: seen.append(scope.active()))
        t.start()
        t.join()
    assert seen == [True]


@pytest.mark.parametrize(
    ("load_format", "ours"),
    [("marlin_prepacked", True), ("ipc_cache", True), ("auto", False), ("safetensors", False), ("dummy", False)],
)
def test_uses_marlin_pack_reads_the_load_format(registered: None, load_format: str, ours: bool) -> None:
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format=load_format))
    assert scope.uses_marlin_pack(config) is ours
    assert scope.uses_marlin_pack(SimpleNamespace(load_config=SimpleNamespace(load_format=load_format))) is ours


def test_uses_marlin_pack_without_a_config() -> None:
    assert not scope.uses_marlin_pack(None)
    assert not scope.uses_marlin_pack(SimpleNamespace())
    assert not scope.uses_marlin_pack(SimpleNamespace(load_config=None))
