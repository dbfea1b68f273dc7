"""``marlin-pack check`` and the loader's pre-GPU path it shares: every failure a refusal naming its field."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.vllm_plugin.preflight import preflight

runner = CliRunner()


@pytest.fixture
def model(make_bundle: Any, damaged_copy: Any) -> Path:
    return damaged_copy(make_bundle("gptq", "tiny", tp_sizes=(1, 2)))


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files a test just copied count as settled (as a downloaded checkpoint): their hashes are stamped."""
    from marlin_pack.io import hashing

    monkeypatch.setattr(hashing, "RACY_NS", -1)


def _check(*args: str) -> tuple[int, dict]:
    r = runner.invoke(app, ["check", *args, "--json"])
    return r.exit_code, json.loads(r.stdout)


def test_intact_bundle_loads_on_every_rank(model: Path, settled: None) -> None:
    code, data = _check(str(model), "--tp", "2")
    assert code == 0 and data["decision"] == "load" and data["field"] is None
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and all(r["decision"] == "load" for r in data["ranks"])
    r = runner.invoke(app, ["check", str(model), "--tp", "2", "--compute-capability", "8.0"])  # a GPU named: nothing unchecked
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and len(lines) == 2, r.stdout
    assert lines[0].startswith("rank 0/2: load tp2/rank-0.safetensors (8 layers") and lines[1].startswith("rank 1/2: load tp2/rank-1")


@pytest.mark.parametrize(
    "args,field",
    [
        (["--tp", "4"], "tp_size"),
        (["--dtype", "bfloat16"], "serving_dtype"),
        (["--bundle", "/nonexistent/bundle"], "manifest"),
    ],
)
def test_engine_mismatch_is_refused_naming_the_field(model: Path, args: list[str], field: str) -> None:
    code, data = _check(str(model), *args)
    assert code == 1 and data["decision"] == "refuse" and data["field"] == field
    assert f"[{field}]" in data["message"] and '{"fallback": true}' in data["message"]


def test_fallback_is_reported_and_exits_0(model: Path) -> None:
    code, data = _check(str(model), "--tp", "4", "--fallback")
    assert code == 0 and data["decision"] == "fallback" and data["field"] == "tp_size"


def test_one_rank(model: Path) -> None:
    (model / "marlin-pack" / "tp2" / "rank-1.safetensors").write_bytes(b"broken")
    assert _check(str(model), "--tp", "2", "--rank", "0")[0] == 0
    code, data = _check(str(model), "--tp", "2", "--rank", "1")
    assert code == 1 and data["field"] == "files" and [r["rank"] for r in data["ranks"]] == [1]


def test_dangling_source_symlink_is_a_refusal_and_fallback_works(model: Path) -> None:
    # A pruned Hugging Face cache: the snapshot's symlink points at a blob that is gone.
    shard = model / "model.safetensors"
    blob = model / "blob"
    shard.rename(blob)
    shard.symlink_to(blob)
    blob.unlink()
    code, data = _check(str(model))
    assert code == 1 and data["field"] == "source.files" and "cannot be read" in data["message"]
    assert preflight(model, fallback=True).decision == "fallback"


