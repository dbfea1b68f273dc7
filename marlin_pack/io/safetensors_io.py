"""safetensors files without loading them: one header parser, one dtype table, a streaming writer.

Every safetensors file marlin-pack opens (checkpoint shards, rank files, the common file)
goes through :func:`read_header`, which checks the header against the file before any
tensor byte is read: size prefix, JSON, ``__metadata__`` (a map of strings), each tensor's
dtype, shape and offsets (inside the data section, sized to the shape, not overlapping).
Offsets are returned absolute (from the start of the file).

:class:`StreamWriter` is the other direction: ``safetensors.torch.save_file`` needs every
tensor in memory at once, and a 40 GB rank file cannot be built that way. The converter
knows every output shape before it reads any data, so the header is written first and each
tensor appended as soon as it is computed, hashed on the way out.

Importing this module does not import torch (the CLI's ``inspect`` reads manifests only).
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from marlin_pack.io.buffers import BufferPool
from marlin_pack.io.direct_file import SequentialFile
from marlin_pack.io.files import open_regular
from marlin_pack.io.hashing import new_file_hasher

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsFormatError",
    "TensorInfo",
    "SafetensorsHeader",
    "read_header_bytes",
    "read_header_bytes_of",
    "read_header",
    "parse_header",
    "unpacked",
    "torch_dtype",
    "dtype_code",
    "StreamWriter",
]

# safetensors' own limit (100 MB: it refuses a longer header, so vLLM could not open the file), far above any real header.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype code -> (torch dtype attribute, bytes per element). The one table.
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "C64": ("complex64", 8),
}


class SafetensorsFormatError(ValueError):
    """A file is not a well-formed safetensors file; the message names the file and the problem.

    Callers wrap it in the error of their domain (checkpoint or bundle), adding what to do.
    """


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"F16"`` -> ``torch.float16``)."""
    import torch

    return getattr(torch, _DTYPES[code][0])  # type: ignore[no-any-return]


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype (``torch.float16`` -> ``"F16"``)."""
    name = str(dtype).removeprefix("torch.")
    for code, (attr, _) in _DTYPES.items():
        if attr == name:
            return code
    raise ValueError(f"dtype {dtype} has no safetensors code")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; ``start``/``end`` are absolute file offsets."""

    name: str
    file: str  # the file's name (not its path)
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, bounds-checked header; ``raw`` is the length prefix plus the JSON text."""

    path: Path
    raw: bytes
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header_bytes(path: Path) -> bytes:
    """The 8-byte length prefix plus the JSON header of a safetensors file (no tensor data).

    Raises:
        SafetensorsFormatError: too short, or an implausible or truncated header.
        OSError: the file cannot be opened or read, or is not a regular file.
    """
    return _read_header_bytes(path)[0]


def _read_header_bytes(path: Path) -> tuple[bytes, int]:
    with open(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return read_header_bytes_of(f, size, path), size


def read_header_bytes_of(f: BinaryIO, size: int, path: Path) -> bytes:
    """:func:`read_header_bytes` of a file already open (at its start; ``size``: its size, ``path``: the name messages
    give): its length prefix and JSON header, checked as there, from the same open file as the reads that follow."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise SafetensorsFormatError(f"{path.name} is {size} bytes: too short for safetensors; the file is truncated")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:  # whatever the file's size: a header this long is not one, not a cut-off file
        raise SafetensorsFormatError(
            f"{path.name} declares a {n}-byte header in a {size}-byte file, more than the {MAX_HEADER_BYTES:,} bytes "
            "safetensors (and so vLLM) accepts: the header is oversized, the file is corrupt or not safetensors"
        )
    if 8 + n > size:
        raise SafetensorsFormatError(
            f"{path.name} declares a {n}-byte header in a {size}-byte file; the file is truncated or not safetensors"
        )
    header = f.read(n)
    if len(header) != n:
        raise SafetensorsFormatError(f"{path.name} ends inside its safetensors header; the file is truncated")
    return prefix + header


