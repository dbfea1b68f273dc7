"""marlin-pack's cache of model-id bundles: what ``marlin-pack cache ls`` lists and ``cache rm`` removes.

Bundles of Hugging Face model ids live under :func:`~marlin_pack.sources.hub.cache_root` as
``models--ORG--NAME/COMMIT`` (one per commit converted). Removing one removes that bundle only, never
the checkpoint in the hub's cache. Everything under the root is untrusted: only entries whose names
have the cache's shape and that hold a manifest are listed (a symlinked entry is not), and removal deletes only directories
that are marlin-pack bundles (a manifest and nothing it does not list), without following symlinks, checked and removed
through one descriptor (another user who may write the cache cannot swap in what is removed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.errors import BundleError, MarlinPackError
from marlin_pack.sources.hub import cache_root, is_repo_id

__all__ = ["CachedBundle", "cache_root", "cached_bundles", "cached_of", "remove_cached", "remove_entries"]

_REPO_DIR = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9_.-]*)--([A-Za-z0-9][A-Za-z0-9_.-]*)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class CachedBundle:
    """One cached bundle: its model id, commit, what it holds, its bytes and its directory."""

    repo_id: str
    commit: str
    tp_sizes: tuple[int, ...]
    dtype: str
    size: int
    path: Path

    @property
    def tp_text(self) -> str:
        return ",".join(map(str, self.tp_sizes)) or "?"

    def to_dict(self) -> dict[str, object]:
        return {"model": self.repo_id, "commit": self.commit, "tp_sizes": list(self.tp_sizes), "dtype": self.dtype,
                "size": self.size, "path": str(self.path)}


def _entry(repo_dir: Path, repo_id: str, commit_dir: Path) -> CachedBundle | None:
    from marlin_pack.bundle.reader import read_manifest

    if commit_dir.is_symlink() or not _COMMIT.fullmatch(commit_dir.name) or not (commit_dir / MANIFEST_NAME).is_file():
        return None
    size = sum(p.stat().st_size for p in commit_dir.rglob("*") if p.is_file() and not p.is_symlink())
    try:
        manifest = read_manifest(commit_dir)
        tps, dtype = tuple(manifest.tp_sizes), manifest.serving_dtype.value
    except BundleError:  # another format version: still listed (and removable), its settings unknown
        tps, dtype = (), "unreadable manifest"
    return CachedBundle(repo_id, commit_dir.name, tps, dtype, size, commit_dir)


def cached_bundles(root: Path | None = None) -> list[CachedBundle]:
    """Every bundle in the cache, sorted by model id and commit."""
    root = cache_root() if root is None else root
    if not root.is_dir():
        return []
    found: list[CachedBundle] = []
    for repo_dir in sorted(root.iterdir()):
        m = _REPO_DIR.fullmatch(repo_dir.name)
        if m is None or repo_dir.is_symlink() or not repo_dir.is_dir():
            continue
        for commit_dir in sorted(repo_dir.iterdir()):
            entry = _entry(repo_dir, f"{m.group(1)}/{m.group(2)}", commit_dir)
            if entry is not None:
                found.append(entry)
    return found


def cached_of(model: str, revision: str | None = None, root: Path | None = None) -> list[CachedBundle]:
    """The cached bundles of ``model``: every commit's, or the one ``revision`` names (a full commit, or a branch/tag
    the hub's cache resolves; nothing is downloaded). What :func:`remove_cached` would remove.

    Raises:
        MarlinPackError: ``model`` is not a model id.
    """
    if not is_repo_id(model):
        raise MarlinPackError(f"{model} is not a model id (org/name); the cache holds bundles of model ids only")
    commit = None
    if revision is not None:
        commit = revision if _COMMIT.fullmatch(revision) else _resolved_commit(model, revision)
    return [e for e in cached_bundles(root) if e.repo_id == model and (commit is None or e.commit == commit)]


def remove_entries(entries: list[CachedBundle]) -> list[Path]:
    """Remove these cached bundles (from :func:`cached_of`); the paths removed, in order.

    Raises:
        MarlinPackError: an entry holds files its manifest does not list (it and those after it are kept).
    """
    from marlin_pack.bundle.writer import remove_bundle

    removed: list[Path] = []
    for entry in entries:
        why = remove_bundle(entry.path)  # checked and removed through one descriptor
        if why is not None:
            raise MarlinPackError(f"{entry.path} {why}; not removed: remove it yourself")
        removed.append(entry.path)
        parent = entry.path.parent
        if not any(parent.iterdir()):
            parent.rmdir()
    return removed


def remove_cached(model: str, revision: str | None = None, root: Path | None = None) -> list[Path]:
    """Remove the cached bundles of ``model`` (every commit's, or the one ``revision`` names); the paths removed.

    ``revision`` may be a full commit or a branch/tag the hub's cache resolves (nothing is downloaded).

    Raises:
        MarlinPackError: ``model`` is not a model id, or an entry holds files its manifest does not list.
    """
    return remove_entries(cached_of(model, revision, root))


def _resolved_commit(model: str, revision: str) -> str:
    from marlin_pack.sources.hub import resolve_model

    commit = resolve_model(model, revision, download=False).commit
    assert commit is not None
    return commit
