"""Fixtures of the vLLM plugin tests.

marlin-pack's patches are process-global, so every test here starts and ends with stock
vLLM (all patches uninstalled, originals restored); a test that needs them asks for
``patched``. ``register()`` runs once per session: its success is cached and vLLM's loader
registry keeps the loader, so neither is undone between tests (a fresh process is used where
a test needs an unregistered plugin).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def stock_vllm() -> Iterator[None]:
    """No marlin-pack patch is installed before or after the test (importing this does not import vLLM)."""
    from marlin_pack.vllm_plugin import patches

    patches.uninstall_all()
    yield
    patches.uninstall_all()


@pytest.fixture(scope="session")
def registered() -> None:
    """The ``marlin_prepacked`` load format is registered with vLLM in this process."""
    from marlin_pack.vllm_plugin import is_registered, register

    register()
    assert is_registered(), "register() failed: see the log"


@pytest.fixture
def patched(registered: None, stock_vllm: None) -> Iterator[ModuleType]:
    """marlin-pack registered and every patch installed for this test; all undone afterwards."""
    from marlin_pack.vllm_plugin import patches

    assert patches.install()
    yield patches


@pytest.fixture
def weight_cache_scope() -> Iterator[None]:
    """The process is a weight-cache one for this test: marlin-pack's scope entered, as its patches of the IPC loader's
    build and of a daemon's fill enter it (outside it, post-processing under weights_already_processed() is vLLM's own)."""
    from marlin_pack.vllm_plugin.patches import scope

    with scope.in_use():
        yield


@pytest.fixture
def awq_bundle(make_bundle) -> Path:  # type: ignore[no-untyped-def]
    """The tiny AWQ checkpoint with a float16 bundle for TP 1 and 2 (shared, read-only)."""
    return make_bundle("awq", "tiny", tp_sizes=(1, 2))


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cold bundle and this user's empty stamp store (a fresh node's first start): every bundle file's residency
    stood in for as cold (the decision leaves its digest to the copy: ``hash_left_to_copy``), the copy ``direct`` as the
    plan makes it for a cold file, the test's files old enough to be stamped. Returns the stamp store."""
    import json

    from marlin_pack.io import hashing
    from marlin_pack.vllm_plugin import decision, preload

    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.setattr(decision, "hash_left_to_copy", lambda path: True)
    monkeypatch.setenv("MARLIN_PACK_IO", json.dumps({"mode": "direct", "threads": 2, "window_mib": 1}))
    monkeypatch.setattr(hashing, "RACY_NS", -1)  # the test's files count as settled: stampable
    store = tmp_path / "stamps"
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(store))
    return store


@pytest.fixture
def marlin_log() -> Iterator[list[str]]:
    """Messages logged to ``vllm.marlin_pack`` (INFO and up) during the test, whatever vLLM's logging config."""
    import logging

    messages: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("vllm.marlin_pack")
    handler, level = Record(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def moe_bundle(tmp_path_factory: pytest.TempPathFactory) -> object:
    """``make(arch, fmt, dtype, tps=(1, 2))``: a tiny MoE checkpoint (``tests/moe_checkpoints.py``; ``fmt`` awq, gptq,
    ct or ct-asym: compressed-tensors W4A16 / W4A16_ASYM) converted for ``tps``, made once per module and arguments."""
    from moe_checkpoints import write_moe_checkpoint

    from marlin_pack import convert

    cache: dict[tuple, Path] = {}

    def make(arch: str, fmt: str, dtype: object, tps: tuple[int, ...] = (1, 2)) -> Path:
        key = (arch, fmt, dtype, tps)
        if key not in cache:
            ct = {"fmt": "compressed-tensors", "symmetric": fmt == "ct"} if fmt.startswith("ct") else {"fmt": fmt}
            model = write_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", arch, dtype=dtype, **ct)
            convert(model, tp=tps)
            cache[key] = model
        return cache[key]

    return make
