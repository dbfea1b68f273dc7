"""A file hashed as it is copied (``ParallelReader.copy_files(..., hashed=...)``, ``io.hashing.CopyHash``): one read of
each byte serves the copy and the BLAKE3 digest, in every I/O plan, on the CPU path the loader tests take (the GPU path
stages the same windows through pinned buffers: tests/on_gpu/test_reader_gpu.py)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

import blake3
import pytest
import torch

from marlin_pack.errors import BundleError
from marlin_pack.gpu import reader as reader_mod
from marlin_pack.gpu.plan import IoFacts, IoPlan, plan_io, reads_cold
from marlin_pack.gpu.reader import CopyItem, ParallelReader, windows_of
from marlin_pack.io import hashing
from marlin_pack.io.hashing import CopyHash, FileChangedError

_WINDOW = 1 << 16


class Reads:
    """Every byte range read from each file (by name) through ``os.preadv``, whatever the descriptor (buffered or
    ``O_DIRECT``): what the tests count."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        preadv = os.preadv

        def counted(fd: int, bufs: list, offset: int) -> int:
            n = preadv(fd, bufs, offset)
            name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
            with self._lock:
                self.ranges[name].append((offset, n))
            return n

        monkeypatch.setattr(os, "preadv", counted)

    def total(self, name: str) -> int:
        return sum(n for _, n in self.ranges[name])

    def once_each(self, name: str, size: int) -> bool:
        """Every byte of ``[0, size)`` read exactly once."""
        seen = bytearray(size)
        for lo, n in self.ranges[name]:
            for i in range(lo, min(lo + n, size)):
                seen[i] += 1
        return all(c == 1 for c in seen) and self.total(name) == size


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * _WINDOW + 1234)  # a short last window, and (below) pieces off page boundaries
    path = tmp_path / "rank-0.safetensors"
    path.write_bytes(data)
    return path, data


def _items(data: bytes) -> tuple[list[CopyItem], list[tuple[torch.Tensor, int, int]]]:
    """Two tensors' ranges, with gaps before, between and after them (a header, alignment) that only the hash reads."""
    spans = [(100, 1000), (_WINDOW + 7, 2 * _WINDOW)]
    outs = [(torch.empty(n, dtype=torch.uint8), lo, n) for lo, n in spans]
    return [CopyItem(lo, n, t) for t, lo, n in outs], outs


@pytest.mark.parametrize("mode", ["staged", "direct", "registered", "helpers"])
@pytest.mark.parametrize("threads", [1, 3])
def test_one_read_serves_the_copy_and_the_digest(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, mode: str, threads: int
) -> None:
    """Each byte of the file is read once: the items get theirs, and the digest is BLAKE3 of the whole file (header
    and gaps included); every plan stages a hashed file through this process's buffers."""
    path, data = data_file
    reads = Reads(monkeypatch)
    items, outs = _items(data)
    with ParallelReader(IoPlan(mode, threads=threads, window=_WINDOW, helpers=4 if mode == "helpers" else 0)) as r:
        copied = r.copy_files([(path, items)], hashed=[path])
        hashed = r.digests[str(path)]
    assert copied == sum(n for _, _, n in outs)
    for t, lo, n in outs:
        assert bytes(t.numpy()) == data[lo : lo + n]
    assert reads.once_each(path.name, len(data)), sorted(reads.ranges[path.name])
    assert hashed.digest == blake3.blake3(data).hexdigest() == hashing.file_digest(path)
    assert hashed.identity == hashing.file_identity(path) and hashed.path == path


