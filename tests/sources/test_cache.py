"""marlin-pack's cache of model-id bundles: beside the hub's cache by default, listed and removed by `marlin-pack cache`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_cache import REPO, cache_repo
from typer.testing import CliRunner

from marlin_pack import convert
from marlin_pack.cli import app
from marlin_pack.sources.cache import cached_bundles, remove_cached
from marlin_pack.sources.hub import cache_root

runner = CliRunner()


def test_the_cache_is_beside_the_hub_cache_under_hf_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MARLIN_PACK_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "volume" / "hf"))
    assert cache_root() == tmp_path / "volume" / "hf" / "marlin-pack"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "huggingface" / "marlin-pack"  # as huggingface_hub places HF_HOME
    monkeypatch.setenv("MARLIN_PACK_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_a_model_id_bundle_lands_under_hf_home(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARLIN_PACK_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "volume"))
    result = convert(REPO)
    assert result.bundle == tmp_path / "volume" / "marlin-pack" / "models--acme--tiny-awq" / ("a" * 40)
    assert (result.bundle / "manifest.json").is_file()


def test_cache_ls_and_rm(hub: Path, tmp_path: Path, make_checkpoint) -> None:
    convert(REPO, tp=(1, 2))
    cache_repo(hub, REPO, make_checkpoint("awq", seed=1), "b" * 40)  # main moves to a new commit
    convert(REPO)
    (cache_root() / "not-a-repo").mkdir()  # unrelated entries are not listed, nor removed
    entries = cached_bundles()
    assert [(e.repo_id, e.commit, e.tp_sizes) for e in entries] == [(REPO, "a" * 40, (1, 2)), (REPO, "b" * 40, (1,))]
    assert all(e.size > 0 and e.dtype == "float16" for e in entries)
    r = runner.invoke(app, ["cache", "ls", "--json"])
    assert r.exit_code == 0 and [e["commit"] for e in json.loads(r.stdout)] == ["a" * 40, "b" * 40], r.output
    assert remove_cached(REPO, "a" * 40) == [entries[0].path] and not entries[0].path.exists()
    r = runner.invoke(app, ["cache", "rm", REPO, "--yes"])
    assert r.exit_code == 0 and f"removed {entries[1].path}" in r.stdout, r.output
    assert cached_bundles() == [] and (cache_root() / "not-a-repo").is_dir()
    r = runner.invoke(app, ["cache", "rm", REPO])
    assert r.exit_code == 1


def test_cache_rm_keeps_an_entry_holding_foreign_files(hub: Path) -> None:
    bundle = convert(REPO).bundle
    (bundle / "notes.txt").write_text("mine")
    r = runner.invoke(app, ["cache", "rm", REPO, "--yes"])
    assert r.exit_code == 1 and (bundle / "notes.txt").is_file()


def test_verify_and_inspect_take_a_model_id(hub: Path) -> None:
    bundle = convert(REPO).bundle
    r = runner.invoke(app, ["inspect", REPO, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["bundle"] == str(bundle), r.output
    r = runner.invoke(app, ["verify", REPO, "--revision", "main", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True, r.output


def test_a_cache_whose_home_cannot_be_expanded_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``MARLIN_PACK_CACHE=~x/...`` (no user x): `cache ls` and `cache rm` say so in one line, exit 1, instead of an internal error."""
    import sys

    from marlin_pack import cli
    from marlin_pack.io.home import HomeDirectoryError

    monkeypatch.setenv("MARLIN_PACK_CACHE", "~nosuchuser/bundles")
    monkeypatch.delenv("MARLIN_PACK_DEBUG", raising=False)
    with pytest.raises(HomeDirectoryError, match="MARLIN_PACK_CACHE is '~nosuchuser/bundles', whose ~ cannot be expanded"):
        cached_bundles()
    for args in (["cache", "ls"], ["cache", "rm", REPO]):
        monkeypatch.setattr(sys, "argv", ["marlin-pack", *args])
        with pytest.raises(SystemExit) as e:
            cli._run_app()
        err = capsys.readouterr().err
        assert e.value.code == 1 and "error: MARLIN_PACK_CACHE is '~nosuchuser/bundles'" in err, err


def test_cache_rm_shows_what_and_how_big_then_asks(hub: Path) -> None:
    """As `hf cache rm`: each bundle and its size, then a question (--yes: none); --dry-run shows and removes nothing."""
    bundle = convert(REPO, tp=(1, 2)).bundle
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    shown = f"{size / 1e6:,.1f} MB"
    r = runner.invoke(app, ["cache", "rm", REPO, "--dry-run"])
    assert r.exit_code == 0 and bundle.is_dir(), r.output
    assert f"1 bundle ({shown}) of {REPO}" in r.stdout and str(bundle) in r.stdout and "1,2" in r.stdout, r.stdout
    assert "dry run: nothing removed" in r.stdout and "Remove" not in r.stdout
    r = runner.invoke(app, ["cache", "rm", REPO], input="n\n")
    assert r.exit_code == 0 and f"Remove 1 bundle ({shown})? [y/N]" in r.stdout and "nothing removed" in r.stdout, r.output
    assert bundle.is_dir()
    r = runner.invoke(app, ["cache", "rm", REPO], input="")  # no answer (a script without --yes): never removed on a guess
    assert r.exit_code == 1 and bundle.is_dir(), r.output
    assert "nothing removed; pass --yes to remove without asking" in str(r.exception), r.exception
    r = runner.invoke(app, ["cache", "rm", REPO], input="y\n")
    assert r.exit_code == 0 and f"removed {bundle} ({shown})" in r.stdout and not bundle.exists(), r.output


def test_cache_rm_yes_removes_without_asking(hub: Path) -> None:
    bundle = convert(REPO).bundle
    r = runner.invoke(app, ["cache", "rm", REPO, "-y"], input="n\n")  # -y: the input is never read
    assert r.exit_code == 0 and "Remove" not in r.stdout and not bundle.exists(), r.output
