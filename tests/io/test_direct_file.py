"""Files written around the page cache: the exact bytes, and the page cache where O_DIRECT is refused."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import marlin_pack.io.direct_file as direct_file
from marlin_pack.io.direct_file import _ALIGN, SequentialFile


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


@pytest.mark.parametrize("fstype", ["tmpfs", "ramfs", "ext4"])
def test_memory_file_systems_are_written_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str) -> None:
    """On tmpfs (which takes O_DIRECT since Linux 6.6) O_DIRECT would only add the staging copy: not asked for there."""
    seen: list[object] = []

    def fs(path: object) -> str:
        seen.append(path)
        return fstype

    monkeypatch.setattr(direct_file, "filesystem_type", fs)
    opened: list[int] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: opened.append(flags) or real_open(path, flags, *a))
    path = tmp_path / "m.bin"
    f = SequentialFile(path)
    for piece in _pieces():
        f.write(piece)
    f.close()
    assert seen == [path] and path.read_bytes() == b"".join(_pieces())
    in_memory = fstype != "ext4"
    assert any(flags & os.O_DIRECT for flags in opened) is not in_memory
    if in_memory:
        assert not f.direct


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
    real_pwrite = os.pwrite
    calls = []

    def refuse_direct(fd: int, data: memoryview, offset: int) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")  # a file system that opens with O_DIRECT but refuses its writes
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    path = tmp_path / "w.bin"
    f = SequentialFile(path)
    data = bytes(range(256)) * 100  # 25,600 bytes: three chunks and a tail
    f.write(data)
    f.close()
    assert not f.direct and path.read_bytes() == data


def test_write_errors_surface_and_abort_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_file, "_CHUNK", 4096)

    def full(fd: int, data: memoryview, *offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    f = SequentialFile(tmp_path / "e.bin")
    monkeypatch.setattr(os, "write", full)  # where the file system refused O_DIRECT at the open
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        f.write(bytes(10_000))
    f.abort()
    assert f.closed


def _needs_direct(directory: Path) -> None:
    probe = SequentialFile(directory / "probe.bin")
    refused = not probe.direct
    probe.abort()
    if refused:
        pytest.skip(f"{directory} refuses O_DIRECT")


def _random(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("marlin-pack-direct")]


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


_CHUNK = 64 << 10  # patched in: a few MB go through many stages
_PATTERNS = {  # write sizes
    "chunks": [_CHUNK] * 20,
    "ragged": [int(n) for n in np.random.default_rng(1).integers(0, 200_000, 40)] + [0, 1, 0],
    "one larger than all stages": [3_000_000],
    "small": [4095] * 300,
    "ends on a chunk": [_CHUNK * 5 + 100, _CHUNK * 3 - 100],
    "pieces": [len(p) for p in _pieces()],
    "zeros": [0, 0],
    "empty": [],
}


@pytest.mark.parametrize("pattern", list(_PATTERNS))
@pytest.mark.parametrize(("direct", "writers"), [(True, 1), (True, 3), (False, 1)])
def test_overlapped_writes_give_exactly_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str, direct: bool, writers: int
) -> None:
    if direct:
        _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    real_pwrite = os.pwrite

    def slow(fd: int, data: memoryview, offset: int) -> int:
        # Writes finish late and out of order: a stage taken back before its write is done would corrupt the file.
        time.sleep(float(np.random.default_rng(offset).uniform(0, 0.002)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)
    sizes = _PATTERNS[pattern]
    data = _random(sum(sizes))
    path = tmp_path / "f.bin"
    f = SequentialFile(path, direct, writers=writers)
    pos = 0
    for n in sizes:
        f.write(memoryview(data)[pos : pos + n])
        pos += n
    f.close()
    # Still direct at the end: no write was misaligned (O_DIRECT would have refused it, and the file fallen back).
    assert f.direct == direct and f.closed and f.size == len(data)
    assert path.read_bytes() == data
    assert not _writer_threads()


@pytest.mark.parametrize("writers", [1, 3])
def test_writes_overlap_the_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: int) -> None:
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    real_pwrite = os.pwrite
    lock = threading.Lock()
    now = [0]
    most = [0]

    def counted(fd: int, data: memoryview, offset: int) -> int:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        try:
            return real_pwrite(fd, data, offset)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(os, "pwrite", counted)
    data = _random(12 * _CHUNK)
    f = SequentialFile(tmp_path / "o.bin", writers=writers)
    t = time.perf_counter()
    f.write(data[: _CHUNK + 1000])
    handed_over = time.perf_counter() - t
    f.write(data[_CHUNK + 1000 :])
    f.close()
    assert (tmp_path / "o.bin").read_bytes() == data
    assert most[0] == writers  # that many writes at the disk at once, and no more
    assert handed_over < 0.04  # the first full stage was written while the caller filled the second


def test_a_write_refused_mid_file_goes_on_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    real_pwrite = os.pwrite
    refused: list[int] = []
    after: list[bool] = []

    def refuse_direct(fd: int, data: memoryview, offset: int) -> int:
        if offset >= 3 * _CHUNK:
            if _is_direct(fd):
                time.sleep(0.02)  # the other writers issue theirs with O_DIRECT meanwhile: each is refused, and retries
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            after.append(True)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    data = _random(40 * _CHUNK + 777)
    path = tmp_path / "r.bin"
    f = SequentialFile(path, writers=3)
    for i in range(0, len(data), 100_000):
        f.write(data[i : i + 100_000])
    f.close()
    assert not f.direct and path.read_bytes() == data and path.stat().st_size == len(data)
    assert len(refused) >= 2 and len(set(refused)) == len(refused)  # several stages refused, each once
    assert len(after) > 30  # the rest went through the page cache
    assert not _writer_threads()


def test_a_short_write_mid_file_goes_on_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    real_pwrite = os.pwrite
    short: list[int] = []
    rest: list[tuple[int, int, bool]] = []

    def short_once(fd: int, data: memoryview, offset: int) -> int:
        if offset == 5 * _CHUNK and not short:
            short.append(offset)
            return real_pwrite(fd, memoryview(data)[: 3 * _ALIGN], offset)  # the device took only part of it
        if short and offset == 5 * _CHUNK + 3 * _ALIGN:
            rest.append((offset, len(data), _is_direct(fd)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short_once)
    data = _random(20 * _CHUNK + 5)
    path = tmp_path / "s.bin"
    f = SequentialFile(path, writers=2)
    f.write(data)
    f.close()
    assert not f.direct and path.read_bytes() == data
    assert rest == [(5 * _CHUNK + 3 * _ALIGN, _CHUNK - 3 * _ALIGN, False)]  # the rest of that stage, through the page cache


@pytest.mark.parametrize("surfaces", ["write", "close"])
def test_a_failed_background_write_surfaces_once_and_abort_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, surfaces: str) -> None:
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    real_pwrite = os.pwrite
    failed: list[int] = []

    def full(fd: int, data: memoryview, offset: int) -> int:
        if offset >= _CHUNK:
            failed.append(offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    f = SequentialFile(tmp_path / "e.bin", writers=2)
    stages = list(f._stages)
    if surfaces == "write":
        with pytest.raises(OSError, match="No space left") as raised:
            for _ in range(10):
                f.write(_random(_CHUNK + 1000))
    else:
        f.write(_random(2 * _CHUNK + 1000))  # two stages handed over, a third free: write() does not wait
        with pytest.raises(OSError, match="No space left") as raised:
            f.close()
        assert f.closed and not _writer_threads()  # a failed close released everything
    assert raised.value.errno == errno.ENOSPC and failed
    with pytest.raises(OSError) as again:
        f.close()  # the file is failed: the same error, not a durable file
    assert again.value is raised.value
    f.abort()
    assert f.closed and not _writer_threads() and all(s.closed for s in stages)


def test_abort_with_writes_in_flight_waits_and_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    started: list[int] = []

    def slow_failure(fd: int, data: memoryview, offset: int) -> int:
        started.append(offset)
        time.sleep(0.05)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", slow_failure)
    f = SequentialFile(tmp_path / "a.bin", writers=2)
    stages = list(f._stages)
    f.write(_random(2 * _CHUNK))  # both handed over, neither finished
    assert _writer_threads()
    f.abort()
    assert f.closed and not _writer_threads() and all(s.closed for s in stages) and started


def test_through_the_page_cache_of_a_disk_the_writes_run_behind_and_start_their_writeback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """direct=False on a disk (a bundle kept cached for the first start): the caller hands full stages to a writer
    thread, each stage's writeback is started right after its write, and the file is exact and durable."""
    monkeypatch.setattr(direct_file, "filesystem_type", lambda path: "ext4")
    monkeypatch.setattr(direct_file, "_CHUNK", _CHUNK)
    started: list[tuple[int, int, str]] = []
    monkeypatch.setattr(
        direct_file, "start_writeback", lambda fd, offset, n: started.append((offset, n, threading.current_thread().name))
    )
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    data = _random(5 * _CHUNK + 123)
    path = tmp_path / "c.bin"
    f = SequentialFile(path, direct=False)
    f.write(data)
    f.close()
    assert not f.direct and path.read_bytes() == data and len(synced) == 1
    # Every byte's writeback was started once, in order, the full stages' on the writer thread.
    assert [(o, n) for o, n, _ in started] == [(k * _CHUNK, _CHUNK) for k in range(5)] + [(5 * _CHUNK, 123)]
    assert all(name.startswith("marlin-pack-direct") for _, _, name in started[:5])
    assert not _writer_threads()


