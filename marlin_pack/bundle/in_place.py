"""Publishing into the output directory itself: what ``convert`` does where the output is a directory already.

A bundle to extend or heal keeps the files it keeps (their identity too, so this user's stamps still vouch for
them), an empty directory or a volume mounted at the output cannot be replaced by a rename. So the new files are
written into a temporary directory made inside the output (by :class:`~marlin_pack.bundle.writer.BundleWriter`,
held by a descriptor) and moved into place one entry at a time, the manifest last: a TP size that is new moves in
as its folder; a file that is rewritten first moves the old one aside into the temporary directory, then the new
one in (``renameat2(RENAME_NOREPLACE)`` relative to held descriptors, never through a symlink, never onto anything).
A failure moves back what was moved; SIGINT, SIGTERM and SIGHUP wait until the moves are done. Files the old
manifest lists and the new one does not (the TP sizes dropped) are removed after the manifest, through descriptors.
Anything at a bundle path that is not what a conversion writes (a symlink, a directory where a file goes) is
refused, never moved or followed; entries the bundle does not name are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from marlin_pack._constants import COMMON_FILE, MANIFEST_NAME
from marlin_pack.bundle.reader import listed_files
from marlin_pack.errors import BundleError, MarlinPackError, OutputExistsError
from marlin_pack.io.files import UntrustedSymlinkError, open_dirs, rename_no_replace, same_file

__all__ = ["open_output", "open_parent", "publish_in_place"]

_RANK_FILE = re.compile(r"tp[1-9][0-9]*/rank-[0-9]+\.safetensors")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_output(out: Path, expect: tuple[int, int] | None = None) -> int:
    """A descriptor of the existing output directory ``out`` (never through a symlink), checked to be the one decided on.

    Raises:
        MarlinPackError: it cannot be opened; OutputExistsError: it is not the directory ``expect`` (device, inode) names.
    """
    try:
        fd = os.open(out, _DIR_FLAGS)
    except OSError as e:
        raise MarlinPackError(f"cannot write to {out} ({e.strerror or e}); choose a writable location (`output=DIR`)") from e
    st = os.fstat(fd)
    if expect is not None and (st.st_dev, st.st_ino) != expect:
        os.close(fd)
        raise OutputExistsError(f"{out} was replaced while converting; nothing was written, convert again")
    return fd


def open_parent(out: Path) -> int:
    """A descriptor of the folder ``out`` is published in, made if missing (never through another user's symlink).

    Raises:
        MarlinPackError: it cannot be made or opened (not writable, not a directory, another user's symlink).
    """
    try:
        return open_dirs(out.parent)
    except UntrustedSymlinkError as e:
        raise MarlinPackError(
            f"cannot write to {out.parent}: {e.filename} {e.strerror}; refusing to follow it: remove it or pass another `output=DIR`"
        ) from e
    except OSError as e:
        raise MarlinPackError(f"cannot write to {out.parent} ({e.strerror or e}); choose a writable location (`output=DIR`)") from e


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP are delivered only after the block (the main thread's), so moves are never cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _kind(mode: int) -> str:
    return "a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"


class _Moves:
    """The moves of one publish, undone in reverse order on failure."""

    def __init__(self, out: Path, out_fd: int, tmp_fd: int) -> None:
        self.out, self.out_fd, self.tmp_fd = out, out_fd, tmp_fd
        self._done: list[tuple[int, str, int, str, str | None]] = []  # (folder fd, name, new file's folder fd, its name, aside)
        self._fds: list[int] = []
        self._aside = 0

    def folder(self, name: str) -> int | None:
        """The held folder ``name`` of the output, or None where nothing is there.

        Raises:
            OutputExistsError: something other than a directory is there.
        """
        try:
            st = os.lstat(name, dir_fd=self.out_fd)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            raise OutputExistsError(
                f"{self.out / name} is {_kind(st.st_mode)}, expected a folder of rank files; nothing was replaced: "
                "remove it or pass `output=DIR`"
            )
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.out_fd)
        if not same_file(os.fstat(fd), st):
            os.close(fd)
            raise OutputExistsError(f"{self.out / name} changed while converting; nothing was replaced, convert again")
        self._fds.append(fd)
        return fd

    def move(self, src_fd: int, name: str, dst_fd: int, shown: str) -> None:
        """Move ``name`` from the held ``src_fd`` into the held ``dst_fd``, moving a file already there aside first."""
        aside = None
        try:
            st = os.lstat(name, dir_fd=dst_fd)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise OutputExistsError(
                    f"{self.out / shown} is {_kind(st.st_mode)}, expected a bundle file; nothing was replaced: "
                    "remove it or pass `output=DIR`"
                )
            self._aside += 1
            aside = f"old-{self._aside}"
            rename_no_replace(name, aside, src_dir_fd=dst_fd, dst_dir_fd=self.tmp_fd)
            if not same_file(os.lstat(aside, dir_fd=self.tmp_fd), st):  # swapped after the check: put it back, refuse
                with contextlib.suppress(OSError):
                    rename_no_replace(aside, name, src_dir_fd=self.tmp_fd, dst_dir_fd=dst_fd)
                raise OutputExistsError(f"{self.out / shown} changed while converting; nothing was replaced, convert again")
        try:
            rename_no_replace(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except BaseException:
            if aside is not None:
                with contextlib.suppress(OSError):
                    rename_no_replace(aside, name, src_dir_fd=self.tmp_fd, dst_dir_fd=dst_fd)
            raise
        self._done.append((dst_fd, name, src_fd, name, aside))

    def move_new(self, src_fd: int, name: str) -> None:
        """Move the folder ``name`` from the held ``src_fd`` into the output, where nothing is."""
        rename_no_replace(name, name, src_dir_fd=src_fd, dst_dir_fd=self.out_fd)
        self._done.append((self.out_fd, name, src_fd, name, None))

    def undo(self) -> None:
        """Move back what was moved (best effort): each new entry back where it was made, each old one into place."""
        for dst_fd, name, src_fd, src_name, aside in reversed(self._done):
            with contextlib.suppress(OSError):
                rename_no_replace(name, src_name, src_dir_fd=dst_fd, dst_dir_fd=src_fd)
                if aside is not None:
                    rename_no_replace(aside, name, src_dir_fd=self.tmp_fd, dst_dir_fd=dst_fd)
        self._done.clear()

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def _remove_listed(out_fd: int, paths: list[str]) -> None:
    """Remove the bundle files ``paths`` (``tpN/rank-M.safetensors``) of the output, regular files only, through
    descriptors; then each folder they leave empty. What cannot be removed stays (the manifest no longer names it)."""
    folders: set[str] = set()
    for rel in paths:
        folder, _, name = rel.rpartition("/")
        try:
            fd = os.open(folder, _DIR_FLAGS, dir_fd=out_fd) if folder else os.dup(out_fd)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.lstat(name, dir_fd=fd).st_mode):
                os.unlink(name, dir_fd=fd)
        except OSError:
            pass
        finally:
            os.close(fd)
        if folder and "/" not in folder:
            folders.add(folder)
    for folder in sorted(folders):
        with contextlib.suppress(OSError):
            os.rmdir(folder, dir_fd=out_fd)


def publish_in_place(out: Path, out_fd: int, tmp_fd: int, folders: dict[str, int], common: bool, new_files: list[str]) -> None:
    """Move what the temporary directory ``tmp_fd`` (inside the output ``out_fd``) holds into the output: the rank
    folders ``folders`` (name -> the temporary one's descriptor), the common file if ``common``, then the manifest;
    then remove the files the old manifest lists and the new one (``new_files``) does not.

    Raises:
        OutputExistsError: something not a conversion's is at a bundle path (nothing is then replaced).
        OSError: a move failed (what was moved is moved back).
    """
    held = Path(f"/proc/self/fd/{out_fd}")
    try:
        old_files = listed_files(held if held.is_dir() else out)
    except BundleError:  # a manifest that no longer parses lists nothing to remove
        old_files = []
    moves = _Moves(out, out_fd, tmp_fd)
    with _signals_held():
        try:
            for name, tmp_folder in sorted(folders.items()):
                there = moves.folder(name)
                if there is None:  # a TP size that is new: its folder moves in whole
                    moves.move_new(tmp_fd, name)
                    continue
                for file in sorted(os.listdir(tmp_folder)):
                    moves.move(tmp_folder, file, there, f"{name}/{file}")
            if common:
                moves.move(tmp_fd, COMMON_FILE, out_fd, COMMON_FILE)
            moves.move(tmp_fd, MANIFEST_NAME, out_fd, MANIFEST_NAME)
        except BaseException:
            moves.undo()
            raise
        finally:
            moves.close()
        dropped = set(old_files) - set(new_files)
        _remove_listed(out_fd, sorted(p for p in dropped if _RANK_FILE.fullmatch(p)))  # only what a conversion names so
