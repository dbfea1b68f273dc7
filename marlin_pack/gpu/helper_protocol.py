"""The lines a copy helper (:mod:`.helper_main`) and its parent (:mod:`.helpers`) speak over the helper's pipes.

Standard library only: the helper imports this as a sibling module under ``python -S``.

One JSON object per line:

* helper -> parent, once: ``{"ready": true, "protocol": PROTOCOL}`` after creating its CUDA context, or
  ``{"error": ...}`` (then it exits);
* parent -> helper, a job: ``{"parts": [{"file": PATH, "windows": [[LO, HI, [[FILE_OFFSET, NBYTES,
  HANDLE_INDEX, DEST_OFFSET], ...]], ...]}, ...], "handles": [HEX, ...], "threads": T}``: each window's
  pages ``[LO, HI)`` of its part's file are page-locked in place (read-only) and its pieces copied to
  ``DEST_OFFSET`` bytes into the allocation of ``handles[HANDLE_INDEX]`` (a ``cuIpcGetMemHandle``). The
  threads take the windows of every part from one queue, so a job of two files has no pause between them.
  Answered ``{"ok": BYTES}`` once every copy has completed, or ``{"error": ...}``;
* parent -> helper: ``{"retain": [{"file": PATH, "ranges": [[LO, HI], ...]}, ...]}``: page-lock those ranges
  now and keep them registered (with their file maps) until ``end`` or the end of input; a later job's
  window inside one of them is copied without page-locking. Answered ``{"ok": BYTES}`` (newly retained);
* parent -> helper: ``{"end": true}``, answered ``{"closed": true}`` once the helper's IPC mappings of the
  parent's memory are closed and its retained pages unregistered. The helper stays alive (its CUDA context
  too) until its input ends; at the end of input it closes everything and exits.

Every line a helper reads is untrusted input, answered and never fatal: a line longer than :data:`MAX_LINE`
(skipped up to its newline), one that is not UTF-8 JSON of an object, a job or ``retain`` line that is not
the shape above (:func:`check_job`, :func:`check_retain`), a file that is not a regular one or ranges
outside it: each is answered ``{"error": "RequestError: ..."}`` before any driver call, and the next line
is read as usual. A parent reads each reply whole under one deadline (:func:`read_reply`).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import time
from collections.abc import Callable, Sequence

PAGE = os.sysconf("SC_PAGE_SIZE")
# Bumped when the lines change meaning. 2: pipes only; "retain" without a budget; "end" also unregisters retained pages.
PROTOCOL = 2
# Set for every helper. One hardware work queue per helper context instead of 8: creating and tearing down the
# queues is what slows the engine's own CUDA calls while helpers start and exit (4 helpers beside a model's
# construction on an H200: +0.42 s -> +0.18 s; copies lose nothing).
HELPER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# The longest line either side reads, newline included. A job line lists every piece of a helper's share at ~45
# bytes a piece: 130k destination pieces (a MoE bundle stored per expert) need ~6 MB with one helper; 32 MiB is
# five times that, while a line that never ends costs a helper at most this much instead of growing it unbounded.
MAX_LINE = 32 << 20
READ_CHUNK = 1 << 20  # bytes asked of the kernel per read: a job line comes in a few reads
MAX_THREADS = 64  # copy threads a job may ask for: the loader's io_threads option allows 1..64
HANDLE_HEX = 128  # a cuIpcGetMemHandle handle: 64 bytes, as hex digits

__all__ = [
    "HELPER_ENV", "MAX_LINE", "MAX_THREADS", "PAGE", "PROTOCOL", "LineReader", "LineTooLong", "RequestError",
    "check_job", "check_retain", "next_request", "parse_line", "read_reply", "retain_shares",
]


class RequestError(ValueError):
    """A request the helper refuses before any driver call (not UTF-8 or JSON, malformed, out of range, naming no
    regular file): answered with an ``{"error": ...}`` line, never fatal."""


class LineTooLong(RequestError):
    """A line longer than the reader's limit: its bytes are skipped up to its newline, the next line is read as usual."""


