"""The control plane of a bucket (boto3): small objects read whole, objects described, files published.

Run:ai's streamer (:mod:`marlin_pack.remote.stream`) reads the large byte ranges; everything else goes through boto3,
which its ``s3`` package depends on anyway: the publication record, the manifest, the safetensors headers, object sizes,
and ``push``'s uploads (multipart for large files). Credentials come from boto3's usual chain, read when a store is
opened (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, SSO, web identity, the
instance's role), the endpoint from ``AWS_ENDPOINT_URL`` (an S3-compatible server: MinIO, a test's moto), as for vLLM's
``runai_streamer``.

``gs://bucket/prefix`` is Google Cloud Storage through its XML API, which speaks S3's protocol: the same two clients, at
:data:`GCS_ENDPOINT` (never ``AWS_ENDPOINT_URL``, which names the server of ``s3://`` URLs), signed with an HMAC key of
a service account given as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (or a profile). S3 features GCS lacks are
left off there: boto3's default request checksums (aws-chunked uploads) and virtual-host addressing; GCS returns user
metadata as ``x-goog-meta-*``, read as S3's (:func:`_metadata`). The streamer is handed ``s3://`` names and that
endpoint (:meth:`S3Store.stream_target`), so it too uses its S3 backend and the same key.

Every failure is a :class:`RemoteError`: one line naming the object, what the store answered, and what to do (bad or
missing credentials, a missing bucket or object, an endpoint that does not answer).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from marlin_pack.errors import BundleError
from marlin_pack.remote.url import ObjectUrl

__all__ = ["GCS_ENDPOINT", "GCS_REGION", "ObjectInfo", "RemoteError", "S3Store", "open_store"]

# Google Cloud Storage's XML API (S3's protocol, HMAC keys): where gs:// URLs are read and written. SigV4 with region
# "auto" is what GCS documents for it.
GCS_ENDPOINT = "https://storage.googleapis.com"
GCS_REGION = "auto"

_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId",
                "AuthorizationHeaderMalformed")
_DENIED = ("AccessDenied", "AllAccessDisabled", "Forbidden", "403")
_MISSING = ("NoSuchKey", "NotFound", "404")
_EXTRA = "install marlin-pack's s3 extra: pip install 'marlin-pack[s3]'"
_GCS_KEY = ("an HMAC key of a service account that may use the bucket in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (gs:// is "
            "read through GCS's XML API: `gcloud storage hmac create SERVICE_ACCOUNT_EMAIL` makes one)")


class RemoteError(BundleError):
    """A bucket refused, lacked or garbled what marlin-pack asked of it."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD says of an object: its size, ETag (a version for "changed since"), and user metadata."""

    size: int
    etag: str
    metadata: dict[str, str]


def _client(url: ObjectUrl) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise RemoteError(f"{url} needs boto3, which is not installed: {_EXTRA}") from e
    # A fresh session reads the environment now (boto3's default session keeps what it read first). Retries are
    # bounded: an endpoint that does not answer is said in seconds, not minutes.
    settings: dict[str, Any] = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 120,
                                "user_agent_extra": "marlin-pack"}
    if url.scheme != "gs":
        return boto3.session.Session().client("s3", config=Config(**settings))
    # GCS's XML API: no aws-chunked uploads with trailing checksums (boto3's default since 1.36), path-style names
    # (a bucket with '.' or '_' has no virtual host); the objects are verified by their BLAKE3 digests anyway.
    settings.update(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=GCS_ENDPOINT, region_name=GCS_REGION, config=Config(**settings))


