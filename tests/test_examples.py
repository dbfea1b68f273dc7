"""The examples a user runs: ``examples/make_checkpoint.py`` writes every source format, and marlin-pack converts it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from marlin_pack import convert
from marlin_pack.schemas import SourceFormat

MAKE_CHECKPOINT = Path(__file__).parents[1] / "examples" / "make_checkpoint.py"


def _make_checkpoint(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(MAKE_CHECKPOINT), *args])
    runpy.run_path(str(MAKE_CHECKPOINT), run_name="__main__")


@pytest.mark.parametrize(
    ("args", "source_format", "zero_points", "bits"),
    [
        (["--format", "awq"], SourceFormat.awq_gemm, True, 4),
        (["--format", "gptq", "--bits", "8"], SourceFormat.gptq_v1, False, 8),
        (["--format", "compressed-tensors"], SourceFormat.compressed_tensors, False, 4),
        (["--format", "compressed-tensors", "--asymmetric", "--dtype", "bfloat16"], SourceFormat.compressed_tensors, True, 4),
        (["--format", "compressed-tensors", "--bits", "8", "--group-size", "-1"], SourceFormat.compressed_tensors, False, 8),
    ],
)
def test_make_checkpoint_writes_what_convert_takes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  args: list[str], source_format: SourceFormat, zero_points: bool, bits: int) -> None:
    _make_checkpoint(monkeypatch, str(tmp_path / "model"), *args)
    assert "checkpoint to" in capsys.readouterr().out
    manifest = convert(tmp_path / "model", tp=(1, 2)).manifest
    assert (manifest.source.format, manifest.quant.zero_points, manifest.quant.bits) == (source_format, zero_points, bits)


def test_make_checkpoint_refuses_asymmetric_outside_compressed_tensors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _make_checkpoint(monkeypatch, str(tmp_path / "model"), "--format", "gptq", "--asymmetric")
    assert e.value.code == 2 and "--asymmetric applies to --format compressed-tensors only" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
