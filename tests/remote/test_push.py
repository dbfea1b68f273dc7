"""``marlin-pack push``: a bundle published to a real S3 server, atomically for readers (files, then the manifest,
then the publication record), a second push writing nothing, another bundle refused without --force."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.errors import BundleError
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME, Record
from marlin_pack.remote.store import RemoteError


def _bundle_files(bundle: Path) -> dict[str, bytes]:
    return {str(p.relative_to(bundle)): p.read_bytes() for p in sorted(bundle.rglob("*")) if p.is_file()}


def test_push_publishes_the_bundle_byte_for_byte(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    bundle = make_bundle("awq", group_size=32, tp_sizes=(1, 2)) / "marlin-pack"
    done = push(bundle, s3.url("llama/awq"))
    local = _bundle_files(bundle)
    assert sorted(done.uploaded) == sorted([*local, RECORD_NAME]) and not done.up_to_date
    assert done.uploaded[-2:] == [MANIFEST_NAME, RECORD_NAME]  # the manifest after the files, the record last
    client = s3.client()
    for name, data in local.items():
        assert client.get_object(Bucket=s3.bucket, Key=f"llama/awq/{name}")["Body"].read() == data
    record = Record.model_validate_json(client.get_object(Bucket=s3.bucket, Key=f"llama/awq/{RECORD_NAME}")["Body"].read())
    assert record.manifest_sha256 == hashlib.sha256(local[MANIFEST_NAME]).hexdigest()
    assert {f.path for f in record.files} == set(local) - {MANIFEST_NAME}


def test_second_push_writes_nothing(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    bundle = make_bundle("awq", group_size=32) / "marlin-pack"
    push(bundle, s3.url("m"))
    before = {o["Key"]: o["LastModified"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]}
    again = push(bundle, s3.url("m"))
    assert again.up_to_date and again.uploaded == [] and again.bytes_uploaded == 0
    assert "nothing written" in again.summary()
    after = {o["Key"]: o["LastModified"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]}
    assert after == before


def test_push_heals_a_missing_object_and_republishes(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    bundle = make_bundle("awq", group_size=32) / "marlin-pack"
    push(bundle, s3.url("m"))
    s3.client().delete_object(Bucket=s3.bucket, Key="m/tp1/rank-0.safetensors")
    healed = push(bundle, s3.url("m"))
    assert healed.uploaded == ["tp1/rank-0.safetensors", MANIFEST_NAME, RECORD_NAME]
    assert s3.keys("m/")["m/tp1/rank-0.safetensors"] == (bundle / "tp1/rank-0.safetensors").stat().st_size


def test_another_bundle_is_refused_without_force(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    first = make_bundle("awq", group_size=32) / "marlin-pack"
    second = make_bundle("gptq", group_size=32) / "marlin-pack"
    push(first, s3.url("m"))
    with pytest.raises(BundleError, match=r"^s3://marlin-pack-\d+/m holds a bundle with manifest SHA-256 [0-9a-f]{16}…, not this "
                       r"bundle \([0-9a-f]{16}…\); pass --force to replace it"):
        push(second, s3.url("m"))
    replaced = push(second, s3.url("m"), force=True)
    assert replaced.replaced and "replacing another bundle" in replaced.summary()
    got = s3.client().get_object(Bucket=s3.bucket, Key=f"m/{MANIFEST_NAME}")["Body"].read()
    assert got == (second / MANIFEST_NAME).read_bytes()


def test_a_damaged_bundle_is_not_pushed(make_bundle, damaged_copy, s3) -> None:  # type: ignore[no-untyped-def]
    model = damaged_copy(make_bundle("awq", group_size=32))
    rank = model / "marlin-pack" / "tp1" / "rank-0.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 1
    rank.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"rank-0.safetensors is [\d,]+ bytes with BLAKE3 [0-9a-f]{16}…, the manifest records "
                       r"[\d,]+ bytes, [0-9a-f]{16}…: the bundle is damaged; re-run `marlin-pack convert .*`, then push again"):
        push(model / "marlin-pack", s3.url("m"))
    assert s3.keys() == {}  # nothing sent


def test_a_symlinked_bundle_file_is_not_followed(make_bundle, damaged_copy, s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = damaged_copy(make_bundle("awq", group_size=32))
    common = model / "marlin-pack" / "common.safetensors"
    elsewhere = tmp_path / "planted.safetensors"
    shutil.move(common, elsewhere)
    os.symlink(elsewhere, common)
    with pytest.raises(BundleError, match=r"cannot read .*common.safetensors \(.*\)"):
        push(model / "marlin-pack", s3.url("m"))
    assert s3.keys() == {}


def test_bad_credentials_are_one_line(make_bundle, s3, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteError, match=r"^cannot read s3://marlin-pack-\d+/m/marlin-pack-published.json: SignatureDoesNotMatch; "
                       r"the credentials were refused: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"):
        push(make_bundle("awq", group_size=32) / "marlin-pack", s3.url("m"))


def test_missing_bucket_is_one_line(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RemoteError, match=r"^cannot read s3://no-such-bucket/m/marlin-pack-published.json: (NoSuchBucket|404); "):
        push(make_bundle("awq", group_size=32) / "marlin-pack", "s3://no-such-bucket/m")


def test_cli_push_then_up_to_date(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from marlin_pack.cli import app

    model = make_bundle("awq", group_size=32)
    r = CliRunner().invoke(app, ["push", str(model), s3.url("cli"), "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert body["up_to_date"] is False and body["uploaded"][-1] == RECORD_NAME
    r = CliRunner().invoke(app, ["push", str(model / "marlin-pack"), s3.url("cli")])
    assert r.exit_code == 0 and "up to date" in r.stdout and "nothing written" in r.stdout, r.output
