"""Fixtures of the source tests: a hand-made Hugging Face hub cache (offline) holding a tiny AWQ repo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hub_cache import REPO, cache_repo


@pytest.fixture
def hub(tmp_path: Path, make_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    cache = tmp_path / "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MARLIN_PACK_CACHE", str(tmp_path / "mp-cache"))
    cache_repo(cache, REPO, make_checkpoint("awq"), "a" * 40)
    return cache

