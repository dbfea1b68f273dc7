"""A HuggingFace checkpoint directory: its config, the headers of its safetensors files, its tensors.

Headers are parsed and checked up front (dtype, shape, offsets inside the file), so a
truncated or corrupt file is reported before any long work starts. Tensor data is read
lazily, one tensor at a time, with ``pread`` into memory of its own (:class:`~marlin_pack.io.preads.TensorFile`),
never through a memory map: a file truncated while a conversion reads it is a one-line refusal ("changed
while it was read"), not a SIGBUS that kills the process and leaves its lock and temporary directory behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from marlin_pack.errors import CheckpointError
from marlin_pack.io.checkpoint_files import FoundSettings, quant_settings, quantization_config, read_json, unreadable, weight_files
from marlin_pack.io.hashing import file_identity
from marlin_pack.io.preads import FileChangedError, TensorFile
from marlin_pack.io.safetensors_io import SafetensorsFormatError, TensorInfo, read_header, unpacked

__all__ = ["Checkpoint"]


class Checkpoint:
    """A local checkpoint directory: ``config.json`` and its safetensors files.

    Args:
        model_dir: directory holding ``config.json`` and ``*.safetensors``
            (one file, or several with ``model.safetensors.index.json``).
        open_file: opens a weight file for reading its tensors, as ``open_file(path, identity)`` (default
            :class:`~marlin_pack.io.preads.TensorFile`; ``verify``'s also hashes what it reads).

    Raises:
        CheckpointError: missing/unreadable config, missing or truncated files,
            an index naming files or tensors that are not there.
    """

    def __init__(self, model_dir: str | Path, *, open_file: Callable[[Path, tuple[int, ...]], TensorFile] | None = None) -> None:
        self.dir = Path(model_dir)
        self._open_file = open_file or (lambda path, identity: TensorFile(path, identity=identity))
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir} is not a directory; pass a checkpoint directory holding config.json")
        try:  # safetensors (Rust) opens UTF-8 paths only; say so instead of "the file is corrupt"
            str(self.dir.resolve()).encode("utf-8")
        except UnicodeEncodeError as e:
            raise CheckpointError(
                f"{self.dir!s} is not a UTF-8 path ({e.reason}); safetensors cannot open files there, rename the directory"
            ) from e
        self.config = read_json(self.dir / "config.json", "config.json")
        self.files = weight_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        # Identity of each file as its header was read: a file that changes later is caught by
        # check_unchanged(), so a bundle never pairs one file's header with another's data.
        self.identities: dict[str, list[int]] = {}
        # Why safetensors itself (so vLLM loading the checkpoint) refuses a file, said when a tensor of it is read.
        self._unpacked: dict[str, str | None] = {}
        for f in self.files:
            try:
                self.identities[f] = file_identity(self.dir / f)
                header = read_header(self.dir / f)
            except SafetensorsFormatError as e:
                raise CheckpointError(f"{e}; download the file again") from e
            except OSError as e:
                raise unreadable(self.dir / f, e, "a safetensors weight file") from e
            self._unpacked[f] = unpacked(header, self.identities[f][0])
            for name, info in header.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name} is in both {self.tensors[name].file} and {f}; remove the duplicate file")
                self.tensors[name] = info
        self._handles: dict[str, TensorFile] = {}
        self._lock = threading.Lock()  # conversion reads ahead on a thread of its own

    def quantization_config(self) -> dict | None:
        """The quantization settings (``config.json``, else ``quantize_config.json``), or None if not quantized."""
        return quantization_config(self.dir, self.config)

    def quant_settings(self) -> FoundSettings | None:
        """The quantization settings that decide a bundle, and the file they came from; None if not quantized."""
        return quant_settings(self.dir, self.config)

    def info(self, name: str) -> TensorInfo:
        """Header facts of one tensor; a one-line error if the checkpoint lacks it."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint; the checkpoint is incomplete") from None

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (CPU) with ``pread``, from the file whose header named it.

        Raises:
            CheckpointError: the tensor is missing; its file is laid out as safetensors refuses, was replaced since
                its header was read, or ends before the tensor's bytes (truncated while it is read); a read failed.
        """
        info = self.info(name)
        if (why := self._unpacked[info.file]) is not None:
            raise CheckpointError(f"cannot read tensor {name}: {info.file} is not a file safetensors reads ({why}); download it again")
        try:
            with self._lock:
                handle = self._handles.get(info.file)
                if handle is None:
                    handle = self._open_file(self.dir / info.file, tuple(self.identities[info.file]))
                    self._handles[info.file] = handle
            return handle.read(info)
        except FileChangedError as e:
            raise CheckpointError(f"{info.file} {e.strerror}; re-run once nothing is writing the checkpoint") from e
        except OSError as e:
            raise CheckpointError(
                f"cannot read tensor {name} from {info.file} ({e.strerror or e}); check the disk, or download the file again"
            ) from e

    def check_unchanged(self) -> None:
        """Refuse if any weight file was replaced or modified since this checkpoint was opened.

        Raises:
            CheckpointError: naming the first file that moved.
        """
        for f, before in self.identities.items():
            try:
                now = file_identity(self.dir / f)
            except OSError as e:
                raise CheckpointError(f"{f} disappeared while converting ({e.strerror}); re-run when the checkpoint is complete") from e
            if now != before:
                raise CheckpointError(
                    f"{f} changed while converting (size, time or inode differ); nothing was written, "
                    "re-run when the checkpoint is no longer being written"
                )

    def close(self) -> None:
        """Close the files opened for reading tensors."""
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
