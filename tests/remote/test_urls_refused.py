"""A URL is never taken for a path: every command and API taking a bundle or model path refuses ``s3://...`` (and
``gs://...``) in one line (what was found, what was expected, what to do), exits non-zero and writes nothing (no local
folder ``s3:``)."""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from marlin_pack import cli
from marlin_pack.remote.url import ObjectUrl, UrlNotPathError, parse_url, url_scheme, url_text

URL = "s3://bucket-1/models/x"


@pytest.mark.parametrize(("value", "scheme"), [
    ("s3://b1/x", "s3"), ("s3:/b1/x", "s3"), (Path("s3://b1/x"), "s3"), ("GS://b1", "gs"), ("file:///tmp/x", "file"),
    ("/tmp/s3:/x", None), ("models/x", None), ("./s3:/x", None), ("c:/x", None), ("", None), (None, None),
])
def test_url_scheme(value: object, scheme: str | None) -> None:
    assert url_scheme(value) == scheme  # type: ignore[arg-type]


def test_url_text_restores_what_a_path_collapsed() -> None:
    assert url_text(Path(URL)) == URL
    assert url_text("./local") == "./local"


def test_parse_url() -> None:
    assert parse_url("s3://bucket-1/a/b/") == ObjectUrl("s3", "bucket-1", "a/b")
    assert parse_url("GS://bucket_1/a") == ObjectUrl("gs", "bucket_1", "a")
    assert str(parse_url("gs://bucket-1/a/")) == "gs://bucket-1/a"
    assert parse_url("s3://bucket-1") == ObjectUrl("s3", "bucket-1", "")
    assert parse_url("s3://bucket-1/a").url_of("tp1/rank-0.safetensors") == "s3://bucket-1/a/tp1/rank-0.safetensors"
    assert str(parse_url(Path("s3://bucket-1/a"))) == "s3://bucket-1/a"


@pytest.mark.parametrize(("value", "match"), [
    ("az://bucket-1/x", r"at s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, not az://; copy the bundle to one of those or to a"),
    ("s3://B/x", r"bucket 'B' is not a bucket name"),
    ("gs://B/x", r"bucket 'B' is not a bucket name \(3-63 lowercase letters, digits, '-', '_' and '\.'\)"),
    ("s3://bucket-1/a//b", r"has an empty, '\.' or '\.\.' segment"),
    ("gs://bucket-1/a/../b", r"has an empty, '\.' or '\.\.' segment"),
    ("/local/dir", r"is not an object-storage URL; expected s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"),
])
def test_parse_url_refuses(value: str, match: str) -> None:
    with pytest.raises(UrlNotPathError, match=match):
        parse_url(value)


@dataclass
class Ran:
    exit_code: int
    stderr: str


@pytest.fixture
def marlin_pack(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """``marlin_pack(*argv)``: the console entry point in this process (its one-line errors), as a :class:`Ran`."""
    monkeypatch.setattr(gc, "freeze", lambda: None)

    def run(*argv: str) -> Ran:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["marlin-pack", *argv])
        with pytest.raises(SystemExit) as e:
            cli.main()
        return Ran(int(e.value.code or 0), capsys.readouterr().err)

    return run


def _one_line_refusal(result: Ran, found: str, expected: str) -> None:
    assert result.exit_code == 1, result.stderr
    line = result.stderr.splitlines()[0]
    assert line.startswith("error: ") and found in line and expected in line, result.stderr
    assert "Traceback" not in result.stderr


def test_convert_to_a_url_writes_nothing(make_checkpoint, marlin_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = make_checkpoint("awq", "tiny", group_size=32)
    before = sorted(os.listdir(model))
    r = marlin_pack("convert", str(model), "-o", URL)
    _one_line_refusal(r, f"-o {URL} is an object-storage URL, not a directory", f"`marlin-pack push DIR {URL}`")
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(model)) == before  # no folder "s3:", no bundle


