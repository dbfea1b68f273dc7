"""Writing where another user may rename things: held directories, new files only, removal that never follows a symlink."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from marlin_pack.io.files import (
    UntrustedSymlinkError,
    create_file,
    open_dir,
    open_dirs,
    owner_text,
    remove_contents,
    rename_no_replace,
)

OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user's symlink needs root (lchown)")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    folder = tmp_path / "victim"
    (folder / "sub").mkdir(parents=True)
    (folder / "file").write_text("keep")
    (folder / "sub" / "file").write_text("keep too")
    return folder


def test_create_file_never_opens_an_existing_entry_or_a_symlink(tmp_path: Path, victim: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        (tmp_path / "link").symlink_to(victim / "file")
        with pytest.raises(FileExistsError):
            create_file("link", fd)
        new = create_file("new", fd, 0o600)
        os.write(new, b"x")
        os.close(new)
        assert (tmp_path / "new").read_bytes() == b"x" and ((tmp_path / "new").stat().st_mode & 0o777) == 0o600
        with pytest.raises(FileExistsError):
            create_file("new", fd)
    finally:
        os.close(fd)
    assert (victim / "file").read_text() == "keep"


def test_remove_contents_removes_links_never_their_targets(tmp_path: Path, victim: Path) -> None:
    held = tmp_path / "held"
    (held / "tp1").mkdir(parents=True)
    (held / "tp1" / "rank-0.safetensors").write_bytes(b"x")
    (held / "manifest.json").symlink_to(victim / "file")
    (held / "tp2").symlink_to(victim / "sub")
    fd = os.open(held, os.O_RDONLY)
    try:
        held.rename(tmp_path / "moved")  # what the descriptor holds is emptied, wherever it is now
        held.mkdir()
        (held / "theirs").write_text("not ours")
        remove_contents(fd)
    finally:
        os.close(fd)
    assert list((tmp_path / "moved").iterdir()) == [] and (held / "theirs").read_text() == "not ours"
    assert (victim / "file").read_text() == "keep" and (victim / "sub" / "file").read_text() == "keep too"


def test_rename_no_replace_relative_to_held_directories(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(FileExistsError):
            rename_no_replace("a", "b", src_dir_fd=fd, dst_dir_fd=fd)
        rename_no_replace("a", "c", src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]


def test_open_dirs_makes_the_missing_folders(tmp_path: Path) -> None:
    fd = open_dirs(tmp_path / "a" / "b" / "c")
    try:
        assert os.path.samestat(os.fstat(fd), (tmp_path / "a" / "b" / "c").stat())
    finally:
        os.close(fd)
    os.close(open_dirs(tmp_path / "a" / "b" / "c"))  # already there


def test_own_symlinks_are_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    fd = open_dir("link", os.open(tmp_path, os.O_RDONLY))
    try:
        assert os.path.samestat(os.fstat(fd), (tmp_path / "real").stat())
    finally:
        os.close(fd)


@as_root
def test_a_folder_planted_as_another_users_symlink_is_never_followed(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir

    def planting(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if path == "b":  # she wins the race for the folder about to be made
            os.symlink(victim, path, dir_fd=dir_fd)
            os.chown(path, OTHER_UID, OTHER_UID, dir_fd=dir_fd, follow_symlinks=False)
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", planting)
    with pytest.raises(UntrustedSymlinkError, match=rf"is a symlink owned by uid {OTHER_UID}, not by this user or root"):
        open_dirs(tmp_path / "a" / "b" / "c")
    assert sorted(p.name for p in victim.iterdir()) == ["file", "sub"]


def test_owner_text_names_the_user() -> None:
    assert owner_text(0) == "root (uid 0)"
    assert owner_text(OTHER_UID) == f"uid {OTHER_UID}"  # no such user here