def test_a_file_read_whole_into_memory_is_hashed_and_never_read_again(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ParallelReader.read_whole`` (common.safetensors on a cold start): one read, its digest; the reader then copies the
    file's items from that memory, and its tensors are views of it."""
    path, data = data_file
    reads = Reads(monkeypatch)
    with ParallelReader(IoPlan("direct", threads=2, window=_WINDOW)) as r:
        host = r.read_whole(path)
        assert r.digests[str(path)].digest == blake3.blake3(data).hexdigest()
        items, outs = _items(data)
        assert r.copy(path, items) == sum(n for _, _, n in outs)
    for t, lo, n in outs:
        assert bytes(t.numpy()) == data[lo : lo + n]
    assert bytes(host.tensor(5, 11, torch.uint8, (11,)).numpy()) == data[5:16]
    assert reads.total(path.name) == len(data)


def test_windows_of_a_hashed_file_tile_it() -> None:
    t = torch.empty(10, dtype=torch.uint8)
    windows = windows_of([CopyItem(70_000, 10, t)], _WINDOW, 3 * _WINDOW + 5, whole=True)
    assert [(w.lo, w.hi) for w in windows] == [(0, _WINDOW), (_WINDOW, 2 * _WINDOW), (2 * _WINDOW, 3 * _WINDOW),
                                               (3 * _WINDOW, 3 * _WINDOW + 5)]
    assert [len(w.pieces) for w in windows] == [0, 1, 0, 0]
    assert windows_of([], _WINDOW, 0, whole=True) == []


def test_a_file_cut_short_mid_copy_is_refused_cleanly(data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated after its first window was read: the copy raises a one-line BundleError naming the file, and no
    thread is left waiting for a window the hash will never get."""
    path, _ = data_file
    preadv, cut = os.preadv, threading.Event()

    def truncating(fd: int, bufs: list, offset: int) -> int:
        if offset >= _WINDOW and not cut.is_set():
            cut.set()
            os.truncate(path, _WINDOW + 10)
        return preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", truncating)
    items, _ = _items(path.read_bytes())
    with ParallelReader(IoPlan("staged", threads=3, window=_WINDOW)) as r, pytest.raises(BundleError) as e:
        r.copy_files([(path, items)], hashed=[path])
    assert str(path) in str(e.value) and "truncated" in str(e.value) and "\n" not in str(e.value)
    assert str(path) not in r.digests
    assert not [t for t in threading.enumerate() if t.name == "marlin-pack-copy-hash"]


def test_a_file_written_while_it_is_copied_has_no_digest(data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its identity moved between the first read and the last: no digest, the FileChangedError check_files gives."""
    path, _ = data_file
    preadv = os.preadv

    def touching(fd: int, bufs: list, offset: int) -> int:
        n = preadv(fd, bufs, offset)
        if offset == 0:
            os.utime(path, ns=(1, 1))  # a new mtime (and ctime)
        return n

    monkeypatch.setattr(os, "preadv", touching)
    items, _ = _items(path.read_bytes())
    with ParallelReader(IoPlan("staged", threads=2, window=_WINDOW)) as r:
        r.copy_files([(path, items)], hashed=[path])
    found = r.digests[str(path)]
    assert isinstance(found, FileChangedError) and "changed while it was hashed (written)" in str(found)


def test_copy_hash_takes_windows_in_any_order_and_releases_each_once_hashed(tmp_path: Path) -> None:
    data = os.urandom(4000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        h = CopyHash(path, fd, threads=1)
        late = h.submit(3000, memoryview(data[3000:]))
        mid = h.submit(1000, memoryview(data[1000:3000]))
        assert not late.wait(0.05) and not mid.is_set()  # waiting for bytes [0, 1000)
        h.submit(0, memoryview(data[:1000])).wait(5)
        assert mid.wait(5) and late.wait(5)
        assert h.finish().digest == blake3.blake3(data).hexdigest()
        left = CopyHash(path, fd)
        left.submit(1000, memoryview(data[1000:]))
        with pytest.raises(RuntimeError, match="handed 0 of its 4000 bytes"):
            left.finish()
        aborted = CopyHash(path, fd)
        waiting = aborted.submit(1000, memoryview(data[1000:]))
        aborted.abort()
        assert waiting.is_set()
    finally:
        os.close(fd)


def test_the_plan_hashes_on_the_copy_where_it_stages_every_byte() -> None:
    """One rule for a cold file (the decision leaves its digest to the copy where it holds, the plan then reads it
    direct, or staged where memory keeps it); a plan that does not stage (registered pages, helpers) stages a hashed file."""
    assert reads_cold(0.0, True) and reads_cold(0.49, True)
    assert not reads_cold(0.5, True) and not reads_cold(0.0, False) and not reads_cold(None, True)
    cold = plan_io(IoFacts(cached=0.1, direct_reads=True), environ={})
    assert cold.mode == "direct" and cold.hashing() is cold
    kept = plan_io(IoFacts(cached=0.1, direct_reads=True, cache_room=True), environ={})
    assert kept.mode == "staged" and kept.hashing() is kept
    assert plan_io(IoFacts(base_pages=True), environ={}).hashing().mode == "staged"
    for mode in ("registered", "helpers"):
        plan = IoPlan(mode, helpers=4 if mode == "helpers" else 0).hashing()
        assert (plan.mode, plan.helpers, plan.preload) == ("staged", 0, False) and plan.window == 64 << 20


def test_reader_module_reads_with_preadv() -> None:
    """The counting above sees every read: the reader and the hash read only with ``os.preadv``."""
    source = Path(reader_mod.__file__).read_text()
    assert "os.pread(" not in source and "os.read(" not in source


@pytest.mark.parametrize(("mode", "left_cached"), [("staged", True), ("direct", False)])
def test_a_cold_file_read_once_is_left_cached_only_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, left_cached: bool
) -> None:
    """The two cold plans read a cold file once and hash it on the way; ``staged`` (where memory keeps the file) leaves
    it in the page cache for the next start, ``direct`` leaves the page cache as it was: the plan's reason to prefer
    the first, with no second read afterwards."""
    from marlin_pack.io.residency import cached_fraction, drop_cached, takes_direct_reads

    data = os.urandom(64 * _WINDOW)
    path = tmp_path / "rank-0.safetensors"
    path.write_bytes(data)
    os.sync()
    drop_cached(path)
    if not takes_direct_reads(path) or (cached_fraction(path) or 0.0) > 0.1:
        pytest.skip(f"{tmp_path} takes no direct reads or keeps its pages")
    reads = Reads(monkeypatch)
    out = torch.empty(len(data), dtype=torch.uint8)
    with ParallelReader(IoPlan(mode, threads=2, window=_WINDOW)) as r:
        r.copy_files([(path, [CopyItem(0, len(data), out)])], hashed=[path])
        digest = r.digests[str(path)].digest  # type: ignore[union-attr]
    assert bytes(out.numpy()) == data and digest == blake3.blake3(data).hexdigest()
    assert reads.once_each(path.name, len(data))
    assert ((cached_fraction(path) or 0.0) > 0.9) is left_cached
