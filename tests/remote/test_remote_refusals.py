"""Every refusal of a bucket's bundle is one line naming the object and what to do, for ``s3://`` and ``gs://`` alike
(``conftest.bucket``): bad credentials, a missing object, a truncated one, a half-published prefix, a manifest that is
not the record's, a record whose files or digests are not the manifest's, a block whose bytes are not the record's, a
bucket holding another checkpoint's bundle."""

from __future__ import annotations

import json

import pytest

from marlin_pack.errors import MarlinPackError
from marlin_pack.remote.bundle import open_remote, plan_rank
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME
from marlin_pack.remote.stream import HostSink, read_rank

BLOCK = 64 << 10


def _record(bucket, key: str) -> dict:  # type: ignore[no-untyped-def]
    return json.loads(bucket.client().get_object(Bucket=bucket.bucket, Key=key)["Body"].read())


def _put(bucket, key: str, data: bytes) -> None:  # type: ignore[no-untyped-def]
    bucket.client().put_object(Bucket=bucket.bucket, Key=key, Body=data)


def _read(url: str) -> None:
    plan = plan_rank(open_remote(url), 1, 0)
    read_rank(plan, HostSink(plan))


CASES = ["credentials", "missing", "truncated", "half-published", "foreign manifest", "record digests", "record files",
         "changed block"]


@pytest.mark.parametrize("case", CASES)
def test_each_refusal_is_one_line(make_bundle, bucket, monkeypatch: pytest.MonkeyPatch, case: str) -> None:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    url = bucket.url("m")
    push(model / "marlin-pack", url, block_size=BLOCK)
    rank_key, record_key = "m/tp1/rank-0.safetensors", f"m/{RECORD_NAME}"
    if case == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        match = rf"^cannot read {url}/{RECORD_NAME}: SignatureDoesNotMatch; the credentials were refused"
    elif case == "missing":
        bucket.client().delete_object(Bucket=bucket.bucket, Key=rank_key)
        match = rf"^{url}/tp1/rank-0.safetensors is missing; publish it again with `marlin-pack push BUNDLE {url}`"
    elif case == "truncated":
        data = (model / "marlin-pack/tp1/rank-0.safetensors").read_bytes()
        _put(bucket, rank_key, data[:-1])
        match = rf"^{url}/tp1/rank-0.safetensors is {len(data) - 1:,} bytes, the manifest says {len(data):,}: truncated"
    elif case == "half-published":
        bucket.client().delete_object(Bucket=bucket.bucket, Key=record_key)
        match = rf"^{url} is half-published: it holds manifest.json but no {RECORD_NAME}"
    elif case == "foreign manifest":
        _put(bucket, "m/manifest.json", (make_bundle("gptq", group_size=32) / "marlin-pack/manifest.json").read_bytes())
        match = rf"^{url}/manifest.json is not the manifest its publication record names \(SHA-256 [0-9a-f]{{16}}…, recorded"
    elif case == "record digests":  # a record that names the manifest but not its files' digests
        record = _record(bucket, record_key)
        record["files"][0]["blake3"] = "0" * 64
        _put(bucket, record_key, json.dumps(record).encode())
        match = rf"^{url}: the publication record says .* BLAKE3 0000000000000000…, the manifest .*; push the bundle again"
    elif case == "record files":
        record = _record(bucket, record_key)
        record["files"].pop()
        _put(bucket, record_key, json.dumps(record).encode())
        match = rf"^{url}: the publication record and the manifest list different files"
    else:  # the object's bytes changed, its size kept: its blocks are not the record's
        data = bytearray((model / "marlin-pack/tp1/rank-0.safetensors").read_bytes())
        data[len(data) // 2] ^= 1
        _put(bucket, rank_key, bytes(data))
        match = rf"^{url}/tp1/rank-0.safetensors: block \d+ \(bytes [\d,]+\.\.[\d,]+\) does not match the publication record"
    with pytest.raises(MarlinPackError, match=match) as e:
        _read(url)
    assert "\n" not in str(e.value)


def test_a_bucket_holding_another_checkpoints_bundle_is_refused(make_bundle, make_checkpoint, bucket) -> None:  # type: ignore[no-untyped-def]
    """The engine's MODEL_DIR is not the checkpoint the published bundle was made from: [source], one line, before
    any tensor byte is read."""
    import vllm

    from marlin_pack.errors import BundleMismatchError
    from marlin_pack.remote.decision import select_remote
    from marlin_pack.vllm_plugin.decision import EngineFacts

    published = make_bundle("awq", group_size=32)
    url = bucket.url("other")
    push(published / "marlin-pack", url, block_size=BLOCK)
    mine = make_checkpoint("awq", "tiny", group_size=32, seed=3)
    facts = EngineFacts(model=str(mine), vllm_version=vllm.__version__, quantization="awq", dtype="float16")
    with pytest.raises(BundleMismatchError) as e:
        select_remote(url, facts)
    assert e.value.field.value.startswith("source") and "\n" not in str(e.value)