@pytest.mark.parametrize("args", [
    ["check", URL],
    ["verify", URL],
    ["verify", "{bundle}", "--source", URL],
    ["inspect", URL],
    ["convert", URL],
])
def test_commands_refuse_urls(args: list[str], make_bundle, marlin_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = make_bundle("awq", group_size=32)
    argv = [a.format(model=model, bundle=model / "marlin-pack") for a in args]
    r = marlin_pack(*argv)
    _one_line_refusal(r, f"{URL} is an object-storage URL, not a", "aws s3 sync" if args[0] != "convert" else "")
    assert os.listdir(tmp_path) == []


def test_a_gcs_url_where_a_path_is_expected_names_gcloud(make_bundle, marlin_pack, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    gs = "gs://bucket-1/models/x"
    r = marlin_pack("verify", gs)
    _one_line_refusal(r, f"{gs} is an object-storage URL, not a", f"`gcloud storage rsync -r {gs} DIR`")
    r = marlin_pack("convert", str(make_bundle("awq", group_size=32)), "-o", gs)
    _one_line_refusal(r, f"-o {gs} is an object-storage URL, not a directory", f"`marlin-pack push DIR {gs}`")
    assert os.listdir(tmp_path) == []


def test_library_refuses_urls(make_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack import convert
    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.sources.hub import locate_bundle, resolve_model

    monkeypatch.chdir(tmp_path)
    model = make_checkpoint("awq", "tiny", group_size=32)
    with pytest.raises(UrlNotPathError, match=rf"^output {URL} is an object-storage URL, not a directory; .*marlin-pack push"):
        convert(model, output=URL)
    with pytest.raises(UrlNotPathError, match=rf"^bundle {URL} is an object-storage URL"):
        read_manifest(URL)
    with pytest.raises(UrlNotPathError, match=rf"^bundle {URL} is an object-storage URL"):
        read_manifest(Path(URL))  # as a Path collapses it: still said as written
    with pytest.raises(UrlNotPathError, match=rf"^model {URL} is an object-storage URL"):
        resolve_model(URL)
    with pytest.raises(UrlNotPathError, match=rf"^bundle {URL} is an object-storage URL"):
        locate_bundle(model, None, URL)
    assert os.listdir(tmp_path) == []


def test_loader_option_takes_an_s3_or_gs_url_and_refuses_other_schemes() -> None:
    """The loader streams a bundle published at ``s3://`` or ``gs://`` (tests/remote/test_remote_loader.py,
    test_gcs.py); other schemes and malformed URLs are refused in one line naming what is served."""
    from marlin_pack.remote.url import parse_url
    from marlin_pack.vllm_plugin.options import parse_extra_config

    assert parse_extra_config({"bundle": URL}).remote == parse_url(URL)
    assert parse_extra_config({"bundle": "gs://bucket-1/x"}).remote == ObjectUrl("gs", "bucket-1", "x")
    assert parse_extra_config({"bundle": "/models/b"}).bundle == Path("/models/b")
    assert parse_extra_config({"bundle": "/models/b"}).remote is None
    for bad, why in [("az://bucket-1/x", "not az://"), ("s3://B/x", "bucket 'B' is not a bucket name")]:
        with pytest.raises(ValueError, match=rf"model_loader_extra_config\['bundle'\] must be a directory path, "
                           rf"s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, got '{bad}' \(.*{why}"):
            parse_extra_config({"bundle": bad})


def test_the_local_decision_never_reads_a_bucket_as_a_directory() -> None:
    """Only the loader's remote path streams a bucket; the local decision, given one, refuses it in one line (with
    fallback: falls back), never a TypeError or a local folder named ``s3:``."""
    from marlin_pack.errors import LoadRefusedError
    from marlin_pack.vllm_plugin.decision import EngineFacts, decide
    from marlin_pack.vllm_plugin.options import parse_extra_config

    facts = EngineFacts(model="/models/x", vllm_version="0.33.0")
    with pytest.raises(LoadRefusedError, match=rf"from bundle {URL}: \[bundle\] {URL} is a bundle in object storage"):
        decide(parse_extra_config({"bundle": URL}), facts)
    fallback = decide(parse_extra_config({"bundle": URL, "fallback": True}), facts)
    assert fallback.bundle is None and fallback.field == "bundle"
