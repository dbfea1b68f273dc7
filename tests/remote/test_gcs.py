"""``gs://bucket/prefix`` with ``MARLIN_PACK_GCS_HMAC=1``: a bundle in Google Cloud Storage is published, checked, planned
and streamed exactly as one in S3, through GCS's XML API (S3's protocol, an HMAC key): boto3 and Run:ai's streamer at
``GCS_ENDPOINT``, never at ``AWS_ENDPOINT_URL``. (The default, application-default credentials: ``test_gcs_adc.py``.)

Offline, moto's S3 server stands in for GCS's XML API (``conftest.gcs``: the endpoint pointed at it, ``AWS_ENDPOINT_URL``
a closed port). What GCS's XML API does unlike S3 is tested on its own below: metadata answered as ``x-goog-meta-*``,
no aws-chunked uploads, path-style names.
"""

from __future__ import annotations

import json

import pytest
from remote_published import BLOCK, assert_rank_streams_its_files, publish_llama

from marlin_pack.errors import BundleError, BundleMismatchError
from marlin_pack.remote import store
from marlin_pack.remote.bundle import open_remote, plan_rank
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME
from marlin_pack.remote.store import RemoteError, _metadata
from marlin_pack.remote.stream import HostSink, read_rank
from marlin_pack.remote.url import ObjectUrl, parse_url


@pytest.fixture
def published(make_bundle, gcs):  # type: ignore[no-untyped-def]
    return publish_llama(make_bundle, gcs)


def test_push_then_read_every_rank_byte_exact(published, gcs) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    assert set(gcs.keys("llama/")) == {f"llama/{p}" for p in ("manifest.json", "common.safetensors", RECORD_NAME,
                                                              "tp1/rank-0.safetensors", "tp2/rank-0.safetensors",
                                                              "tp2/rank-1.safetensors")}
    again = push(model / "marlin-pack", url, block_size=BLOCK)  # a second push writes nothing
    assert again.up_to_date and again.summary().startswith(f"{url} already holds this bundle")
    bundle = open_remote(url)
    assert str(bundle.url) == url
    for tp, rank in ((1, 0), (2, 1)):
        assert_rank_streams_its_files(bundle, model, url, tp, rank)


def test_the_streamer_reads_gcs_through_its_s3_backend(published) -> None:  # type: ignore[no-untyped-def]
    """Run:ai's streamer is handed ``s3://`` names at GCS's endpoint (its S3 backend, the same HMAC key); messages keep
    the ``gs://`` URL."""
    _, url = published
    target, endpoint = open_remote(url).store.stream_target("tp1/rank-0.safetensors")
    assert target == url.replace("gs://", "s3://") + "/tp1/rank-0.safetensors" and endpoint == store.GCS_ENDPOINT


def test_bad_hmac_key(published, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "GOOG1ENOTAKEY0000000")
    with pytest.raises(RemoteError, match=rf"^cannot read {url}/marlin-pack-published.json: InvalidAccessKeyId; the credentials "
                       r"were refused: set an HMAC key of a service account .* in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"):
        open_remote(url)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteError, match=rf"^cannot read {url}/marlin-pack-published.json: no credentials; set an HMAC key"):
        open_remote(url)


def test_missing_object_half_published_and_a_foreign_manifest(published, gcs, make_bundle) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    gcs.client().delete_object(Bucket=gcs.bucket, Key="llama/tp2/rank-1.safetensors")
    with pytest.raises(BundleMismatchError, match=rf"^{url}/tp2/rank-1.safetensors is missing; publish it again with "
                       rf"`marlin-pack push BUNDLE {url}`"):
        plan_rank(open_remote(url), 2, 1)
    other = make_bundle("gptq", group_size=32)
    gcs.client().put_object(Bucket=gcs.bucket, Key="llama/manifest.json", Body=(other / "marlin-pack/manifest.json").read_bytes())
    with pytest.raises(BundleError, match=rf"^{url}/manifest.json is not the manifest its publication record names"):
        open_remote(url)
    gcs.client().delete_object(Bucket=gcs.bucket, Key=f"llama/{RECORD_NAME}")
    with pytest.raises(BundleError, match=rf"^{url} is half-published"):
        open_remote(url)


