"""The stamp cache: bound to each file's identity, ignored when corrupt, never littering."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from marlin_pack.io.hashing import StampCache, file_digest


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_same_size_edit_with_restored_mtime_is_not_trusted(tmp_path: Path) -> None:
    # `touch -r` (or utime) restores size and mtime after an edit; the change time still moves.
    f = _file(tmp_path / "a.bin", b"0123456789")
    stamps = StampCache(tmp_path / ".stamps.json")
    stamps.record("a", f, file_digest(f))
    assert stamps.trusted("a", f, file_digest(f))
    st = f.stat()
    old_sha = file_digest(f)
    f.write_bytes(b"9876543210")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    assert not stamps.trusted("a", f, old_sha)


def test_swapped_files_written_in_one_tick_are_not_trusted(tmp_path: Path) -> None:
    a, b = _file(tmp_path / "a", b"A" * 64), _file(tmp_path / "b", b"B" * 64)
    t = a.stat().st_mtime_ns
    os.utime(b, ns=(t, t))
    stamps = StampCache(tmp_path / ".stamps.json")
    sha_a, sha_b = file_digest(a), file_digest(b)
    stamps.record("a", a, sha_a)
    stamps.record("b", b, sha_b)
    os.rename(a, tmp_path / "tmp")
    os.rename(b, a)
    os.rename(tmp_path / "tmp", b)
    assert not stamps.trusted("a", a, sha_a) and not stamps.trusted("b", b, sha_b)


def test_a_copy_with_equal_mtime_is_not_trusted(tmp_path: Path) -> None:
    a = _file(tmp_path / "a", b"x" * 100)
    stamps = StampCache(tmp_path / ".stamps.json")
    stamps.record("a", a, file_digest(a))
    copy = tmp_path / "copy"
    shutil.copy2(a, copy)
    os.replace(copy, a)  # same bytes, size and mtime, another file
    assert not stamps.trusted("a", a, file_digest(a))


@pytest.mark.parametrize("damage", ["nested", "directory", "list", "garbage", "fifo"])
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path, damage: str) -> None:
    path = tmp_path / ".stamps.json"
    if damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "directory":
        path.mkdir()
    elif damage == "list":
        path.write_text("[1, 2]")
    elif damage == "garbage":
        path.write_bytes(b"\xff\xfe{")
    else:
        os.mkfifo(path)
    f = _file(tmp_path / "a", b"data")
    stamps = StampCache(path)  # never raises, never blocks
    assert not stamps.trusted("a", f, file_digest(f))
    stamps.record("a", f, file_digest(f))
    stamps.save()  # may fail to replace a directory or FIFO: silently, and without leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == [".stamps.json", "a"]


def test_file_digests_in_parallel_keep_order_and_errors(tmp_path) -> None:
    import blake3

    from marlin_pack.io.hashing import file_digests

    paths = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (1 << 20) * (i + 1))
        paths.append(p)
    paths.insert(2, tmp_path / "missing")
    got = file_digests(paths)
    assert isinstance(got[2], OSError)
    want = [blake3.blake3(p.read_bytes()).hexdigest() for p in paths if p.exists()]
    assert [g for g in got if not isinstance(g, OSError)] == want


def test_file_digest_of_an_empty_file_and_threads(tmp_path) -> None:
    import blake3

    empty, big = tmp_path / "empty", tmp_path / "big"
    empty.write_bytes(b"")
    big.write_bytes(bytes(range(256)) * (1 << 16))
    assert file_digest(empty) == blake3.blake3(b"").hexdigest()
    assert file_digest(big, threads=1) == file_digest(big) == blake3.blake3(big.read_bytes()).hexdigest()