def _why(e: Exception, scheme: str = "s3") -> tuple[str, str]:
    """(the store's code, one line of what to do) for a client error of a ``scheme://`` bucket."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, PartialCredentialsError

    gcs = scheme == "gs"
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        if gcs:
            return "no credentials", f"set {_GCS_KEY}"
        return "no credentials", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a role) for this bucket"
    if isinstance(e, EndpointConnectionError):
        if gcs:
            return "no answer", f"check that {GCS_ENDPOINT} (GCS's XML API) is reachable from here"
        where = os.environ.get("AWS_ENDPOINT_URL") or "the S3 endpoint"
        return "no answer", f"check that {where} is reachable (AWS_ENDPOINT_URL names an S3-compatible server)"
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", "")) or str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        if code in _CREDENTIALS:
            if gcs:
                return code, f"the credentials were refused: set {_GCS_KEY}"
            return code, "the credentials were refused: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the profile) for this bucket"
        if code in _DENIED:
            if gcs:
                return code, ("this key's service account may not read or write it: grant it roles/storage.objectViewer "
                              "(readers) or roles/storage.objectUser (push) on the bucket")
            return code, ("these credentials may not read or write it: grant s3:GetObject (readers), s3:PutObject and "
                          "s3:DeleteObject (push) on the prefix")
        if code == "NoSuchBucket":
            return code, "check the bucket's name" + ("" if gcs else " (and AWS_ENDPOINT_URL for a server other than AWS)")
        return code, "see the store's message above"
    return type(e).__name__, str(e)[:200]


def _metadata(response: dict[str, Any]) -> dict[str, str]:
    """An object's user metadata from a HEAD/GET response: boto3's ``Metadata`` (``x-amz-meta-*``), and GCS's own
    spelling of it (``x-goog-meta-*``), which its XML API may answer with."""
    found = {str(k).lower(): str(v) for k, v in (response.get("Metadata") or {}).items()}
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    for name, value in headers.items():
        name = str(name).lower()
        if name.startswith("x-goog-meta-"):
            found.setdefault(name[len("x-goog-meta-"):], str(value))
    return found


class S3Store:
    """One bucket prefix, through boto3. Names are bundle-relative (``manifest.json``, ``tp2/rank-1.safetensors``)."""

    def __init__(self, url: ObjectUrl, client: Any) -> None:
        self.url = url
        self._client = client

    def _fail(self, name: str, action: str, e: Exception) -> RemoteError:
        code, todo = _why(e, self.url.scheme)
        return RemoteError(f"cannot {action} {self.url.url_of(name)}: {code}; {todo}")

    def _call(self, name: str, action: str, fn: Callable[..., Any], **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.url.bucket, **kw)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(name, action, e) from e

    def head(self, name: str) -> ObjectInfo | None:
        """The object's size, ETag and metadata; None where there is no such object (any other failure raises)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self._client.head_object(Bucket=self.url.bucket, Key=self.url.key(name))
        except ClientError as e:
            # A HEAD's answer has no body (404: no such key, or no such bucket?): a 1-byte GET says which it is.
            try:
                self._client.get_object(Bucket=self.url.bucket, Key=self.url.key(name), Range="bytes=0-0")
            except ClientError as got:
                if _why(got)[0] == "NoSuchKey":
                    return None
                if _why(got)[0] != "InvalidRange":  # InvalidRange: an empty object, so the HEAD's own refusal stands
                    raise self._fail(name, "read", got) from got
            except BotoCoreError:
                pass
            if _why(e)[0] in _MISSING:
                return None
            raise self._fail(name, "read", e) from e
        except BotoCoreError as e:
            raise self._fail(name, "read", e) from e
        return ObjectInfo(int(r["ContentLength"]), str(r.get("ETag", "")), _metadata(r))

    def get(self, name: str, limit: int) -> tuple[bytes, str] | None:
        """The whole object and its ETag, refused over ``limit`` bytes; None where there is no such object."""
        info = self.head(name)
        if info is None:
            return None
        if info.size > limit:
            raise RemoteError(f"{self.url.url_of(name)} is {info.size:,} bytes, expected at most {limit:,}: not what "
                              "marlin-pack publishes there; push the bundle again (`marlin-pack push BUNDLE URL --force`)")
        data, etag = self.get_range(name, 0, info.size, if_match=info.etag)
        return data, etag

    def get_range(self, name: str, start: int, length: int, if_match: str | None = None) -> tuple[bytes, str]:
        """``length`` bytes from ``start`` (exactly: a short read is refused), and the ETag they were read at."""
        if length == 0:
            return b"", if_match or ""
        kw: dict[str, Any] = {"Key": self.url.key(name), "Range": f"bytes={start}-{start + length - 1}"}
        if if_match:
            kw["IfMatch"] = if_match
        r = self._call(name, "read", self._client.get_object, **kw)
        data = r["Body"].read()
        if len(data) != length:
            raise RemoteError(f"{self.url.url_of(name)} gave {len(data):,} bytes at offset {start:,}, expected {length:,}: "
                              "the object is truncated or was replaced; push the bundle again")
        return data, str(r.get("ETag", ""))

    def put_bytes(self, name: str, data: bytes, metadata: dict[str, str]) -> None:
        self._call(name, "write", self._client.put_object, Key=self.url.key(name), Body=data, Metadata=metadata)

    def put_file(self, name: str, f: BinaryIO, metadata: dict[str, str], on_bytes: Callable[[int], None] | None = None) -> None:
        """Upload an open file (multipart above 64 MiB, 8 parts at once): the object appears whole or not at all."""
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)
        try:
            self._client.upload_fileobj(f, self.url.bucket, self.url.key(name), ExtraArgs={"Metadata": metadata},
                                        Config=config, Callback=on_bytes)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(name, "write", e) from e
        except Exception as e:  # s3transfer wraps a failed part: still one line naming the object
            cause = e.__cause__ or e.__context__
            if isinstance(cause, (ClientError, BotoCoreError)):
                raise self._fail(name, "write", cause) from e
            raise

    def delete(self, name: str) -> None:
        self._call(name, "delete", self._client.delete_object, Key=self.url.key(name))

    def stream_target(self, name: str) -> tuple[str, str | None]:
        """What Run:ai's streamer is given for the object ``name``: its URL, and the endpoint to read it at (None: the
        environment's, ``AWS_ENDPOINT_URL`` or AWS). A ``gs://`` object is named ``s3://`` at :data:`GCS_ENDPOINT`: the
        streamer's S3 backend, with the HMAC key the environment gives boto3 too."""
        if self.url.scheme == "gs":
            return f"s3://{self.url.bucket}/{self.url.key(name)}", GCS_ENDPOINT
        return self.url.url_of(name), None


def open_store(url: ObjectUrl) -> S3Store:
    """A store of ``url``'s bucket and prefix, with the credentials and endpoint the environment gives now."""
    return S3Store(url, _client(url))
