"""convert's output against another local user who can write its folder (issue 68: items 1, 3, 4 and 8).

She may rename anything in the output's folder and put symlinks in its place at any moment, leave
symlinks and lock files of hers there, or hold a lock file open; none of it may make a conversion write,
remove or wait outside what it made. "Another user" is simulated as root by ``lchown`` to an unused uid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import marlin_pack.bundle.writer as writer
import marlin_pack.conversion as conversion
from marlin_pack import MarlinPackError, OutputExistsError, convert
from marlin_pack.bundle.output_lock import output_lock

OTHER_UID = 12345  # no one's: "another user"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user's files needs root (lchown)")


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A root-only folder holding a file another user must never get written or removed."""
    folder = tmp_path / "root-only"
    folder.mkdir(mode=0o700)
    (folder / "secret").write_text("root's")
    (folder / "sub").mkdir()
    (folder / "sub" / "keep").write_text("root's too")
    yield folder
    assert (folder / "secret").read_text() == "root's" and (folder / "sub" / "keep").read_text() == "root's too"


def _temp_dir(model: Path) -> Path:
    (found,) = [p for p in model.iterdir() if p.name.startswith(".marlin-pack.tmp-")]
    return found


def _plant_links(at: Path, victim: Path) -> None:
    """A directory of symlinks to the victim's files, named as the bundle's files."""
    at.mkdir()
    for name in ("manifest.json", "common.safetensors"):
        (at / name).symlink_to(victim / "secret")
    (at / "tp1").symlink_to(victim / "sub")


# item 1: the temporary directory swapped for a directory of symlinks


