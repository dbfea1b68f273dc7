"""File digests: in parallel, in order, bound to the identity of the bytes hashed, read without a memory map."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from hashing_fakes import HookedBlake3

from marlin_pack.io import hashing
from marlin_pack.io.hashing import FileChangedError, file_digest, file_digests, hash_file


def test_file_digests_in_parallel_keep_order_and_errors(tmp_path: Path) -> None:
    paths = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (1 << 20) * (i + 1))
        paths.append(p)
    paths.insert(2, tmp_path / "missing")
    got = file_digests(paths)
    assert isinstance(got[2], OSError)
    want = [blake3.blake3(p.read_bytes()).hexdigest() for p in paths if p.exists()]
    assert [g.digest for g in got if not isinstance(g, OSError)] == want


def test_file_digest_of_an_empty_file_and_threads(tmp_path: Path) -> None:
    empty, big = tmp_path / "empty", tmp_path / "big"
    empty.write_bytes(b"")
    big.write_bytes(bytes(range(256)) * (1 << 16))
    assert file_digest(empty) == blake3.blake3(b"").hexdigest()
    assert file_digest(big, threads=1) == file_digest(big) == blake3.blake3(big.read_bytes()).hexdigest()


def test_the_identity_is_the_one_of_the_bytes_hashed(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    h = hash_file(f)
    st = f.stat()
    assert h.identity == (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@pytest.mark.parametrize("change", ["append", "truncate-then-grow", "replace", "in-place"])
def test_a_file_changed_while_it_is_hashed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * (1 << 20))
    if change == "in-place":  # an in-place write moves the times: make the last change visibly older first
        os.utime(f, ns=(1, 1))
    other = tmp_path / "other"
    other.write_bytes(b"y" * (1 << 20))

    def during(_: int) -> None:
        if change == "append":
            with open(f, "ab") as fh:
                fh.write(b"more")
        elif change == "truncate-then-grow":
            os.truncate(f, 10)
            os.truncate(f, 1 << 20)
        elif change == "replace":
            os.replace(other, f)
        else:
            fd = os.open(f, os.O_WRONLY)
            os.pwrite(fd, b"\x01" * 16, 4096)
            os.close(fd)

    monkeypatch.setattr(blake3, "blake3", HookedBlake3(during))
    with pytest.raises(FileChangedError, match="changed while it was hashed"):
        hash_file(f)


def test_a_file_changed_within_the_clock_tick_is_hashed_but_not_stampable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "RACY_NS", 10**9)
    f = tmp_path / "f"
    f.write_bytes(b"x")
    assert not hash_file(f).stampable
    os.utime(f, ns=(1, 1))  # mtime in 1970, but the change time is now
    assert not hash_file(f).stampable


@pytest.mark.parametrize("threads", [1, 16])  # one reading thread; four, each reading a part of every chunk
def test_chunks_read_ahead_hash_as_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Files are read CHUNK bytes at a time (the next while one is hashed): the digest is the whole file's."""
    monkeypatch.setattr(hashing, "CHUNK", 1 << 16)
    for size in (0, 1, 4097, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 5 * (1 << 16) + 3):
        f = tmp_path / f"f{size}"
        f.write_bytes(os.urandom(size))
        assert hash_file(f, threads=threads).digest == blake3.blake3(f.read_bytes()).hexdigest(), size


@pytest.mark.parametrize("threads", [1, 16])
def test_a_file_truncated_midway_reads_short_and_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """A chunk that reads short (the file cut after the hash began): refused, named, before the identity is compared."""
    monkeypatch.setattr(hashing, "CHUNK", 1 << 16)
    f = tmp_path / "f"
    f.write_bytes(b"x" * (8 << 16))
    cut: list[int] = []

    def during(n: int) -> None:
        if not cut:
            cut.append(n)
            os.truncate(f, 3 << 16)

    monkeypatch.setattr(blake3, "blake3", HookedBlake3(during))
    with pytest.raises(FileChangedError, match=r"changed while it was hashed \(truncated to 196608 of its 524288 bytes\)") as e:
        hash_file(f, threads=threads)
    assert e.value.filename == str(f)


# Hashes argv[1] with a BLAKE3 whose first update cuts the file to nothing *before* hashing the buffer it was given:
# through a memory map (before issue 68) that buffer was the file's pages, and the hash died of SIGBUS.
_TRUNCATED_WHILE_HASHED = """
import os, sys
from pathlib import Path
import blake3
from marlin_pack.io import hashing

target, real = sys.argv[1], blake3.blake3

class Truncating:
    AUTO = real.AUTO

    def __init__(self, *args, **kwargs):
        self.h = real(*args, **kwargs)

    def update(self, data):
        if os.path.getsize(target):
            os.truncate(target, 0)
        self.h.update(data)

    def hexdigest(self):
        return self.h.hexdigest()

blake3.blake3 = Truncating
try:
    hashing.hash_file(Path(target))
except hashing.FileChangedError as e:
    print(f"{e.filename} {e.strerror}")
    sys.exit(1)
print("hashed")
"""