class LineReader:
    """Lines of bytes read from the file descriptor ``fd`` (a pipe), each at most ``limit`` bytes (default
    :data:`MAX_LINE`), with one deadline over every read of a line.

    A line is read here and not through a buffered file: ``select`` on a file object says only that *some*
    byte came, after which its ``readline`` blocks until the newline (a peer sending half a line held it
    forever), and it buffers lines that ``select`` then no longer sees. Never more than ``limit`` bytes of
    one line are held: a longer line raises :class:`LineTooLong` and the rest of it is skipped.
    """

    def __init__(self, fd: int, limit: int | None = None) -> None:
        self.fd = fd
        self.limit = MAX_LINE if limit is None else limit
        self.buf = bytearray()
        self.scanned = 0  # bytes of buf known to hold no newline
        self.skipping = False  # inside a line found too long: its bytes are dropped up to its newline
        self.eof = False

    def readline(self, deadline: float | None = None) -> bytes:
        """The next line with its newline; the bytes left without one when the input ends; ``b""`` after that.

        Raises :class:`TimeoutError` when ``deadline`` (``time.monotonic()``; None: none) passes first (what
        came of the line is kept for the next call), :class:`LineTooLong` for a line over the limit.
        """
        while True:
            line = self._take_line()
            if line is not None:
                return line
            if self.eof:
                rest, self.skipping = (b"" if self.skipping else bytes(self.buf)), False
                self.buf.clear()
                self.scanned = 0
                return rest
            self._fill(deadline)

    def _take_line(self) -> bytes | None:
        """A whole line out of the buffer, or None; drops a line being skipped, raises on one that grew too long."""
        while True:
            nl = self.buf.find(b"\n", self.scanned)
            if nl < 0:
                break
            line = bytes(self.buf[: nl + 1])
            del self.buf[: nl + 1]
            self.scanned = 0
            if self.skipping:
                self.skipping = False
                continue
            if len(line) > self.limit:
                raise LineTooLong(f"a line of {len(line)} bytes, longer than the protocol's {self.limit}")
            return line
        self.scanned = len(self.buf)
        if self.skipping:
            self.buf.clear()
            self.scanned = 0
        elif len(self.buf) > self.limit:
            self.buf.clear()
            self.scanned = 0
            self.skipping = True
            raise LineTooLong(f"a line longer than the protocol's {self.limit} bytes (skipped up to its newline)")
        return None

    def _fill(self, deadline: float | None) -> None:
        """One read into the buffer, once ``fd`` is readable (by ``deadline``, else :class:`TimeoutError`)."""
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise TimeoutError("no whole line in time")
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise TimeoutError("no whole line in time")
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:  # a non-blocking descriptor that select woke spuriously
            return
        if chunk:
            self.buf += chunk
        else:
            self.eof = True


def parse_line(line: bytes) -> dict:
    """A protocol line as a JSON object; :class:`RequestError` when it is not UTF-8, not JSON or not an object."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(f"a line that is not UTF-8 (byte {e.start}: {line[e.start : e.start + 1]!r})") from None
    except ValueError as e:  # json.JSONDecodeError, an integer of too many digits
        raise RequestError(f"a line that is not JSON ({e})") from None
    except RecursionError:  # arrays nested deeper than the decoder goes
        raise RequestError("a line of JSON nested too deep") from None
    if not isinstance(obj, dict):
        raise RequestError(f"a line that is not a JSON object ({type(obj).__name__})")
    return obj


def next_request(reader: LineReader) -> tuple[dict | None, dict | None]:
    """The next request line as ``(request, None)``; ``(None, {"error": ...})`` for a line that is none (too long, not
    UTF-8, not a JSON object: the reply to send before reading on); ``(None, None)`` at the end of input."""
    try:
        line = reader.readline()
    except LineTooLong as e:
        return None, {"error": f"RequestError: {e}"}
    if not line:
        return None, None
    try:
        return parse_line(line), None
    except RequestError as e:
        return None, {"error": f"RequestError: {e}"}


def read_reply(reader: LineReader, deadline: float | None, gone_why: Callable[[], str]) -> dict:
    """A helper's next line as a dict; ``{"error": ...}`` when the whole line has not come by ``deadline`` (None:
    wait), it is too long or not a JSON object, or the helper's output ended (``gone_why()`` says why).

    ``deadline`` bounds every read until the newline: a helper that says half a line is given up on then.
    """
    try:
        line = reader.readline(deadline)
    except TimeoutError:
        return {"error": "no answer in time"}
    except LineTooLong as e:
        return {"error": f"unreadable answer: {e}"}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not line:
        return {"error": gone_why()}
    try:
        return parse_line(line)
    except ValueError:
        return {"error": f"unreadable answer {line[:80]!r}"}


def _int(value: object, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float) in ``lo..hi``; :class:`RequestError` otherwise."""
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise RequestError(f"{what} must be an integer {bounds}, not {str(value)[:40]!r}")
    return value


def _list(value: object, what: str, length: int | None = None) -> list:
    """``value`` if it is a JSON array (of ``length`` items, when given); :class:`RequestError` otherwise."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise RequestError(f"{what} must be an array{f' of {length}' if length is not None else ''}, not {str(value)[:40]!r}")
    return value


def _file(part: object, what: str) -> str:
    """A part's ``"file"``: a non-empty path without NUL bytes."""
    if not isinstance(part, dict):
        raise RequestError(f"{what} must be an object")
    file = part.get("file")
    if not isinstance(file, str) or not file or "\0" in file:
        raise RequestError(f"{what}: \"file\" must be a path, not {str(file)[:40]!r}")
    return file


