"""Writing a bundle: atomic publish, --force only over a bundle, nothing half-written on any failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlin_pack import MarlinPackError, OutputExistsError, convert


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


def test_unwritable_output(awq: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MarlinPackError, match=r"cannot write to .*file"):
        convert(awq, blocker / "bundle")


def test_existing_output_needs_force(awq: Path) -> None:
    convert(awq)
    first = (awq / "marlin-pack" / "manifest.json").read_bytes()
    with pytest.raises(OutputExistsError, match=r"already exists; pass --force"):
        convert(awq)
    convert(awq, force=True)
    assert (awq / "marlin-pack" / "manifest.json").read_bytes() == first


def test_interrupted_run_leaves_nothing(awq: Path, tmp_path: Path, no_leftovers) -> None:
    def interrupt(done: int, total: int, name: str) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(awq, progress=interrupt)
    no_leftovers(awq)


def test_failed_force_keeps_old_bundle(awq: Path) -> None:
    convert(awq)
    before = (awq / "marlin-pack" / "manifest.json").read_bytes()

    def boom(done: int, total: int, name: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        convert(awq, force=True, progress=boom)
    assert (awq / "marlin-pack" / "manifest.json").read_bytes() == before


def test_force_never_replaces_a_non_bundle(awq: Path, tmp_path: Path) -> None:
    other = tmp_path / "important"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match=r"is not a marlin-pack bundle \(no manifest.json\); refusing to replace it"):
        convert(awq, other, force=True)
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(OutputExistsError, match=r"holds the checkpoint itself"):
        convert(awq, awq, force=True)
    assert (awq / "config.json").exists()


def test_bundle_permissions_follow_umask(awq: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        convert(awq)
    finally:
        os.umask(old)
    assert stat.S_IMODE((awq / "marlin-pack").stat().st_mode) == 0o755


def test_write_failure_is_one_line_and_leaves_nothing(awq: Path, tmp_path: Path) -> None:
    # A full disk, simulated with a file-size limit: the first write past it fails (EFBIG).
    import subprocess
    import sys

    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000));"
        "from marlin_pack.cli import main; sys.argv=['marlin-pack','convert',sys.argv[1],'-o',sys.argv[2]]; main()"
    )
    out = tmp_path / "out" / "bundle"
    r = subprocess.run([sys.executable, "-c", code, str(awq), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "writing the bundle under" in r.stderr and "failed (File too large)" in r.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_writer_removes_its_directory_when_not_finished(tmp_path: Path) -> None:
    from marlin_pack.bundle.writer import BundleWriter

    out = tmp_path / "bundle"
    with pytest.raises(RuntimeError, match="never finished"), BundleWriter.create(out) as bundle:
        bundle.write_common([], lambda name: None)  # type: ignore[arg-type,return-value]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_writer_removes_its_directory_on_error(tmp_path: Path) -> None:
    import torch

    from marlin_pack.bundle.writer import BundleWriter

    out = tmp_path / "bundle"
    with pytest.raises(ValueError, match="boom"), BundleWriter.create(out) as bundle:
        w = bundle.open_rank(1, 0, [("a", torch.int32, (4,))])
        w.write("a", torch.zeros(4, dtype=torch.int32))
        raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []
