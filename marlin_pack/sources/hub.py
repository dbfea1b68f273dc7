"""Hugging Face model ids: the checkpoint in the hub's local cache, and where its bundle lives.

``vllm serve Qwen/Qwen2.5-7B-Instruct-AWQ`` is how most people start vLLM. A model given as a
repo id resolves, through ``huggingface_hub`` (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``), to a snapshot folder and the commit it holds. Its bundle is written to
marlin-pack's own cache, keyed by repo id and commit (never inside the hub's snapshot
folders): ``$MARLIN_PACK_CACHE``, else ``marlin-pack`` beside the hub's cache under
``$HF_HOME`` (default ``~/.cache/huggingface/marlin-pack``), so that the volume holding a
model also holds its bundle; then ``models--ORG--NAME/COMMIT``. A local directory keeps its
bundle at ``MODEL_DIR/marlin-pack``, unless it is a snapshot folder of the hub's cache
(``models--ORG--NAME/snapshots/COMMIT``, COMMIT a 40-hex commit hash): that is its repo id and commit.
A ``~`` in any of these settings that names no home directory is a one-line
:class:`~marlin_pack.io.home.HomeDirectoryError` naming the variable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from marlin_pack._constants import BUNDLE_DIRNAME
from marlin_pack.errors import CheckpointError
from marlin_pack.io.home import expand_user, home_dir
from marlin_pack.remote.url import refuse_url

__all__ = ["CACHE_ENV", "ResolvedModel", "is_repo_id", "hf_home", "cache_root", "locate_bundle", "resolve_model", "bundle_dir_for"]

CACHE_ENV = "MARLIN_PACK_CACHE"
# What conversion reads of a repo: config, index, quantize_config.json and the weights.
_PATTERNS = ["*.json", "*.safetensors"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What the hub's cache names a snapshot folder by, and marlin-pack its bundle: a full git commit hash.
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class ResolvedModel:
    """A model as given to vLLM, resolved: the local checkpoint directory and, for a repo id, which commit."""

    dir: Path
    repo_id: str | None = None
    commit: str | None = None


def is_repo_id(model: str) -> bool:
    """``org/name``, as vLLM and the hub take it (not an existing path)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not Path(model).exists()


def hf_home() -> Path:
    """``$HF_HOME`` as ``huggingface_hub`` reads it (default ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``),
    read at each call (the hub's constant is fixed at its import).

    Raises:
        HomeDirectoryError: a ``~`` that names no home directory, or no home directory for the default.
    """
    if os.environ.get("HF_HOME"):
        return expand_user(os.environ["HF_HOME"], "HF_HOME")
    if os.environ.get("XDG_CACHE_HOME"):
        return expand_user(os.environ["XDG_CACHE_HOME"], "XDG_CACHE_HOME") / "huggingface"
    return home_dir("the Hugging Face cache", "HF_HOME (or MARLIN_PACK_CACHE for marlin-pack's bundles)") / ".cache" / "huggingface"


def cache_root() -> Path:
    """Where bundles of repo ids live: ``$MARLIN_PACK_CACHE``, else ``$HF_HOME/marlin-pack`` (beside the hub's cache).

    Raises:
        HomeDirectoryError: as :func:`hf_home`, or for ``MARLIN_PACK_CACHE``.
    """
    if os.environ.get(CACHE_ENV):
        return expand_user(os.environ[CACHE_ENV], CACHE_ENV)
    return hf_home() / "marlin-pack"


def bundle_dir_for(model: ResolvedModel) -> Path:
    """The default bundle of a resolved model: ``MODEL_DIR/marlin-pack``, or the cache entry of a repo id."""
    if model.repo_id is None:
        return model.dir / BUNDLE_DIRNAME
    return cache_root() / f"models--{model.repo_id.replace('/', '--')}" / str(model.commit)


def locate_bundle(model: str | Path, revision: str | None = None, bundle: str | Path | None = None) -> Path:
    """The one bundle locator: ``bundle`` when given, else the default bundle of ``model`` (a directory or a repo
    id already in the Hugging Face cache; nothing is downloaded).

    Raises:
        CheckpointError: ``model`` is neither a directory nor a cached repo id.
        HomeDirectoryError: a ``~`` that names no home directory (``bundle``, ``model``, ``HF_HOME``, ...).
    """
    if bundle is not None:
        refuse_url(bundle, "bundle", "a directory", "copy it to a local directory first (`{sync} DIR`) and name DIR")
        return expand_user(os.fspath(bundle), "the bundle directory")
    return bundle_dir_for(resolve_model(model, revision, download=False))


def resolve_model(model: str | Path, revision: str | None = None, *, download: bool = True) -> ResolvedModel:
    """A local checkpoint directory as it is, or a repo id resolved through the Hugging Face cache.

    Args:
        model: a directory, or a Hugging Face model id ``org/name``.
        revision: branch, tag or commit of a repo id (default ``main``).
        download: fetch what the cache lacks (unless ``HF_HUB_OFFLINE``); False uses the cache only.

    Raises:
        CheckpointError: neither a directory nor a repo id, or the repo is not available.
        HomeDirectoryError: ``model`` starts with a ``~`` that names no home directory.
    """
    refuse_url(model, "model", "a checkpoint directory or a Hugging Face model id (org/name)",
               "copy the checkpoint to a local directory first (`{sync} DIR`) and pass DIR")
    path = expand_user(os.fspath(model), "the model directory")
    if path.is_dir():
        snapshot = _snapshot_of(path)
        return ResolvedModel(path) if snapshot is None else ResolvedModel(path, *snapshot)
    name = str(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        raise CheckpointError(
            f"{name} is a GGUF file; marlin-pack converts AWQ, GPTQ and compressed-tensors safetensors checkpoints (a "
            f"directory), and vLLM loads GGUF itself (`vllm serve {name}`): use an AWQ or GPTQ checkpoint of the model"
        )
    if not is_repo_id(name):
        raise CheckpointError(
            f"{name} is neither a checkpoint directory nor a Hugging Face model id (org/name); "
            "pass a local directory holding config.json, or a repo id"
        )
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError as e:
        raise CheckpointError(f"{name} looks like a Hugging Face model id, but huggingface_hub is not installed") from e
    if not os.path.isabs(constants.HF_HUB_CACHE):  # a ~ the hub could not expand (HF_HOME=~nosuchuser/x, no home): name it
        expand_user(os.environ.get("HF_HUB_CACHE") or "", "HF_HUB_CACHE")
        hf_home()
    offline = bool(constants.HF_HUB_OFFLINE) or not download
    try:
        snapshot = Path(snapshot_download(name, revision=revision, allow_patterns=_PATTERNS, local_files_only=offline))
    except Exception as e:  # the hub's own error types (not found, gated, offline miss, network)
        where = f"{name}@{revision}" if revision else name
        if offline and constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
                f"download it once (`hf download {name}`), unset HF_HUB_OFFLINE, or pass a local directory"
            ) from e
        if offline:  # a step that reads the cache only (check, verify, inspect, the loader): convert fetches it
            raise CheckpointError(
                f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), which this step only reads; "
                f"`marlin-pack convert {name}{f' --revision {revision}' if revision else ''}` downloads and converts it "
                "(or `hf download` it), or pass a local directory"
            ) from e
        raise CheckpointError(f"cannot fetch {where} from the Hugging Face hub ({type(e).__name__}: {e})") from e
    return ResolvedModel(snapshot, name, _commit(snapshot, name))


def _snapshot_of(path: Path) -> tuple[str, str] | None:
    """``(repo id, commit)`` of a local directory that is a snapshot folder of the hub's cache, else None.

    vLLM hands the loader the snapshot path (offline): that is the repo at that commit, whose bundle lives in
    marlin-pack's cache, never inside the hub's cache. Only a folder that really is one counts:
    ``models--ORG--NAME/snapshots/COMMIT`` with a valid repo id and COMMIT a 40-hex commit hash. Any other
    directory (``.../snapshots/v1``, a copy named like the cache) is a local checkpoint directory like every other.
    """
    resolved = path.resolve()
    snapshots = resolved.parent
    repo = snapshots.parent.name.removeprefix("models--").replace("--", "/", 1)
    if (snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--") and _COMMIT.fullmatch(resolved.name)
            and _REPO_ID.fullmatch(repo) and ".." not in repo):
        return repo, resolved.name
    return None


def _commit(snapshot: Path, repo: str) -> str:
    """The commit a hub snapshot folder holds: its name, if that is a 40-hex commit hash right under ``snapshots``.

    The hub's cache turns a branch or tag into a commit through its ``refs`` files; one holding ``..``
    or a path (damaged, or planted) would make anything the commit, and marlin-pack's bundle
    directory (``models--ORG--NAME/COMMIT``) a path outside its cache.

    Raises:
        CheckpointError: the folder's name is not a commit hash, or it is not a snapshot of the cache.
    """
    if ".." in snapshot.parts or snapshot.parent.name != "snapshots" or not _COMMIT.fullmatch(snapshot.name):
        raise CheckpointError(
            f"{repo} resolves to the Hugging Face cache folder {str(snapshot)!r}, expected snapshots/COMMIT with COMMIT a "
            "40-hex commit hash; the cache's refs file for it is damaged: delete the repo's refs folder and download it again, "
            "or pass --revision COMMIT"
        )
    return snapshot.name