@pytest.mark.parametrize("size", [1 << 20, 80 << 20])  # one chunk; several (read ahead on a thread)
def test_a_file_truncated_while_it_is_hashed_is_a_one_line_refusal_not_a_sigbus(tmp_path: Path, size: int) -> None:
    f = tmp_path / "rank-0.safetensors"
    with open(f, "wb") as fh:
        fh.truncate(size)  # sparse: reads as zeros, mapped or not
    r = subprocess.run([sys.executable, "-c", _TRUNCATED_WHILE_HASHED, str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # -7: killed by SIGBUS
    assert r.stdout == f"{f} changed while it was hashed (truncated to 0 of its {size} bytes)\n" and r.stderr == ""


def test_remembered_hashes_a_file_once_per_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within ``remembered()`` (``marlin-pack check`` over several ranks) a file hashed again under the same path and
    identity is not read again; a file whose identity moved, one others may write, or one outside the scope is."""
    f = tmp_path / "common.safetensors"
    f.write_bytes(os.urandom(100_000))
    reads: list[int] = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: reads.append(offset) or preadv(fd, bufs, offset))
    with hashing.remembered():
        first = hash_file(f)
        assert hash_file(f) == first and len(reads) == 1
        os.utime(f, ns=(1, 1))  # another identity: hashed again
        assert hash_file(f).digest == first.digest and len(reads) == 2
        f.chmod(0o666)  # others may write it: never taken from the scope
        hash_file(f)
        hash_file(f)
        assert len(reads) == 4
    f.chmod(0o644)
    hash_file(f)
    assert len(reads) == 5 and not hashing._REMEMBERED


# ReadHash: a file's digest from the ranges a reader reads, in the reader's order (verify's comparisons).


def _ranges(size: int, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` adjacent ranges tiling ``[64, size - 32)`` (a header before, padding after), shuffled."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(65, size - 32), n - 1))
    spans = list(zip([64, *cuts], [*cuts, size - 32], strict=True))
    rng.shuffle(spans)
    return spans


def _read_as(path: Path, order: list[tuple[int, int]], expected: list[tuple[int, int]], held: hashing.HeldBytes,
             repeat: bool = False) -> hashing.ReadHash:
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hashing.ReadHash(path, fd, expected, held)
        for a, b in order + (order[:3] if repeat else []):
            h.seen(a, memoryview(data[a:b]))
        h.digest = h.finish().digest  # type: ignore[attr-defined]
    finally:
        os.close(fd)
    return h


@pytest.mark.parametrize("limit", [0, 1 << 12, 1 << 30])
def test_read_hash_of_ranges_read_in_any_order_is_the_file_digest(tmp_path: Path, limit: int) -> None:
    """Whatever the order and the limit: the whole file's BLAKE3. Read here: the header and the padding, a range the
    reader was to read and never did, and the ranges it read that the limit could not keep (none where it keeps all)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 18))
    spans = _ranges(1 << 18, 40, limit)
    held = hashing.HeldBytes(limit)
    h = _read_as(path, spans[1:], spans, held, repeat=True)  # spans[0]: expected, never read
    assert h.digest == blake3.blake3(path.read_bytes()).hexdigest()  # type: ignore[attr-defined]
    assert held.held == 0 and h.given_up <= sum(b - a for a, b in spans)
    never = spans[0][1] - spans[0][0]
    assert h.read_here == 64 + 32 + never + h.given_up
    if limit == 1 << 30:
        assert h.given_up == 0


def test_read_hash_gives_up_the_ranges_farthest_from_their_front(tmp_path: Path) -> None:
    """Two files share a limit of 4 KiB: a range 1 KiB past its front takes the place of one 3 KiB past its own."""
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        p.write_bytes(os.urandom(8 << 10))
    held = hashing.HeldBytes(4 << 10)
    fds = [os.open(p, os.O_RDONLY) for p in (a, b)]
    try:
        ha = hashing.ReadHash(a, fds[0], [(0, 8 << 10)], held)
        hb = hashing.ReadHash(b, fds[1], [(0, 8 << 10)], held)
        ha.seen(3 << 10, memoryview(a.read_bytes()[3 << 10 : 7 << 10]))  # 3 KiB ahead of a's front: kept
        assert held.held == 4 << 10
        hb.seen(1 << 10, memoryview(b.read_bytes()[1 << 10 : 2 << 10]))  # 1 KiB ahead of b's: a's range gives way
        assert (ha.given_up, hb.given_up, held.held) == (4 << 10, 0, 1 << 10)
        assert ha.finish().digest == blake3.blake3(a.read_bytes()).hexdigest()
        assert hb.finish().digest == blake3.blake3(b.read_bytes()).hexdigest() and held.held == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_read_hash_of_a_file_truncated_before_it_finishes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 16))
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hashing.ReadHash(path, fd, [(0, 1 << 15)])
        os.truncate(path, 1 << 14)
        with pytest.raises(FileChangedError, match=r"changed while it was hashed \(truncated to 16384 of its 65536 bytes\)"):
            h.finish()
    finally:
        os.close(fd)
