"""The per-user stamp store: bound to each file's identity, private to its user, never written through a planted path."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from marlin_pack.io import hashing
from marlin_pack.io import stamps as stamps_module
from marlin_pack.io.hashing import hash_file
from marlin_pack.io.stamps import STAMPS_ENV, NotStamped, StampStore, stamps_dir

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another user")


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture(autouse=True)
def _settled_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by a test count as settled (as a checkpoint downloaded earlier), unless a test says otherwise."""
    monkeypatch.setattr(hashing, "RACY_NS", -1)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StampStore]:
    with StampStore.open({STAMPS_ENV: str(tmp_path / "stamps")}) as s:
        yield s


def test_the_store_is_a_private_directory_outside_any_bundle(tmp_path: Path) -> None:
    assert stamps_dir({STAMPS_ENV: "/x/y"}) == Path("/x/y")
    assert stamps_dir({"XDG_STATE_HOME": "/state", "HOME": "/home/u"}) == Path("/state/marlin-pack/stamps")
    assert stamps_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/marlin-pack/stamps")
    assert stamps_dir({"XDG_STATE_HOME": "relative", "HOME": "/home/u"}) == Path("/home/u/.cache/marlin-pack/stamps")
    with StampStore.open({STAMPS_ENV: str(tmp_path / "a" / "stamps")}) as s:
        assert s.unavailable is None
        assert stat.S_IMODE((tmp_path / "a" / "stamps").stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o755, 0o750, 0o711])
def test_a_directory_it_did_not_create_is_never_chmod_ed_and_not_used_when_open_to_others(tmp_path: Path, mode: int) -> None:
    # MARLIN_PACK_STAMPS=/tmp as root: tightening it to 0700 would lock every other user out of /tmp.
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    f = _file(tmp_path / "a", b"data")
    with StampStore.open({STAMPS_ENV: str(d)}) as s:
        assert s.unavailable is not None and f"mode {mode:04o}" in s.unavailable and "did not create" in s.unavailable
        assert STAMPS_ENV in s.unavailable and "chmod 700" in s.unavailable, s.unavailable
        assert s.record(hash_file(f)) == NotStamped("store", s.unavailable)
        assert not s.trusted(f, hash_file(f).digest)
    assert stat.S_IMODE(d.stat().st_mode) == mode and list(d.iterdir()) == []


def test_an_existing_private_directory_is_used_and_a_new_one_is_created_private(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir(mode=0o700)
    f = _file(tmp_path / "a", b"data")
    with StampStore.open({STAMPS_ENV: str(d)}) as s:
        assert s.unavailable is None and s.record(hash_file(f)) is None and s.trusted(f, hash_file(f).digest)
    old = os.umask(0)  # the mode asked for, whatever the umask
    try:
        with StampStore.open({STAMPS_ENV: str(tmp_path / "new" / "stamps")}) as s:
            assert s.unavailable is None
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "stamps").stat().st_mode) == 0o700


def test_a_symlinked_stamp_directory_is_not_used(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "stamps").symlink_to(real)
    f = _file(tmp_path / "a", b"data")
    with StampStore.open({STAMPS_ENV: str(tmp_path / "stamps")}) as s:
        assert s.unavailable is not None and "symlink" in s.unavailable and STAMPS_ENV in s.unavailable
        s.record(hash_file(f))
        assert not s.trusted(f, hash_file(f).digest)
    assert list(real.iterdir()) == []


@as_root
def test_a_directory_of_another_user_is_not_trusted(tmp_path: Path) -> None:
    d = tmp_path / "stamps"
    d.mkdir(mode=0o700)
    f = _file(tmp_path / "a", b"data")
    with StampStore.open({STAMPS_ENV: str(d)}) as s:  # stamped by its owner ...
        s.record(hash_file(f))
    os.chown(d, 12345, 12345)  # ... which is now someone else
    with StampStore.open({STAMPS_ENV: str(d)}) as s:
        assert s.unavailable is not None and "uid 12345" in s.unavailable
        assert not s.trusted(f, hash_file(f).digest)


@as_root
def test_a_stamp_file_of_another_user_is_not_trusted(tmp_path: Path, store: StampStore) -> None:
    f = _file(tmp_path / "a", b"data")
    store.record(hash_file(f))
    assert store.trusted(f, hash_file(f).digest)
    (stamp,) = [p for p in store.where.iterdir()]
    os.chown(stamp, 12345, 12345)
    assert not store.trusted(f, hash_file(f).digest)


def test_a_planted_stamp_symlink_is_neither_followed_nor_written_through(tmp_path: Path, store: StampStore) -> None:
    f = _file(tmp_path / "a", b"data")
    victim = _file(tmp_path / "victim", b"secret")
    os.chmod(victim, 0o600)
    st = f.stat()
    (store.where / f"{st.st_dev}-{st.st_ino}.json").symlink_to(victim)
    assert not store.trusted(f, hash_file(f).digest)  # O_NOFOLLOW: not read
    store.record(hash_file(f))  # replaces the link itself
    assert victim.read_bytes() == b"secret"
    assert store.trusted(f, hash_file(f).digest)
    assert not [p for p in store.where.iterdir() if p.name.endswith(".tmp")]


