"""Hugging Face model ids: converted from a hand-made hub cache (offline), found by check, verify and the loader's decision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hub_cache import REPO
from hub_cache import cache_repo as _cache_repo

from marlin_pack import CheckpointError, convert, verify
from marlin_pack.vllm_plugin.preflight import preflight


def test_convert_a_repo_id_into_marlin_packs_cache(hub: Path, tmp_path: Path) -> None:
    before = sorted(p.relative_to(hub) for p in hub.rglob("*"))
    m = convert(REPO, tp=(1, 2)).manifest
    bundle = tmp_path / "mp-cache" / "models--acme--tiny-awq" / ("a" * 40)
    assert (bundle / "manifest.json").is_file() and m.tp_sizes == [1, 2]
    assert sorted(p.relative_to(hub) for p in hub.rglob("*")) == before  # nothing written into the hub's cache
    assert verify(bundle).ok  # its source (the cached snapshot) is found from the cache entry
    assert verify(bundle, REPO).ok
    report = preflight(REPO, tp_size=2)
    assert report.decision == "load", report.to_dict()


def test_a_new_commit_needs_its_own_bundle(hub: Path, make_checkpoint: Any) -> None:
    convert(REPO)
    root = hub / "models--acme--tiny-awq"
    _cache_repo(hub, REPO, make_checkpoint("awq", seed=1), "b" * 40)  # main now points at a new commit
    report = preflight(REPO)
    assert report.decision == "refuse" and report.ranks[0].field == "manifest"
    assert "b" * 40 in report.ranks[0].message
    assert preflight(REPO, revision="a" * 40).decision == "load"
    assert (root / "refs" / "main").read_text() == "b" * 40


def test_uncached_repo_offline_is_one_clear_error(hub: Path) -> None:
    with pytest.raises(CheckpointError, match=r"acme/missing is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        convert("acme/missing")
    report = preflight("acme/missing")
    assert report.decision == "refuse" and report.ranks[0].field == "bundle"


def test_cli_check_and_convert_take_a_repo_id(hub: Path) -> None:
    from typer.testing import CliRunner

    from marlin_pack.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["convert", REPO, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bundle"].endswith("models--acme--tiny-awq/" + "a" * 40)
    r = runner.invoke(app, ["check", REPO, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["decision"] == "load", r.output


def test_not_a_directory_nor_a_repo_id(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"neither a checkpoint directory nor a Hugging Face model id"):
        convert(tmp_path / "nowhere")


def test_a_snapshot_folder_is_its_repo_and_commit(hub: Path, tmp_path: Path) -> None:
    # vLLM hands the loader the snapshot path (offline): the bundle is the repo's cache entry, not snapshot/marlin-pack.
    snapshot = hub / "models--acme--tiny-awq" / "snapshots" / ("a" * 40)
    convert(REPO)
    assert preflight(str(snapshot)).decision == "load"
    assert not (snapshot / "marlin-pack").exists()
    m = convert(snapshot, force=True).manifest  # converting the snapshot path writes the same cache entry
    assert m.tp_sizes == [1] and not (snapshot / "marlin-pack").exists()
    assert (tmp_path / "mp-cache" / "models--acme--tiny-awq" / ("a" * 40) / "manifest.json").is_file()


@pytest.mark.parametrize("ref", ["..", "../../models--acme--other/snapshots/" + "c" * 40, "/tmp", "main", "A" * 40])
def test_a_refs_file_that_is_not_a_commit_hash_is_refused(hub: Path, tmp_path: Path, make_checkpoint: Any, ref: str) -> None:
    """refs/main holding ``..`` or a path must not become the commit (the bundle would land outside marlin-pack's cache)."""
    _cache_repo(hub, "acme/other", make_checkpoint("awq"), "c" * 40)
    root = hub / "models--acme--tiny-awq"
    if ref == "A" * 40:
        (root / "snapshots" / ("a" * 40)).rename(root / "snapshots" / ref)
    elif ref == "main":
        (root / "snapshots" / ("a" * 40)).rename(root / "snapshots" / "main")
    (root / "refs" / "main").write_text(ref)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=r"acme/tiny-awq resolves to the Hugging Face cache folder .* 40-hex commit hash") as e:
        convert(REPO)
    assert "\n" not in str(e.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    report = preflight(REPO)
    assert report.decision == "refuse" and "40-hex commit hash" in report.ranks[0].message


def test_a_snapshot_folder_not_named_by_a_commit_is_a_local_directory(hub: Path) -> None:
    """Given as a path, ``snapshots/x`` (no commit hash) is a checkpoint directory like any other, not a damaged refs file."""
    root = hub / "models--acme--tiny-awq"
    odd = root / "snapshots" / "x"
    (root / "snapshots" / ("a" * 40)).rename(odd)
    assert convert(odd).bundle == odd / "marlin-pack"
    assert preflight(str(odd)).decision == "load"


def test_a_repo_id_with_a_trailing_newline_is_not_one() -> None:
    from marlin_pack.sources.hub import is_repo_id

    assert is_repo_id("acme/tiny-awq") and not is_repo_id("acme/tiny-awq\n")


# --- a local directory is a local directory; a ~ that names no home is one line naming its variable ---


@pytest.mark.parametrize("name", ["v1", "main", "A" * 40, "a" * 39, "a" * 41, "..snap"])
def test_a_snapshot_shaped_local_directory_without_a_commit_name_is_a_local_directory(
    tmp_path: Path, make_checkpoint: Any, name: str
) -> None:
    """``.../models--a--b/snapshots/v1`` is no hub snapshot (its name is no commit): its bundle is MODEL_DIR/marlin-pack."""
    import shutil

    from marlin_pack.sources.hub import locate_bundle, resolve_model

    model = tmp_path / "models--a--b" / "snapshots" / name
    shutil.copytree(make_checkpoint("awq"), model)
    resolved = resolve_model(model)
    assert (resolved.dir, resolved.repo_id, resolved.commit) == (model, None, None)
    assert locate_bundle(model) == model / "marlin-pack"
    convert(model)
    assert (model / "marlin-pack" / "manifest.json").is_file() and preflight(str(model)).decision == "load"


@pytest.mark.parametrize("repo_dir", ["models--", "models--a--b"])
def test_only_a_real_snapshot_folder_is_a_repo_and_commit(tmp_path: Path, make_checkpoint: Any, repo_dir: str) -> None:
    import shutil

    from marlin_pack.sources.hub import resolve_model

    model = tmp_path / repo_dir / "snapshots" / ("b" * 40)
    shutil.copytree(make_checkpoint("awq"), model)
    resolved = resolve_model(model)
    want = (None, None) if repo_dir == "models--" else ("a/b", "b" * 40)  # "models--" names no repo id
    assert (resolved.repo_id, resolved.commit) == want


def _no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arbitrary UID as OpenShift runs containers: no HOME, no passwd entry."""
    import pwd

    def missing(uid: int) -> object:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", missing)


@pytest.mark.parametrize("env,variable", [
    ({"HF_HOME": "~nosuchuser/hf"}, "HF_HOME is '~nosuchuser/hf'"),
    ({"XDG_CACHE_HOME": "~nosuchuser"}, "XDG_CACHE_HOME is '~nosuchuser'"),
    ({"MARLIN_PACK_CACHE": "~x/bundles"}, "MARLIN_PACK_CACHE is '~x/bundles'"),
    ({"MARLIN_PACK_CACHE": "~/bundles", "no home": ""}, "MARLIN_PACK_CACHE is '~/bundles'.*HOME is unset and uid"),
    ({"no home": ""}, "the Hugging Face cache defaults to .*HOME is unset and uid .*; set HF_HOME"),
])
def test_a_home_that_cannot_be_expanded_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict, variable: str
) -> None:
    from marlin_pack.io.home import HomeDirectoryError
    from marlin_pack.sources.hub import cache_root

    for name in ("HF_HOME", "XDG_CACHE_HOME", "MARLIN_PACK_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if name == "no home":
            _no_home(monkeypatch)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(HomeDirectoryError, match=variable) as e:
        cache_root()
    assert "\n" not in str(e.value)


def test_a_model_or_bundle_path_whose_home_cannot_be_expanded(tmp_path: Path) -> None:
    from marlin_pack.io.home import HomeDirectoryError
    from marlin_pack.sources.hub import locate_bundle, resolve_model

    with pytest.raises(HomeDirectoryError, match="the model directory is '~nosuchuser/m', .*no user 'nosuchuser'"):
        resolve_model("~nosuchuser/m")
    with pytest.raises(HomeDirectoryError, match="the bundle directory is '~nosuchuser/b'"):
        locate_bundle(tmp_path, bundle="~nosuchuser/b")


@pytest.mark.parametrize("case", ["MARLIN_PACK_CACHE", "no home"])
def test_check_and_the_loader_refuse_or_fall_back_on_a_home_they_cannot_expand(
    hub: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A repo id's bundle is in marlin-pack's cache: where its home cannot be expanded, one line naming the variable,
    ``fallback`` covering it (the loader decides as check does)."""
    if case == "no home":
        monkeypatch.delenv("MARLIN_PACK_CACHE")
        monkeypatch.delenv("HF_HOME", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        _no_home(monkeypatch)
    else:
        monkeypatch.setenv("MARLIN_PACK_CACHE", "~nosuchuser/bundles")
    report = preflight(REPO)
    assert report.decision == "refuse" and report.ranks[0].field == "bundle"
    assert ("MARLIN_PACK_CACHE is '~nosuchuser/bundles'" if case != "no home" else "set HF_HOME") in report.ranks[0].message
    assert preflight(REPO, fallback=True).decision == "fallback"
