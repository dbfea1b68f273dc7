"""The local S3 server of the benchmarks (:mod:`marlin_pack.testing.s3_file_server`), as its clients see it: byte-exact
ranges through boto3, marlin-pack's own remote client and Run:ai's streamer; listings, multipart uploads, metadata;
a bundle pushed through it (or placed in it) and every rank streamed back byte for byte."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from marlin_pack.testing.s3_file_server import STATS_PATH, UPLOADS_DIR, S3FileServer, place

DATA = random.Random(0).randbytes(3_000_017)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3FileServer]:
    """A server over a fresh folder with the bucket ``bench``, and the environment that points clients at it."""
    for var in [v for v in os.environ if v.startswith(("AWS_", "RUNAI_STREAMER_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # never the machine's ~/.aws
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-config"))
    with S3FileServer(tmp_path / "root") as s:
        for k, v in s.env().items():
            monkeypatch.setenv(k, v)
        s.create_bucket("bench")
        yield s


def _client():  # type: ignore[no-untyped-def]
    boto3 = pytest.importorskip("boto3")
    return boto3.session.Session().client("s3")


def _code(e: BaseException) -> str:
    return str(e.response["Error"]["Code"])  # type: ignore[attr-defined]


def test_boto3_reads_byte_exact_ranges_with_metadata_and_etags(server: S3FileServer) -> None:
    from botocore.exceptions import ClientError

    c = _client()
    c.put_object(Bucket="bench", Key="m/data.bin", Body=DATA, Metadata={"blake3": "ab" * 32})
    head = c.head_object(Bucket="bench", Key="m/data.bin")
    assert head["ContentLength"] == len(DATA) and head["Metadata"] == {"blake3": "ab" * 32}
    n = len(DATA)
    before = server.stats
    for rng, want in [("bytes=0-0", DATA[:1]), ("bytes=1-100", DATA[1:101]), (f"bytes={n - 1}-{n - 1}", DATA[-1:]),
                      ("bytes=-10", DATA[-10:]), ("bytes=2999000-", DATA[2999000:]), (f"bytes=5-{n + 99}", DATA[5:])]:
        r = c.get_object(Bucket="bench", Key="m/data.bin", Range=rng, IfMatch=head["ETag"])
        assert r["Body"].read() == want, rng
        assert r["ContentRange"].endswith(f"/{n}") and r["Metadata"] == {"blake3": "ab" * 32}
    assert c.get_object(Bucket="bench", Key="m/data.bin")["Body"].read() == DATA
    after = server.stats
    assert after["GetObject"] - before.get("GetObject", 0) == 7
    assert after["bytes_sent"] - before["bytes_sent"] == 1 + 100 + 1 + 10 + (n - 2999000) + (n - 5) + n
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket="bench", Key="m/data.bin", Range=f"bytes={n}-")
    assert _code(e.value) == "InvalidRange"
    c.put_object(Bucket="bench", Key="m/data.bin", Body=DATA[::-1])  # replaced: another ETag, its metadata gone
    again = c.head_object(Bucket="bench", Key="m/data.bin")
    assert again["ETag"] != head["ETag"] and again["Metadata"] == {}
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket="bench", Key="m/data.bin", Range="bytes=0-9", IfMatch=head["ETag"])
    assert _code(e.value) == "PreconditionFailed"
    for key, bucket, code in [("m/none", "bench", "NoSuchKey"), ("m/data.bin", "nobucket", "NoSuchBucket")]:
        with pytest.raises(ClientError) as e:
            c.get_object(Bucket=bucket, Key=key)
        assert _code(e.value) == code


def test_listings_by_prefix_delimiter_and_page(server: S3FileServer, tmp_path: Path) -> None:
    c = _client()
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 10)
    keys = ["a.txt", "ckpt/config.json", "ckpt/model-00001.safetensors", "ckpt/model-00002.safetensors", "ckpt/sub/x", "z"]
    for k in keys:
        place(server.root, "bench", k, src)
    pages = c.get_paginator("list_objects_v2").paginate(Bucket="bench", PaginationConfig={"PageSize": 2})
    assert [o["Key"] for p in pages for o in p.get("Contents", [])] == keys
    top = c.list_objects_v2(Bucket="bench", Delimiter="/")
    assert [o["Key"] for o in top["Contents"]] == ["a.txt", "z"] and top["CommonPrefixes"] == [{"Prefix": "ckpt/"}]
    ckpt = c.list_objects_v2(Bucket="bench", Prefix="ckpt/", Delimiter="/")
    assert [o["Key"] for o in ckpt["Contents"]] == keys[1:4] and ckpt["CommonPrefixes"] == [{"Prefix": "ckpt/sub/"}]
    assert all(o["Size"] == 10 for o in ckpt["Contents"])
    assert [o["Key"] for o in c.list_objects(Bucket="bench", Prefix="ckpt/m")["Contents"]] == keys[2:4]  # v1
    assert [b["Name"] for b in c.list_buckets()["Buckets"]] == ["bench"]


def test_multipart_upload_joins_its_parts_and_keeps_metadata(server: S3FileServer, tmp_path: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    c = _client()
    src = tmp_path / "big.bin"
    src.write_bytes(DATA * 4)  # 12 MB: 3 parts of 5 MiB and a last one
    config = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=4)
    with open(src, "rb") as f:
        c.upload_fileobj(f, "bench", "p/big.bin", ExtraArgs={"Metadata": {"blake3": "cd" * 32}}, Config=config)
    assert server.stats["UploadPart"] == 3 and server.stats["CompleteMultipartUpload"] == 1
    assert (server.root / "bench/p/big.bin").read_bytes() == DATA * 4
    assert c.head_object(Bucket="bench", Key="p/big.bin")["Metadata"] == {"blake3": "cd" * 32}
    assert not any((server.root / UPLOADS_DIR).iterdir())  # every part removed once joined
    upload = c.create_multipart_upload(Bucket="bench", Key="p/gone.bin")["UploadId"]
    c.upload_part(Bucket="bench", Key="p/gone.bin", UploadId=upload, PartNumber=1, Body=b"y" * 100)
    c.abort_multipart_upload(Bucket="bench", Key="p/gone.bin", UploadId=upload)
    assert not any((server.root / UPLOADS_DIR).iterdir()) and not (server.root / "bench/p/gone.bin").exists()
    c.delete_object(Bucket="bench", Key="p/big.bin")
    assert not (server.root / "bench/p").exists()  # the folder it left empty went with it


def test_the_projects_store_reads_exact_ranges(server: S3FileServer, tmp_path: Path) -> None:
    from marlin_pack.remote.store import RemoteError, open_store
    from marlin_pack.remote.url import parse_url

    src = tmp_path / "obj.bin"
    src.write_bytes(DATA)
    place(server.root, "bench", "prefix/obj.bin", src, metadata={"blake3": "ef" * 32})
    store = open_store(parse_url("s3://bench/prefix"))
    info = store.head("obj.bin")
    assert info is not None and info.size == len(DATA) and info.metadata == {"blake3": "ef" * 32}
    for start, n in [(0, 1), (7, 8 << 10), (len(DATA) - 3, 3), (123_456, 1_000_000)]:
        data, etag = store.get_range("obj.bin", start, n, if_match=info.etag)
        assert data == DATA[start:start + n] and etag == info.etag
    assert store.get("obj.bin", 4 << 20) == (DATA, info.etag)
    assert store.head("missing.bin") is None and store.get("missing.bin", 10) is None
    with pytest.raises(RemoteError, match=r"^cannot read s3://bench/prefix/obj.bin: PreconditionFailed"):
        store.get_range("obj.bin", 0, 10, if_match='"0000"')


def test_runai_streamer_reads_byte_exact_chunks(server: S3FileServer, tmp_path: Path) -> None:
    streamer = pytest.importorskip("runai_model_streamer")
    pytest.importorskip("runai_model_streamer_s3")
    src = tmp_path / "obj.bin"
    src.write_bytes(DATA)
    place(server.root, "bench", "r/obj.bin", src)
    offsets, sizes = [0, 10, 1 << 20, len(DATA) - 5], [10, 100, 1_500_000, 5]
    got = {}
    with streamer.FileStreamer() as fs:
        fs.stream_files([streamer.FileChunks(0, "s3://bench/r/obj.bin", offsets, sizes)], credentials=None, device="cpu")
        for _, index, chunk in fs.get_chunks():
            got[index] = chunk.numpy().tobytes()
    assert got == {i: DATA[o:o + n] for i, (o, n) in enumerate(zip(offsets, sizes, strict=True))}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _stream_every_rank(url: str, bundle: Path, server: S3FileServer) -> None:
    """Each rank of TP 1 and 2 streamed from ``url`` equals the local bundle's tensors, byte for byte; the server sent
    what the plan reads."""
    from safetensors.torch import load_file

    from marlin_pack.remote.bundle import open_remote, plan_rank
    from marlin_pack.remote.stream import HostSink, read_rank

    for tp, rank in [(1, 0), (2, 0), (2, 1)]:
        before = server.stats["bytes_sent"]
        plan = plan_rank(open_remote(url), tp, rank)
        sink = HostSink(plan)
        done = read_rank(plan, sink)
        assert set(done.bytes_read) == {f"tp{tp}/rank-{rank}.safetensors", "common.safetensors"}
        for path in done.bytes_read:
            local = load_file(bundle / path)
            got = sink.tensors(path)
            assert set(got) == set(local)
            for name, t in local.items():
                assert got[name].dtype == t.dtype and _bytes(got[name]).equal(_bytes(t)), name
        assert done.total <= server.stats["bytes_sent"] - before  # the blocks, and the record, manifest and headers


def test_push_through_it_then_stream_every_rank(server: S3FileServer, make_bundle) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("runai_model_streamer_s3")
    from marlin_pack.remote.push import push

    bundle = make_bundle("awq", group_size=32, tp_sizes=(1, 2)) / "marlin-pack"
    done = push(bundle, "s3://bench/llama", block_size=64 << 10)
    assert not done.up_to_date and done.uploaded[-1] == "marlin-pack-published.json"
    assert server.stats["PutObject"] == len(done.uploaded)
    assert push(bundle, "s3://bench/llama", block_size=64 << 10).up_to_date  # the same bundle again: nothing written
    _stream_every_rank("s3://bench/llama", bundle, server)


def test_a_placed_bundle_is_published_by_push_without_its_data(server: S3FileServer, make_bundle) -> None:  # type: ignore[no-untyped-def]
    """``bench_remote.py --push place``: the data objects placed with their manifest digests as metadata; push proves
    the bundle, keeps them, and writes the manifest and the record."""
    pytest.importorskip("runai_model_streamer_s3")
    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.remote.push import push

    bundle = make_bundle("awq", group_size=32, tp_sizes=(1, 2)) / "marlin-pack"
    entries = read_manifest(bundle).files()
    for entry in entries:
        place(server.root, "bench", f"placed/{entry.path}", bundle / entry.path, metadata={"blake3": entry.blake3})
    done = push(bundle, "s3://bench/placed", block_size=64 << 10)
    assert done.uploaded == ["manifest.json", "marlin-pack-published.json"]
    assert sorted(done.kept) == sorted(e.path for e in entries)
    _stream_every_rank("s3://bench/placed", bundle, server)


def test_aws_chunked_bodies_and_virtual_host_names(server: S3FileServer) -> None:
    host, port = server.endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = (b"5;chunk-signature=00\r\nhello\r\n7;chunk-signature=00\r\n, world\r\n0;chunk-signature=00\r\n"
            b"x-amz-checksum-crc32:AAAAAA==\r\n\r\n")
    conn.request("PUT", "/chunked.txt", body=body, headers={
        "Host": f"bench.s3.local:{port}", "Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": "12",
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER", "x-amz-meta-who": "me"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200
    conn.request("GET", "/bench/chunked.txt", headers={"Range": "bytes=7-"})  # path-style, same connection
    r = conn.getresponse()
    assert (r.status, r.read(), r.getheader("x-amz-meta-who")) == (206, b"world", "me")
    conn.close()


def test_the_command_serves_until_terminated(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "marlin_pack.testing.s3_file_server", str(tmp_path / "root"), "--port", "0",
                             "--bucket", "made"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        endpoint = first.split()[1]
        assert first.startswith("s3-file-server: http://127.0.0.1:") and (tmp_path / "root/made").is_dir()
        with urllib.request.urlopen(endpoint + "/made?list-type=2", timeout=10) as r:
            assert b"<Name>made</Name>" in r.read()
        with urllib.request.urlopen(endpoint + STATS_PATH, timeout=10) as r:
            assert json.loads(r.read())["ListObjectsV2"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and '"ListObjectsV2": 1' in out
