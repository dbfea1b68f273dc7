"""Reading a HuggingFace checkpoint directory: config, safetensors headers, tensors.

Headers are parsed and checked up front (dtype, shape, offsets inside the file), so a
truncated or corrupt file is reported before any long work starts. Tensor data is read
lazily through memory maps, one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from marlin_pack.checkpoint_files import read_json, weight_files
from marlin_pack.errors import CheckpointError

__all__ = ["TensorInfo", "Checkpoint", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, from the safetensors header."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def parse_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path.name} is {size} bytes: too short for safetensors; the file is truncated, download it again")
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path.name} declares a {n}-byte header in a {size}-byte file; the file is truncated or not safetensors")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e}); check the file's permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{path.name} has a corrupt safetensors header; download the file again") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name} has a corrupt safetensors header; download the file again")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: tensor {name} has a malformed header entry; download the file again") from None
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise CheckpointError(
                f"{path.name}: tensor {name} spans bytes {begin}..{end} of {data_len}, expected {nbytes} bytes "
                "inside the file; the file is truncated or corrupt, download it again"
            )
        out[name] = TensorInfo(name, path.name, dtype, shape, nbytes)
    return out


class Checkpoint:
    """A local checkpoint directory: ``config.json`` and its safetensors files.

    Args:
        model_dir: directory holding ``config.json`` and ``*.safetensors``
            (one file, or several with ``model.safetensors.index.json``).

    Raises:
        CheckpointError: missing/unreadable config, missing or truncated files,
            an index naming files or tensors that are not there.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir} is not a directory; pass a checkpoint directory holding config.json")
        self.config = read_json(self.dir / "config.json", "config.json")
        self.files = weight_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in parse_safetensors_header(self.dir / f).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name} is in both {self.tensors[name].file} and {f}; remove the duplicate file")
                self.tensors[name] = info
        self._handles: dict[str, object] = {}

    def quantization_config(self) -> dict | None:
        qc = self.config.get("quantization_config")
        return qc if isinstance(qc, dict) else None

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint; the checkpoint is incomplete") from None

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (CPU) through a memory map."""
        info = self.info(name)
        handle = self._handles.get(info.file)
        try:
            if handle is None:
                handle = safe_open(str(self.dir / info.file), framework="pt")  # type: ignore[no-untyped-call]
                self._handles[info.file] = handle
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name} from {info.file} ({e}); the file is corrupt, download it again") from None

    def close(self) -> None:
        self._handles.clear()
