"""The ``convert`` API: argument checks that come before any file is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlin_pack import MarlinPackError, convert


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


@pytest.mark.parametrize("device", ["foo", "meta"])
def test_unsupported_device(awq: Path, device: str, no_leftovers) -> None:
    with pytest.raises(MarlinPackError, match=rf"--device '{device}' is not supported; expected cpu or cuda"):
        convert(awq, device=device)
    no_leftovers(awq)
