"""Writing a bundle: :class:`BundleWriter` owns the lock, the temporary directory, the files and the publish.

Everything is written into ``.NAME.tmp-PID-XXXX`` beside the output and renamed into place at
the end, so an interrupted or failed conversion never leaves a directory that looks like a
bundle; on any error (SIGINT, SIGTERM and SIGHUP included) the temporary directory is
removed, and temporary directories of dead conversions (SIGKILL) are removed by the next one.
A lock (``.NAME.lock`` beside the output, removed at the end) keeps two conversions from writing
one output: the second waits for the first (:func:`output_lock`). Publishing never clobbers: the
rename succeeds only onto nothing, or, with ``--force``, onto a directory that is a marlin-pack bundle and holds nothing else.

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
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marlin_pack._constants import COMMON_FILE, FORMAT_VERSION, LEGACY_STAMPS_NAME, MANIFEST_NAME
from marlin_pack.bundle.rank_files import common_metadata, rank_file_path, rank_metadata
from marlin_pack.bundle.reader import listed_files
from marlin_pack.errors import BundleError, MarlinPackError, OutputExistsError
from marlin_pack.io.files import rename_no_replace
from marlin_pack.io.hashing import HashedFile
from marlin_pack.io.safetensors_io import StreamWriter
from marlin_pack.io.stamps import StampStore
from marlin_pack.schemas import FileEntry, LayerEntry, Manifest, MoeLayerEntry, RankEntry, TensorParallelSet

if TYPE_CHECKING:
    import torch

    from marlin_pack.marlin.rank_tensors import TensorSpec

__all__ = ["Interrupted", "check_output", "output_lock", "foreign_entry", "BundleWriter"]

# The common file's tensors queued for writing at most (see BundleWriter.write_common).
_COMMON_BYTES_IN_FLIGHT = 1 << 30

# errnos for which "free space" is the right advice
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while writing (SIGINT arrives as a plain KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def foreign_entry(out: Path) -> str | None:
    """Why ``out`` is not a bundle that ``--force`` may replace, or None if it is one.

    A replaceable bundle parses as a marlin-pack manifest (of any format version: re-converting
    is how an older bundle is upgraded) and holds only what a conversion writes: the manifest,
    the common file and the rank files (and their folders), and the stamp cache older versions
    kept in the bundle.
    """
    try:
        files = listed_files(out)
    except BundleError as e:
        return f"it is not a marlin-pack bundle ({e})"
    allowed = {MANIFEST_NAME, LEGACY_STAMPS_NAME, *files}
    folders = {str(Path(p).parent) for p in allowed} - {"."}
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if rel in allowed and path.is_file() and not path.is_symlink():
            continue
        if rel == LEGACY_STAMPS_NAME and not path.is_symlink() and (not path.is_dir() or not any(path.iterdir())):
            continue  # a damaged stamp cache (FIFO, empty directory) is still only a cache
        if rel.startswith(f"{LEGACY_STAMPS_NAME}.") and rel.endswith(".tmp") and path.is_file():
            continue  # a stamp-cache write interrupted by a crash
        if rel in folders and path.is_dir() and not path.is_symlink():
            continue
        return f"it holds {rel}, which no conversion writes"
    return None


def check_output(model_dir: Path, out: Path, force: bool) -> Path:
    """The directory to publish at (``out``, or its target if it is a symlink), if it may be written.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is off, holds the checkpoint, or is
            not a bundle that ``force`` may replace.
    """
    if out.is_symlink():
        out = out.resolve()  # replace the link's target, keep the link (the user's layout)
    if not os.path.lexists(out):
        return out
    if not force:
        raise OutputExistsError(f"{out} already exists; pass --force to replace it or -o to write elsewhere")
    if model_dir.resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{out} holds the checkpoint itself; choose another output with -o")
    if not (out / MANIFEST_NAME).is_file():
        raise OutputExistsError(f"{out} exists and is not a marlin-pack bundle (no {MANIFEST_NAME}); refusing to replace it")
    why = foreign_entry(out)
    if why is not None:
        raise OutputExistsError(f"{out} exists and {why}; refusing to replace it, remove it yourself or use -o")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temp_dirs(out: Path) -> None:
    """Temporary directories of conversions to ``out`` whose process is gone (SIGKILL, power loss)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.tmp-(\d+)-")
    for path in out.parent.glob(f".{out.name}.tmp-*"):
        m = pattern.match(path.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


_WAIT_NOTICE_S = 30.0  # how often a waiting conversion says it is still waiting


def _lock_holder(fd: int) -> str:
    """``" (pid N)"`` from a lock file's text, or nothing: the file is untrusted (another user may have made it)."""
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        if text.isdigit():
            return f" (pid {int(text)})"
    return ""


@contextlib.contextmanager
def output_lock(out: Path, on_wait: Callable[[str], None] | None = None, poll_s: float = 0.2) -> Iterator[None]:
    """Hold the lock of ``out`` (``.NAME.lock`` beside it): one conversion writes ``out`` at a time.

    A second conversion of the same output **waits** for the first (pods whose init containers start
    together), saying so through ``on_wait`` at once and every 30 s, and then decides again with the
    first one's result in place (usually: up to date). The lock is ``flock`` on a file opened without
    following a symlink; a holder that dies releases it. Removed at the end: a waiter that then holds a
    lock on the removed file tries again, so two conversions never both believe they hold it.

    Raises:
        MarlinPackError: the lock file cannot be made (an unwritable folder) or is not a regular file.
    """
    import fcntl

    path = out.parent / f".{out.name}.lock"
    began = time.monotonic()
    noticed = -_WAIT_NOTICE_S
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise MarlinPackError(
                f"cannot make the lock file {path} ({e.strerror or e}); choose a writable location with -o"
            ) from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise MarlinPackError(f"{path} is not a regular file; remove it (it is only a lock) or choose another -o")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = time.monotonic() - began
                if on_wait is not None and waited - noticed >= _WAIT_NOTICE_S:
                    noticed = waited
                    on_wait(f"another marlin-pack conversion{_lock_holder(fd)} is writing {out}; waiting for it "
                            f"({waited:.0f} s so far)")
                os.close(fd)
                fd = -1
                time.sleep(poll_s)
                continue
            try:
                same = os.fstat(fd).st_ino == os.lstat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file as we took the lock: take the new one
                continue
            if os.fstat(fd).st_uid == os.geteuid():  # ours: say who holds it (never write into another user's file)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return
        finally:
            if fd >= 0:
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
        advice = "free space or choose another place with -o"
    else:
        advice = "check that location (permissions, open-file limit, a concurrent writer) or choose another place with -o"
    return MarlinPackError(f"writing the bundle under {out.parent} failed ({e.strerror or e}); {advice}")


class BundleWriter:
    """One bundle being written into ``tmp``, to be published at ``out``; use :meth:`create`."""

    def __init__(self, out: Path, tmp: Path, force: bool, format_version: int = FORMAT_VERSION, direct: bool = True) -> None:
        self.out = out
        self.direct = direct  # files written around the page cache (see marlin_pack.io.residency.write_through_cache)
        self.tmp = tmp
        self.force = force
        self.format_version = format_version  # written into every file's metadata; the manifest's must match
        self._common: StreamWriter | None = None
        self._ranks: dict[tuple[int, int], StreamWriter] = {}
        self._open: list[StreamWriter] = []
        self._published = False

    @classmethod
    @contextlib.contextmanager
    def create(
        cls, out: Path, *, force: bool = False, locked: bool = False, format_version: int = FORMAT_VERSION, direct: bool = True
    ) -> Iterator[BundleWriter]:
        """A locked writer over a fresh temporary directory beside ``out``, removed unless :meth:`finish` ran.

        ``locked``: the caller holds :func:`output_lock` of ``out`` already (else it is taken here, waiting for
        another conversion of ``out``). ``direct``: write the files around the page cache (False: through it, so
        that they are in the page cache afterwards).

        Raises:
            MarlinPackError: the parent of ``out`` is not writable, or writing failed (disk full, ...).
        """
        with contextlib.ExitStack() as stack:
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                if not locked:
                    stack.enter_context(output_lock(out))
                _remove_stale_temp_dirs(out)
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a vLLM run by another user must read it
            except OSError as e:
                raise MarlinPackError(f"cannot write to {out.parent} ({e.strerror}); choose a writable location with -o") from e
            writer = cls(out, tmp, force, format_version, direct)
            try:
                with _signals_interrupt():
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
        w = self._track(StreamWriter(self.tmp / COMMON_FILE, specs, meta, None, _COMMON_BYTES_IN_FLIGHT, direct=self.direct))
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
        path = self.tmp / rank_file_path(tp_size, rank)
        path.parent.mkdir(exist_ok=True)
        w = self._track(StreamWriter(path, specs, rank_metadata(tp_size, rank, self.format_version), **{"direct": self.direct, **options}))
        self._ranks[(tp_size, rank)] = w
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
        """Write the manifest, then publish the bundle at ``out`` and stamp its files and the source's.

        Stamps go to this user's stamp store (:mod:`marlin_pack.io.stamps`), so that this user's
        first start need not hash again: the bundle files, hashed while this process wrote them
        (stamped only where no one else could write them), and the source files as hashed.

        Args:
            source_hashes: the source files hashed while converting (identity held still while hashed).

        Raises:
            OutputExistsError: something that may not be replaced appeared at ``out`` meanwhile.
        """
        with open(self.tmp / MANIFEST_NAME, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        self._publish()
        self._published = True
        with StampStore.open() as stamps:  # after the rename: it keeps each file's identity
            for entry in manifest.files():
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

    def _publish(self) -> None:
        """Rename ``tmp`` onto nothing; with ``force``, an existing bundle is moved aside first, then removed."""
        old = None
        if os.path.lexists(self.out):
            if not self.force:
                raise OutputExistsError(f"{self.out} appeared while converting; nothing was replaced, pass --force or -o")
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.rename(self.out, old)
            why = foreign_entry(old)  # re-checked on what was actually moved: it may have changed since
            if why is not None:
                os.rename(old, self.out)
                raise OutputExistsError(f"{self.out} changed while converting and {why}; nothing was replaced")
        try:
            rename_no_replace(self.tmp, self.out)
        except FileExistsError as e:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            raise OutputExistsError(f"{self.out} appeared while converting; nothing was replaced, pass --force or -o") from e
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _abort(self) -> None:
        for w in self._open:
            with contextlib.suppress(Exception):
                w.abort()
        self._open.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