def _disjoint_pages(ranges: list[tuple[int, int]], what: str) -> None:
    """Refuse ranges of one file that share a page: registering a page twice fails in the driver."""
    ordered = sorted(ranges)
    for (_, hi), (lo, _) in itertools.pairwise(ordered):
        if -(-hi // PAGE) > lo // PAGE:
            raise RequestError(f"{what}: ranges ending at {hi} and starting at {lo} share a page")


def check_job(job: dict) -> None:
    """Refuse a job line that is not the protocol's (:class:`RequestError`), before any file or driver call:
    integers where integers go, every window ``0 <= LO < HI`` with no page shared with another window of its
    file, every piece inside its window, every handle index naming a handle of the job (each ``HANDLE_HEX``
    hex digits), ``DEST_OFFSET >= 0``, ``threads`` in ``0..MAX_THREADS``. That the windows lie inside their
    files is checked once they are open, that the pieces fit their allocations once the handles are."""
    handles = _list(job.get("handles"), "\"handles\"")
    for h in handles:
        if not isinstance(h, str) or len(h) != HANDLE_HEX or any(c not in "0123456789abcdefABCDEF" for c in h):
            raise RequestError(f"a handle must be {HANDLE_HEX} hex digits, not {str(h)[:40]!r}")
    _int(job.get("threads"), "\"threads\"", 0, MAX_THREADS)
    for k, part in enumerate(_list(job.get("parts"), "\"parts\"")):
        what = f"part {k}"
        _file(part, what)
        spans = []
        for window in _list(part.get("windows"), f"{what}: \"windows\""):
            lo, hi, pieces = _list(window, f"{what}: a window", 3)
            lo, hi = _int(lo, f"{what}: a window's LO"), _int(hi, f"{what}: a window's HI", lo + 1)
            spans.append((lo, hi))
            for piece in _list(pieces, f"{what}: a window's pieces"):
                offset, n, index, dest = _list(piece, f"{what}: a piece", 4)
                offset = _int(offset, f"{what}: a piece's FILE_OFFSET", lo, hi)
                _int(n, f"{what}: a piece's NBYTES", 0, hi - offset)
                _int(index, f"{what}: a piece's HANDLE_INDEX", 0, len(handles) - 1)
                _int(dest, f"{what}: a piece's DEST_OFFSET")
        _disjoint_pages(spans, what)


def check_retain(parts: object) -> list[list[tuple[int, int]]]:
    """A ``retain`` line's ranges per part, refused (:class:`RequestError`) unless each part names a file and
    its ranges are ``0 <= LO < HI`` sharing no page; that they lie inside the file is checked once it is open."""
    found = []
    for k, part in enumerate(_list(parts, "\"retain\"")):
        what = f"retain part {k}"
        _file(part, what)
        ranges = []
        for r in _list(part.get("ranges"), f"{what}: \"ranges\""):
            lo, hi = _list(r, f"{what}: a range", 2)
            lo = _int(lo, f"{what}: a range's LO")
            ranges.append((lo, _int(hi, f"{what}: a range's HI", lo + 1)))
        _disjoint_pages(ranges, what)
        found.append(ranges)
    return found


def retain_shares(files: Sequence[tuple[str, int]], window: int, helpers: int) -> list[list[dict]]:
    """The ``retain`` lines' parts that page-lock ``files`` (``(path, size)``) whole, in blocks at multiples of
    ``window`` bytes (rounded up to whole pages), cut into at most ``helpers`` contiguous shares of about equal
    bytes: one list of parts per helper, in order (fewer when there are fewer blocks than helpers).

    Blocks at multiples of ``window``: a loader reading with windows of that size cuts each of its windows
    inside one block, which is what a copy without page-locking needs (a copy may not cross two registrations).
    """
    window = max(PAGE, -(-window // PAGE) * PAGE)
    blocks = [(path, lo, min(lo + window, size)) for path, size in files for lo in range(0, size, window)]
    total = sum(hi - lo for _, lo, hi in blocks)
    shares: list[list[tuple[str, int, int]]] = [[]]
    done = 0
    for block in blocks:
        if shares[-1] and len(shares) < helpers and done >= total * len(shares) / helpers:
            shares.append([])
        shares[-1].append(block)
        done += block[2] - block[1]
    lines = []
    for share in shares:
        by_file: dict[str, list[list[int]]] = {}
        for path, lo, hi in share:
            by_file.setdefault(path, []).append([lo, hi])
        lines.append([{"file": path, "ranges": ranges} for path, ranges in by_file.items()])
    return [line for line in lines if line]
