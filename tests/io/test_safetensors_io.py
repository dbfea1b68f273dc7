"""The one safetensors header parser: exact facts for good files, one clear error for every bad one."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from marlin_pack.io.safetensors_io import (
    MAX_HEADER_BYTES,
    SafetensorsFormatError,
    StreamWriter,
    dtype_code,
    read_header,
    read_header_bytes,
    torch_dtype,
)


def _raw_file(path: Path, header: dict, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_offsets_are_absolute_and_match_safetensors(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.int32).view(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    raw = path.read_bytes()
    for name, t in tensors.items():
        info = header.tensors[name]
        assert info.file == "t.safetensors" and info.torch_dtype == t.dtype and info.shape == tuple(t.shape)
        got = torch.frombuffer(bytearray(raw[info.start : info.end]), dtype=t.dtype).view(t.shape)
        assert torch.equal(got, t)
    assert header.raw == read_header_bytes(path) and header.raw == raw[: len(header.raw)]


def test_stream_writer_output_is_read_by_safetensors(tmp_path: Path) -> None:
    specs = [("x", torch.float16, (3, 4)), ("y", torch.int32, (0,)), ("z", torch.uint8, (7,))]
    path = tmp_path / "s.safetensors"
    w = StreamWriter(path, specs, {"k": "v"})
    values = {"x": torch.randn(3, 4).half(), "y": torch.zeros(0, dtype=torch.int32), "z": torch.arange(7, dtype=torch.uint8)}
    for name, _, _ in specs:
        w.write(name, values[name])
    size, _ = w.close()
    assert size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, t in values.items():
            assert torch.equal(f.get_tensor(name), t)
    assert set(read_header(path).tensors) == set(values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.bool])
def test_dtype_table_round_trips(dtype: torch.dtype) -> None:
    assert torch_dtype(dtype_code(dtype)) == dtype


@pytest.mark.parametrize(
    "header,data,match",
    [
        ({"__metadata__": ["x"]}, b"", r"corrupt safetensors header \(__metadata__ is not a map of strings\)"),
        ({"__metadata__": {"a": 1}}, b"", r"__metadata__ is not a map of strings"),
        ({"t": {"dtype": "F16", "shape": [-2, -3], "data_offsets": [0, 12]}}, b"\0" * 12, r"tensor t has a malformed header entry"),
        ({"t": {"dtype": "F16", "shape": [2.5], "data_offsets": [0, 4]}}, b"\0" * 4, r"malformed header entry"),
        ({"t": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, r"malformed header entry"),
        ({"t": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 4, r"spans bytes 0..8 of 4"),
        ({"t": {"dtype": "F16", "shape": [4], "data_offsets": [0, 6]}}, b"\0" * 8, r"expected 8 bytes"),
        (
            {"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, "b": {"dtype": "F16", "shape": [4], "data_offsets": [4, 12]}},
            b"\0" * 12,
            r"tensors a and b overlap",
        ),
        ([1, 2], b"", r"corrupt safetensors header"),
    ],
)
def test_malformed_headers_are_refused(tmp_path: Path, header: object, data: bytes, match: str) -> None:
    path = _raw_file(tmp_path / "bad.safetensors", header, data)  # type: ignore[arg-type]
    with pytest.raises(SafetensorsFormatError, match=match):
        read_header(path)


def test_short_and_truncated_files(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(SafetensorsFormatError, match=r"short.safetensors is 3 bytes: too short"):
        read_header(tmp_path / "short.safetensors")
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsFormatError, match=r"declares a 1099511627776-byte header in a 10-byte file"):
        read_header(tmp_path / "long.safetensors")
    (tmp_path / "deep.safetensors").write_bytes(struct.pack("<Q", 100_000) + b"[" * 100_000)
    with pytest.raises(SafetensorsFormatError, match=r"corrupt safetensors header"):
        read_header(tmp_path / "deep.safetensors")



def test_stream_writer_digest_is_the_files_digest(tmp_path: Path) -> None:
    # Writing and hashing run on two threads: both must see every tensor, in file order.
    from marlin_pack.io.hashing import file_digest

    specs = [(f"t{i}", torch.int32, (37 * i,)) for i in range(1, 20)]
    path = tmp_path / "w.safetensors"
    w = StreamWriter(path, specs, {"k": "v"})
    values = {name: torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32) for name, _, shape in specs}
    for name, _, _ in specs:
        w.write(name, values[name])
    size, digest = w.close()
    assert size == path.stat().st_size and digest == file_digest(path)
    with safe_open(str(path), framework="pt") as f:
        for name, t in values.items():
            assert torch.equal(f.get_tensor(name), t)


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 100 << 20, 1 << 40])
def test_oversized_header_is_called_oversized_with_the_limit(tmp_path: Path, n: int) -> None:
    """A header longer than safetensors accepts (100 MB, what vLLM opens) is oversized, not truncated, however long the file."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{}")
        f.truncate(8 + min(n, 100 << 20) + 16)  # sparse: the header fits in the file when it can
    with pytest.raises(SafetensorsFormatError, match=rf"declares a {n}-byte header .*more than the 100,000,000 bytes.*oversized"):
        read_header(path)
    assert MAX_HEADER_BYTES == 100_000_000


@pytest.mark.parametrize(
    ("tensors", "data", "why"),
    [
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, bytes(4), None),
        ({"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},
         bytes(4), None),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, bytes(12), "8 bytes follow the last tensor"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}},
         bytes(12), "tensor b starts at byte"),
    ],
)
def test_unpacked_says_what_safetensors_itself_refuses(tmp_path: Path, tensors: dict, data: bytes, why: str | None) -> None:
    """Tensors must fill the data section end to end (safetensors' own rule, so vLLM's), which read_header does not ask."""
    from safetensors import SafetensorError

    from marlin_pack.io.safetensors_io import unpacked

    path = _raw_file(tmp_path / "t.safetensors", tensors, data)
    got = unpacked(read_header(path), path.stat().st_size)
    assert got is None if why is None else why in (got or "")
    if why is not None:
        with pytest.raises(SafetensorError), safe_open(str(path), framework="pt") as f:
            f.get_tensor("a")