def test_same_size_edit_with_restored_mtime_is_not_trusted(tmp_path: Path, store: StampStore) -> None:
    # `touch -r` (or utime) restores size and mtime after an edit; the change time still moves.
    f = _file(tmp_path / "a.bin", b"0123456789")
    old = hash_file(f)
    store.record(old)
    assert store.trusted(f, old.digest)
    st = f.stat()
    f.write_bytes(b"9876543210")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    assert not store.trusted(f, old.digest)


def test_swapped_files_are_not_trusted(tmp_path: Path, store: StampStore) -> None:
    a, b = _file(tmp_path / "a", b"A" * 64), _file(tmp_path / "b", b"B" * 64)
    ha, hb = hash_file(a), hash_file(b)
    store.record(ha)
    store.record(hb)
    os.rename(a, tmp_path / "tmp")
    os.rename(b, a)
    os.rename(tmp_path / "tmp", b)
    assert not store.trusted(a, ha.digest) and not store.trusted(b, hb.digest)


def test_a_copy_with_equal_mtime_is_not_trusted(tmp_path: Path, store: StampStore) -> None:
    a = _file(tmp_path / "a", b"x" * 100)
    store.record(hash_file(a))
    copy = tmp_path / "copy"
    shutil.copy2(a, copy)
    os.replace(copy, a)  # same bytes, size and mtime, another file
    assert not store.trusted(a, hash_file(a).digest)


def test_a_stamp_vouches_only_for_its_digest(tmp_path: Path, store: StampStore) -> None:
    a = _file(tmp_path / "a", b"x" * 100)
    h = hash_file(a)
    store.record(h)
    assert store.trusted(a, h.digest)
    assert not store.trusted(a, "0" * 64)


def test_a_file_changed_just_before_it_was_hashed_is_not_stamped(
    tmp_path: Path, store: StampStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write in the same clock tick as the last one would leave the identity unchanged: such a hash is used, not kept.
    monkeypatch.setattr(hashing, "RACY_NS", 1_000_000_000)
    f = _file(tmp_path / "fresh", b"new")
    h = hash_file(f)
    assert not h.stampable
    store.record(h)
    assert not store.trusted(f, h.digest)


@pytest.mark.parametrize("damage", ["nested", "directory", "list", "garbage", "fifo", "huge"])
def test_a_corrupt_stamp_is_ignored_and_replaced(tmp_path: Path, store: StampStore, damage: str) -> None:
    f = _file(tmp_path / "a", b"data")
    st = f.stat()
    path = store.where / f"{st.st_dev}-{st.st_ino}.json"
    if damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "directory":
        path.mkdir()
    elif damage == "list":
        path.write_text("[1, 2]")
    elif damage == "garbage":
        path.write_bytes(b"\xff\xfe{")
    elif damage == "huge":
        path.write_text('{"format": 1, "pad": "' + "x" * 100_000 + '"}')
    else:
        os.mkfifo(path)
    h = hash_file(f)
    assert not store.trusted(f, h.digest)  # never raises, never blocks
    store.record(h)  # may fail to replace a directory: silently, and without leftovers
    assert sorted(p.name for p in store.where.iterdir()) == [path.name]
    assert store.trusted(f, h.digest) == (damage != "directory")


def test_record_written_only_for_files_no_one_else_can_write(tmp_path: Path, store: StampStore) -> None:
    import blake3

    d = tmp_path / "out"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    mine = _file(d / "mine", b"m" * 10)
    os.chmod(mine, 0o644)
    shared = _file(d / "shared", b"s" * 10)
    os.chmod(shared, 0o664)
    link = d / "link"
    link.symlink_to(mine)
    results = [store.record_written(p, blake3.blake3(p.read_bytes()).hexdigest()) for p in (mine, shared, link)]
    assert results[0] is None and results[1] == NotStamped("writable", "mode 0664: group or others may write it")
    assert results[2] == NotStamped("changed", "is not a regular file")
    assert store.trusted(mine, blake3.blake3(b"m" * 10).hexdigest())
    assert not store.trusted(shared, blake3.blake3(b"s" * 10).hexdigest())
    assert len(list(store.where.iterdir())) == 1  # the symlink recorded nothing of its own


def test_record_written_not_in_a_directory_others_may_write(tmp_path: Path, store: StampStore) -> None:
    import blake3

    d = tmp_path / "out"
    d.mkdir()
    os.chmod(d, 0o1777)  # the sticky bit stops renames, not a writer's new file under a name we later use
    f = _file(d / "mine", b"m" * 10)
    os.chmod(f, 0o644)
    why = store.record_written(f, blake3.blake3(b"m" * 10).hexdigest())
    assert why is not None and why.kind == "writable" and "mode 1777" in why.why and str(d) in why.why
    assert list(store.where.iterdir()) == []


def _others_may_write(tmp_path: Path, how: str) -> tuple[Path, str]:
    """A settled file that a user other than this one and root may change (``how``), and the reason expected."""
    d = tmp_path / "dir"
    d.mkdir()
    os.chmod(d, 0o755)
    f = _file(d / "weights.safetensors", b"w" * 4096)
    os.chmod(f, 0o644)
    if how == "owner":  # she may chmod it back, or write through a mapping she opened
        os.chown(f, 12345, 12345)
        return f, "owned by uid 12345"
    if how in ("group", "other"):
        os.chmod(f, 0o664 if how == "group" else 0o646)
        return f, f"mode {0o664 if how == 'group' else 0o646:04o}: group or others may write it"
    if how == "dir-owner":
        os.chown(d, 12345, 12345)
        return f, f"its directory {d} is owned by uid 12345"
    if how in ("dir-group", "dir-sticky"):
        os.chmod(d, 0o775 if how == "dir-group" else 0o1777)
        return f, f"its directory {d}: mode {0o775 if how == 'dir-group' else 0o1777:04o}: group or others may write it"
    assert how == "link-target-dir"  # named in a private directory, but really in a shared one
    os.chmod(d, 0o777)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "weights.safetensors").symlink_to(f)
    return private / "weights.safetensors", f"its directory {d}: mode 0777: group or others may write it"