def test_a_swapped_temporary_directory_is_never_written_through(awq: Path, tmp_path: Path, victim: Path) -> None:
    moved = tmp_path / "moved"

    def swap(done: int, total: int, name: str) -> None:
        if done == 1:
            tmp = _temp_dir(awq)
            tmp.rename(moved)
            _plant_links(tmp, victim)

    with pytest.raises(MarlinPackError, match=r"temporary directory, was replaced while converting; expected the directory it made: "
                       r"nothing was published") as e:
        convert(awq, progress=swap)
    assert "\n" not in str(e.value)
    assert not os.path.lexists(awq / "marlin-pack")
    planted = [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.tmp-")]
    assert len(planted) == 1 and (planted[0] / "manifest.json").is_symlink()  # hers: left alone
    assert list(moved.iterdir()) == []  # what this conversion wrote is removed, wherever it was moved


def test_an_aborted_conversion_never_removes_what_was_put_at_its_temporary_path(awq: Path, tmp_path: Path, victim: Path) -> None:
    def swap_then_fail(done: int, total: int, name: str) -> None:
        if done == 1:
            tmp = _temp_dir(awq)
            tmp.rename(tmp_path / "moved")
            _plant_links(tmp, victim)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(awq, progress=swap_then_fail)
    planted = [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.tmp-")]
    assert len(planted) == 1 and sorted(p.name for p in planted[0].iterdir()) == ["common.safetensors", "manifest.json", "tp1"]
    assert list((tmp_path / "moved").iterdir()) == []


def test_force_removes_only_the_bundle_it_moved_aside(awq: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another bundle in the same folder, renamed to the moved-aside name while --force checks it, must survive.
    convert(awq, tmp_path / "elsewhere")
    other = awq / "other-users-bundle"
    shutil.move(tmp_path / "elsewhere", other)
    convert(awq)
    real = writer.foreign_entry
    swapped: list[Path] = []

    def swap_while_checking(path: Path, *shown: Path) -> str | None:
        aside = [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.old-")]
        if aside and not swapped:
            aside[0].rename(tmp_path / "aside")
            other.rename(aside[0])
            swapped.append(aside[0])
        return real(path, *shown)

    monkeypatch.setattr(writer, "foreign_entry", swap_while_checking)
    convert(awq, force=True)
    assert swapped and (swapped[0] / "manifest.json").is_file() and (swapped[0] / "tp1" / "rank-0.safetensors").is_file()
    assert (awq / "marlin-pack" / "manifest.json").is_file()


@as_root
def test_stale_temporary_directories_of_other_users_are_left_alone(awq: Path, victim: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    hers = awq / f".marlin-pack.tmp-{pid}-hers"
    (hers / "tp1").mkdir(parents=True)
    (hers / "tp1" / "rank-0.safetensors").write_bytes(b"hers")
    os.lchown(hers, OTHER_UID, OTHER_UID)
    link = awq / f".marlin-pack.tmp-{pid}-link"
    link.symlink_to(victim)
    mine = awq / f".marlin-pack.tmp-{pid}-mine"
    (mine / "tp1").mkdir(parents=True)
    convert(awq)
    assert (hers / "tp1" / "rank-0.safetensors").read_bytes() == b"hers" and link.is_symlink()
    assert not mine.exists()


# item 3: another user's symlink at the output


def _links_to(link: Path, target: Path, uid: int) -> None:
    link.symlink_to(target)
    os.lchown(link, uid, uid)


@as_root
@pytest.mark.parametrize("force", [False, True])
def test_an_output_symlink_of_another_user_is_never_followed(awq: Path, victim: Path, force: bool) -> None:
    _links_to(awq / "marlin-pack", victim / "bundle", OTHER_UID)
    with pytest.raises(OutputExistsError, match=rf"marlin-pack is a symlink owned by uid {OTHER_UID}, not by this user or root; "
                       r"refusing to follow it .*: remove it, or pass its target as `output=DIR` if you trust it") as e:
        convert(awq, force=force)
    assert "\n" not in str(e.value)
    assert not (victim / "bundle").exists() and not [p for p in awq.iterdir() if p.name.startswith(".marlin-pack.")]


@as_root
def test_a_chain_of_symlinks_is_followed_only_while_each_is_trusted(awq: Path, tmp_path: Path, victim: Path) -> None:
    _links_to(tmp_path / "hop", victim / "bundle", OTHER_UID)
    _links_to(awq / "marlin-pack", tmp_path / "hop", os.geteuid())
    with pytest.raises(OutputExistsError, match=rf"hop is a symlink owned by uid {OTHER_UID}"):
        convert(awq)
    assert not (victim / "bundle").exists()
    (tmp_path / "hop").unlink()
    _links_to(tmp_path / "hop", tmp_path / "mine", 0)  # root's: followed
    assert convert(awq).bundle.resolve() == (tmp_path / "mine").resolve() and (tmp_path / "mine" / "manifest.json").is_file()


@pytest.fixture
def shared_cache(tmp_path: Path, make_checkpoint, monkeypatch: pytest.MonkeyPatch) -> Path:
    """marlin-pack's cache of model-id bundles, world-writable, and an offline hub cache holding acme/tiny-awq."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    from hub_cache import REPO, cache_repo

    hub = tmp_path / "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("MARLIN_PACK_CACHE", str(cache))
    cache_repo(hub, REPO, make_checkpoint("awq"), "a" * 40)
    return cache


@as_root
def test_a_model_id_cache_entry_of_another_user_is_never_followed(shared_cache: Path, victim: Path) -> None:
    from hub_cache import REPO

    repo = shared_cache / "models--acme--tiny-awq"
    _links_to(repo, victim, OTHER_UID)  # the repo's folder
    with pytest.raises(OutputExistsError, match=rf"models--acme--tiny-awq is a symlink owned by uid {OTHER_UID}"):
        convert(REPO)
    repo.unlink()
    repo.mkdir()
    _links_to(repo / ("a" * 40), victim / "bundle", OTHER_UID)  # the commit's entry
    with pytest.raises(OutputExistsError, match=rf"{'a' * 40} is a symlink owned by uid {OTHER_UID}"):
        convert(REPO)
    assert not (victim / "bundle").exists() and not (victim / ("a" * 40)).exists()


def test_cache_rm_removes_only_the_entry_it_checked(shared_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hub_cache import REPO

    from marlin_pack.sources.cache import remove_cached

    entry = convert(REPO).bundle
    other = tmp_path / "other-bundle"
    shutil.copytree(entry, other)
    real = writer.foreign_entry

    def swap_while_checking(path: Path, *shown: Path) -> str | None:
        why = real(path, *shown)
        entry.rename(tmp_path / "aside")  # someone who may write the cache swaps in another bundle after the check
        other.rename(entry)
        return why

    monkeypatch.setattr(writer, "foreign_entry", swap_while_checking)
    remove_cached(REPO)
    assert (entry / "manifest.json").is_file() and (entry / "tp1" / "rank-0.safetensors").is_file()
    assert list((tmp_path / "aside").iterdir()) == []


@as_root
def test_missing_folders_are_never_made_through_a_symlink_planted_meanwhile(
    awq: Path, tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir

    def planting(path: str | Path, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if os.path.basename(os.fspath(path)) == "b":  # she wins the race for a/b
            os.symlink(victim, path, dir_fd=dir_fd)
            os.chown(path, OTHER_UID, OTHER_UID, dir_fd=dir_fd, follow_symlinks=False)
            raise FileExistsError(errno.EEXIST, "File exists", os.fspath(path))
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", planting)
    with pytest.raises(MarlinPackError, match=rf"cannot write to .*a/b: b is a symlink owned by uid {OTHER_UID}, not by this user or root; "
                       r"refusing to follow it"):
        convert(awq, tmp_path / "a" / "b" / "bundle")
    assert sorted(p.name for p in victim.iterdir()) == ["secret", "sub"]


# item 4: the lock


def _ofd_lock(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))


def test_a_lock_file_held_through_a_read_only_descriptor_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    lock = tmp_path / ".bundle.lock"
    lock.write_text("")
    lock.chmod(0o644)  # as older versions left it: anyone may open it for reading
    reader = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a reader could hold forever

        def waiting(line: str) -> None:
            raise AssertionError(f"waited for a reader's lock: {line}")

        with output_lock(out, on_wait=waiting):
            assert (lock.stat().st_mode & 0o777) == 0o600
    finally:
        os.close(reader)


def test_a_new_lock_file_is_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with output_lock(tmp_path / "bundle"):
            assert ((tmp_path / ".bundle.lock").stat().st_mode & 0o777) == 0o600
    finally:
        os.umask(old)
    assert not (tmp_path / ".bundle.lock").exists()


@as_root
def test_a_lock_file_of_another_user_is_refused_naming_its_owner(awq: Path) -> None:
    lock = awq / ".marlin-pack.lock"
    lock.write_text("")
    os.chown(lock, OTHER_UID, OTHER_UID)
    with pytest.raises(MarlinPackError, match=rf"the lock file .*\.marlin-pack\.lock belongs to uid {OTHER_UID}, not to this user "
                       r"or root \(anyone could hold it\); remove it if no conversion of .* is running") as e:
        convert(awq)
    assert "\n" not in str(e.value) and not (awq / "marlin-pack").exists()


def test_the_wait_for_a_lock_is_bounded(awq: Path) -> None:
    lock = awq / ".marlin-pack.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        _ofd_lock(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as older versions locked it
        code = "import sys; from marlin_pack.cli import main; sys.argv = ['marlin-pack', 'convert', sys.argv[1]]; main()"
        env = {**os.environ, "MARLIN_PACK_LOCK_WAIT_S": "1"}
        r = subprocess.run([sys.executable, "-c", code, str(awq)], capture_output=True, text=True, timeout=90, env=env)
    finally:
        os.close(fd)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if "still locked" in line]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"is still locked after 1 s: another marlin-pack conversion (pid {os.getpid()}) is writing" in lines[0]
    assert "set MARLIN_PACK_LOCK_WAIT_S to wait longer" in lines[0]
    assert not (awq / "marlin-pack").exists()


@as_root
def test_the_wait_says_whose_lock_it_is_when_not_this_users(tmp_path: Path) -> None:
    holder = subprocess.Popen(["sleep", "60"], user=OTHER_UID)
    lock = tmp_path / ".bundle.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{holder.pid}\n".encode())
        _ofd_lock(fd)
        lines: list[str] = []
        with pytest.raises(MarlinPackError, match=rf"still locked after 0 s: pid {holder.pid} of uid {OTHER_UID}, not a conversion "
                           r"of this user, holds the lock of"), output_lock(tmp_path / "bundle", on_wait=lines.append, wait_s=0.3):
            pass
        assert lines and f"pid {holder.pid} of uid {OTHER_UID}, not a conversion of this user" in lines[0]
    finally:
        os.close(fd)
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_lock_wait_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MARLIN_PACK_LOCK_WAIT_S", value)
    with pytest.raises(MarlinPackError, match=r"MARLIN_PACK_LOCK_WAIT_S=.* is not a number of seconds; expected e.g. 1800, or inf"), \
            output_lock(tmp_path / "bundle"):
        pass


# item 8: an up-to-date bundle needs no write access


def test_an_up_to_date_bundle_is_reported_without_taking_the_lock(awq: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    convert(awq)

    def read_only(out: Path, *args: object, **kwargs: object) -> None:
        raise MarlinPackError(f"cannot make the lock file {out.parent}/.{out.name}.lock (Read-only file system); choose ...")

    monkeypatch.setattr(conversion, "output_lock", read_only)
    assert convert(awq).reused
    with pytest.raises(MarlinPackError, match=r"marlin-pack is not up to date \(tp2 is not in it\) and cannot be updated: "
                       r"cannot make the lock file"):
        convert(awq, tp=(2,))  # what is wrong with the bundle first, then that its folder is read-only
    with pytest.raises(MarlinPackError, match=r"cannot make the lock file"):
        convert(awq, force=True)


def test_an_up_to_date_bundle_on_a_read_only_volume_is_up_to_date(awq: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a read-only bind mount")
    convert(awq)
    wrap = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(awq)]
    probe = subprocess.run([*wrap, "touch", str(awq / "probe")], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0 or (awq / "probe").exists():
        pytest.skip(f"no read-only bind mount here: {probe.stderr.strip()}")
    code = "import sys; from marlin_pack.cli import main; sys.argv = ['marlin-pack', 'convert', sys.argv[1]]; main()"
    r = subprocess.run([*wrap, sys.executable, "-c", code, str(awq)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
