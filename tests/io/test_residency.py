"""``io.residency``: the facts of the cold path (how much of a file the page cache holds; O_DIRECT reads; room in
memory to keep a file cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from marlin_pack.io import residency
from marlin_pack.io.residency import cached_fraction, drop_cached, room_for, takes_direct_reads, write_through_cache


def _written(tmp_path: Path, size: int = 8 << 20) -> Path:
    path = tmp_path / "rank-0.safetensors"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # written back, so that the pages can be dropped
    return path


def _drop(path: Path) -> None:
    drop_cached(path)
    if cached_fraction(path) != 0.0:
        pytest.skip(f"{path.parent}'s file system keeps its pages (a tmpfs)")


def test_a_file_just_written_is_cached_and_dropped_it_is_not(tmp_path: Path) -> None:
    path = _written(tmp_path)
    assert cached_fraction(path) == 1.0
    _drop(path)
    with open(path, "rb") as f:  # reading a quarter (and its readahead) brings part of it back
        f.read(2 << 20)
    assert 0.2 <= (cached_fraction(path) or 0.0) < 1.0


def test_what_cannot_be_told(tmp_path: Path) -> None:
    assert cached_fraction(tmp_path / "missing") is None
    (tmp_path / "empty").write_bytes(b"")
    assert cached_fraction(tmp_path / "empty") == 1.0


def test_direct_reads(tmp_path: Path) -> None:
    path = _written(tmp_path, 1 << 16)
    assert takes_direct_reads(path) is True  # ext4 (the machines here)
    assert takes_direct_reads(tmp_path / "missing") is False


def test_a_large_file_is_sampled_not_walked() -> None:
    """mincore costs ~12 ms per GiB: a 40 GB rank file is looked at in 64 aligned ranges, 1 GiB in all."""
    import mmap

    size = 40 * 10**9 + 123
    ranges = residency._ranges(size)
    assert len(ranges) == 64 and sum(n for _, n in ranges) <= 1 << 30
    assert all(lo % mmap.ALLOCATIONGRANULARITY == 0 and lo + n <= size for lo, n in ranges)
    assert ranges[0][0] == 0 and ranges[-1][0] > size * 0.95  # spread over the whole file
    assert residency._ranges(3 << 20) == [(0, 3 << 20)]  # a small file: all of it


def test_a_conversion_writes_through_the_cache_only_where_memory_holds_the_bundle() -> None:
    gib = 1 << 30
    assert write_through_cache(30 * gib, 38 * gib) and not write_through_cache(30 * gib, 38 * gib - 1)  # 8 GiB headroom
    assert not write_through_cache(1, None)  # memory unknown: around the cache, as before
    assert write_through_cache(100 * gib, 1, forced="cached") and not write_through_cache(1, 100 * gib, forced="direct")
    with pytest.raises(ValueError, match="MARLIN_PACK_WRITE='fast': expected 'direct' or 'cached'"):
        write_through_cache(1, 1, forced="fast")


def test_room_to_keep_a_file_cached() -> None:
    """A cold rank file is read through the page cache only where the host's available memory keeps it with the
    headroom to spare (the plan's ``cache_room``); unknown memory counts as no room."""
    size = 1 << 20
    assert room_for(size, size + residency.HEADROOM)
    assert not room_for(size, size + residency.HEADROOM - 1)  # one byte short
    assert not room_for(size, None)
    assert room_for(size, size, headroom=0)
