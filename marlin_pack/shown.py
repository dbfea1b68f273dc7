"""Untrusted text made safe to show: its control characters written as escapes.

A path, a manifest string, a tensor name or a message quoting them is shown through :func:`shown`, so it
cannot move the cursor, clear the screen, set a terminal's title, reorder what follows or start a line of
its own (a forged ``rank 0/1: load``). Escaped (:data:`UNSAFE`): the C0 controls (newline and tab too), DEL,
the C1 controls (U+0080-U+009F), the line and paragraph separators (U+2028/U+2029), the bidirectional
embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) and lone surrogates (a file name that is
not UTF-8, as Python decodes it: a terminal cannot even be sent one). ``\\n``, ``\\r`` and ``\\t`` are written
so, the other C0 controls ``\\xNN``, the rest ``\\uNNNN`` (an escape JSON reads as the same character).
Backslashes are left alone, so :func:`shown` changes nothing in its own output: a sink applies it to whole
messages, parts of which may have been shown already.

The sinks: the CLI's consoles (:mod:`marlin_pack.cli`), plain progress lines (:mod:`marlin_pack.progress`),
marlin-pack's log records (:func:`show_log_records` on the ``vllm.marlin_pack`` logger) and the text of every
:class:`~marlin_pack.errors.MarlinPackError` (vLLM prints a refusal itself). Standard library only.
"""

from __future__ import annotations

import logging
import re

__all__ = ["UNSAFE", "ShownFilter", "show_log_records", "shown"]

UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    return f"\\x{ord(c):02x}" if ord(c) < 0x20 else f"\\u{ord(c):04x}"


def shown(text: str) -> str:
    """``text`` with every character of :data:`UNSAFE` escaped (``"a\\x1b[2Jb\\n"`` -> ``a\\x1b[2Jb\\n`` as plain
    characters); ``text`` itself when it has none."""
    return UNSAFE.sub(_escape, text) if UNSAFE.search(text) else text


class ShownFilter(logging.Filter):
    """Makes a log record's message :func:`shown` (its arguments formatted in first); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = shown(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


def show_log_records(logger: logging.Logger) -> logging.Logger:
    """``logger`` with a :class:`ShownFilter` (added once): every record logged through it is shown safely."""
    if not any(isinstance(f, ShownFilter) for f in logger.filters):
        logger.addFilter(ShownFilter())
    return logger
