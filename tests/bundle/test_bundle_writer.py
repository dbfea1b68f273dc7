"""Writing a bundle: atomic publish, --force only over a bundle, nothing half-written on any failure."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from marlin_pack import MarlinPackError, OutputExistsError, convert, verify


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


def test_unwritable_output(awq: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MarlinPackError, match=r"cannot write to .*file"):
        convert(awq, blocker / "bundle")


def test_existing_up_to_date_output_is_reused_and_force_replaces_it(awq: Path) -> None:
    first = convert(awq, tp=(1, 2))
    manifest = (awq / "marlin-pack" / "manifest.json").stat()
    again = convert(awq, tp=(2,))  # a subset of what the bundle holds: up to date
    assert again.reused and not first.reused and again.bundle == first.bundle == awq / "marlin-pack"
    assert again.manifest == first.manifest
    assert (awq / "marlin-pack" / "manifest.json").stat().st_ino == manifest.st_ino  # nothing written
    assert not convert(awq, tp=(1, 2), force=True).reused
    assert (awq / "marlin-pack" / "manifest.json").stat().st_ino != manifest.st_ino


def test_existing_output_for_other_settings_is_updated_saying_what_and_why(awq: Path) -> None:
    convert(awq)
    added = convert(awq, tp=(2,))
    assert not added.reused and added.summary == "added tp2; tp1 kept" and added.manifest.tp_sizes == [1, 2]
    other = convert(awq, dtype="bfloat16")
    assert other.summary == ("rewrote tp1 and common.safetensors: it holds float16 scales, asked for bfloat16; "
                             "dropped tp2 (not asked)")
    assert other.manifest.tp_sizes == [1] and other.manifest.serving_dtype.value == "bfloat16"


def test_existing_output_of_a_changed_checkpoint_is_rewritten(awq: Path) -> None:
    convert(awq, tp=(1, 2))
    weights = awq / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the same header and size, other bytes: only the digest tells
    weights.write_bytes(bytes(data))
    again = convert(awq, tp=(2,))
    assert re.fullmatch(r"rewrote tp2 and common.safetensors: source file model.safetensors changed since the bundle was made "
                        r"\(blake3 \w+…, expected \w+…\); dropped tp1 \(not asked\)", again.summary), again.summary
    assert verify(awq / "marlin-pack").ok


def test_existing_output_of_another_format_version_is_refused(awq: Path) -> None:
    convert(awq)
    path = awq / "marlin-pack" / "manifest.json"
    path.write_text(path.read_text().replace('"format_version": ', '"format_version": 9', 1))
    with pytest.raises(OutputExistsError, match=r"holds a bundle this marlin-pack cannot use .*pass `force=True`"):
        convert(awq)
    assert not convert(awq, force=True).reused


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


def test_force_never_deletes_a_foreign_directory_with_a_manifest(awq: Path, tmp_path: Path) -> None:
    # Issue: a web app's manifest.json made its whole directory look like a bundle to --force.
    site = tmp_path / "site"
    (site / "src").mkdir(parents=True)
    (site / "manifest.json").write_text('{"name": "pwa"}')
    (site / "src" / "app.js").write_text("x")
    with pytest.raises(OutputExistsError, match=r"is not a marlin-pack bundle .*refusing to replace it"):
        convert(awq, site, force=True)
    assert (site / "src" / "app.js").read_text() == "x"


def test_force_never_deletes_files_a_bundle_did_not_write(awq: Path) -> None:
    convert(awq)
    (awq / "marlin-pack" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"holds notes.txt, which no conversion writes"):
        convert(awq, force=True)
    assert (awq / "marlin-pack" / "notes.txt").read_text() == "mine"


def test_output_created_during_the_run_is_never_replaced(awq: Path) -> None:
    out = awq / "marlin-pack"

    def squatter(done: int, total: int, name: str) -> None:
        if done == 1:
            out.mkdir()  # an empty directory: a plain rename would silently replace it

    with pytest.raises(OutputExistsError, match=r"appeared while converting; nothing was replaced"):
        convert(awq, progress=squatter)
    assert out.is_dir() and list(out.iterdir()) == []
    assert not [p for p in awq.iterdir() if p.name.startswith(".marlin-pack")]


def test_a_concurrent_conversion_of_one_output_waits_and_reuses_the_result(awq: Path) -> None:
    import subprocess
    import sys

    # The second conversion starts while the first (in this process) holds the lock: it waits, then finds the
    # first one's bundle up to date (an init container of a second pod started at the same time).
    code = "import sys; from marlin_pack import convert; r = convert(sys.argv[1], on_wait=print); print('REUSED', r.reused)"
    started: list[tuple[subprocess.Popen, str]] = []

    def second(done: int, total: int, name: str) -> None:
        if done == 1:
            proc = subprocess.Popen([sys.executable, "-u", "-c", code, str(awq)], stdout=subprocess.PIPE, text=True)
            started.append((proc, proc.stdout.readline()))  # its first line: it is waiting (the lock is held)

    first = convert(awq, progress=second)
    proc, waiting = started[0]
    stdout, _ = proc.communicate(timeout=120)
    assert "another marlin-pack conversion (pid " in waiting and "is writing" in waiting, waiting
    assert proc.returncode == 0 and "REUSED True" in stdout, stdout
    assert not first.reused and (awq / "marlin-pack" / "manifest.json").is_file()
    assert not [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.")]  # lock file and temp dir gone


def test_the_lock_is_never_taken_through_a_symlink(awq: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (awq / ".marlin-pack.lock").symlink_to(victim)
    with pytest.raises(MarlinPackError, match=r"cannot make the lock file"):
        convert(awq)
    assert victim.read_text() == "keep" and not (awq / "marlin-pack").exists()


def test_force_through_a_symlink_replaces_its_target(awq: Path, tmp_path: Path) -> None:
    target = tmp_path / "fast-disk" / "bundle"
    convert(awq, target)
    link = awq / "marlin-pack"
    link.symlink_to(target)
    before = (target / "manifest.json").stat().st_ino
    convert(awq, force=True)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (target / "manifest.json").stat().st_ino != before  # a fresh bundle at the target
    assert not [p for p in awq.iterdir() if ".old-" in p.name or p.name.startswith(".marlin-pack.")]
    assert not [p for p in target.parent.iterdir() if p.name != "bundle"]


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signals_clean_up_and_say_interrupted(awq: Path, tmp_path: Path, signame: str) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out" / "bundle"
    # Slow the conversion down (progress sleeps) so the signal lands mid-run.
    code = (
        "import sys, time, marlin_pack.conversion as c; orig = c.convert;"
        "c.convert = lambda *a, **k: orig(*a, **{**k, 'progress': lambda *x: time.sleep(0.5)});"
        "from marlin_pack.cli import main; sys.argv = ['marlin-pack', 'convert', sys.argv[1], '-o', sys.argv[2]]; main()"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(awq), str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list(out.parent.glob(".bundle.tmp-*")):
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(getattr(signal, signame))
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 128 + getattr(signal, signame), stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert list(out.parent.iterdir()) == []


def test_stale_temp_dirs_of_dead_conversions_are_removed(awq: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = awq / f".marlin-pack.tmp-{int(dead.stdout)}-abcd"
    (stale / "tp1").mkdir(parents=True)
    (stale / "tp1" / "rank-0.safetensors").write_bytes(b"partial")
    convert(awq)
    assert not stale.exists()


def test_write_failures_other_than_space_do_not_blame_space(awq: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import marlin_pack.bundle.writer as writer

    def fail(src: str, dst: str, **dir_fds: int) -> None:
        raise OSError(errno.EMFILE, "Too many open files", str(dst))

    monkeypatch.setattr(writer, "rename_no_replace", fail)
    with pytest.raises(MarlinPackError, match=r"failed \(Too many open files\); check that location") as e:
        convert(awq)
    assert "free space" not in str(e.value)


def test_force_replaces_a_bundle_whose_stamp_cache_is_damaged(awq: Path) -> None:
    convert(awq)
    stamps = awq / "marlin-pack" / ".stamps.json"  # the stamp cache earlier versions kept in the bundle
    assert not os.path.lexists(stamps)  # stamps live in the user's store now
    stamps.mkdir()  # a cache, even a broken one, is the bundle's own
    convert(awq, force=True)
    assert not os.path.lexists(stamps) and (awq / "marlin-pack" / "manifest.json").is_file()


def test_a_failed_publish_with_force_puts_the_old_bundle_back(awq: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import marlin_pack.bundle.writer as writer

    convert(awq)
    before = (awq / "marlin-pack" / "manifest.json").stat().st_ino
    real = writer.rename_no_replace

    def fail_publish(src: str, dst: str, **dir_fds: int) -> None:
        if ".tmp-" in str(src):  # the publish itself; moving the old bundle aside and back works
            raise OSError(errno.EIO, "Input/output error", str(dst))
        real(src, dst, **dir_fds)

    monkeypatch.setattr(writer, "rename_no_replace", fail_publish)
    with pytest.raises(MarlinPackError, match=r"failed \(Input/output error\)"):
        convert(awq, force=True)
    assert (awq / "marlin-pack" / "manifest.json").stat().st_ino == before
    assert not [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.")]
