"""A safetensors writer that streams: header first, then tensors one at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once; a 40 GB rank
file cannot be built that way. Since the converter knows every output shape before
it reads any data, the header is written first and each tensor appended as soon as
it is computed, hashed on the way out.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["StreamWriter", "TORCH_TO_SAFETENSORS"]

TORCH_TO_SAFETENSORS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamWriter:
    """Write a safetensors file whose tensors are declared up front.

    Args:
        path: output file.
        entries: ``(name, dtype, shape)`` in the order tensors will be written.
        metadata: string-to-string ``__metadata__``.

    ``write`` must then be called once per entry, in order; ``close`` returns
    ``(size, sha256)`` and refuses a file with tensors missing. Writing and hashing run
    on a background thread (both release the GIL), overlapping the next tensor's
    computation; at most two tensors are in flight.
    """

    _MAX_IN_FLIGHT = 2

    def __init__(
        self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ) -> None:
        self.path = path
        self._expected = entries
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for name, dtype, shape in entries:
            n = dtype.itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": TORCH_TO_SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns tensor data to 8 bytes
        self._hash = hashlib.sha256()
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._size = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="marlin-pack-write")
        self._pending: deque[Future[None]] = deque()
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next declared tensor (moved to CPU, made contiguous)."""
        want_name, dtype, shape = self._expected[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(
                f"internal error: writing {name} {tensor.dtype} {list(tensor.shape)}, declared {want_name} {dtype} {list(shape)}"
            )
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            while len(self._pending) >= self._MAX_IN_FLIGHT:
                self._pending.popleft().result()
            # The tensor is kept alive by the closure until its bytes are written.
            self._pending.append(self._io.submit(self._emit, memoryview(t.view(torch.uint8).reshape(-1).numpy())))
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flush and fsync; return ``(size, sha256)``."""
        if self._next != len(self._expected):
            self.abort()
            raise RuntimeError(f"internal error: {self.path.name} closed after {self._next} of {len(self._expected)} tensors")
        while self._pending:
            self._pending.popleft().result()
        self._io.shutdown()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        if not self._file.closed:
            try:  # closing flushes: on a full disk that fails again, and must not mask the first error
                self._file.close()
            except OSError:
                pass
