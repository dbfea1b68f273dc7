"""The control plane of a bucket (boto3): small objects read whole, objects described, files published.

Run:ai's streamer (:mod:`marlin_pack.remote.stream`) reads the large byte ranges; everything else goes through boto3,
which its ``s3`` package depends on anyway: the publication record, the manifest, the safetensors headers, object sizes,
and ``push``'s uploads (multipart for large files). Credentials come from boto3's usual chain, read when a store is
opened (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, SSO, web identity, the
instance's role), the endpoint from ``AWS_ENDPOINT_URL`` (an S3-compatible server: MinIO, GCS's interoperability API,
a test's moto), as for vLLM's ``runai_streamer``.

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

__all__ = ["ObjectInfo", "RemoteError", "S3Store", "open_store"]

_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId",
                "AuthorizationHeaderMalformed")
_DENIED = ("AccessDenied", "AllAccessDisabled", "Forbidden", "403")
_MISSING = ("NoSuchKey", "NotFound", "404")
_EXTRA = "install marlin-pack's s3 extra: pip install 'marlin-pack[s3]'"


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
    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=120,
                    user_agent_extra="marlin-pack")
    return boto3.session.Session().client("s3", config=config)


def _why(e: Exception) -> tuple[str, str]:
    """(the store's code, one line of what to do) for a client error."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, PartialCredentialsError

    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return "no credentials", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, a role) for this bucket"
    if isinstance(e, EndpointConnectionError):
        where = os.environ.get("AWS_ENDPOINT_URL") or "the S3 endpoint"
        return "no answer", f"check that {where} is reachable (AWS_ENDPOINT_URL names an S3-compatible server)"
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", "")) or str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        if code in _CREDENTIALS:
            return code, "the credentials were refused: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the profile) for this bucket"
        if code in _DENIED:
            return code, ("these credentials may not read or write it: grant s3:GetObject (readers), s3:PutObject and "
                          "s3:DeleteObject (push) on the prefix")
        if code == "NoSuchBucket":
            return code, "check the bucket's name (and AWS_ENDPOINT_URL for a server other than AWS)"
        return code, "see the store's message above"
    return type(e).__name__, str(e)[:200]


class S3Store:
    """One bucket prefix, through boto3. Names are bundle-relative (``manifest.json``, ``tp2/rank-1.safetensors``)."""

    def __init__(self, url: ObjectUrl, client: Any) -> None:
        self.url = url
        self._client = client

    def _fail(self, name: str, action: str, e: Exception) -> RemoteError:
        code, todo = _why(e)
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
        return ObjectInfo(int(r["ContentLength"]), str(r.get("ETag", "")), dict(r.get("Metadata") or {}))

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


def open_store(url: ObjectUrl) -> S3Store:
    """A store of ``url``'s bucket and prefix, with the credentials and endpoint the environment gives now."""
    return S3Store(url, _client(url))