def test_unreadable_bundle_file_is_a_refusal(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The serving user cannot read a file root converted with umask 077 (simulated: tests may run as root).
    import marlin_pack.io.files as files

    real = files.os.open
    rank_file = str(model / "marlin-pack" / "tp1" / "rank-0.safetensors")

    def deny(path: Any, flags: int, *args: Any) -> int:
        if os.fspath(path) == rank_file:
            raise PermissionError(13, "Permission denied", rank_file)
        return real(path, flags, *args)

    monkeypatch.setattr(files.os, "open", deny)
    report = preflight(model, verify="full")
    assert report.decision == "refuse" and report.ranks[0].field == "files"
    assert "the serving user must be able to read" in report.ranks[0].message
    # with stamps trusted (no hashing), the header read before the GPU still finds it
    report = preflight(model, verify="size")
    assert report.decision == "refuse" and "Permission denied" in report.ranks[0].message
    assert preflight(model, verify="size", fallback=True).decision == "fallback"


@pytest.mark.parametrize("damage", ["nested", "directory"])
def test_a_stamp_cache_left_in_the_bundle_is_neither_read_nor_rewritten(model: Path, damage: str) -> None:
    stamps = model / "marlin-pack" / ".stamps.json"  # where earlier versions kept stamps
    stamps.unlink(missing_ok=True)
    if damage == "nested":
        stamps.write_text("[" * 100_000)
    else:
        stamps.mkdir()
    before = sorted(p.name for p in (model / "marlin-pack").iterdir())
    assert preflight(model).decision == "load"
    assert sorted(p.name for p in (model / "marlin-pack").iterdir()) == before


def test_bundle_option_with_unknown_user_is_an_option_error(model: Path) -> None:
    r = runner.invoke(app, ["check", str(model), "--bundle", "~nosuchuser-marlin/x"])
    assert r.exit_code == 2 and "nosuchuser" in r.output


def test_check_says_what_it_hashed_and_where_the_stamps_are(
    model: Path, settled: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    code, first = _check(str(model), "--tp", "2")
    assert code == 0 and first["hashed"]["files"] > 0 and first["hashed"]["stamps"] == str(tmp_path / "stamps")
    r = runner.invoke(app, ["check", str(model), "--tp", "2"])
    assert r.exit_code == 0 and [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")] == [], r.stdout  # stamped: nothing
    code, again = _check(str(model), "--tp", "2", "--verify", "full")
    assert again["hashed"]["files"] >= first["hashed"]["files"]  # full: every file of every rank, stamps or not
    r = runner.invoke(app, ["check", str(model), "--verify", "full"])
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")]
    assert "verify full hashes them at every start" in line, line
    code, sizes = _check(str(model), "--tp", "2", "--verify", "size")
    assert sizes["hashed"]["files"] == 0


def test_check_says_every_start_will_hash_where_stamps_cannot_be_kept(
    model: Path, settled: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "a-file" / "stamps"))  # a read-only home, say
    for _ in range(2):
        r = runner.invoke(app, ["check", str(model)])
        assert r.exit_code == 0, r.stdout
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")]
        assert "MARLIN_PACK_STAMPS" in line and line.endswith("so every start hashes them again"), line


@pytest.mark.parametrize("err,found", [(errno.EROFS, "is read-only"), (errno.ENOSPC, "is full")])
def test_check_says_nothing_was_stamped_when_the_store_cannot_be_written(
    model: Path, settled: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, err: int, found: str
) -> None:
    """A read-only or full store: "stamped in ..." would promise the next start a skip it will not get."""
    store = tmp_path / "stamps"
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(store))
    real = os.rename

    def failing(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        if src_dir_fd is not None:  # the stamp's rename into place
            raise OSError(err, os.strerror(err))
        real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "rename", failing)
    for _ in range(2):  # every check hashes again, and says so
        r = runner.invoke(app, ["check", str(model), "--tp", "2"])
        assert r.exit_code == 0, r.stdout
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")]
        assert "stamped in" not in line and f"; not stamped: {store} {found} ({os.strerror(err)}); " in line, line
        assert line.endswith("every start hashes them until the store can be written"), line
    code, data = _check(str(model), "--tp", "2")
    assert code == 0 and data["hashed"]["files"] > 0 and data["hashed"]["stamped"] == 0, data["hashed"]
    assert {n["kind"] for n in data["hashed"]["not_stamped"]} == {"store"}
    assert len(data["hashed"]["not_stamped"]) == data["hashed"]["files"]


def test_check_says_which_files_are_hashed_at_every_start_and_why(
    model: Path, settled: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    shared = model / "marlin-pack" / "tp2"
    os.chmod(shared, 0o777)  # others may replace the rank files
    for _ in range(2):
        r = runner.invoke(app, ["check", str(model), "--tp", "2"])
        assert r.exit_code == 0, r.stdout
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")]
        assert "; hashed at every start: writable by others, 2 files (tp2/rank-0.safetensors: its directory " in line, line
        assert f"{shared}: mode 0777: group or others may write it; ...)" in line, line
    os.chmod(shared, 0o755)
    runner.invoke(app, ["check", str(model), "--tp", "2"])
    r = runner.invoke(app, ["check", str(model), "--tp", "2"])
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("check hashed")] == [], r.stdout  # stamped now


def test_a_bundle_on_a_read_only_volume_is_hashed_once(model: Path, settled: None) -> None:
    """Checks write nothing into the bundle (a container image, a read-only volume): the user's stamps let
    the second check hash nothing."""
    bundle = model / "marlin-pack"
    before = {p.name: p.stat().st_mtime_ns for p in bundle.rglob("*")}
    assert preflight(model, tp_size=2).decision == "load"
    second = preflight(model, tp_size=2)
    assert second.decision == "load" and second.hashed.files == 0
    assert {p.name: p.stat().st_mtime_ns for p in bundle.rglob("*")} == before


def test_the_first_check_after_convert_hashes_nothing(make_checkpoint: Any, damaged_copy: Any, settled: None) -> None:
    """convert stamps what it hashed (the checkpoint) and what it wrote (the bundle) in this user's store."""
    from marlin_pack import convert

    model = damaged_copy(make_checkpoint("awq"))
    convert(model, tp=(1, 2))
    assert [r.hashed.files for r in preflight(model, tp_size=2).ranks] == [0, 0]
