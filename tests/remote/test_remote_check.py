"""``marlin-pack check MODEL --bundle s3://bucket/prefix`` (``gs://``: test_gcs.py): the loader's decision over a published bundle
(``select_remote``), per rank, against a real S3 server; what each rank streams; the bucket's refusals in one line."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest

from marlin_pack import cli
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME

BLOCK = 64 << 10


def _check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(gc, "freeze", lambda: None)
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["marlin-pack", "check", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    got = capsys.readouterr()
    return int(e.value.code or 0), got.out, got.err


@pytest.fixture
def published(make_bundle, s3) -> tuple[Path, str]:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("llama"), block_size=BLOCK)
    return model, s3.url("llama")


def test_check_says_what_each_rank_streams(published: tuple[Path, str], monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    model, url = published
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "-tp", "2", "--compute-capability", "8.0")
    assert code == 0, out
    for rank in (0, 1):
        assert f"tp2/rank-{rank}.safetensors" in out
    assert out.count(f"from {url}") == 2 and out.count("every block verified against the publication record") == 2
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "-tp", "2", "--rank", "1", "--json",
                          "--compute-capability", "8.0")
    [rank] = json.loads(out)["ranks"]
    size = sum((model / "marlin-pack" / p).stat().st_size for p in ("tp2/rank-1.safetensors", "common.safetensors"))
    assert rank["decision"] == "load" and size <= rank["reads"]["streamed_bytes"] <= size + 4 * BLOCK


def test_check_refuses_what_the_loader_refuses(published: tuple[Path, str], s3, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model, url = published
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "-tp", "4")
    assert code == 1 and "[tp_size]" in out and "publish it again" in out
    s3.client().delete_object(Bucket=s3.bucket, Key=f"llama/{RECORD_NAME}")
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url)
    assert code == 1 and f"{url} is half-published" in out
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "--fallback")
    assert code == 0 and "the engine would load the checkpoint the ordinary way" in out
    code, _, err = _check(monkeypatch, capsys, str(model), "--bundle", "az://bucket-1/x")
    assert code == 1 and err.startswith("error: az://bucket-1/x: marlin-pack reads and writes bundles at s3://")
