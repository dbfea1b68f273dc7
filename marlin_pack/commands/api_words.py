"""The library's errors name the library's arguments; the CLI shows its options in their place.

Below the CLI a message names a setting as a library call takes it, in backquotes: ``force=True``, ``output=DIR``,
``tp=[1, 2]``, ``kernel='marlin'``, ``device='cpu'``, ``revision=COMMIT``, ``source=MODEL_DIR``,
``integrity_only=True``, ``dtype='bfloat16'``, ``bundle=DIR``: what a caller of :func:`marlin_pack.convert` or
:func:`marlin_pack.verify` changes. The CLI prints each as the option that sets it (``--force``, ``-o DIR``,
``--tp 1,2``, ``--kernel marlin``, ...) with :func:`as_cli`, applied to every error it prints. A value that is no
Python literal (``DIR``, ``COMMIT``) is a placeholder, kept as written; a backquoted span of any other shape (a
command to run, a file name) is left alone.
"""

from __future__ import annotations

import ast
import re

__all__ = ["OPTIONS", "as_cli"]

OPTIONS = {
    "force": "--force", "output": "-o", "tp": "--tp", "kernel": "--kernel", "device": "--device", "dtype": "--dtype",
    "revision": "--revision", "source": "--source", "integrity_only": "--integrity-only", "bundle": "--bundle",
}
_ARG = re.compile(r"`([a-z_]+)=([^`\n]*)`")


def _option(match: re.Match[str]) -> str:
    flag = OPTIONS.get(match[1])
    if flag is None:
        return match[0]
    try:
        value = ast.literal_eval(match[2])
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = match[2]  # a placeholder: DIR, COMMIT
    if value is True:
        return f"`{flag}`"
    if isinstance(value, bool) or value is None:
        return match[0]
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"`{flag} {value}`"


def as_cli(text: str) -> str:
    """``text`` with each backquoted library argument written as the CLI option that sets it:
    ``"pass `force=True`"`` -> ``"pass `--force`"``, ``"`tp=[1, 2]`"`` -> ``"`--tp 1,2`"``."""
    return _ARG.sub(_option, text)
