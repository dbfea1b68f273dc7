"""A hand-made Hugging Face hub cache (offline): the layout ``huggingface_hub`` reads, for model-id tests."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REPO = "acme/tiny-awq"


def cache_repo(hub: Path, repo: str, source: Path, commit: str, *, ref: str = "main") -> Path:
    """The hub's cache layout: refs/REF -> COMMIT, snapshots/COMMIT/* -> ../../blobs/SHA."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        if not f.is_file():
            continue
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot
