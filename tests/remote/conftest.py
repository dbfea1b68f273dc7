"""A real S3-compatible server for the tests of bundles in object storage: moto's server mode (``moto[server]``), on
loopback, in this process's threads, started by the session's first test that needs it. The clients (boto3, Run:ai's
streamer) talk HTTP to it exactly as to AWS; nothing of theirs is mocked.

The server checks credentials (moto's IAM access control from the first request on): :func:`s3` hands each test the
keys of an IAM user allowed ``s3:*`` and a bucket of its own, through the usual environment variables.

:func:`gcs` is the same server standing in for Google Cloud Storage's XML API (S3's protocol with HMAC keys, how
marlin-pack speaks to ``gs://`` with ``MARLIN_PACK_GCS_HMAC=1``): ``GCS_ENDPOINT`` points at it, the key is in
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` as a GCS HMAC key is, and ``AWS_ENDPOINT_URL`` names a closed port, so
a ``gs://`` URL read at the S3 endpoint instead would fail. What GCS's XML API does unlike S3 (``x-goog-meta-*``
metadata, no aws-chunked uploads) is covered by unit tests of those differences.

:func:`gcs_adc` is ``gs://`` as it is read by default (application-default credentials): ``gcp-storage-emulator``
(GCS's JSON API, in this process's threads) at ``STORAGE_EMULATOR_HOST`` for Google's client and
``CLOUD_STORAGE_EMULATOR_ENDPOINT`` for Run:ai's GCS backend (both clients then use no credentials).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="moto[server] (the test extra) starts the S3 server")
pytest.importorskip("runai_model_streamer", reason="runai-model-streamer[s3] (the s3 extra) reads bundles from buckets")

_buckets = itertools.count()


@dataclass(frozen=True)
class S3:
    """The server of this session and this test's bucket and credentials (already in the environment)."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    scheme: str = "s3"

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def keys(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` and its size."""
        found = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])
        return {o["Key"]: o["Size"] for o in found}


@pytest.fixture(scope="session")
def _s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bootstrap", "AWS_SECRET_ACCESS_KEY": "bootstrap",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        # Three unauthenticated calls make the user and its key; every request after them is checked.
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 3
        ActionAuthenticatorMixin.request_count = 0
        iam = boto3.session.Session().client("iam")
        iam.create_user(UserName="marlin-pack-tests")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="marlin-pack-tests", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="marlin-pack-tests")["AccessKey"]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    server.stop()
    settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")


@pytest.fixture
def s3(_s3_server: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3:
    """This test's bucket on the session's server, with the environment a user sets for an S3-compatible server."""
    endpoint, access, secret = _s3_server
    for var in [v for v in os.environ if v.startswith(("AWS_", "RUNAI_STREAMER_"))]:
        monkeypatch.delenv(var)
    no_file = tmp_path / "no-aws-config"  # never the machine's ~/.aws
    monkeypatch.setenv("AWS_CONFIG_FILE", str(no_file))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(no_file))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s = S3(endpoint, f"marlin-pack-{next(_buckets)}", access, secret)
    s.client().create_bucket(Bucket=s.bucket)
    return s


@pytest.fixture
def gcs(s3: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """This test's bucket as ``gs://``: the session's server standing in for GCS's XML API (``GCS_ENDPOINT``), the key
    as a GCS HMAC key is given; ``AWS_ENDPOINT_URL`` names a closed loopback port (gs:// never reads it)."""
    from marlin_pack.remote import store

    monkeypatch.setattr(store, "GCS_ENDPOINT", s3.endpoint)
    monkeypatch.setenv(store.GCS_HMAC_ENV, "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    return S3(s3.endpoint, s3.bucket, s3.access_key, s3.secret_key, "gs")


@dataclass(frozen=True)
class GCS:
    """The emulator of this session and this test's bucket (``STORAGE_EMULATOR_HOST`` already in the environment)."""

    endpoint: str
    bucket: str

    def url(self, prefix: str) -> str:
        return f"gs://{self.bucket}/{prefix}"

    def client(self):  # type: ignore[no-untyped-def]
        """The bucket, through Google's client (anonymous at the emulator)."""
        from google.cloud import storage

        return storage.Client(project="marlin-pack-tests").bucket(self.bucket)

    def keys(self, prefix: str = "") -> dict[str, int]:
        return {b.name: b.size for b in self.client().list_blobs(prefix=prefix)}

    def put(self, key: str, data: bytes) -> None:
        self.client().blob(key).upload_from_string(data)

    def delete(self, key: str) -> None:
        self.client().blob(key).delete()


@pytest.fixture(scope="session")
def _gcs_emulator() -> Iterator[str]:
    for module, why in (("gcp_storage_emulator.server", "gcp-storage-emulator (the test extra) serves GCS's JSON API"),
                        ("google.cloud.storage", "google-cloud-storage (the gcs extra) reads gs:// with ADC"),
                        ("runai_model_streamer_gcs", "runai-model-streamer[gcs] (the gcs extra) streams gs:// with ADC")):
        pytest.importorskip(module, reason=why)
    import socket

    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def gcs_adc(_gcs_emulator: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> GCS:
    """This test's bucket as ``gs://`` read the default way (Google's client, Run:ai's GCS backend) at the emulator; no
    HMAC key, ``AWS_ENDPOINT_URL`` a closed port, no gcloud configuration of the machine's."""
    for var in [v for v in os.environ if v.startswith(("AWS_", "RUNAI_STREAMER_", "GOOGLE_", "GCE_", "CLOUDSDK_"))]:
        monkeypatch.delenv(var)
    monkeypatch.delenv("MARLIN_PACK_GCS_HMAC", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", _gcs_emulator)
    monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", _gcs_emulator)
    g = GCS(_gcs_emulator, f"marlin-pack-gcs-{next(_buckets)}")
    from google.cloud import storage

    storage.Client(project="marlin-pack-tests").create_bucket(g.bucket)
    return g


@pytest.fixture(params=["s3", "gs"])
def bucket(request: pytest.FixtureRequest) -> S3:
    """This test's bucket as ``s3://`` and, in a second run, as ``gs://`` (:func:`gcs`)."""
    return request.getfixturevalue("gcs" if request.param == "gs" else "s3")


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every streamed read of the test: (the rank's plan, what it read)."""
    from marlin_pack.remote import stream

    reads: list = []
    read_rank = stream.read_rank

    def counted(plan, sink, **kw):  # type: ignore[no-untyped-def]
        done = read_rank(plan, sink, **kw)
        reads.append((plan, done))
        return done

    monkeypatch.setattr(stream, "read_rank", counted)
    return reads
