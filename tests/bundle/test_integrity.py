"""Attacks on ``verify: auto``'s stamps, replayed through the loader's own decision (``preflight``, as ``check``).

Each is what a user who can write a bundle or a checkpoint directory, but not the serving
user's files, could try: plant symlinks where stamps are written, change a file while it is
hashed, forge stamps. None may make a check write outside its store or vouch for bytes it did
not hash.

A start checks the checkpoint by samples of every tensor where the bundle records them (``convert`` does), and never
stamps it; the source files' stamps concern bundles an older marlin-pack wrote (``without_samples``), whose start still
hashes the checkpoint whole: the attacks on source stamps are replayed on such bundles.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import blake3
import pytest
from hashing_fakes import HookedBlake3
from source_edits import flip_sampled_byte, without_samples

from marlin_pack.vllm_plugin.preflight import preflight

LEGACY_STAMPS = ".stamps.json"  # where earlier versions kept stamps, inside each bundle


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(d).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def _data_offset(path: Path) -> int:
    """An offset inside the tensor data (past the safetensors header) of ``path``."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    return 8 + header_len + 16


def test_planted_stamp_symlinks_are_never_written_through(make_bundle: Any, damaged_copy: Any, tmp_path: Path) -> None:
    model = damaged_copy(make_bundle("awq"))  # a copy: new inodes, so the check hashes (and stamps) again
    bundle = model / "marlin-pack"
    victim = tmp_path / "victim"
    victim.write_text("root's secret")
    os.chmod(victim, 0o600)
    (bundle / f"{LEGACY_STAMPS}.{os.getpid()}.tmp").symlink_to(victim)
    (bundle / LEGACY_STAMPS).unlink(missing_ok=True)
    (bundle / LEGACY_STAMPS).symlink_to(victim)
    before = _tree(bundle)
    assert preflight(model, verify="auto").decision == "load"
    assert preflight(model, verify="full").decision == "load"
    assert victim.read_text() == "root's secret"
    assert _tree(bundle) == before  # a check writes nothing into a bundle (a read-only volume is fine)


def _flip_once_after_hashing(target: Path) -> tuple[HookedBlake3, list[bool]]:
    """A BLAKE3 that flips a data byte of ``target`` once, right after it hashed a buffer of ``target``'s size."""
    size, done = target.stat().st_size, [False]

    def after(n: int) -> None:
        if not done[0] and n == size:
            done[0] = True
            _flip(target, _data_offset(target))

    return HookedBlake3(after), done


@pytest.mark.parametrize("which", ["bundle", "source"])
def test_a_file_tampered_while_it_is_hashed_is_never_vouched_for(
    make_bundle: Any, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    model = damaged_copy(make_bundle("awq"), without_samples if which == "source" else None)
    target = model / "marlin-pack/tp1/rank-0.safetensors" if which == "bundle" else next(model.glob("*.safetensors"))
    os.utime(target, ns=(1, 1))  # as an older file: an in-place write visibly moves its times
    hooked, flipped = _flip_once_after_hashing(target)
    monkeypatch.setattr(blake3, "blake3", hooked)
    preflight(model, verify="auto")  # refused (changed while hashed) or, at worst, loaded without a stamp
    assert flipped[0]
    monkeypatch.undo()
    again = preflight(model, verify="auto")  # the tampered bytes must be hashed, and refused
    assert again.decision == "refuse", again.to_dict()
    assert again.ranks[0].field == ("files" if which == "bundle" else "source.blake3")


def test_forged_stamps_in_the_bundle_do_not_vouch_for_another_checkpoint(make_bundle: Any, damaged_copy: Any) -> None:
    model = damaged_copy(make_bundle("awq"), without_samples)
    bundle = model / "marlin-pack"
    manifest = json.loads((bundle / "manifest.json").read_text())
    source = next(model.glob("*.safetensors"))
    _flip(source, _data_offset(source))  # another checkpoint's weights: same names, shapes and header
    forged = {}
    for f in manifest["source"]["files"]:  # this checkpoint's identities with the bundle's recorded digests
        st = (model / f["name"]).stat()
        forged[f"source:{f['name']}"] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, f["blake3"]]
    (bundle / LEGACY_STAMPS).write_text(json.dumps(forged))
    report = preflight(model, verify="auto")
    assert report.decision == "refuse" and report.ranks[0].field == "source.blake3", report.to_dict()
    assert "changed since the bundle was made" in report.ranks[0].message


def test_stamps_have_no_say_over_sampled_sources(make_bundle: Any, damaged_copy: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle with samples: the checkpoint is sampled at every start, stamped or not, and never stamped."""
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    model = damaged_copy(make_bundle("awq"))
    first = preflight(model, verify="auto")
    assert first.decision == "load", first.to_dict()
    source = next(model.glob("*.safetensors")).name
    assert not any(source in line for line in json.dumps(first.to_dict()["hashed"]).splitlines()), first.to_dict()["hashed"]
    flip_sampled_byte(model / source)  # whatever a stamp of it would say
    again = preflight(model, verify="auto")
    assert again.decision == "refuse" and again.ranks[0].field == "source.sample", again.to_dict()
    assert f"source file {source} holds other tensor bytes than when the bundle was made (sampled)" in again.ranks[0].message


def _others_may_write(target: Path, who: str) -> str:
    """Let a user other than this one and root change ``target`` (``who``); why it is then never stamped."""
    if who == "owner":  # another user's file (she may write it, or chmod it back)
        os.chown(target, 12345, 12345)
        return "owned by uid 12345"
    os.chmod(target.parent, 0o777)  # a directory others may write: they may replace or rename the file
    return f"its directory {target.parent}: mode 0777: group or others may write it"


@pytest.mark.parametrize(
    "who", [pytest.param("owner", marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")), "directory"]
)
@pytest.mark.parametrize("which", ["bundle", "source"])
def test_a_file_others_may_write_is_hashed_at_every_start_so_writes_through_a_mapping_are_caught(
    make_bundle: Any, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, which: str, who: str
) -> None:
    """She dirties a page of a shared writable mapping, lets the check hash the file, then writes through the same
    page: neither mtime nor ctime moves, so a stamp would vouch for the tampered bytes at every later start."""
    from marlin_pack.io import hashing

    monkeypatch.setattr(hashing, "RACY_NS", -1)  # the copy's files count as settled: only the owner rule can refuse a stamp
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    model = damaged_copy(make_bundle("awq"), without_samples if which == "source" else None)
    target = model / "marlin-pack/tp1/rank-0.safetensors" if which == "bundle" else next(model.glob("*.safetensors"))
    why = _others_may_write(target, who)
    offset = _data_offset(target)
    fd = os.open(target, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            mm[offset] = mm[offset]  # the page is dirty and writable: later writes to it move no file time
            first = preflight(model, verify="auto")
            assert first.decision == "load", first.to_dict()
            line = first.hashed.summary()
            name = target.relative_to(model / "marlin-pack").as_posix() if which == "bundle" else target.name
            assert line is not None and f"hashed at every start: writable by others, {name} (" in line, line
            assert first.to_dict()["hashed"]["not_stamped"] == [{"file": name, "kind": "writable", "why": why}]
            mm[offset] ^= 0xFF
    finally:
        os.close(fd)
    again = preflight(model, verify="auto")  # hashed again: the tampered bytes are refused
    assert again.decision == "refuse", again.to_dict()
    assert again.ranks[0].field == ("files" if which == "bundle" else "source.blake3")

