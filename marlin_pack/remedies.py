"""The command that writes a bundle again, named in full: what refusals of a missing or broken bundle advise.

The model is read off the bundle's place (``MODEL_DIR/marlin-pack``: MODEL_DIR; ``.../models--ORG--NAME/COMMIT`` in
marlin-pack's cache: ``ORG/NAME --revision COMMIT``); elsewhere (``-o``) the command names the output, and MODEL is for
the reader to fill in. Standard library only: the plugin's refusals, ``check`` and the CLI's errors all use it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from marlin_pack._constants import BUNDLE_DIRNAME

__all__ = ["convert_command"]

_CACHED = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9_.-]*)--([A-Za-z0-9][A-Za-z0-9_.-]*)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def convert_command(bundle_dir: str | Path | None = None, *, model: str | Path | None = None, manifest: Any = None,
                    tp_sizes: list[int] | tuple[int, ...] | None = None, extra: str = "") -> str:
    """``marlin-pack convert MODEL [--revision C] [--output B] [--tp 1,2 --dtype D --kernel K] [extra]`` for the bundle at
    ``bundle_dir``, or for ``model``'s default bundle (a checkpoint directory); with ``manifest``, the settings it was
    made with (its TP sizes, serving dtype and kernel), so that the command writes the same bundle on any machine."""
    if bundle_dir is None:
        assert model is not None
        bundle = Path(model) / BUNDLE_DIRNAME
    else:
        bundle = Path(bundle_dir)
    cached = _CACHED.fullmatch(bundle.parent.name)
    if bundle.name == BUNDLE_DIRNAME:
        words = [str(bundle.parent)]
    elif cached is not None and _COMMIT.fullmatch(bundle.name):
        words = [f"{cached[1]}/{cached[2]}", "--revision", bundle.name]
    else:
        words = [str(model) if model is not None else "MODEL", "--output", str(bundle)]
    if manifest is not None:
        tp_sizes = manifest.tp_sizes
    if tp_sizes:
        words += ["--tp", ",".join(map(str, sorted(tp_sizes)))]
    if manifest is not None:
        words += ["--dtype", manifest.serving_dtype.value, "--kernel", "machete" if manifest.has_machete_layers else "marlin"]
    command = "marlin-pack convert " + " ".join(w if w == "MODEL" and model is None else shlex.quote(w) for w in words)
    return f"{command} {extra}".rstrip()
