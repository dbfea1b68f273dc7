"""Tensors read with pread, never through a memory map: the same tensors as safetensors, and a short read refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack.io.hashing import file_identity
from marlin_pack.io.preads import FileChangedError, TensorFile, pread_full
from marlin_pack.io.safetensors_io import read_header


def test_every_tensor_reads_as_safetensors_reads_it(tmp_path: Path) -> None:
    tensors = {
        "f16": torch.randn(3, 5, dtype=torch.float16),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "i32": torch.arange(12, dtype=torch.int32).view(2, 2, 3),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "u8": torch.arange(9, dtype=torch.uint8),
        "i64": torch.arange(3, dtype=torch.int64),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    want = load_file(str(path))
    with TensorFile(path, read_header(path).tensors) as f:
        for name, t in want.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_a_tensor_past_the_end_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(1024, dtype=torch.float32), "b": torch.ones(1024, dtype=torch.float32)}, str(path))
    header = read_header(path)
    with TensorFile(path, header.tensors, identity=file_identity(path)) as f:
        size = f.size
        os.truncate(path, header.tensors["b"].start + 10)
        assert torch.equal(f.get_tensor("a"), torch.zeros(1024))  # still whole
        with pytest.raises(FileChangedError, match=rf"changed while it was read \(truncated to {header.tensors['b'].start + 10} of its "
                           rf"{size} bytes: tensor b lies at {header.tensors['b'].start}\.\.{header.tensors['b'].end}\)") as e:
            f.get_tensor("b")
        assert e.value.filename == str(path)


def test_a_file_replaced_since_its_header_was_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4)}, str(path))
    identity = file_identity(path)
    save_file({"a": torch.ones(4)}, str(tmp_path / "new.safetensors"))
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(FileChangedError, match="changed since its header was read"):
        TensorFile(path, identity=identity)


def test_pread_full_stops_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(64)
        assert pread_full(fd, memoryview(buf), 60) == 40 and bytes(buf[:40]) == bytes(range(60, 100))
        assert pread_full(fd, memoryview(buf), 0) == 64 and pread_full(fd, memoryview(buf), 100) == 0
    finally:
        os.close(fd)
