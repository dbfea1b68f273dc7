"""Writing a bundle: :class:`BundleWriter` owns the temporary directory, the files and the publish.

Everything is written into ``.NAME.tmp-XXXX`` beside the output and renamed into place at
the end, so an interrupted or failed conversion never leaves a directory that looks like a
bundle; on any error the temporary directory is removed.

    check_output(model_dir, out, force)                  # before the long work
    with BundleWriter.create(out) as bundle:
        common = bundle.write_common(specs, read_tensor)
        writer = bundle.open_rank(tp, rank, specs)       # StreamWriter; write tensors in order
        sets = bundle.close_ranks(layers_by_tp)
        bundle.finish(manifest, source_stamps)           # manifest, stamps, fsync, atomic rename
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from marlin_pack._constants import COMMON_FILE, MANIFEST_NAME, STAMPS_NAME
from marlin_pack.bundle.rank_files import common_metadata, rank_file_path, rank_metadata
from marlin_pack.errors import MarlinPackError, OutputExistsError
from marlin_pack.io.hashing import StampCache
from marlin_pack.io.safetensors_io import StreamWriter
from marlin_pack.schemas import FileEntry, LayerEntry, Manifest, RankEntry, TensorParallelSet

if TYPE_CHECKING:
    import torch

    from marlin_pack.marlin.rank_tensors import TensorSpec

__all__ = ["check_output", "BundleWriter"]


def check_output(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse to replace anything but an existing bundle, and never the checkpoint itself.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is off, holds the checkpoint, or is
            not a bundle.
    """
    if not out.exists():
        return
    if not force:
        raise OutputExistsError(f"{out} already exists; pass --force to replace it or -o to write elsewhere")
    if model_dir.resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{out} holds the checkpoint itself; choose another output with -o")
    if not (out / MANIFEST_NAME).is_file():
        raise OutputExistsError(f"{out} exists and is not a marlin-pack bundle (no {MANIFEST_NAME}); refusing to replace it")


class BundleWriter:
    """One bundle being written into ``tmp``, to be published at ``out``; use :meth:`create`."""

    def __init__(self, out: Path, tmp: Path) -> None:
        self.out = out
        self.tmp = tmp
        self._ranks: dict[tuple[int, int], StreamWriter] = {}
        self._open: list[StreamWriter] = []
        self._published = False

    @classmethod
    @contextlib.contextmanager
    def create(cls, out: Path) -> Iterator[BundleWriter]:
        """A writer over a fresh temporary directory beside ``out``, removed unless :meth:`finish` ran.

        Raises:
            MarlinPackError: the parent of ``out`` is not writable, or writing failed (disk full, ...).
        """
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a vLLM run by another user must read it
        except OSError as e:
            raise MarlinPackError(f"cannot write to {out.parent} ({e.strerror}); choose a writable location with -o") from e
        writer = cls(out, tmp)
        try:
            yield writer
            if not writer._published:
                raise RuntimeError("internal error: the bundle was never finished")
        except BaseException as e:
            writer._abort()
            if isinstance(e, OSError):
                raise MarlinPackError(
                    f"writing the bundle under {out.parent} failed ({e.strerror or e}); free space or choose another place with -o"
                ) from e
            raise

    def write_common(self, specs: list[TensorSpec], read: Callable[[str], torch.Tensor]) -> FileEntry:
        """Write ``common.safetensors``: the checkpoint's non-quantized tensors, as they are."""
        w = self._track(StreamWriter(self.tmp / COMMON_FILE, specs, common_metadata()))
        for name, _, _ in specs:
            w.write(name, read(name))
        size, sha = self._close(w)
        return FileEntry(path=COMMON_FILE, size=size, sha256=sha)

    def open_rank(self, tp_size: int, rank: int, specs: list[TensorSpec]) -> StreamWriter:
        """Start one rank file; write its tensors, in ``specs`` order, to the returned writer."""
        (self.tmp / rank_file_path(tp_size, rank)).parent.mkdir(exist_ok=True)
        w = self._track(StreamWriter(self.tmp / rank_file_path(tp_size, rank), specs, rank_metadata(tp_size, rank)))
        self._ranks[(tp_size, rank)] = w
        return w

    def close_ranks(self, layers: dict[int, list[LayerEntry]]) -> list[TensorParallelSet]:
        """Close every rank file; the manifest's tensor-parallel sets, ascending TP size."""
        sets = []
        for tp in sorted(layers):
            ranks = []
            for rank in range(tp):
                size, sha = self._close(self._ranks[(tp, rank)])
                ranks.append(RankEntry(rank=rank, file=FileEntry(path=rank_file_path(tp, rank), size=size, sha256=sha)))
            sets.append(TensorParallelSet(tp_size=tp, ranks=ranks, layers=layers[tp]))
        return sets

    def finish(self, manifest: Manifest, source_stamps: list[tuple[str, Path, str]]) -> None:
        """Write the manifest and the stamp cache, then publish the bundle at ``out``.

        Args:
            source_stamps: ``(stamp key, path, sha256)`` of source files hashed while converting,
                so the loader's first start need not hash them again.
        """
        with open(self.tmp / MANIFEST_NAME, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        # The hashes were just computed from these exact files: let the first start skip re-hashing.
        stamps = StampCache(self.tmp / STAMPS_NAME)
        for entry in manifest.files():
            stamps.record(entry.path, self.tmp / entry.path, entry.sha256)
        for key, path, sha in source_stamps:
            stamps.record(key, path, sha)
        stamps.save()
        self._swap_into_place()
        self._published = True

    def _track(self, w: StreamWriter) -> StreamWriter:
        self._open.append(w)
        return w

    def _close(self, w: StreamWriter) -> tuple[int, str]:
        result = w.close()
        self._open.remove(w)
        return result

    def _swap_into_place(self) -> None:
        """Rename ``tmp`` to ``out``; an existing ``out`` (``--force``) is moved aside first, then removed."""
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _abort(self) -> None:
        for w in self._open:
            with contextlib.suppress(Exception):
                w.abort()
        self._open.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