def test_start_writeback_is_harmless_on_any_descriptor(tmp_path: Path) -> None:
    """The real call (libc's sync_file_range) on a file, past its end, and on a pipe: never an error."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDWR)
    r, w = os.pipe()
    try:
        direct_file.start_writeback(fd, 0, 10_000)
        direct_file.start_writeback(fd, 1 << 30, 4096)
        direct_file.start_writeback(w, 0, 10)
    finally:
        for x in (fd, r, w):
            os.close(x)
    assert path.read_bytes() == b"x" * 10_000


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_made_in_a_held_directory_is_new_and_never_a_symlink(tmp_path: Path, direct: bool) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    folder = tmp_path / "held"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY)
    try:
        (folder / "planted.bin").symlink_to(victim)
        with pytest.raises(FileExistsError):
            SequentialFile(folder / "planted.bin", direct, dir_fd=fd)
        folder.rename(tmp_path / "moved")  # written through the descriptor, wherever the folder is now
        f = SequentialFile(folder / "f.bin", direct, dir_fd=fd)
        for piece in _pieces():
            f.write(piece)
        f.close()
    finally:
        os.close(fd)
    assert (tmp_path / "moved" / "f.bin").read_bytes() == b"".join(_pieces()) and victim.read_bytes() == b"keep"
