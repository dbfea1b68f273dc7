"""Reading files another process may truncate: ``pread`` into memory of our own, never through a memory map.

A page of a memory-mapped file that was truncated away cannot be read: the kernel sends SIGBUS, which
Python cannot turn into an exception, so the process dies without a word (and a conversion leaves its
lock and temporary directory behind). Every CPU read of a checkpoint or bundle file's bytes therefore
copies them with ``pread`` (:func:`~marlin_pack.io.files.pread_full`): a file that ends early reads short, and the reader
refuses in one line (:class:`~marlin_pack.io.files.FileChangedError`, "changed while it was read"). :class:`TensorFile` reads
whole tensors so (conversion's checkpoint reads; ``verify``'s reads of the bundle and the checkpoint, through
:class:`HashedTensorFile`, which also hashes what it reads), and :func:`~marlin_pack.io.hashing.hash_file` hashes files
so. The engine's maps of bundle files are :mod:`marlin_pack.gpu.host_map`'s, whose docstring says what a truncation does
there.

Importing this module does not import torch.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from marlin_pack.io.files import FileChangedError, identity_of, open_regular, pread_full
from marlin_pack.io.hashing import HashedFile, HeldBytes, ReadHash

if TYPE_CHECKING:
    import torch

    from marlin_pack.io.safetensors_io import TensorInfo

__all__ = ["FileChangedError", "HashedTensorFile", "TensorFile", "pread_full"]


class TensorFile:
    """One safetensors file's tensors read with :func:`pread_full` (a fresh CPU tensor each, nothing mapped).

    Args:
        path: the file (symlinks followed; a regular file only).
        tensors: its header's tensors (:func:`~marlin_pack.io.safetensors_io.read_header`), for :meth:`get_tensor`.
        identity: the file's identity (:func:`~marlin_pack.io.hashing.identity_of`) when its header was read:
            a file opened with another is refused, so no header is paired with another file's bytes.

    Raises:
        FileChangedError: ``identity`` differs from the opened file's.
        NotRegularFileError, OSError: as :func:`~marlin_pack.io.files.open_regular`.
    """

    def __init__(self, path: Path, tensors: Mapping[str, TensorInfo] | None = None, identity: tuple[int, ...] | None = None) -> None:
        self.path = Path(path)
        self.tensors = dict(tensors or {})
        self._file = open(open_regular(self.path), "rb", buffering=0)  # noqa: SIM115 (closed by close(), or when dropped)
        opened = identity_of(os.fstat(self._file.fileno()))
        self.size = opened[0]  # when opened
        if identity is not None and opened != tuple(identity):
            self._file.close()
            raise FileChangedError(errno.ESTALE, "changed since its header was read (size, time or inode differ)", str(self.path))

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` of :attr:`tensors` (as ``safetensors.safe_open(...).get_tensor``, without its memory map)."""
        return self.read(self.tensors[name])

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor ``info`` describes, read into a new CPU tensor of its dtype and shape.

        Raises:
            FileChangedError: the file now ends before the tensor's last byte ("changed while it was read").
            OSError: a read failed.
        """
        return self._read_bytes(info).view(info.torch_dtype).view(info.shape)

    def _read_bytes(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes, a new ``uint8`` CPU tensor (:meth:`read`'s errors)."""
        import torch

        raw = torch.empty(info.nbytes, dtype=torch.uint8)
        got = pread_full(self._file.fileno(), memoryview(raw.numpy()), info.start) if info.nbytes else 0
        if got < info.nbytes:  # the file ended early; it may be shorter still by now
            now = os.fstat(self._file.fileno()).st_size
            raise FileChangedError(
                errno.ESTALE,
                f"changed while it was read (truncated to {now} of its {self.size} bytes: tensor {info.name} lies at "
                f"{info.start}..{info.end})",
                str(self.path),
            )
        return raw

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HashedTensorFile(TensorFile):
    """A :class:`TensorFile` whose reads also give the whole file's BLAKE3 digest (:class:`~marlin_pack.io.hashing.ReadHash`):
    each tensor read is hashed from the bytes read for it, and :meth:`finish` reads only what no read took (the header,
    padding, tensors not read), so that the file is read once for its tensors and its digest (``verify``).

    Args:
        path, tensors, identity: as :class:`TensorFile`.
        expected: the tensors that will be read (the others are read for the digest alone, as the hash reaches them).
        held: the limit on the bytes kept for the digest, shared with the other files read (:class:`~marlin_pack.io.hashing.HeldBytes`).
    """

    def __init__(
        self, path: Path, tensors: Mapping[str, TensorInfo] | None = None, identity: tuple[int, ...] | None = None, *,
        expected: Iterable[TensorInfo] = (), held: HeldBytes | None = None,
    ) -> None:
        super().__init__(path, tensors, identity)
        try:
            self.digest = ReadHash(self.path, self._file.fileno(), [(i.start, i.end) for i in expected], held)
        except BaseException:
            self._file.close()
            raise

    def read(self, info: TensorInfo) -> torch.Tensor:
        raw = self._read_bytes(info)
        if info.nbytes:
            self.digest.seen(info.start, memoryview(raw.numpy()))
        return raw.view(info.torch_dtype).view(info.shape)

    def finish(self) -> HashedFile:
        """The file's digest, bound to the identity of what was read (:meth:`ReadHash.finish <marlin_pack.io.hashing.ReadHash.finish>`)."""
        return self.digest.finish()

    def close(self) -> None:
        self.digest.abort()
        super().close()
