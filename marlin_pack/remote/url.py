"""Object-storage URLs (``s3://bucket/prefix``, ``gs://bucket/prefix``) told apart from paths, and refused where a path is
expected.

``pathlib.Path("s3://bucket/x")`` is ``s3:/bucket/x``: a relative path whose first folder is ``s3:``. Taken for a
path, ``convert -o s3://bucket/x`` would write a local folder named ``s3:`` and report success, and ``check --bundle
s3://...`` would read it back. Every place that takes a bundle or model path asks :func:`refuse_url` first (the CLI's
words in :mod:`marlin_pack.commands.params`, the loader's ``bundle`` option, the library's ``convert``, the bundle
reader, the model resolver): a URL there is one line naming what was found, what was expected and what to do.

:func:`parse_url` is the one parser of the URLs marlin-pack serves (``s3://`` and ``gs://``: :mod:`marlin_pack.remote`),
used by ``push``, ``check`` and the loader. No client library is imported here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PosixPath

from marlin_pack.errors import MarlinPackError

__all__ = ["SERVED_SCHEMES", "ObjectUrl", "UrlNotPathError", "UrlPath", "parse_url", "refuse_url", "sync_command", "url_scheme", "url_text"]

# Schemes marlin-pack reads and writes (push, check, the loader). gs:// is Google Cloud Storage: application-default
# credentials through Google's client and Run:ai's GCS backend, or with MARLIN_PACK_GCS_HMAC=1 its XML API, which is
# S3's (an HMAC key): marlin_pack.remote.store.
SERVED_SCHEMES = ("s3", "gs")

# "scheme:/" as typed ("s3://b/x") or as a Path leaves it ("s3:/b/x"): a scheme is a letter then letters, digits,
# "+", "-", "." (RFC 3986). A one-letter scheme is not taken (no object store has one).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(/?)(.*)", re.DOTALL)
# S3's bucket naming rules (3-63 characters, lowercase letters, digits, "-" and "."); GCS also takes "_", and dotted
# names up to 222 characters (each dot-separated part at most 63).
_BUCKET = {"s3": re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"), "gs": re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")}
_BUCKET_WORDS = {"s3": "3-63 lowercase letters, digits, '-' and '.'", "gs": "3-63 lowercase letters, digits, '-', '_' and '.'"}


class UrlNotPathError(MarlinPackError, ValueError):
    """An object-storage URL where a local path is expected (or a URL of a scheme marlin-pack does not serve)."""


def url_scheme(value: str | os.PathLike[str] | None) -> str | None:
    """The scheme (lowercase) of ``value`` if it is written as a URL (``s3://...``, or ``s3:/...`` as a Path
    collapses it), else None: a plain path, relative or absolute."""
    if value is None:
        return None
    match = _SCHEME.fullmatch(os.fspath(value))
    return match.group(1).lower() if match else None


def url_text(value: str | os.PathLike[str]) -> str:
    """``value`` as the user wrote it: a Path's ``s3:/bucket/x`` back to ``s3://bucket/x``."""
    text = os.fspath(value)
    match = _SCHEME.fullmatch(text)
    if match is None:
        return text
    return f"{match.group(1)}://{match.group(3)}"


def sync_command(url: str | ObjectUrl) -> str:
    """The command that copies the objects under ``url`` to a local directory (DIR follows it): ``gcloud storage rsync
    -r gs://...`` for GCS, ``aws s3 sync s3://...`` otherwise."""
    text = str(url)
    if url_scheme(text) == "gs":
        return f"gcloud storage rsync -r {text}"
    return f"aws s3 sync {text}"


def refuse_url(value: str | os.PathLike[str] | None, what: str, expected: str, todo: str) -> None:
    """Raise :class:`UrlNotPathError` if ``value`` is a URL: ``{what} {url} is an object-storage URL, not {expected};
    {todo}``. Nothing else is checked: a plain path passes as it is.

    Args:
        what: the word the user gave it as (``-o``, ``--bundle``, ``MODEL``, ``the bundle``).
        expected: what is expected there (``a directory``).
        todo: what to do instead, naming the command: ``{url}`` in it is replaced by the URL, ``{sync}`` by the command
            that copies it down (:func:`sync_command`, which DIR follows).
    """
    if url_scheme(value) is None:
        return
    assert value is not None
    url = url_text(value)
    raise UrlNotPathError(f"{what} {url} is an object-storage URL, not {expected}; {todo.format(url=url, sync=sync_command(url))}")


@dataclass(frozen=True)
class ObjectUrl:
    """``scheme://bucket/prefix``: where a bundle lives in object storage. ``prefix`` has no leading or trailing
    ``/`` (empty: the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        """The object key of ``name`` (a bundle-relative path, ``tp2/rank-1.safetensors``) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        """``s3://bucket/prefix/name``: the object as the user names it (messages)."""
        return f"{self.scheme}://{self.bucket}/{self.key(name)}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def parse_url(value: str | os.PathLike[str]) -> ObjectUrl:
    """``s3://bucket/prefix`` or ``gs://bucket/prefix`` as an :class:`ObjectUrl`.

    Raises:
        UrlNotPathError: not a URL, a scheme marlin-pack does not serve, a malformed bucket, or a prefix with empty,
            ``.`` or ``..`` segments (a key that means another place on each client).
    """
    text = url_text(value)
    match = _SCHEME.fullmatch(text)
    served = " or ".join(f"{s}://BUCKET/PREFIX" for s in SERVED_SCHEMES)
    if match is None or not match.group(2):
        raise UrlNotPathError(f"{text!r} is not an object-storage URL; expected {served}")
    scheme = match.group(1).lower()
    if scheme not in SERVED_SCHEMES:
        raise UrlNotPathError(f"{text}: marlin-pack reads and writes bundles at {served}, not {scheme}://; copy the bundle to "
                              "one of those or to a local directory")
    bucket, _, prefix = match.group(3).partition("/")
    if not _BUCKET[scheme].fullmatch(bucket) or ".." in bucket or any(len(part) > 63 for part in bucket.split(".")):
        raise UrlNotPathError(f"{text}: bucket {bucket!r} is not a bucket name ({_BUCKET_WORDS[scheme]}); expected {served}")
    prefix = prefix.rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise UrlNotPathError(f"{text}: the prefix {prefix!r} has an empty, '.' or '..' segment; write it without them")
    if any(ord(c) < 0x20 or c == "\x7f" for c in prefix):
        raise UrlNotPathError(f"{text}: the prefix has control characters; write it without them")
    return ObjectUrl(scheme, bucket, prefix)


class UrlPath(PosixPath):
    """A bundle object named by its URL where the loader expects a path (its messages, the reader's held files): ``str``
    is the URL as written (``s3://bucket/prefix/tp1/rank-0.safetensors``). Nothing opens it: the copy is streamed."""

    _url: str

    @classmethod
    def of(cls, url: str) -> UrlPath:
        path = cls(url)
        path._url = url
        return path

    def __str__(self) -> str:
        return getattr(self, "_url", None) or super().__str__()

    def __fspath__(self) -> str:
        return str(self)
