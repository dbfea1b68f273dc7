"""Writing a bundle: :class:`BundleWriter` owns the lock, the temporary directory, the files and the publish.

Everything is written into ``.NAME.tmp-PID-XXXX`` beside the output and renamed into place at
the end, so an interrupted or failed conversion never leaves a directory that looks like a
bundle; on any error (SIGINT, SIGTERM and SIGHUP included) the temporary directory is
removed, and temporary directories of dead conversions (SIGKILL) are removed by the next one.
A lock (``.NAME.lock`` beside the output, removed at the end) keeps two conversions from writing
one output: the second waits for the first, for a bounded time (:mod:`marlin_pack.bundle.output_lock`). Publishing
never clobbers: the rename succeeds only onto nothing, or, with ``--force``, onto a directory that is a marlin-pack
bundle and holds nothing else.

The output's parent may be writable by another user (her model directory, a shared model tree or
cache), who can rename any entry there and put a symlink or a directory of symlinks in its place at
any moment. So nothing is written by a path: the temporary directory is made and then held by a
descriptor, every file and folder of the bundle is created relative to it (new, never through a
symlink: :mod:`marlin_pack.io.files`), the directory renamed into place is checked to be the one made,
and removals go through held descriptors too. A symlink at the output is followed only when its
owner is this user or root (:func:`follow_output`); the lock file is this user's (or root's), 0600,
and locked through a write descriptor.

    with output_lock(out):                               # waits for another conversion of out
        out = check_output(model_dir, out, force)        # before the long work
        with BundleWriter.create(out, force=force, locked=True) as bundle:
            bundle.write_common(specs, read_tensor)      # written in the background
            writer = bundle.open_rank(tp, rank, specs)   # StreamWriter; write tensors in order
            common = bundle.close_common()               # its FileEntry, once written and fsynced
            sets = bundle.close_ranks(layers_by_tp)
            bundle.finish(manifest, source_hashes)       # manifest, stamps, fsync, atomic rename
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marlin_pack._constants import COMMON_FILE, FORMAT_VERSION, LEGACY_STAMPS_NAME, MANIFEST_NAME
from marlin_pack.bundle.existing import is_own_entry
from marlin_pack.bundle.in_place import open_output, open_parent, publish_in_place
from marlin_pack.bundle.output_lock import output_lock
from marlin_pack.bundle.rank_files import common_metadata, rank_file_path, rank_metadata
from marlin_pack.bundle.reader import listed_files
from marlin_pack.errors import BundleError, MarlinPackError, OutputExistsError
from marlin_pack.io.files import (
    create_file,
    owner_text,
    remove_contents,
    rename_no_replace,
    same_file,
    trusted_link,
)
from marlin_pack.io.hashing import HashedFile
from marlin_pack.io.safetensors_io import StreamWriter
from marlin_pack.io.stamps import StampStore
from marlin_pack.schemas import FileEntry, LayerEntry, Manifest, MoeLayerEntry, RankEntry, TensorParallelSet

if TYPE_CHECKING:
    import torch

    from marlin_pack.marlin.rank_tensors import TensorSpec

__all__ = ["Interrupted", "check_output", "follow_output", "foreign_entry", "remove_bundle", "BundleWriter"]

# The common file's tensors queued for writing at most (see BundleWriter.write_common).
_COMMON_BYTES_IN_FLIGHT = 1 << 30

# errnos for which "free space" is the right advice
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_MAX_LINKS = 40  # symlinks followed at most in one output path (the kernel's limit)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while writing (SIGINT arrives as a plain KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def foreign_entry(out: Path, shown: Path | None = None) -> str | None:
    """Why ``out`` is not a bundle that ``--force`` may replace, or None if it is one.

    A replaceable bundle parses as a marlin-pack manifest (of any format version: re-converting
    is how an older bundle is upgraded) and holds only what a conversion writes: the manifest,
    the common file and the rank files (and their folders), and the stamp cache older versions
    kept in the bundle. ``shown``: the path to name in the reason, where ``out`` is a held directory's.
    """
    try:
        files = listed_files(out)
    except BundleError as e:
        return f"it is not a marlin-pack bundle ({str(e).replace(str(out), str(shown or out))})"
    allowed = {MANIFEST_NAME, LEGACY_STAMPS_NAME, *files}
    folders = {str(Path(p).parent) for p in allowed} - {"."}
    name = (shown or out).name
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if rel in allowed and path.is_file() and not path.is_symlink():
            continue
        top = out / rel.partition("/")[0]
        if is_own_entry(top.name, shown or out) and top.is_dir() and not top.is_symlink():
            continue  # a temporary directory of an in-place update killed before it finished: the conversion's own
        if rel == f".{name}.lock" and path.is_file() and not path.is_symlink():
            continue
        if rel == LEGACY_STAMPS_NAME and not path.is_symlink() and (not path.is_dir() or not any(path.iterdir())):
            continue  # a damaged stamp cache (FIFO, empty directory) is still only a cache
        if rel.startswith(f"{LEGACY_STAMPS_NAME}.") and rel.endswith(".tmp") and path.is_file():
            continue  # a stamp-cache write interrupted by a crash
        if rel in folders and path.is_dir() and not path.is_symlink():
            continue
        return f"it holds {rel}, which no conversion writes"
    return None


def _follow_link(path: Path) -> Path:
    """``path`` with its final symlinks followed, each only if its owner is this user or root."""
    followed = False
    for _ in range(_MAX_LINKS):
        try:
            st = os.lstat(path)
        except OSError:  # nothing there (or not searchable): what writes there says so
            break
        if not stat.S_ISLNK(st.st_mode):
            break
        if not trusted_link(st):
            raise OutputExistsError(
                f"{path} is a symlink owned by {owner_text(st.st_uid)}, not by this user or root; refusing to follow it (its owner "
                "could point it anywhere): remove it, or pass its target as `output=DIR` if you trust it"
            )
        path = Path(os.path.realpath(path.parent)) / os.readlink(path)
        followed = True
    else:
        raise OutputExistsError(
            f"{path} is a chain of more than {_MAX_LINKS} symlinks; expected a directory: remove it or pass `output=DIR`"
        )
    if not followed:
        return path
    # The checked links are not followed again: only the parent is resolved (a final "." or ".." names a directory).
    return Path(os.path.realpath(path)) if path.name in ("", ".", "..") else Path(os.path.realpath(path.parent)) / path.name


def follow_output(out: Path, base: Path | None = None) -> Path:
    """Where to write the bundle ``out``: ``out``, or its target where it is a symlink this user may trust.

    A symlink at the output is followed (the bundle replaces the link's target and the link stays:
    the user's layout) only when its owner is this user or root, as the kernel's ``protected_symlinks``
    rule has it: another user's link could point anywhere, into a 0700 directory of root's too. With
    ``base`` (marlin-pack's cache, for a model id's entry), every component of ``out`` below ``base`` is
    held to the same rule.

    Raises:
        OutputExistsError: a symlink owned by another user (named), or a loop of symlinks.
    """
    if base is None or not out.is_relative_to(base):
        return _follow_link(out)
    path = base
    for part in out.relative_to(base).parts:
        path = _follow_link(path / part)
    return path


def check_output(model_dir: Path, out: Path, force: bool) -> Path:
    """The directory to publish at (``out``, or its target if it is a symlink: :func:`follow_output`), if it may be written.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is off, holds the checkpoint, or is
            not a bundle that ``force`` may replace; ``out`` is another user's symlink.
    """
    out = follow_output(out)
    if not os.path.lexists(out):
        return out
    if not force:
        raise OutputExistsError(f"{out} already exists; pass `force=True` to replace it or `output=DIR` to write elsewhere")
    if model_dir.resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{out} holds the checkpoint itself; choose another output (`output=DIR`)")
    if not (out / MANIFEST_NAME).is_file():
        raise OutputExistsError(f"{out} exists and is not a marlin-pack bundle (no {MANIFEST_NAME}); refusing to replace it")
    why = foreign_entry(out)
    if why is not None:
        raise OutputExistsError(f"{out} exists and {why}; refusing to replace it, remove it yourself or use another `output=DIR`")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_held(name: str, parent_fd: int, fd: int) -> None:
    """Remove the directory held by ``fd``: its contents through ``fd``, then its entry ``name`` only if it is still that directory."""
    remove_contents(fd)
    with contextlib.suppress(OSError):
        if same_file(os.lstat(name, dir_fd=parent_fd), os.fstat(fd)):
            os.rmdir(name, dir_fd=parent_fd)


def remove_bundle(path: Path) -> str | None:
    """Remove the bundle directory ``path`` (never through a symlink) if it is one: why it is not, or None once removed.

    Checked (:func:`foreign_entry`) and removed through one descriptor, so a directory renamed into its
    place after the check (by another user who may write its folder) is not what is removed.
    """
    try:
        parent_fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        return f"cannot be opened ({e.strerror or e})"
    try:
        try:
            fd = os.open(path.name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError:
            return "is not a directory"
        try:
            why = foreign_entry(_held_path(fd, path), path)
            if why is None:
                _remove_held(path.name, parent_fd, fd)
            return why
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


def _remove_stale_temp_dirs(out: Path, parent_fd: int) -> None:
    """Temporary directories of this user's conversions to ``out`` whose process is gone (SIGKILL, power loss).

    Only real directories of this user (another user may name anything so), emptied through a descriptor.
    """
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.tmp-(\d+)-")
    with os.scandir(parent_fd) as entries:
        found = [(e.name, int(m.group(1))) for e in entries if (m := pattern.match(e.name))]
    for name, pid in found:
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            st = os.lstat(name, dir_fd=parent_fd)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError:
            continue
        try:
            if same_file(os.fstat(fd), st):
                _remove_held(name, parent_fd, fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (``timeout``, ``docker stop``, systemd) raise :class:`Interrupted`, like SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _write_failed(out: Path, e: OSError) -> MarlinPackError:
    if e.errno in _NO_SPACE:
        advice = "free space or choose another place (`output=DIR`)"
    else:
        advice = "check that location (permissions, open-file limit, a concurrent writer) or choose another place (`output=DIR`)"
    return MarlinPackError(f"writing the bundle under {out.parent} failed ({e.strerror or e}); {advice}")


class BundleWriter:
    """One bundle being written into a temporary directory it made and holds, to be published at ``out``; use :meth:`create`."""

    def __init__(
        self, out: Path, parent_fd: int, name: str, fd: int, force: bool, format_version: int = FORMAT_VERSION, direct: bool = True,
        in_place: bool = False,
    ) -> None:
        self.out = out
        self.direct = direct  # files written around the page cache (see marlin_pack.io.residency.write_through_cache)
        self.in_place = in_place  # published into out itself, entry by entry (marlin_pack.bundle.in_place)
        self.tmp = (out if in_place else out.parent) / name  # where the directory was made (messages; every write goes through _fd)
        self._parent_fd = parent_fd  # the folder of out (in place: out), held
        self._written: list[str] = []  # the bundle files written (and so stamped) by this writer
        self._name = name  # the temporary directory's name in it
        self._fd = fd  # the temporary directory, held from its making
        self._folders: dict[str, int] = {}  # its folders (tp2, ...), made and held
        self.force = force
        self.format_version = format_version  # written into every file's metadata; the manifest's must match
        self._common: StreamWriter | None = None
        self._ranks: dict[tuple[int, int], StreamWriter] = {}
        self._open: list[StreamWriter] = []
        self._published = False

    @classmethod
    @contextlib.contextmanager
    def create(
        cls, out: Path, *, force: bool = False, locked: bool = False, format_version: int = FORMAT_VERSION, direct: bool = True,
        in_place: bool = False, expect: tuple[int, int] | None = None,
    ) -> Iterator[BundleWriter]:
        """A locked writer over a fresh temporary directory beside ``out``, removed unless :meth:`finish` ran.

        ``locked``: the caller holds :func:`output_lock` of ``out`` already (else it is taken here, waiting for
        another conversion of ``out``). ``direct``: write the files around the page cache (False: through it, so
        that they are in the page cache afterwards). ``in_place``: ``out`` is a directory (a bundle to extend or
        heal, an empty one) and the temporary directory is made in it, its entries moved into ``out`` by :meth:`finish`
        (:mod:`marlin_pack.bundle.in_place`); ``expect``: ``out``'s (device, inode) when it was decided on.

        Raises:
            MarlinPackError: the parent of ``out`` is not writable, or writing failed (disk full, ...).
        """
        with contextlib.ExitStack() as stack:
            if not locked:
                stack.enter_context(output_lock(out))
            parent_fd = open_output(out, expect) if in_place else open_parent(out)
            stack.callback(os.close, parent_fd)
            # From before the temporary directory exists: a SIGTERM/SIGHUP that finds it always finds the handler.
            stack.enter_context(_signals_interrupt())
            try:
                _remove_stale_temp_dirs(out, parent_fd)
                name, fd = _make_temp_dir(out, parent_fd)
            except OSError as e:
                where = out if in_place else out.parent
                raise MarlinPackError(f"cannot write to {where} ({e.strerror}); choose a writable location (`output=DIR`)") from e
            writer = cls(out, parent_fd, name, fd, force, format_version, direct, in_place)
            stack.callback(writer._close_folders)
            try:
                yield writer
                if not writer._published:
                    raise RuntimeError("internal error: the bundle was never finished")
            except BaseException as e:
                writer._abort()
                if isinstance(e, OSError):
                    raise _write_failed(out, e) from e
                raise

    def write_common(self, specs: list[TensorSpec], read: Callable[[str], torch.Tensor]) -> None:
        """Start ``common.safetensors``: the checkpoint's non-quantized tensors, as they are.

        The file's writer thread goes on writing (from the checkpoint's memory map) while the
        caller converts layers; :meth:`close_common` waits for it. Closing here instead kept
        the first layer waiting for the embeddings' write and fsync (~0.5 s of llama-1gb's ~3 s).
        """
        # Limited by bytes, not by count: llama-1gb's two embeddings (262 MB) go into flight at once,
        # so the first layer does not wait for them. safetensors >= 0.8 reads them as views of the
        # memory map (page cache, not heap); the byte limit bounds memory where it copies them.
        meta = common_metadata(self.format_version)
        w = StreamWriter(self.tmp / COMMON_FILE, specs, meta, None, _COMMON_BYTES_IN_FLIGHT, direct=self.direct, dir_fd=self._fd)
        self._track(w)
        self._written.append(COMMON_FILE)
        for name, _, _ in specs:
            w.write(name, read(name))
        self._common = w

    def close_common(self) -> FileEntry:
        """Finish ``common.safetensors`` (started by :meth:`write_common`): its manifest entry."""
        if self._common is None:
            raise RuntimeError("internal error: close_common before write_common")
        size, sha = self._close(self._common)
        return FileEntry(path=COMMON_FILE, size=size, blake3=sha)

    def open_rank(self, tp_size: int, rank: int, specs: list[TensorSpec], **options: Any) -> StreamWriter:
        """Start one rank file; write its tensors, in ``specs`` order, to the returned writer.

        ``options``: the :class:`~marlin_pack.io.safetensors_io.StreamWriter`'s (in-flight limits, pinned buffers, hash threads);
        bundle files are written as :attr:`direct` says unless ``direct`` is given (see :mod:`marlin_pack.io.direct_file`).
        """
        rel = rank_file_path(tp_size, rank)
        folder = self._folder(rel.rpartition("/")[0])
        meta = rank_metadata(tp_size, rank, self.format_version)
        w = self._track(StreamWriter(self.tmp / rel, specs, meta, **{"direct": self.direct, **options, "dir_fd": folder}))
        self._ranks[(tp_size, rank)] = w
        self._written.append(rel)
        return w

    def close_ranks(
        self, layers: dict[int, list[LayerEntry]], moe_layers: dict[int, list[MoeLayerEntry]] | None = None
    ) -> list[TensorParallelSet]:
        """Close every rank file; the manifest's tensor-parallel sets, ascending TP size (``moe_layers``: experts layers)."""
        sets = []
        for tp in sorted(layers):
            ranks = []
            for rank in range(tp):
                size, sha = self._close(self._ranks[(tp, rank)])
                entry = FileEntry(path=rank_file_path(tp, rank), size=size, blake3=sha)
                ranks.append(RankEntry(rank=rank, file=entry))
            sets.append(TensorParallelSet(tp_size=tp, ranks=ranks, layers=layers[tp], moe_layers=(moe_layers or {}).get(tp, [])))
        return sets

    def finish(self, manifest: Manifest, source_hashes: list[HashedFile]) -> None:
        """Write the manifest, then publish the bundle at ``out`` and stamp the files written and the source's.

        Stamps go to this user's stamp store (:mod:`marlin_pack.io.stamps`), so that this user's
        first start need not hash again: the bundle files, hashed while this process wrote them
        (stamped only where no one else could write them), and the source files as hashed. In place, the
        files the manifest lists and this writer did not write are the ones kept: neither moved nor stamped.

        Args:
            source_hashes: the source files hashed while converting (identity held still while hashed).

        Raises:
            OutputExistsError: something that may not be replaced appeared at ``out`` meanwhile.
            MarlinPackError: the temporary directory was replaced meanwhile (nothing is published).
        """
        with os.fdopen(create_file(MANIFEST_NAME, self._fd), "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        if self.in_place:
            folders = {name: fd for name, fd in self._folders.items() if "/" not in name}
            publish_in_place(self.out, self._parent_fd, self._fd, folders, COMMON_FILE in self._written,
                             [e.path for e in manifest.files()])
            self._published = True
            _remove_held(self._name, self._parent_fd, self._fd)  # the temporary directory, with the old files moved aside
        else:
            self._publish()
            self._published = True
        written = set(self._written)
        with StampStore.open() as stamps:  # after the rename (ext4 gives a renamed file a new ctime)
            for entry in manifest.files():
                if entry.path in written:
                    stamps.record_written(self.out / entry.path, entry.blake3)
            for hashed in source_hashes:
                stamps.record(hashed)

    def _track(self, w: StreamWriter) -> StreamWriter:
        self._open.append(w)
        return w

    def _close(self, w: StreamWriter) -> tuple[int, str]:
        result = w.close()
        self._open.remove(w)
        return result

    def _folder(self, name: str) -> int:
        """The held folder ``name`` of the temporary directory, made at its first use."""
        if name not in self._folders:
            os.mkdir(name, 0o777, dir_fd=self._fd)  # a new one: FileExistsError if anything is there
            self._folders[name] = os.open(name, _DIR_FLAGS, dir_fd=self._fd)
        return self._folders[name]

    def _close_folders(self) -> None:
        for fd in self._folders.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._folders.clear()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _replaced(self, what: str) -> MarlinPackError:
        return MarlinPackError(
            f"{self.tmp}, this conversion's temporary directory, was {what} while converting; expected the directory it made: "
            f"nothing was published, make sure only you can write {self.out.parent} and convert again"
        )

    def _publish(self) -> None:
        """Rename the temporary directory onto nothing, after checking it is the one made; with ``force``, an existing bundle
        is moved aside first, then removed."""
        try:
            held = same_file(os.lstat(self._name, dir_fd=self._parent_fd), os.fstat(self._fd))
        except FileNotFoundError:
            held = False
        if not held:
            raise self._replaced("replaced")
        old = None
        if _lexists(self.out.name, self._parent_fd):
            if not self.force:
                raise OutputExistsError(f"{self.out} appeared while converting; nothing was replaced, pass `force=True` or `output=DIR`")
            old = self._move_aside()
        try:
            rename_no_replace(self._name, self.out.name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
        except FileExistsError as e:
            self._drop_old(old)
            raise OutputExistsError(f"{self.out} appeared while converting; nothing was replaced, pass `force=True` or `output=DIR`") from e
        except BaseException:
            if old is not None:  # the old bundle goes back where it was
                with contextlib.suppress(OSError):
                    rename_no_replace(old[0], self.out.name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
                os.close(old[1])
            raise
        self._drop_old(old)
        try:
            published = same_file(os.lstat(self.out.name, dir_fd=self._parent_fd), os.fstat(self._fd))
        except FileNotFoundError:
            published = False
        if not published:  # swapped between the check and the rename: what was renamed is not this bundle
            with contextlib.suppress(OSError):
                rename_no_replace(self.out.name, self._name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
            raise self._replaced("replaced")

    def _drop_old(self, old: tuple[str, int] | None) -> None:
        """Remove the bundle moved aside, through its descriptor."""
        if old is not None:
            _remove_held(old[0], self._parent_fd, old[1])
            os.close(old[1])

    def _move_aside(self) -> tuple[str, int]:
        """Move the bundle at ``out`` aside (``force``) and hold it: its name and descriptor, once checked to be a bundle.

        Re-checked on what was actually moved, through the descriptor: it may have changed since :func:`check_output`.
        """
        name = f".{self.out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        rename_no_replace(self.out.name, name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._parent_fd)
        except OSError:
            fd = -1
        why = "it is not a directory" if fd < 0 else foreign_entry(_held_path(fd, self.out.parent / name), self.out)
        if why is not None:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                rename_no_replace(name, self.out.name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
            raise OutputExistsError(f"{self.out} changed while converting and {why}; nothing was replaced")
        return name, fd

    def _abort(self) -> None:
        for w in self._open:
            with contextlib.suppress(Exception):
                w.abort()
        self._open.clear()
        if not self._published:  # through the descriptors: whatever was put at the temporary path meanwhile is not touched
            _remove_held(self._name, self._parent_fd, self._fd)


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _held_path(fd: int, fallback: Path) -> Path:
    """A path that reaches the directory held by ``fd`` whatever is renamed meanwhile (``/proc/self/fd/N``), else ``fallback``."""
    path = Path(f"/proc/self/fd/{fd}")
    return path if path.is_dir() else fallback


def _make_temp_dir(out: Path, parent_fd: int) -> tuple[str, int]:
    """A new directory ``.NAME.tmp-PID-XXXXXXXX`` in the folder of ``out``, and its descriptor, held from now on.

    Made 0700, so that no one else can have put anything in it, checked to be the one made (ours, empty), then
    given the umask's permissions (a vLLM run by another user must read the bundle).
    """
    umask = os.umask(0)
    os.umask(umask)
    for _ in range(100):
        name = f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or os.listdir(fd):
            os.close(fd)
            raise MarlinPackError(
                f"{out.parent / name} was replaced as it was made; expected the directory this conversion made: make sure only "
                f"you can write {out.parent} and convert again"
            )
        os.fchmod(fd, 0o777 & ~umask)
        return name, fd
    raise FileExistsError(errno.EEXIST, "no free name for a temporary directory", str(out.parent))
