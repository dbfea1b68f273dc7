"""The checkpoints committed under ``tests/data`` (made by the real quantizers), as the source tests use them: a copy
in the test's own folder, because ``convert`` writes the bundle into the checkpoint's folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from marlin_pack import convert


def copy_fixture(data: Path, name: str, tmp_path: Path) -> Path:
    """A copy of the fixture folder ``data / name`` at ``tmp_path / name``."""
    model = tmp_path / name
    shutil.copytree(data / name, model)
    return model


def convert_copy(data: Path, name: str, tmp_path: Path, tps: tuple[int, ...], dtype: Any) -> tuple[Path, Any]:
    """A copy of the fixture converted at TP sizes ``tps`` into ``dtype`` (a torch dtype): (the copy, its manifest)."""
    model = copy_fixture(data, name, tmp_path)
    return model, convert(model, tp=tps, dtype=str(dtype).removeprefix("torch.")).manifest