def test_a_changed_block_is_refused(published, gcs) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    plan = plan_rank(open_remote(url), 1, 0)
    data = bytearray((model / "marlin-pack" / "tp1/rank-0.safetensors").read_bytes())
    data[-5] ^= 0xFF
    gcs.client().put_object(Bucket=gcs.bucket, Key="llama/tp1/rank-0.safetensors", Body=bytes(data))
    with pytest.raises(BundleMismatchError, match=rf"^{url}/tp1/rank-0.safetensors: block \d+ .* does not match the publication record"):
        read_rank(plan, HostSink(plan))


def test_gcs_metadata_is_read_as_s3s() -> None:
    """GCS's XML API answers user metadata as ``x-goog-meta-*``: read as boto3's ``Metadata``, which push compares."""
    gcs_head = {"Metadata": {}, "ResponseMetadata": {"HTTPHeaders": {"x-goog-meta-blake3": "ab" * 32, "x-goog-hash": "crc32c=x"}}}
    assert _metadata(gcs_head) == {"blake3": "ab" * 32}
    s3_head = {"Metadata": {"blake3": "cd" * 32}, "ResponseMetadata": {"HTTPHeaders": {"x-amz-meta-blake3": "cd" * 32}}}
    assert _metadata(s3_head) == {"blake3": "cd" * 32}


def test_the_gcs_client_leaves_off_what_gcs_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS's endpoint and region (never AWS_ENDPOINT_URL), path-style names, no default request checksums (aws-chunked
    uploads); an s3:// client keeps the environment's endpoint and boto3's defaults."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "GOOG1EXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    client = store._client(ObjectUrl("gs", "my_bucket", "x"))
    assert client.meta.endpoint_url == "https://storage.googleapis.com" and client.meta.region_name == "auto"
    config = client.meta.config
    assert config.s3["addressing_style"] == "path"
    assert (config.request_checksum_calculation, config.response_checksum_validation) == ("when_required", "when_required")
    plain = store._client(ObjectUrl("s3", "bucket-1", "x"))
    assert plain.meta.endpoint_url == "http://127.0.0.1:9"
    assert (plain.meta.config.s3 or {}).get("addressing_style") != "path"


@pytest.mark.parametrize(("value", "ok"), [
    ("gs://my_bucket/x", True), ("gs://a.b.c/x", True), ("gs://" + "a" * 63, True), ("gs://" + "a" * 64, False),
    ("gs://" + ".".join(["a" * 60] * 3), True), ("s3://my_bucket/x", False), ("gs://-bucket/x", False),
])
def test_gcs_bucket_names(value: str, ok: bool) -> None:
    from marlin_pack.remote.url import UrlNotPathError

    if ok:
        assert parse_url(value).scheme == value[:2]
    else:
        with pytest.raises(UrlNotPathError, match="is not a bucket name"):
            parse_url(value)


def test_check_and_push_commands_take_gs(published, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from test_remote_check import _check

    from marlin_pack import cli

    model, url = published
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "-tp", "2", "--compute-capability", "8.0")
    assert code == 0 and out.count(f"from {url}") == 2, out
    for up_to_date in (False, True):  # published in 8 MiB blocks, then again: nothing written
        monkeypatch.setattr(sys, "argv", ["marlin-pack", "push", str(model), url + "-cli", "--json"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main()
        assert e.value.code in (0, None)
        got = json.loads(capsys.readouterr().out)
        assert got["url"] == url + "-cli" and got["up_to_date"] is up_to_date


def test_the_same_bundle_in_other_blocks_is_republished_without_force(published, gcs) -> None:  # type: ignore[no-untyped-def]
    """Pushed again with another block size: the same manifest, so only the record is written (no --force, no upload)."""
    model, url = published
    again = push(model / "marlin-pack", url, block_size=2 * BLOCK)
    assert again.uploaded == [RECORD_NAME] and not again.replaced
    assert open_remote(url).record.block_size == 2 * BLOCK
