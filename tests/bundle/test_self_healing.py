"""convert makes the bundle at its output match the checkpoint and the settings asked (issue 70, item 2).

An init container runs it at every start: a damaged file is rewritten (checked as ``check`` checks it), a TP size
added without rewriting the others, a checkpoint changed in place rewritten, an empty directory written into; a
directory that is not a bundle is never written into or replaced. Updates in place keep every guarantee of a
new bundle: nothing written through a planted path, nothing half-done after a failure.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import marlin_pack.bundle.in_place as in_place
from marlin_pack import MarlinPackError, OutputExistsError, convert, verify
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.errors import BundleError
from marlin_pack.vllm_plugin.preflight import preflight


def _flip(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _inodes(bundle: Path) -> dict[str, int]:
    return {p.relative_to(bundle).as_posix(): p.stat().st_ino for p in bundle.rglob("*") if p.is_file()}


def _temp_dirs(*folders: Path) -> list[Path]:
    return [p for f in folders for p in f.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_flipped_byte_is_rewritten_and_check_then_loads(make_bundle, damaged_copy) -> None:
    original = make_bundle("awq", tp_sizes=(1, 2))
    model = damaged_copy(original)
    bundle = model / "marlin-pack"
    _flip(bundle / "tp2" / "rank-1.safetensors")
    assert preflight(model, tp_size=2).ranks[1].decision == "refuse"
    before = _inodes(bundle)
    healed = convert(model, tp=(2,), kernel="marlin")
    assert not healed.reused and healed.summary == "rewrote tp2: tp2/rank-1.safetensors changed since it was written; tp1 kept"
    after = _inodes(bundle)
    assert {p for p in before if before[p] == after[p]} == {"common.safetensors", "tp1/rank-0.safetensors"}  # kept as they were
    assert (bundle / "manifest.json").read_text() == (original / "marlin-pack" / "manifest.json").read_text()
    assert preflight(model, tp_size=2).decision == "load" and verify(bundle).ok
    assert convert(model, tp=(2,), kernel="marlin").reused and not _temp_dirs(model, bundle)


def test_a_damaged_common_file_is_rewritten_alone(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("gptq", tp_sizes=(1, 2)))
    bundle = model / "marlin-pack"
    (bundle / "common.safetensors").write_bytes((bundle / "common.safetensors").read_bytes()[:-1])
    before = _inodes(bundle)
    healed = convert(model, tp=(1, 2), kernel="marlin")
    assert healed.summary.startswith("rewrote common.safetensors: it is ") and healed.summary.endswith("; tp1, tp2 kept")
    assert sorted(p for p, ino in _inodes(bundle).items() if before[p] != ino) == ["common.safetensors", "manifest.json"]
    assert verify(bundle).ok


def test_a_size_is_added_keeping_the_others_as_a_fresh_conversion_writes_them(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("awq", tp_sizes=(1,)))
    time.sleep(1.1)  # files changed less than a second before they are hashed are not stamped (marlin_pack.io.stamps)
    bundle = model / "marlin-pack"
    tp1 = (bundle / "tp1" / "rank-0.safetensors").stat().st_ino
    added = convert(model, tp=(2,), kernel="marlin")
    assert added.summary == "added tp2; tp1 kept" and added.manifest.tp_sizes == [1, 2]
    assert (bundle / "tp1" / "rank-0.safetensors").stat().st_ino == tp1
    fresh = make_bundle("awq", tp_sizes=(1, 2)) / "marlin-pack"
    assert (bundle / "manifest.json").read_text() == (fresh / "manifest.json").read_text()
    again = convert(model, tp=(1, 2), kernel="marlin")  # tp1 (not asked before) is checked now, and stamped
    assert again.reused and again.hashed.files == 1
    assert convert(model, tp=(1, 2), kernel="marlin").hashed.files == 0  # this user's stamps vouch for every file as it is


def test_an_empty_directory_is_written_into(awq_copy: Path, tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (volume / f".volume.tmp-{int(dead.stdout)}-0a1b2c3d" / "tp1").mkdir(parents=True)  # a conversion killed earlier
    inode = volume.stat().st_ino
    made = convert(awq_copy, volume, kernel="marlin")
    assert made.summary == "tp1 into the empty directory" and volume.stat().st_ino == inode
    assert sorted(p.name for p in volume.iterdir()) == ["common.safetensors", "manifest.json", "tp1"]
    assert verify(volume, awq_copy).ok
    assert convert(awq_copy, volume, tp=(1, 2), kernel="marlin").summary == "added tp2; tp1 kept"
    forced = convert(awq_copy, volume, tp=(2,), kernel="marlin", force=True)
    assert forced.summary == "rewrote tp2 and common.safetensors: `force=True`; dropped tp1 (not asked)"
    assert sorted(p.name for p in volume.iterdir()) == ["common.safetensors", "manifest.json", "tp2"]
    assert verify(volume, awq_copy).ok
    assert not _temp_dirs(tmp_path, volume)


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_that_is_not_a_bundle_is_refused_in_one_line(awq_copy: Path, tmp_path: Path, force: bool) -> None:
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match=r"mine exists and is not a marlin-pack bundle \(no manifest.json\); refusing to "
                       r"replace it \(it holds sub; expected a bundle, an empty directory or nothing\): choose another output") as e:
        convert(awq_copy, mine, force=force)
    assert "\n" not in str(e.value)
    assert [p.relative_to(mine).as_posix() for p in sorted(mine.rglob("*"))] == ["sub", "sub/notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [awq_copy.parent.name, "mine"]  # no lock, no temporary directory
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match=r"file is a file, expected a directory \(a bundle or an empty one\) or nothing"):
        convert(awq_copy, tmp_path / "file", force=force)


def test_a_checkpoint_changed_in_place_rewrites_the_bundle_and_drops_the_sizes_not_asked(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("gptq", tp_sizes=(1, 2)))
    _flip(model / "model.safetensors", -1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (model / "marlin-pack" / f".marlin-pack.tmp-{int(dead.stdout)}-0a1b2c3d").mkdir()  # an update in place killed earlier
    assert preflight(model).decision == "refuse"
    again = convert(model, tp=(1,), kernel="marlin")
    assert again.summary.startswith("rewrote tp1 and common.safetensors: source file model.safetensors changed since the bundle")
    assert again.summary.endswith("; dropped tp2 (not asked)") and again.manifest.tp_sizes == [1]
    assert preflight(model).decision == "load" and verify(model / "marlin-pack").ok
    assert not (model / "marlin-pack" / "tp2").exists() and not _temp_dirs(model)


def test_a_damaged_manifest_makes_a_new_bundle(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("awq"))
    path = model / "marlin-pack" / "manifest.json"
    path.write_text(path.read_text().replace('"serving_dtype": "float16"', '"serving_dtype": "float99"'))
    healed = convert(model, kernel="marlin")
    assert healed.summary.startswith("rewrote tp1 and common.safetensors: its manifest is damaged (") and verify(model / "marlin-pack").ok


def test_the_kernel_asked_is_the_layout_written_and_named(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("gptq", tp_sizes=(1, 2)))
    machete = convert(model, tp=(1, 2), kernel="machete")
    assert machete.summary.startswith("rewrote tp1, tp2 and common.safetensors: its layers are in marlin's layout, asked for machete")
    text = json.loads((model / "marlin-pack" / "manifest.json").read_text())
    assert text["format_version"] == 5 and text["target"]["kernel"] == "MacheteLinearKernel"
    assert preflight(model, capability=90).decision == "load"
    back = convert(model, tp=(1,), kernel="marlin")
    assert back.manifest.target.kernel == "MarlinLinearKernel" and back.manifest.format_version == 4 and back.manifest.tp_sizes == [1]


def test_a_machete_bundle_written_before_target_kernel_named_it_still_loads(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("gptq", kernel="machete"))
    path = model / "marlin-pack" / "manifest.json"
    assert json.loads(path.read_text())["target"]["kernel"] == "MacheteLinearKernel"
    path.write_text(path.read_text().replace('"MacheteLinearKernel"', '"MarlinLinearKernel"'))  # as every bundle said before
    assert read_manifest(model / "marlin-pack").target.kernel == "MarlinLinearKernel"
    assert preflight(model, capability=90).decision == "load" and convert(model, kernel="machete").reused
    marlin = damaged_copy(make_bundle("gptq"))
    path = marlin / "marlin-pack" / "manifest.json"
    path.write_text(path.read_text().replace('"MarlinLinearKernel"', '"MacheteLinearKernel"'))
    with pytest.raises(BundleError, match=r"target.kernel is MacheteLinearKernel, the layers are laid out for MarlinLinearKernel"):
        read_manifest(marlin / "marlin-pack")


def test_an_interrupted_update_leaves_the_bundle_as_it_was(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("awq"))
    bundle = model / "marlin-pack"
    before = (bundle / "manifest.json").read_bytes()

    def interrupt(done: int, total: int, name: str) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(model, tp=(1, 2), kernel="marlin", progress=interrupt)
    assert (bundle / "manifest.json").read_bytes() == before and not (bundle / "tp2").exists()
    assert not _temp_dirs(model, bundle) and verify(bundle).ok


def test_a_failed_update_moves_back_what_it_moved(make_bundle, damaged_copy, monkeypatch: pytest.MonkeyPatch) -> None:
    model = damaged_copy(make_bundle("awq", tp_sizes=(1, 2)))
    bundle = model / "marlin-pack"
    _flip(bundle / "tp2" / "rank-0.safetensors")
    damaged = (bundle / "tp2" / "rank-0.safetensors").read_bytes()
    manifest = (bundle / "manifest.json").read_bytes()
    real = in_place.rename_no_replace

    def fail_manifest(src: str, dst: str, **fds: int) -> None:
        if src == dst == "manifest.json":  # the last move: the rank files are in place by now
            raise OSError(errno.EIO, "Input/output error", dst)
        real(src, dst, **fds)

    monkeypatch.setattr(in_place, "rename_no_replace", fail_manifest)
    with pytest.raises(MarlinPackError, match=r"writing the bundle under .* failed \(Input/output error\)"):
        convert(model, tp=(2,), kernel="marlin")
    assert (bundle / "tp2" / "rank-0.safetensors").read_bytes() == damaged and (bundle / "manifest.json").read_bytes() == manifest
    assert not _temp_dirs(model, bundle)
    monkeypatch.undo()
    assert convert(model, tp=(2,), kernel="marlin").summary.startswith("rewrote tp2: tp2/rank-0.safetensors changed")


def test_what_is_planted_at_a_bundle_path_is_never_followed_or_moved(make_bundle, damaged_copy, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "rank-0.safetensors").write_text("hers")
    model = damaged_copy(make_bundle("awq"))
    bundle = model / "marlin-pack"
    (bundle / "tp2").symlink_to(victim)
    with pytest.raises(OutputExistsError, match=r"marlin-pack/tp2 is a symlink, expected a folder of rank files; nothing was "
                       r"replaced: remove it or pass `output=DIR`"):
        convert(model, tp=(1, 2), kernel="marlin")
    assert [p.name for p in victim.iterdir()] == ["rank-0.safetensors"] and (victim / "rank-0.safetensors").read_text() == "hers"
    (bundle / "tp2").unlink()
    rank = bundle / "tp1" / "rank-0.safetensors"
    rank.unlink()
    (rank / "inside").mkdir(parents=True)  # a directory where a rank file goes
    with pytest.raises(OutputExistsError, match=r"tp1/rank-0.safetensors is a directory, expected a bundle file"):
        convert(model, kernel="marlin")
    assert (rank / "inside").is_dir() and not _temp_dirs(model, bundle)
    assert os.path.lexists(bundle / "manifest.json")


def test_a_fresh_volume_mounted_at_the_output_is_written_into(awq_copy: Path, tmp_path: Path) -> None:
    """A volume mounted at the output (lost+found at its root) cannot be renamed over: written into, updated in place, its
    lock inside it (where every pod that mounts it finds it), even with --force."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a file system at the output")
    volume = tmp_path / "volume"
    volume.mkdir()
    code = (
        "import json, os, sys; from pathlib import Path; from marlin_pack import convert, verify;"
        "model, vol = Path(sys.argv[1]), Path(sys.argv[2]); assert os.path.ismount(vol); seen = set();"
        "look = lambda *a, **k: seen.update(n for n in os.listdir(vol) if n.startswith('.'));"
        "done = [convert(model, vol, kernel='marlin', progress=look).summary,"
        "        convert(model, vol, tp=(1, 2), kernel='marlin', progress=look).summary];"
        "(vol / 'tp1' / 'notes.txt').write_text('mine');"  # in place, what the bundle does not name is never touched
        "done.append(convert(model, vol, tp=(2,), kernel='marlin', force=True).summary);"
        "entries = sorted(p.relative_to(vol).as_posix() for p in vol.rglob('*'));"
        "print(json.dumps([done, entries, verify(vol, model).ok, sorted(seen), os.listdir(vol.parent)]))"
    )
    script = 'mount -t tmpfs tmpfs "$1" && mkdir "$1/lost+found" && exec "$0" -c "$2" "$3" "$1"'
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script, sys.executable, str(volume), code, str(awq_copy)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "mount" in r.stderr and "Traceback" not in r.stderr:
        pytest.skip(f"no file system can be mounted here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    done, entries, ok, seen, beside = json.loads(r.stdout.splitlines()[-1])
    assert done == ["tp1 into the empty directory", "added tp2; tp1 kept",
                    "rewrote tp2 and common.safetensors: `force=True`; dropped tp1 (not asked)"]
    assert entries == ["common.safetensors", "lost+found", "manifest.json", "tp1", "tp1/notes.txt", "tp2", "tp2/rank-0.safetensors",
                       "tp2/rank-1.safetensors"] and ok
    assert ".volume.lock" in seen and any(n.startswith(".volume.tmp-") for n in seen)
    assert sorted(beside) == ["copy-1", "volume"]  # nothing beside the volume: no lock, no temporary directory
