"""File digests: in parallel, in order, and bound to the identity of the bytes hashed."""

from __future__ import annotations

import os
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
    with pytest.raises(FileChangedError, match="while it was hashed"):
        hash_file(f)


def test_a_file_changed_within_the_clock_tick_is_hashed_but_not_stampable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "RACY_NS", 10**9)
    f = tmp_path / "f"
    f.write_bytes(b"x")
    assert not hash_file(f).stampable
    os.utime(f, ns=(1, 1))  # mtime in 1970, but the change time is now
    assert not hash_file(f).stampable
