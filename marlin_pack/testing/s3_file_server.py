"""A local S3-compatible server over a directory, for benchmarks and tests only: tens of GB at the machine's speed.

Why it exists: the tests of bundles in object storage run moto's server (``tests/remote/conftest.py``), which keeps every
object as Python bytes in its process's memory and answers a GET by slicing them behind Werkzeug. That is right for
the tests' kilobytes and their credential checks, but a 70B-shaped bundle and its raw checkpoint (about 45 GB) would
need that much memory again inside moto, and would be read at the rate of one Python process copying bytes: a
benchmark would measure moto, not the clients. MinIO would do, but it is a Go binary the GPU machine does not have.

This server keeps each object as a plain file, ``ROOT/BUCKET/KEY`` (put ``ROOT`` on tmpfs, ``/dev/shm``, and every GET
is served from memory), and answers GETs with ``sendfile(2)`` from the page cache to the socket: no copy through Python,
one thread per connection (``ThreadingHTTPServer``; the clients open as many as they read ranges at once). What it
speaks, as S3 does over HTTP (path-style ``/BUCKET/KEY``, or virtual-host ``BUCKET.HOST``):

* ``GET`` of an object, whole or one ``Range: bytes=A-B`` (``A-``, ``-N``; 206 with ``Content-Range``; 416
  ``InvalidRange`` past the end), with ``If-Match`` / ``If-None-Match``; ``HEAD`` of an object or a bucket;
* ``ListObjectsV2`` (``prefix``, ``delimiter``, ``max-keys``, ``continuation-token``, ``start-after``), ``ListObjects``
  (v1), ``ListBuckets``;
* ``PUT`` of an object (``x-amz-meta-*`` user metadata kept beside it; written to a temporary file and renamed: a reader
  sees the old object or the new one, never a part), multipart uploads (create, upload part, complete, abort; the parts
  are joined and removed one by one, so a 20 GB object needs little more than its own size), ``DELETE`` of an object,
  ``PUT`` / ``DELETE`` of a bucket. Bodies may be ``aws-chunked`` (boto3's streaming checksums) or HTTP-chunked.

ETags are not MD5s: each is derived from the file's inode, size and modification time, so it changes whenever the
object is replaced (what ``If-Match`` and the project's "changed since" checks need) and costs no read. No signature is
checked (any credentials pass), no TLS, no versions, no ACLs, no checksums returned: never expose it beyond loopback.

User metadata lives in ``ROOT/.s3meta/BUCKET/KEY.json`` (with the file identity it was written for: a file placed or
replaced by other means has none), multipart uploads under ``ROOT/.s3uploads``; neither is a bucket (bucket names never
start with '.'). :func:`place` and :func:`place_tree` put files into a bucket without HTTP (a hard link where the
source is on the same file system, else a copy), with metadata if given.

``GET /.s3-file-server/stats`` (not S3) answers this server's counters as JSON: requests per operation, bytes sent and
received; benchmarks read it around each load to say how many bytes each client fetched.

Run it (``--port 0`` picks a free port; the first line printed names the endpoint)::

    python -m marlin_pack.testing.s3_file_server /dev/shm/s3 --port 9000 --bucket bench

then point clients at it: ``AWS_ENDPOINT_URL=http://127.0.0.1:9000`` with any ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION=us-east-1`` (Run:ai's client needs a region with an endpoint) and
``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0`` (:func:`client_env`). Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import email.utils
import errno
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

__all__ = ["S3FileServer", "client_env", "place", "place_tree", "etag_of"]

_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
META_DIR = ".s3meta"
UPLOADS_DIR = ".s3uploads"
TMP_PREFIX = ".s3tmp-"
STATS_PATH = "/.s3-file-server/stats"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_CHUNK = 8 << 20


class S3Error(Exception):
    """An S3 error answer: HTTP status, S3's code, message."""

    def __init__(self, status: int, code: str, message: str, **extra: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def _identity(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def etag_of(st: os.stat_result) -> str:
    """An object's ETag (quoted, as S3 sends it): from its file's inode, size and mtime, so it changes with the object."""
    return '"' + hashlib.md5(_identity(st).encode(), usedforsecurity=False).hexdigest() + '"'


def _http_date(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts) or "\x00" in key:
        raise S3Error(400, "InvalidArgument", f"this server keeps objects as files: the key {key!r} names none", Key=key)


def _meta_path(root: Path, bucket: str, key: str) -> Path:
    return root / META_DIR / bucket / f"{key}.json"


def _write_meta(root: Path, bucket: str, key: str, st: os.stat_result, metadata: dict[str, str], content_type: str | None) -> None:
    path = _meta_path(root, bucket, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}")
    tmp.write_text(json.dumps({"identity": _identity(st), "metadata": metadata, "content_type": content_type}))
    os.replace(tmp, path)


def _read_meta(root: Path, bucket: str, key: str, st: os.stat_result) -> tuple[dict[str, str], str | None]:
    try:
        data = json.loads(_meta_path(root, bucket, key).read_text())
    except (OSError, ValueError):
        return {}, None
    if data.get("identity") != _identity(st):  # written for another file at this key: not this object's
        return {}, None
    return dict(data.get("metadata") or {}), data.get("content_type")


def place(root: str | os.PathLike[str], bucket: str, key: str, source: str | os.PathLike[str], *,
          metadata: dict[str, str] | None = None, link: bool = True) -> int:
    """Put the file ``source`` into ``ROOT/BUCKET`` as the object ``key`` without HTTP: a hard link where ``link`` and
    the source is on the same file system, else a copy (written beside it, then renamed). ``metadata``: the object's
    user metadata (``x-amz-meta-*``). Returns its size."""
    _check_key(key)
    root = Path(root)
    dest = root / bucket / key
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}")
    linked = False
    if link:
        try:
            os.link(source, tmp)
            linked = True
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    if not linked:
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
    st = dest.stat()
    if metadata:
        _write_meta(root, bucket, key, st, dict(metadata), None)
    return st.st_size


def place_tree(root: str | os.PathLike[str], bucket: str, prefix: str, source: str | os.PathLike[str], *,
               exclude: tuple[str, ...] = (), link: bool = True) -> int:
    """Every file under the directory ``source`` as ``PREFIX/relative path`` (:func:`place`), but the top-level entries
    named in ``exclude`` and hidden files. Returns the bytes placed."""
    source = Path(source)
    total = 0
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (here == source and d in exclude))
        for name in sorted(filenames):
            if name.startswith(".") or (here == source and name in exclude):
                continue
            rel = (here / name).relative_to(source).as_posix()
            total += place(root, bucket, f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel, here / name, link=link)
    return total


