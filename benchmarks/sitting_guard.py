"""What a benchmark sitting that draws a checkpoint and converts it needs around it: room on the file systems it writes,
checked before anything is drawn, and its files removed when it is stopped.

* :func:`checkpoint_bytes` estimates a synthetic checkpoint's size from its shape (``marlin_pack.testing.synthetic``
  and ``synthetic_moe`` presets); a bundle is about :data:`BUNDLE_RATIO` times its checkpoint, so a checkpoint and its
  bundle on one disk take about 2.1 x the checkpoint.
* :func:`check_room` refuses in one line (``SystemExit``) when a file system holds less free space than the sitting
  puts on it, plus a margin: what is needed, what is free, which option to change.
* :func:`run` runs a benchmark's ``main`` with SIGTERM and SIGINT raising :class:`Stopped`: a call's timeout (or ^C)
  goes through the ``finally`` blocks, which end the engines and remove the workdir, so the next call finds its disk
  empty (a sitting killed mid-way once left 40 GB in /tmp/cold and the next one failed with "No space left on
  device"). ``Stopped`` is a ``KeyboardInterrupt``: the rows' ``except (Exception, SystemExit)`` do not swallow it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

GB = 1e9
BUNDLE_RATIO = 1.1  # a bundle / its checkpoint (repacked words, scales, the common file)
MARGIN, MARGIN_BYTES = 1.1, 2 * GB  # on top of the estimate: logs, the page-cache probe files, estimate error


def checkpoint_bytes(shape: Any, *, bits: int = 4, group_size: int = 128) -> int:
    """About the bytes of a synthetic ``bits``-bit checkpoint of ``shape`` (a ``ModelShape`` or ``MoeShape``): the
    quantized linears with a 16-bit scale and a packed zero point per group, the embedding and the head in 16 bits."""
    if hasattr(shape, "linears"):
        per_layer = sum(k * n for _, k, n, _ in shape.linears())
    else:
        per_layer = sum(x.in_features * x.out_features for x in shape.decoder_layer(0) if hasattr(x, "in_features"))
    per_weight = bits / 8 + (2 + bits / 8) / (group_size if group_size > 0 else 1 << 30)
    heads = 1 if getattr(shape, "tie_word_embeddings", False) else 2
    return int(per_layer * shape.num_hidden_layers * per_weight + heads * shape.vocab_size * shape.hidden_size * 2)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(prog: str, needs: Iterable[tuple[Path, float, str]], hint: str) -> None:
    """``needs``: ``(path, bytes, what)`` the sitting writes. Summed per file system (the nearest existing folder above
    each path tells which), each with the margin, against what that file system has free: one line and
    ``SystemExit`` where it falls short, naming ``hint`` (the options that need less)."""
    by_fs: dict[int, list[tuple[Path, float, str]]] = {}
    for path, nbytes, what in needs:
        if nbytes > 0:
            by_fs.setdefault(os.stat(_existing(path)).st_dev, []).append((path, nbytes, what))
    for items in by_fs.values():
        need = sum(n for _, n, _ in items) * MARGIN + MARGIN_BYTES
        free = shutil.disk_usage(_existing(items[0][0])).free
        if free < need:
            paths = " and ".join(dict.fromkeys(str(p) for p, _, _ in items))
            whats = " + ".join(f"{what} ~{n / GB:.1f} GB" for _, n, what in items)
            raise SystemExit(f"{prog}: {paths} needs ~{need / GB:.0f} GB free ({whats}, with a margin), its file system has "
                             f"{free / GB:.1f} GB free (leftovers of an earlier run there?): {hint}")


def same_file_system(a: Path, b: Path) -> bool:
    return os.stat(_existing(a)).st_dev == os.stat(_existing(b)).st_dev


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: the sitting unwinds through its ``finally`` blocks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # one unwinding: a second signal does not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def run(main: Callable[[], None], prog: str) -> None:
    """``main()`` with SIGTERM and SIGINT raising :class:`Stopped`; a stopped sitting ends with one line and 128 + the
    signal's number (143 for a timeout's SIGTERM), its ``finally`` blocks run."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        main()
    except Stopped as e:
        print(f"{prog}: stopped by {e}: its engines ended and its files removed (unless --keep)", file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None
