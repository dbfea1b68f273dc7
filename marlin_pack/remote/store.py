"""The control plane of a bucket (boto3): small objects read whole, objects described, files published.

Run:ai's streamer (:mod:`marlin_pack.remote.stream`) reads the large byte ranges; everything else goes through boto3,
which its ``s3`` package depends on anyway: the publication record, the manifest, the safetensors headers, object sizes,
and ``push``'s uploads (multipart for large files). Credentials come from boto3's usual chain, read when a store is
opened (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, SSO, web identity, the
instance's role), the endpoint from ``AWS_ENDPOINT_URL`` (an S3-compatible server: MinIO, a test's moto), as for vLLM's
``runai_streamer``.

``gs://bucket/prefix`` is Google Cloud Storage, in one of two ways (:func:`gcs_hmac`, one rule):

- by default, with application-default credentials (GKE workload identity, ``GOOGLE_APPLICATION_CREDENTIALS``,
  ``gcloud auth application-default login``, a VM's service account), as vLLM's ``runai_streamer`` reads ``gs://``:
  Google's client (``google-cloud-storage``, :class:`GcsStore`) reads and writes through GCS's JSON API and Run:ai's
  GCS backend (``runai-model-streamer-gcs``) streams the ranges. ``STORAGE_EMULATOR_HOST`` points Google's client at
  an emulator, ``CLOUD_STORAGE_EMULATOR_ENDPOINT`` the streamer's (google-cloud-cpp's): with one, the other must be the
  same (:func:`check_gcs_emulator`);
- with ``MARLIN_PACK_GCS_HMAC=1``, through GCS's XML API, which speaks S3's protocol: boto3 and the streamer's S3 backend
  at :data:`GCS_ENDPOINT` (never ``AWS_ENDPOINT_URL``, which names the server of ``s3://`` URLs), signed with an HMAC
  key of a service account given as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (or a profile). S3 features GCS
  lacks are left off there: boto3's default request checksums (aws-chunked uploads) and virtual-host addressing; GCS
  returns user metadata as ``x-goog-meta-*``, read as S3's (:func:`_metadata`). The streamer is handed ``s3://`` names
  and that endpoint (:meth:`S3Store.stream_target`), so it too uses its S3 backend and the same key.

Every failure is a :class:`RemoteError`: one line naming the object, what the store answered, and what to do (bad or
missing credentials, a missing bucket or object, an endpoint that does not answer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from marlin_pack.errors import BundleError
from marlin_pack.remote.url import ObjectUrl

__all__ = ["GCS_ENDPOINT", "GCS_HMAC_ENV", "GCS_REGION", "GcsStore", "ObjectInfo", "RemoteError", "S3Store", "Store",
           "check_gcs_emulator", "gcs_hmac", "open_store"]

# Google Cloud Storage's XML API (S3's protocol, HMAC keys): where gs:// URLs are read and written. SigV4 with region
# "auto" is what GCS documents for it.
GCS_ENDPOINT = "https://storage.googleapis.com"
GCS_REGION = "auto"
# gs:// through the XML API with an HMAC key (1/true/yes) instead of application-default credentials.
GCS_HMAC_ENV = "MARLIN_PACK_GCS_HMAC"

_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId",
                "AuthorizationHeaderMalformed")
_DENIED = ("AccessDenied", "AllAccessDisabled", "Forbidden", "403")
_MISSING = ("NoSuchKey", "NotFound", "404")
_EXTRA = "install marlin-pack's s3 extra: pip install 'marlin-pack[s3]'"
_GCS_EXTRA = "install marlin-pack's gcs extra: pip install 'marlin-pack[gcs]'"
_GCS_ADC = ("set application-default credentials (GKE workload identity, GOOGLE_APPLICATION_CREDENTIALS=KEY.json, or "
            f"`gcloud auth application-default login`), or {GCS_HMAC_ENV}=1 with an HMAC key in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
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


def gcs_hmac() -> bool:
    """The one rule: ``gs://`` goes through GCS's XML API with an HMAC key only where ``MARLIN_PACK_GCS_HMAC`` asks for
    it (1, true, yes); otherwise through Google's client and Run:ai's GCS backend, with application-default credentials."""
    return os.environ.get(GCS_HMAC_ENV, "").strip().lower() in ("1", "true", "yes")


def check_gcs_emulator() -> None:
    """An emulator named for one of the two GCS clients is named for both: Google's client reads
    ``STORAGE_EMULATOR_HOST``, Run:ai's GCS backend ``CLOUD_STORAGE_EMULATOR_ENDPOINT``; with only one set, the metadata
    would come from the emulator and the ranges from storage.googleapis.com (or the reverse)."""
    python = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
    cpp = os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT", "").rstrip("/")
    if python != cpp:
        raise RemoteError(f"STORAGE_EMULATOR_HOST={python or '(unset)'} but CLOUD_STORAGE_EMULATOR_ENDPOINT={cpp or '(unset)'}: "
                          "Google's client reads the first, Run:ai's GCS backend the second; set both to the same emulator, "
                          "or neither for GCS itself")


class GcsStore:
    """One ``gs://`` bucket prefix through Google's client (GCS's JSON API), with application-default credentials
    (anonymous at ``STORAGE_EMULATOR_HOST``). The ETag of an object is its generation, which every write changes."""

    def __init__(self, url: ObjectUrl) -> None:
        self.url = url
        self._bucket_handle: Any = None

    def _bucket(self) -> Any:
        if self._bucket_handle is None:
            try:
                from google.cloud import storage
            except ImportError as e:
                raise RemoteError(f"{self.url} needs google-cloud-storage, which is not installed: {_GCS_EXTRA} "
                                  f"(or {GCS_HMAC_ENV}=1 with an HMAC key: {_EXTRA})") from e
            check_gcs_emulator()
            self._bucket_handle = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT")).bucket(self.url.bucket)
        return self._bucket_handle

    def _fail(self, name: str, action: str, e: Exception) -> RemoteError:
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth

        if isinstance(e, auth.DefaultCredentialsError):
            code, todo = "no credentials", _GCS_ADC
        elif isinstance(e, (auth.RefreshError, api.Unauthorized)):
            code, todo = "credentials refused", f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}; {_GCS_ADC}"
        elif isinstance(e, api.Forbidden):
            code, todo = "403", ("these credentials' service account may not read or write it: grant it roles/storage.objectViewer "
                                 "(readers) or roles/storage.objectUser (push) on the bucket")
        elif isinstance(e, api.NotFound):
            code, todo = "NoSuchBucket", "check the bucket's name"
        elif isinstance(e, api.PreconditionFailed):
            code, todo = "412", "the object was replaced while it was read (a push?); retry once the push is finished"
        elif isinstance(e, api.GoogleAPICallError):
            code, todo = str(e.code), (e.message or "see the store's message")[:200]
        else:  # requests' ConnectionError, google.auth's TransportError: no answer
            where = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
            code, todo = "no answer", f"check that {where} is reachable from here ({type(e).__name__})"
        return RemoteError(f"cannot {action} {self.url.url_of(name)}: {code}; {todo}")

    def _run(self, name: str, action: str, fn: Callable[[Any], Any]) -> Any:
        from google.api_core.exceptions import GoogleAPICallError
        from google.auth.exceptions import GoogleAuthError
        from requests.exceptions import RequestException

        try:
            return fn(self._bucket())
        except (GoogleAPICallError, GoogleAuthError, RequestException) as e:
            raise self._fail(name, action, e) from e

    def head(self, name: str) -> ObjectInfo | None:
        """The object's size, generation and metadata; None where there is no such object (a missing bucket raises)."""
        blob = self._run(name, "read", lambda b: b.get_blob(self.url.key(name)))
        if blob is None:
            # get_blob answers None for a missing bucket too: a listing (storage.objects.list, which readers hold) tells
            self._run(name, "read", lambda b: next(iter(b.list_blobs(prefix=self.url.key(name), max_results=1)), None))
            return None
        return ObjectInfo(int(blob.size or 0), str(blob.generation), {str(k).lower(): str(v) for k, v in (blob.metadata or {}).items()})

    def get(self, name: str, limit: int) -> tuple[bytes, str] | None:
        return S3Store.get(self, name, limit)  # type: ignore[arg-type]

    def get_range(self, name: str, start: int, length: int, if_match: str | None = None) -> tuple[bytes, str]:
        """``length`` bytes from ``start`` (exactly: a short read is refused), of the generation ``if_match`` if given."""
        if length == 0:
            return b"", if_match or ""
        kw: dict[str, Any] = {"if_generation_match": int(if_match)} if if_match else {}

        def read(b: Any) -> bytes:
            return b.blob(self.url.key(name)).download_as_bytes(start=start, end=start + length - 1, raw_download=True,
                                                                 checksum=None, **kw)

        from google.api_core.exceptions import NotFound

        try:
            data = self._run(name, "read", read)
        except RemoteError as e:
            if isinstance(e.__cause__, NotFound) and self.head(name) is None:
                raise RemoteError(f"cannot read {self.url.url_of(name)}: NoSuchKey; the object is gone; push the bundle again") from e
            raise
        if len(data) != length:
            raise RemoteError(f"{self.url.url_of(name)} gave {len(data):,} bytes at offset {start:,}, expected {length:,}: "
                              "the object is truncated or was replaced; push the bundle again")
        return data, if_match or ""

    def put_bytes(self, name: str, data: bytes, metadata: dict[str, str]) -> None:
        def put(b: Any) -> None:
            blob = b.blob(self.url.key(name))
            blob.metadata = metadata or None
            blob.upload_from_string(data, content_type="application/octet-stream")

        self._run(name, "write", put)

    def put_file(self, name: str, f: BinaryIO, metadata: dict[str, str], on_bytes: Callable[[int], None] | None = None) -> None:
        """Upload an open file (resumable above 8 MiB): the object appears whole, when the last part is written, or not at all."""
        size = os.fstat(f.fileno()).st_size - f.tell()

        def put(b: Any) -> None:
            blob = b.blob(self.url.key(name), chunk_size=64 << 20)
            blob.metadata = metadata or None
            blob.upload_from_file(_Counted(f, on_bytes), size=size, content_type="application/octet-stream", checksum=None)

        self._run(name, "write", put)

    def delete(self, name: str) -> None:
        from google.api_core.exceptions import NotFound

        def delete(b: Any) -> None:
            with contextlib.suppress(NotFound):  # already gone, as S3's DELETE answers
                b.blob(self.url.key(name)).delete()

        self._run(name, "delete", delete)

    def stream_target(self, name: str) -> tuple[str, str | None]:
        """Run:ai's streamer reads ``gs://`` names with its GCS backend and application-default credentials."""
        return self.url.url_of(name), None


class _Counted:
    """A file whose reads are counted (push's progress): Google's client has no progress callback."""

    def __init__(self, f: BinaryIO, on_bytes: Callable[[int], None] | None) -> None:
        self._f, self._on_bytes = f, on_bytes

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self._on_bytes is not None and data:
            self._on_bytes(len(data))
        return data

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)


Store = S3Store | GcsStore


def open_store(url: ObjectUrl) -> Store:
    """A store of ``url``'s bucket and prefix, with the credentials and endpoint the environment gives now: boto3 for
    ``s3://`` and for ``gs://`` with ``MARLIN_PACK_GCS_HMAC=1``, Google's client for ``gs://`` otherwise."""
    if url.scheme == "gs" and not gcs_hmac():
        return GcsStore(url)
    return S3Store(url, _client(url))
