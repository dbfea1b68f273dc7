"""Reporting the progress of long work (a conversion, a verification's round trip) on stderr.

On a terminal: a transient rich bar (on the CLI's console, which shows names with their control
characters escaped). Anywhere else (a pipe, a file, a container's log): plain lines, flushed at once,
without ANSI codes, names shown the same way (:func:`~marlin_pack.shown.shown`): one at the first update, then at most one every
:data:`DEFAULT_INTERVAL_S` seconds (``MARLIN_PACK_PROGRESS_INTERVAL`` seconds; ``0``: every
update), and a last one when the work ends::

    marlin-pack: converting layer 1/80 (model.layers.0.mlp), 0.4/35.3 GB read
    marlin-pack: converting layer 37/80 (model.layers.36.mlp), 16.2/35.3 GB read, 1.9 GB/s, ETA 10 s
    marlin-pack: converting done: 80 layers, 35.3 GB read in 18 s (1.9 GB/s)

The protocol (:class:`ProgressFn`): ``progress(done, total, name, *, bytes_done=None, bytes_total=None)``,
``done`` of ``total`` steps (layers) finished, ``name`` the last one's; the byte counts, where the
work knows them, give the line its GB, GB/s and a byte-based ETA. Rates and ETAs are measured from the first
update on, so the first line has none. Callers written for the older
three-argument form ``progress(done, total, name)`` keep working: the work calls them through
:func:`as_progress_fn`, which leaves the byte counts out for a function that takes no such keywords.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TextIO

from marlin_pack.shown import shown

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["INTERVAL_ENV", "DEFAULT_INTERVAL_S", "ProgressFn", "PlainProgress", "as_progress_fn", "progress_reporter"]

INTERVAL_ENV = "MARLIN_PACK_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0
_PREFIX = "marlin-pack: "


class ProgressFn(Protocol):
    """``progress(done, total, name, *, bytes_done=None, bytes_total=None)``: see the module's docstring."""

    def __call__(self, done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None: ...


def as_progress_fn(fn: Callable[..., None]) -> ProgressFn:
    """``fn`` as a :class:`ProgressFn`: itself if it takes the byte keywords (or ``**kwargs``), else a
    wrapper calling ``fn(done, total, name)`` (the older protocol), the byte counts left out."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): the older protocol is the safe call
        params = []
    kinds = {p.name: p.kind for p in params}
    takes = inspect.Parameter.VAR_KEYWORD in kinds.values() or all(
        kinds.get(k) in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in ("bytes_done", "bytes_total")
    )
    if takes:
        return fn

    def three_args(done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
        fn(done, total, name)

    return three_args


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """Seconds between plain lines: ``MARLIN_PACK_PROGRESS_INTERVAL`` if it is a number >= 0, else ``default``."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


def _size(n: float, unit: float) -> str:
    return f"{n / unit:.1f}"


def _unit(total: float) -> tuple[float, str]:
    """Decimal GB for a model's sizes; MB below a GB, so that a small job does not read 0.0/0.0 GB."""
    return (1e9, "GB") if total >= 1e9 else (1e6, "MB")


def _duration(s: float) -> str:
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class PlainProgress:
    """Plain progress lines on ``file`` (see the module's docstring); ``clock`` is seconds, monotonic.

    Rates and the ETA are measured from the first update on: the steady pipeline, not the setup before it (reading
    headers, hashing the checkpoint, planning, starting the reader: often longer than the first layers, so a rate
    from the reporter's start made the first ETA 10-20x too long). The first line has no rate or ETA: none is known.
    """

    def __init__(self, file: TextIO, what: str, *, interval: float | None = None, bytes_label: str = "read",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file, self.what, self.bytes_label, self.clock = file, what, bytes_label, clock
        self.interval = interval_from_env() if interval is None else interval
        self.start = clock()
        self.first: tuple[float, int, int] | None = None  # (time, done, bytes_done) at the first update
        self.last_line: float | None = None
        self.done = self.total = 0
        self.bytes_done: int | None = None
        self.bytes_total: int | None = None

    def update(self, done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
        now = self.clock()
        self.done, self.total, self.bytes_done, self.bytes_total = done, total, bytes_done, bytes_total
        if self.last_line is None or now - self.last_line >= self.interval:
            self._write(self._line(now, name))
            self.last_line = now
        if self.first is None:
            self.first = (now, done, bytes_done or 0)

    def _rates(self, now: float) -> tuple[float | None, float | None]:
        """(steps per second, bytes per second) since the first update; (None, None) until a step after it."""
        if self.first is None:
            return None, None
        t0, d0, b0 = self.first
        dt = now - t0
        if dt <= 0 or self.done <= d0:
            return None, None
        bytes_rate = (self.bytes_done - b0) / dt if self.bytes_done is not None and self.bytes_done > b0 else None
        return (self.done - d0) / dt, bytes_rate

    def _line(self, now: float, name: str) -> str:
        parts = [f"{_PREFIX}{self.what} layer {self.done}/{self.total}" + (f" ({name})" if name else "")]
        step_rate, byte_rate = self._rates(now)
        if self.bytes_done is not None and self.bytes_total:
            scale, unit = _unit(self.bytes_total)
            parts.append(f"{_size(self.bytes_done, scale)}/{_size(self.bytes_total, scale)} {unit} {self.bytes_label}")
            if byte_rate:
                parts.append(f"{_size(byte_rate, scale)} {unit}/s")
        eta: float | None = None
        if self.bytes_done is not None and self.bytes_total and byte_rate:
            eta = max(0, self.bytes_total - self.bytes_done) / byte_rate
        elif step_rate:
            eta = max(0, self.total - self.done) / step_rate
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        return ", ".join(parts)

    def finish(self, ok: bool = True) -> None:
        """The last line: how much was done in how long; nothing if no update ever came."""
        if self.first is None:
            return
        elapsed = self.clock() - self.start
        if not ok:
            self._write(f"{_PREFIX}{self.what} stopped after layer {self.done}/{self.total} ({_duration(elapsed)})")
            return
        line = f"{_PREFIX}{self.what} done: {self.done} layer{'' if self.done == 1 else 's'}"
        if self.bytes_done is not None and self.bytes_total:
            scale, unit = _unit(self.bytes_total)
            line += f", {_size(self.bytes_done, scale)} {unit} {self.bytes_label}"
            rate = f" ({_size(self.bytes_done / elapsed, scale)} {unit}/s)" if elapsed > 0 else ""
            line += f" in {_duration(elapsed)}{rate}"
        else:
            line += f" in {_duration(elapsed)}"
        self._write(line)

    def _write(self, line: str) -> None:
        self.file.write(shown(line) + "\n")  # a layer name with a newline or an escape sequence: shown, not obeyed
        self.file.flush()  # a container's log may sit behind a block buffer


@contextmanager
def _rich_bar(console: Console, what: str) -> Iterator[ProgressFn]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(
        TextColumn(what, style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}", markup=False),  # a file or layer name: plain text, never markup
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, name: str, *, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
            bar.update(task, completed=done, total=total, description=name)

        yield update


@contextmanager
def progress_reporter(console: Console, enabled: bool, what: str, *, interval: float | None = None, bytes_label: str = "read",
                      clock: Callable[[], float] = time.monotonic) -> Iterator[ProgressFn | None]:
    """A :class:`ProgressFn` reporting ``what`` on ``console`` (stderr's), or None when not ``enabled`` (``--json``).

    A rich bar when ``console.is_terminal``, else :class:`PlainProgress` lines on ``console.file``
    (``interval``: seconds between lines, default from ``MARLIN_PACK_PROGRESS_INTERVAL`` or 5 s).
    """
    if not enabled:
        yield None
        return
    if console.is_terminal:
        with _rich_bar(console, what) as update:
            yield update
        return
    plain = PlainProgress(console.file, what, interval=interval, bytes_label=bytes_label, clock=clock)
    try:
        yield plain.update
    except BaseException:
        plain.finish(ok=False)
        raise
    plain.finish()
