"""Files written around the page cache: the exact bytes, and the page cache where O_DIRECT is refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import marlin_pack.io.direct_file as direct_file
from marlin_pack.io.direct_file import SequentialFile


def _pieces() -> list[bytes]:
    # Sizes that cross chunk and block boundaries and end unaligned.
    sizes = [8, 3, 4096, 4095, 1, 200_001, 70_000, 5]
    return [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("direct", [True, False])
def test_writes_exactly_the_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    monkeypatch.setattr(direct_file, "_CHUNK", 64 << 10)  # several chunks, one partial at the end
    path = tmp_path / "f.bin"
    f = SequentialFile(path, direct)
    for piece in _pieces():
        f.write(memoryview(piece))
    f.close()
    assert f.closed and path.read_bytes() == b"".join(_pieces()) and f.size == path.stat().st_size


def test_falls_back_to_the_page_cache_where_o_direct_cannot_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: object, flags: int, *a: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # tmpfs
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    f = SequentialFile(tmp_path / "t.bin")
    assert not f.direct
    f.write(b"abc")
    f.close()
    assert (tmp_path / "t.bin").read_bytes() == b"abc"


def test_falls_back_when_o_direct_writes_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_file, "_CHUNK", 8192)
    real_write = os.write
    calls = []

    def refuse_direct(fd: int, data: memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")  # a file system that opens with O_DIRECT but refuses its writes
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_direct)
    path = tmp_path / "w.bin"
    f = SequentialFile(path)
    data = bytes(range(256)) * 100  # 25,600 bytes: three chunks and a tail
    f.write(data)
    f.close()
    assert not f.direct and path.read_bytes() == data


def test_write_errors_surface_and_abort_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_file, "_CHUNK", 4096)

    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    f = SequentialFile(tmp_path / "e.bin")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        f.write(bytes(10_000))
    f.abort()
    assert f.closed