def _corrupt(path: Path, why: str = "") -> SafetensorsFormatError:
    return SafetensorsFormatError(f"{path.name} has a corrupt safetensors header{why}")


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header against the file (the data is not read).

    Raises:
        SafetensorsFormatError: malformed JSON or metadata, an unknown dtype, a negative
            dimension, offsets outside the data or not sized to the shape, overlapping tensors.
        OSError: the file cannot be opened or read.
    """
    raw, size = _read_header_bytes(path)
    return parse_header(raw, size, path)


def parse_header(raw: bytes, size: int, path: Path) -> SafetensorsHeader:
    """:func:`read_header`'s checks over header bytes read elsewhere (``raw``: the length prefix and the JSON; ``size``:
    the whole file's; ``path``: the name messages give), e.g. a bundle file in object storage (marlin_pack.remote).

    Raises:
        SafetensorsFormatError: as :func:`read_header`.
    """
    try:
        header = json.loads(raw[8:])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _corrupt(path) from e
    if not isinstance(header, dict):
        raise _corrupt(path)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, " (__metadata__ is not a map of strings)")
    base, data_len = len(raw), size - len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, spec in header.items():
        try:
            dtype = spec["dtype"]
            _, itemsize = _DTYPES[dtype]
            shape = tuple(spec["shape"])
            begin, end = spec["data_offsets"]
            if not all(type(x) is int for x in (*shape, begin, end)) or any(d < 0 for d in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsFormatError(f"{path.name}: tensor {name} has a malformed header entry") from e
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise SafetensorsFormatError(
                f"{path.name}: tensor {name} spans bytes {begin}..{end} of {data_len}, expected {nbytes} bytes "
                "inside the file; the file is truncated or corrupt"
            )
        tensors[name] = TensorInfo(name, path.name, dtype, shape, base + begin, base + end)
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:], strict=False):
        if start < prev_end:
            raise SafetensorsFormatError(f"{path.name}: tensors {prev} and {name} overlap; the file is corrupt")
    return SafetensorsHeader(path, raw, tensors, dict(metadata))


def unpacked(header: SafetensorsHeader, size: int) -> str | None:
    """Why the ``safetensors`` library (and so vLLM's ordinary loading) refuses a file of ``size`` bytes with this
    header, where :func:`read_header` does not: its tensors must fill the data section end to end, in offset
    order, with no gap and nothing after the last. None when they do."""
    at = len(header.raw)
    for t in sorted(header.tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start != at:
            return f"tensor {t.name} starts at byte {t.start}, where the one before it ends at {at}"
        at = t.end
    return None if at == size else f"{size - at} bytes follow the last tensor"


def _when_ready(ready: Callable[[], object] | None, fn: Callable[[memoryview], object], data: memoryview) -> None:
    """``fn(data)`` once ``ready()`` returned (a writer thread's task)."""
    if ready is not None:
        ready()
    fn(data)


class StreamWriter:
    """Write a safetensors file whose tensors are declared up front.

    Args:
        path: output file.
        entries: ``(name, dtype, shape)`` in the order tensors will be written.
        metadata: string-to-string ``__metadata__``.
        max_in_flight: tensors queued for the writer threads before ``write`` waits (None: no limit).
        max_bytes_in_flight: bytes of tensors queued before ``write`` waits (None: no limit); one
            tensor larger than this is still written, alone.

    ``write`` must then be called once per entry, in order; ``close`` returns
    ``(size, blake3)`` and refuses a file with tensors missing. Writing and hashing run on
    two background threads of their own (both release the GIL), overlapping each other and
    the next tensor's computation (on one thread, the copy into the page cache plus BLAKE3
    made the writer the conversion's bottleneck); by default at most two tensors are in
    flight.

    Nothing asks the kernel to write back early: ``close`` fsyncs the whole file. Starting
    writeback every 64 MiB while converting (``sync_file_range``) cut that fsync from ~0.38 s
    to ~0.03 s on llama-1gb, but slowed the writes themselves more (conversion 0.5 s slower,
    3 runs out of 3, on a 2-core VM whose disk I/O competes with the conversion for the CPU).
    Writing around the page cache (``direct``) removes both the copy into the cache and the
    wait in the fsync.

    A caller that computes a tensor on the CPU can compute it into :meth:`empty`, a buffer the
    writer recycles once it is written (see :mod:`marlin_pack.io.buffers`), instead of fresh memory.
    A caller whose tensor is still being filled (a non-blocking copy from a GPU into a pinned
    :meth:`empty` buffer) passes ``ready``: the writer threads wait on it before reading the bytes,
    so the caller's thread never waits for the copy.

    ``pin_memory``: :meth:`empty` gives page-locked buffers. ``hash_threads``: BLAKE3 threads per
    tensor (its tree hash splits one buffer across them; the digest does not depend on it), for
    machines whose cores would otherwise leave one hashing thread the bottleneck. ``direct``:
    write around the page cache where possible (:mod:`marlin_pack.io.direct_file`). ``dir_fd``: the file is
    ``path.name`` made new in this held directory, never through a symlink (``path`` then names it in messages).
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str],
        max_in_flight: int | None = 2,
        max_bytes_in_flight: int | None = None,
        *,
        pin_memory: bool = False,
        hash_threads: int = 1,
        direct: bool = False,
        dir_fd: int | None = None,
    ) -> None:
        self.path = path
        self._max_in_flight = max_in_flight
        self._max_bytes = max_bytes_in_flight
        self._bytes_in_flight = 0
        self._expected = entries
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = largest = 0
        for name, dtype, shape in entries:
            n = dtype.itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            largest = max(largest, n)
        self._pool = BufferPool(largest, pin_memory)
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns tensor data to 8 bytes
        self._hash = new_file_hasher(hash_threads)
        self._file = SequentialFile(path, direct, dir_fd=dir_fd)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="marlin-pack-write")
        self._hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="marlin-pack-hash")
        # Per tensor in flight: the tensor (kept alive until written and hashed), its write, its hash.
        self._pending: deque[tuple[torch.Tensor, Future[None], Future[None]]] = deque()
        prefix = struct.pack("<Q", len(raw)) + raw
        self._hash.update(prefix)
        self._emit(prefix)

    def _emit(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the file (the writer thread; hashing is the caller's)."""
        self._file.write(data)

    def empty(self, name: str) -> torch.Tensor:
        """An uninitialized CPU tensor of the declared ``name``'s dtype and shape, to compute into and pass to :meth:`write`.

        Its memory is recycled after the write, so the caller must not keep it past that.
        """
        entry = next((e for e in self._expected[self._next :] if e[0] == name), None)
        if entry is None:
            raise RuntimeError(f"internal error: {name} is not a tensor still to be written to {self.path.name}")
        return self._pool.take(entry[1], tuple(entry[2]))

    def write(self, name: str, tensor: torch.Tensor, ready: Callable[[], object] | None = None) -> None:
        """Append the next declared tensor (moved to CPU, made contiguous).

        ``ready``: the tensor is a CPU buffer (from :meth:`empty`) still being filled; the writer
        threads call ``ready()`` (e.g. a CUDA event's ``synchronize``) before reading it.
        """
        import torch

        want_name, dtype, shape = self._expected[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(
                f"internal error: writing {name} {tensor.dtype} {list(tensor.shape)}, declared {want_name} {dtype} {list(shape)}"
            )
        if ready is not None and (tensor.device.type != "cpu" or not tensor.is_contiguous()):
            raise RuntimeError(f"internal error: {name} is written when ready, but is not a contiguous CPU buffer")
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            while self._pending and self._slot_wanted(t.nbytes):
                self._retire()
            self._bytes_in_flight += t.nbytes
            data = memoryview(t.view(torch.uint8).reshape(-1).numpy())
            # Both threads take tensors in file order: the file and its hash see the same bytes in the same order.
            written = self._io.submit(_when_ready, ready, self._emit, data)
            self._pending.append((t, written, self._hashing.submit(_when_ready, ready, self._hash.update, data)))
        else:
            self._pool.give_back(t)
        self._next += 1

    def _slot_wanted(self, nbytes: int) -> bool:
        """Whether queueing ``nbytes`` more would exceed a limit on what is in flight."""
        too_many = self._max_in_flight is not None and len(self._pending) >= self._max_in_flight
        too_big = self._max_bytes is not None and self._bytes_in_flight + nbytes > self._max_bytes
        return too_many or too_big

    def _retire(self) -> None:
        """Wait for the oldest tensor in flight to be written and hashed; recycle its buffer if it is the pool's."""
        t, written, hashed = self._pending.popleft()
        written.result()
        hashed.result()
        self._bytes_in_flight -= t.nbytes
        self._pool.give_back(t)

    def close(self) -> tuple[int, str]:
        """Flush and fsync; return ``(size, blake3)``."""
        if self._next != len(self._expected):
            self.abort()
            raise RuntimeError(f"internal error: {self.path.name} closed after {self._next} of {len(self._expected)} tensors")
        while self._pending:
            self._retire()
        self._io.shutdown()
        self._hashing.shutdown()
        self._file.close()
        return self._file.size, self._hash.hexdigest()

    def abort(self) -> None:
        """Stop writing and close the file (the caller removes it)."""
        self._io.shutdown(wait=True, cancel_futures=True)
        self._hashing.shutdown(wait=True, cancel_futures=True)
        # Nothing staged is written: on a full disk that would fail again, and must not mask the first error.
        self._file.abort()