def client_env(endpoint: str) -> dict[str, str]:
    """The environment that points boto3, Run:ai's streamer and vLLM's ``runai_streamer`` at ``endpoint`` (any keys:
    nothing is checked; a region, which Run:ai's client needs with an endpoint; path-style addressing; no instance
    metadata lookups)."""
    return {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local-secret",
        "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }


class _Body:
    """A request's body as sent (``Content-Length`` or HTTP-chunked), decoded from ``aws-chunked`` where it is."""

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        h = handler.headers
        self._rfile: BinaryIO = handler.rfile  # type: ignore[assignment]
        self._http_chunked = "chunked" in (h.get("Transfer-Encoding") or "").lower()
        self._left = int(h.get("Content-Length") or 0) if not self._http_chunked else 0
        self._chunk_left = 0  # HTTP chunked: bytes left of the current chunk
        self._http_done = False
        sha = h.get("x-amz-content-sha256") or ""
        self._aws = "aws-chunked" in (h.get("Content-Encoding") or "").lower() or sha.startswith("STREAMING-")
        self._aws_left = 0
        self._aws_done = False
        self.consumed = False

    # --- the raw body --------------------------------------------------------------------------
    def _raw_readinto(self, mv: memoryview) -> int:
        if not self._http_chunked:
            if self._left == 0:
                return 0
            n = self._rfile.readinto(mv[: min(len(mv), self._left)])  # type: ignore[attr-defined]
            if not n:
                raise S3Error(400, "IncompleteBody", "the request body ended early")
            self._left -= n
            return n
        while self._chunk_left == 0:
            if self._http_done:
                return 0
            line = self._rfile.readline(1024)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self._rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                self._http_done = True
                return 0
            self._chunk_left = size
        n = self._rfile.readinto(mv[: min(len(mv), self._chunk_left)])  # type: ignore[attr-defined]
        if not n:
            raise S3Error(400, "IncompleteBody", "the request body ended early")
        self._chunk_left -= n
        if self._chunk_left == 0:
            self._rfile.readline(16)  # the chunk's CRLF
        return n

    def _raw_line(self) -> bytes:
        out = bytearray()
        one = memoryview(bytearray(1))
        while not out.endswith(b"\r\n"):
            if self._raw_readinto(one) == 0 or len(out) > 4096:
                raise S3Error(400, "IncompleteBody", "an aws-chunked body ended early")
            out += one
        return bytes(out[:-2])

    def readinto(self, mv: memoryview) -> int:
        """Up to ``len(mv)`` bytes of the decoded body; 0 at its end."""
        if not self._aws:
            n = self._raw_readinto(mv)
            self.consumed = n == 0
            return n
        while self._aws_left == 0:
            if self._aws_done:
                self.consumed = True
                return 0
            size = int(self._raw_line().split(b";")[0] or b"0", 16)
            if size == 0:
                while self._raw_line():  # trailing checksums, then the empty line
                    pass
                self._aws_done = True
                continue
            self._aws_left = size
        n = self._raw_readinto(mv[: min(len(mv), self._aws_left)])
        self._aws_left -= n
        if self._aws_left == 0:
            self._raw_line()  # the chunk's CRLF
        return n

    def read_all(self, limit: int = 64 << 20) -> bytes:
        out = bytearray()
        buf = memoryview(bytearray(1 << 16))
        while n := self.readinto(buf):
            out += buf[:n]
            if len(out) > limit:
                raise S3Error(400, "EntityTooLarge", "this request's body is too large")
        return bytes(out)

    def to_file(self, fd: int) -> int:
        buf = memoryview(bytearray(_CHUNK))
        total = 0
        while n := self.readinto(buf):
            view = buf[:n]
            while view:
                w = os.write(fd, view)
                view = view[w:]
            total += n
        return total


@dataclass
class _Entry:
    key: str
    size: int = 0
    mtime: float = 0.0
    etag: str = ""
    common: bool = False  # a CommonPrefixes entry


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "s3-file-server"
    sys_version = ""
    server: _Server  # type: ignore[assignment]
    timeout = 600  # an idle connection's thread ends after this

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    # --- dispatch ------------------------------------------------------------------------------
    def _target(self) -> tuple[str, str, dict[str, str]]:
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        path = unquote(url.path)
        host = self.headers.get("Host") or ""
        host = host.rsplit(":", 1)[0] if not host.startswith("[") else host
        bucket = self.server.virtual_bucket(host)
        if bucket is not None:
            return bucket, path.lstrip("/"), query
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key, query

    def _run(self, method: str) -> None:
        self._body: _Body | None = None
        self._counted = False
        self._op = method
        try:
            if method == "GET" and urlsplit(self.path).path == STATS_PATH:
                self._op = "Stats"
                return self._send_json(self.server.snapshot())
            bucket, key, q = self._target()
            if method in ("PUT", "POST"):
                self._body = _Body(self)
            if not bucket:
                self._op = "ListBuckets"
                if method != "GET":
                    raise S3Error(405, "MethodNotAllowed", f"{method} of the service")
                return self._list_buckets()
            if not _BUCKET.fullmatch(bucket):
                raise S3Error(400, "InvalidBucketName", f"{bucket!r} is not a bucket name", BucketName=bucket)
            bdir = self.server.root / bucket
            if not key:
                self._op, action = {
                    ("GET", True): ("ListObjectsV2", self._list), ("GET", False): ("ListObjects", self._list),
                    ("HEAD", True): ("HeadBucket", self._head_bucket), ("HEAD", False): ("HeadBucket", self._head_bucket),
                    ("PUT", True): ("CreateBucket", self._create_bucket), ("PUT", False): ("CreateBucket", self._create_bucket),
                    ("DELETE", True): ("DeleteBucket", self._delete_bucket),
                    ("DELETE", False): ("DeleteBucket", self._delete_bucket),
                }.get((method, q.get("list-type") == "2"), ("Unsupported", None))
                if method == "GET" and "location" in q:
                    self._op, action = "GetBucketLocation", self._location
                if action is None:
                    raise S3Error(501, "NotImplemented", f"{method} of a bucket with {sorted(q)} is not served here")
                if self._op != "CreateBucket" and not bdir.is_dir():
                    raise S3Error(404, "NoSuchBucket", f"no bucket {bucket}", BucketName=bucket)
                return action(bucket, bdir, q)
            _check_key(key)
            if not bdir.is_dir():
                raise S3Error(404, "NoSuchBucket", f"no bucket {bucket}", BucketName=bucket)
            if method in ("GET", "HEAD"):
                self._op = "GetObject" if method == "GET" else "HeadObject"
                return self._get(bucket, key, bdir / key, head=method == "HEAD")
            if method == "PUT" and "uploadId" in q:
                self._op = "UploadPart"
                return self._upload_part(bucket, key, q)
            if method == "PUT":
                if "x-amz-copy-source" in self.headers:
                    raise S3Error(501, "NotImplemented", "CopyObject is not served here")
                self._op = "PutObject"
                return self._put(bucket, key, bdir / key)
            if method == "POST" and "uploads" in q:
                self._op = "CreateMultipartUpload"
                return self._create_upload(bucket, key)
            if method == "POST" and "uploadId" in q:
                self._op = "CompleteMultipartUpload"
                return self._complete_upload(bucket, key, bdir / key, q["uploadId"])
            if method == "DELETE" and "uploadId" in q:
                self._op = "AbortMultipartUpload"
                return self._abort_upload(q["uploadId"])
            if method == "DELETE":
                self._op = "DeleteObject"
                return self._delete(bucket, key, bdir / key)
            raise S3Error(501, "NotImplemented", f"{method} of an object with {sorted(q)} is not served here")
        except S3Error as e:
            self._send_error(e, head=method == "HEAD")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - one answer for anything unexpected, and the server goes on
            self._send_error(S3Error(500, "InternalError", f"{type(e).__name__}: {e}"), head=method == "HEAD")
        finally:
            self._count_once()  # (a request answered before it was counted is counted here)

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._run("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._run("HEAD")

    def do_PUT(self) -> None:  # noqa: N802
        self._run("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._run("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._run("DELETE")

    def _count_once(self) -> None:
        """Count this request's operation in the server's stats, once: before its answer goes out, so that a client
        reading the stats after the answer finds it counted."""
        if not self._counted:
            self._counted = True
            self.server.count(self._op)

    # --- answers -------------------------------------------------------------------------------
    def _headers(self, status: int, headers: dict[str, str], length: int) -> None:
        self._count_once()
        if self._body is not None and not self._body.consumed:
            self.close_connection = True  # a body left unread: this connection cannot carry another request
            headers = {**headers, "Connection": "close"}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
        self.end_headers()

    def _send_bytes(self, status: int, body: bytes, content_type: str, counted: bool = True) -> None:
        self._headers(status, {"Content-Type": content_type}, len(body))
        self.wfile.write(body)
        if counted:
            self.server.count_bytes(sent=len(body))

    def _send_xml(self, status: int, xml: str) -> None:
        self._send_bytes(status, ('<?xml version="1.0" encoding="UTF-8"?>\n' + xml).encode(), "application/xml")

    def _send_json(self, obj: object) -> None:
        self._send_bytes(200, json.dumps(obj).encode(), "application/json", counted=False)  # the counters' own reads: not counted

    def _send_error(self, e: S3Error, head: bool = False) -> None:
        extra = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in e.extra.items())
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{e.code}</Code><Message>{escape(e.message)}</Message>'
                f"{extra}</Error>").encode()
        headers = {"Content-Type": "application/xml"}
        if e.code == "InvalidRange" and "size" in e.extra:
            headers["Content-Range"] = f"bytes */{e.extra.pop('size')}"
        try:
            self._headers(e.status, headers, 0 if head else len(body))
            if not head:
                self.wfile.write(body)
        except OSError:
            self.close_connection = True

    # --- objects -------------------------------------------------------------------------------
    def _get(self, bucket: str, key: str, path: Path, head: bool) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after sendfile
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", Key=key) from e
        with f:
            st = os.fstat(f.fileno())
            if not os.path.isfile(path):
                raise S3Error(404, "NoSuchKey", "The specified key does not exist.", Key=key)
            etag = etag_of(st)
            match = self.headers.get("If-Match")
            if match and match.strip() != "*" and etag not in [m.strip() for m in match.split(",")]:
                raise S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold",
                              Condition="If-Match")
            none_match = self.headers.get("If-None-Match")
            if none_match and (none_match.strip() == "*" or etag in [m.strip() for m in none_match.split(",")]):
                self._headers(304, {"ETag": etag}, 0)
                return
            size = st.st_size
            start, length, status = 0, size, 200
            rng = self.headers.get("Range")
            if rng:
                start, length = _parse_range(rng, size)
                status = 206
            metadata, content_type = _read_meta(self.server.root, bucket, key, st)
            headers = {"Content-Type": content_type or "application/octet-stream", "ETag": etag,
                       "Last-Modified": _http_date(st.st_mtime), "Accept-Ranges": "bytes",
                       **{f"x-amz-meta-{k}": v for k, v in metadata.items()}}
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{start + length - 1}/{size}"
            self._headers(status, headers, length)
            if head or length == 0:
                return
            sent = self.connection.sendfile(f, start, length)
            self.server.count_bytes(sent=sent)
            if sent != length:  # the file shrank meanwhile: the client sees a short body, and this connection ends
                self.close_connection = True

    def _receive(self, dest_dir: Path) -> tuple[Path, os.stat_result]:
        """The request's body into a new temporary file in ``dest_dir`` (the caller renames it into place)."""
        assert self._body is not None
        dest_dir.mkdir(parents=True, exist_ok=True)
        tmp = dest_dir / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            n = self._body.to_file(fd)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.server.count_bytes(received=n)
        return tmp, st

    def _user_metadata(self) -> dict[str, str]:
        return {k.lower()[len("x-amz-meta-"):]: v for k, v in self.headers.items() if k.lower().startswith("x-amz-meta-")}

    def _put(self, bucket: str, key: str, path: Path) -> None:
        if path.is_dir():
            raise S3Error(400, "InvalidArgument", f"{key!r} is a folder of other objects here")
        tmp, st = self._receive(path.parent)
        try:
            _write_meta(self.server.root, bucket, key, st, self._user_metadata(), self.headers.get("Content-Type"))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._headers(200, {"ETag": etag_of(st)}, 0)

    def _delete(self, bucket: str, key: str, path: Path) -> None:
        try:
            if path.is_file():
                path.unlink()
        except FileNotFoundError:
            pass
        _meta_path(self.server.root, bucket, key).unlink(missing_ok=True)
        bdir = self.server.root / bucket
        for d in path.parents:  # folders the object left empty (S3 has no folders)
            if d == bdir or not d.is_relative_to(bdir):
                break
            try:
                d.rmdir()
            except OSError:
                break
        self._headers(204, {}, 0)

    # --- multipart uploads ---------------------------------------------------------------------
    def _upload_dir(self, upload_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id) or not (d := self.server.root / UPLOADS_DIR / upload_id).is_dir():
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist.", UploadId=upload_id)
        return d

    def _create_upload(self, bucket: str, key: str) -> None:
        upload_id = uuid.uuid4().hex
        d = self.server.root / UPLOADS_DIR / upload_id
        d.mkdir(parents=True)
        (d / "info.json").write_text(json.dumps({"bucket": bucket, "key": key, "metadata": self._user_metadata(),
                                                 "content_type": self.headers.get("Content-Type")}))
        assert self._body is not None
        self._body.read_all()
        self._send_xml(200, f'<InitiateMultipartUploadResult xmlns="{_NS}"><Bucket>{escape(bucket)}</Bucket>'
                            f"<Key>{escape(key)}</Key><UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>")

    def _upload_part(self, bucket: str, key: str, q: dict[str, str]) -> None:
        d = self._upload_dir(q["uploadId"])
        try:
            number = int(q.get("partNumber", ""))
        except ValueError:
            number = 0
        if not 1 <= number <= 10000:
            raise S3Error(400, "InvalidArgument", "partNumber must be 1 to 10000")
        tmp, st = self._receive(d)
        os.replace(tmp, d / f"part-{number:05d}")
        etag = '"' + hashlib.md5(f"{q['uploadId']}-{number}-{st.st_size}".encode(), usedforsecurity=False).hexdigest() + '"'
        (d / f"part-{number:05d}.etag").write_text(etag)
        self._headers(200, {"ETag": etag}, 0)

    def _complete_upload(self, bucket: str, key: str, path: Path, upload_id: str) -> None:
        d = self._upload_dir(upload_id)
        assert self._body is not None
        try:
            doc = ElementTree.fromstring(self._body.read_all())
        except ElementTree.ParseError as e:
            raise S3Error(400, "MalformedXML", f"CompleteMultipartUpload: {e}") from e
        parts = []
        for part in doc.iter():
            if part.tag.rsplit("}", 1)[-1] != "Part":
                continue
            fields = {c.tag.rsplit("}", 1)[-1]: (c.text or "").strip() for c in part}
            parts.append((int(fields.get("PartNumber", "0")), fields.get("ETag", "")))
        if not parts or [n for n, _ in parts] != sorted({n for n, _ in parts}):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.")
        for n, etag in parts:
            file = d / f"part-{n:05d}"
            if not file.is_file() or (etag and (d / f"part-{n:05d}.etag").read_text().strip('"') != etag.strip('"')):
                raise S3Error(400, "InvalidPart", f"part {n} was not uploaded, or its ETag differs")
        info = json.loads((d / "info.json").read_text())
        if path.is_dir():
            raise S3Error(400, "InvalidArgument", f"{key!r} is a folder of other objects here")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            for n, _ in parts:  # joined in order, each part removed once in: the upload never holds twice its size
                file = d / f"part-{n:05d}"
                with open(file, "rb") as f:
                    _copy_fd(f.fileno(), out, os.fstat(f.fileno()).st_size)
                file.unlink()
            st = os.fstat(out)
        except BaseException:
            os.close(out)
            tmp.unlink(missing_ok=True)
            raise
        os.close(out)
        _write_meta(self.server.root, bucket, key, st, info["metadata"], info.get("content_type"))
        os.replace(tmp, path)
        shutil.rmtree(d, ignore_errors=True)
        self._send_xml(200, f'<CompleteMultipartUploadResult xmlns="{_NS}"><Location>/{escape(bucket)}/{escape(key)}</Location>'
                            f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key><ETag>{escape(etag_of(st))}</ETag>"
                            "</CompleteMultipartUploadResult>")

    def _abort_upload(self, upload_id: str) -> None:
        shutil.rmtree(self._upload_dir(upload_id), ignore_errors=True)
        self._headers(204, {}, 0)

    # --- buckets -------------------------------------------------------------------------------
    def _list_buckets(self) -> None:
        root = self.server.root
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and _BUCKET.fullmatch(p.name))
        items = "".join(f"<Bucket><Name>{n}</Name><CreationDate>{_iso((root / n).stat().st_mtime)}</CreationDate></Bucket>"
                        for n in names)
        self._send_xml(200, f'<ListAllMyBucketsResult xmlns="{_NS}"><Owner><ID>local</ID><DisplayName>local</DisplayName>'
                            f"</Owner><Buckets>{items}</Buckets></ListAllMyBucketsResult>")

    def _head_bucket(self, bucket: str, bdir: Path, q: dict[str, str]) -> None:
        self._headers(200, {"x-amz-bucket-region": "us-east-1"}, 0)

    def _location(self, bucket: str, bdir: Path, q: dict[str, str]) -> None:
        self._send_xml(200, f'<LocationConstraint xmlns="{_NS}"></LocationConstraint>')

    def _create_bucket(self, bucket: str, bdir: Path, q: dict[str, str]) -> None:
        assert self._body is not None
        self._body.read_all()
        bdir.mkdir(parents=True, exist_ok=True)
        self._headers(200, {"Location": f"/{bucket}"}, 0)

    def _delete_bucket(self, bucket: str, bdir: Path, q: dict[str, str]) -> None:
        if any(_walk(bdir, "")):
            raise S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty", BucketName=bucket)
        shutil.rmtree(bdir)
        shutil.rmtree(self.server.root / META_DIR / bucket, ignore_errors=True)
        self._headers(204, {}, 0)

    def _list(self, bucket: str, bdir: Path, q: dict[str, str]) -> None:
        v2 = q.get("list-type") == "2"
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        try:
            max_keys = max(0, min(1000, int(q.get("max-keys", "1000"))))
        except ValueError as e:
            raise S3Error(400, "InvalidArgument", "max-keys must be a number") from e
        after = q.get("start-after", "") if v2 else q.get("marker", "")
        if v2 and q.get("continuation-token"):
            try:
                after = base64.urlsafe_b64decode(q["continuation-token"].encode()).decode()
            except ValueError as e:
                raise S3Error(400, "InvalidArgument", "The continuation token provided is incorrect") from e
        entries: list[_Entry] = []
        seen: set[str] = set()
        for key, st in _walk(bdir, prefix):
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest[: rest.index(delimiter) + len(delimiter)]
                if common not in seen:
                    seen.add(common)
                    entries.append(_Entry(common, common=True))
                continue
            entries.append(_Entry(key, st.st_size, st.st_mtime, etag_of(st)))
        entries.sort(key=lambda e: e.key)
        entries = [e for e in entries if e.key > after]
        page, truncated = entries[:max_keys], len(entries) > max_keys
        contents = "".join(
            f"<Contents><Key>{escape(e.key)}</Key><LastModified>{_iso(e.mtime)}</LastModified><ETag>{escape(e.etag)}</ETag>"
            f"<Size>{e.size}</Size><StorageClass>STANDARD</StorageClass></Contents>" for e in page if not e.common)
        commons = "".join(f"<CommonPrefixes><Prefix>{escape(e.key)}</Prefix></CommonPrefixes>" for e in page if e.common)
        head = (f'<ListBucketResult xmlns="{_NS}"><Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>'
                f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
        if delimiter:
            head += f"<Delimiter>{escape(delimiter)}</Delimiter>"
        if v2:
            head += f"<KeyCount>{len(page)}</KeyCount>"
            if q.get("continuation-token"):
                head += f"<ContinuationToken>{escape(q['continuation-token'])}</ContinuationToken>"
            if q.get("start-after"):
                head += f"<StartAfter>{escape(q['start-after'])}</StartAfter>"
            if truncated:
                token = base64.urlsafe_b64encode(page[-1].key.encode()).decode()
                head += f"<NextContinuationToken>{token}</NextContinuationToken>"
        else:
            head += f"<Marker>{escape(after)}</Marker>"
            if truncated:
                head += f"<NextMarker>{escape(page[-1].key)}</NextMarker>"
        self._send_xml(200, f"{head}{contents}{commons}</ListBucketResult>")


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """(start, length) of a single ``bytes=`` range of an object of ``size`` bytes; several ranges are not served."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or (not m.group(1) and not m.group(2)):
        raise S3Error(416, "InvalidRange", f"the range {header!r} is not one this server reads", size=str(size))
    if not m.group(1):  # the last N bytes
        n = int(m.group(2))
        if n == 0 or size == 0:
            raise S3Error(416, "InvalidRange", "The requested range is not satisfiable", size=str(size))
        return max(0, size - n), min(n, size)
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable", size=str(size))
    end = min(end, size - 1)
    return start, end - start + 1


def _walk(bdir: Path, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every object under ``prefix`` (key, stat), from the deepest folder the prefix names."""
    top = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    start = bdir / top if top else bdir
    if not start.is_dir() or (top and any(p in ("", ".", "..") for p in top.split("/"))):
        return
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
        rel = Path(dirpath).relative_to(bdir).as_posix()
        for name in filenames:
            if name.startswith(TMP_PREFIX):
                continue
            key = name if rel == "." else f"{rel}/{name}"
            if key.startswith(prefix):
                try:
                    st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if os.path.isfile(os.path.join(dirpath, name)):
                    yield key, st


def _copy_fd(src: int, dst: int, count: int) -> None:
    """``count`` bytes of ``src`` appended to ``dst`` in the kernel (copy_file_range, else sendfile)."""
    left = count
    while left:
        try:
            n = os.copy_file_range(src, dst, min(left, 1 << 30))
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.sendfile(dst, src, None, min(left, 1 << 30))
        if n == 0:
            raise OSError(f"a multipart part ended {left:,} bytes early")
        left -= n


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # clients open dozens of connections at once

    def __init__(self, root: Path, address: tuple[str, int], verbose: bool) -> None:
        self.root = root
        self.verbose = verbose
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0}
        super().__init__(address, _Handler)

    def count(self, op: str) -> None:
        with self._lock:
            self.stats[op] = self.stats.get(op, 0) + 1

    def count_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.stats["bytes_sent"] += sent
            self.stats["bytes_received"] += received

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    def virtual_bucket(self, host: str) -> str | None:
        """The bucket a virtual-host-style request names (``BUCKET.HOST``), or None (path-style)."""
        if "." not in host or host == "localhost":
            return None
        try:
            ipaddress.ip_address(host.strip("[]"))
            return None
        except ValueError:
            pass
        label = host.split(".", 1)[0]
        return label if _BUCKET.fullmatch(label) and (self.root / label).is_dir() else None


class S3FileServer:
    """The server over ``root`` (created if missing), in threads of this process: ``with S3FileServer(root) as s3:``
    gives it started, at :attr:`endpoint`."""

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = _Server(self.root, (host, port), verbose)
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def stats(self) -> dict[str, int]:
        """Requests per operation (``GetObject``, ``PutObject``, ...), ``bytes_sent``, ``bytes_received``, so far."""
        return self._server.snapshot()

    def create_bucket(self, name: str) -> Path:
        if not _BUCKET.fullmatch(name):
            raise ValueError(f"{name!r} is not a bucket name")
        (self.root / name).mkdir(exist_ok=True)
        return self.root / name

    def env(self) -> dict[str, str]:
        """:func:`client_env` of this server."""
        return client_env(self.endpoint)

    def start(self) -> S3FileServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="s3-file-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.1)

    def __enter__(self) -> S3FileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve a directory as S3 buckets (benchmarks and tests only; see the module's "
                                 "docstring)")
    ap.add_argument("root", type=Path, help="each folder in it is a bucket, each file an object")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (the first line printed names it)")
    ap.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    ap.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = ap.parse_args(argv)
    server = S3FileServer(args.root, args.host, args.port, verbose=args.verbose)
    for name in args.bucket:
        server.create_bucket(name)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"s3-file-server: {server.endpoint} serving {args.root.resolve()}", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        print(f"s3-file-server: {json.dumps(server.stats)}", flush=True)
        server._server.server_close()


if __name__ == "__main__":
    main()