WRITABLE_BY_OTHERS = [
    pytest.param("owner", marks=as_root), "group", "other", pytest.param("dir-owner", marks=as_root), "dir-group",
    "dir-sticky", "link-target-dir",
]


@pytest.mark.parametrize("how", WRITABLE_BY_OTHERS)
def test_a_file_others_may_write_is_never_stamped(tmp_path: Path, store: StampStore, how: str) -> None:
    # Her shared writable mapping of the file changes its bytes after the hash without moving mtime or ctime:
    # no identity can vouch for such a file, so it is hashed at every start.
    f, why = _others_may_write(tmp_path, how)
    h = hash_file(f)
    assert h.stampable
    assert store.record(h) == NotStamped("writable", why)
    assert not store.trusted(f, h.digest)
    assert list(store.where.iterdir()) == []


@pytest.mark.parametrize("how", WRITABLE_BY_OTHERS)
def test_a_stamp_is_not_trusted_while_others_may_write_the_file(tmp_path: Path, store: StampStore, how: str) -> None:
    # A stamp kept from before (by an earlier version, or before a directory's chmod that leaves the file's ctime alone).
    f, _ = _others_may_write(tmp_path, how)
    h = hash_file(f)
    assert store._write(h.identity, h.digest) is None
    assert not store.trusted(f, h.digest)


def test_a_stamp_is_trusted_again_once_the_directory_is_private_again(tmp_path: Path, store: StampStore) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o755)
    f = _file(d / "a", b"data")
    h = hash_file(f)
    assert store.record(h) is None and store.trusted(f, h.digest)
    os.chmod(d, 0o777)  # the file's identity does not move
    assert hash_file(f).identity == h.identity and not store.trusted(f, h.digest)
    os.chmod(d, 0o755)
    assert store.trusted(f, h.digest)


def test_a_file_changed_after_it_was_hashed_is_not_stamped(tmp_path: Path, store: StampStore) -> None:
    f = _file(tmp_path / "a", b"data")
    h = hash_file(f)
    os.chmod(f, 0o600)  # its ctime moves: what the hash saw is no longer known
    why = store.record(h)
    assert why == NotStamped("changed", "changed after it was hashed") and list(store.where.iterdir()) == []


@pytest.mark.parametrize(
    "err,found", [(errno.EROFS, "is read-only"), (errno.ENOSPC, "is full"), (errno.EACCES, "is not writable by this user")]
)
@pytest.mark.parametrize("step", ["create", "write", "rename"])
def test_a_stamp_that_cannot_be_written_says_why(
    tmp_path: Path, store: StampStore, monkeypatch: pytest.MonkeyPatch, err: int, found: str, step: str
) -> None:
    # A read-only or full store: nothing is stamped, and the caller must be able to say so.
    f = _file(tmp_path / "a", b"data")
    real = {"create": os.open, "write": os.write, "rename": os.rename}[step]

    def failing(*args: object, **kwargs: object) -> object:
        if step != "create" or kwargs.get("dir_fd") is not None and args[1] & os.O_CREAT:  # type: ignore[operator]
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(stamps_module.os, {"create": "open", "write": "write", "rename": "rename"}[step], failing)
    why = store.record(hash_file(f))
    monkeypatch.undo()
    assert why is not None and why.kind == "store" and why.why == f"{store.where} {found} ({os.strerror(err)})"
    assert not store.trusted(f, hash_file(f).digest)
    assert list(store.where.iterdir()) == []  # no temporary file left
