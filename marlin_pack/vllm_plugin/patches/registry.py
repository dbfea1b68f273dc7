"""A registry of patches to vLLM internals: version-guarded, idempotent, removable.

A :class:`Patch` names its target (``"module:Class.attribute"`` or ``"module:function"``),
how to build the replacement from the original, its purpose (:data:`PURPOSES`) and the
upstream change that makes it unnecessary. :func:`install_all` installs patches only on a
vLLM release marlin-pack serves (the caller picks the patches of that release); :func:`uninstall_all` restores every original.
Which patches exist, with their purposes and exits, is data (:mod:`.catalog`).

A patch whose module vLLM imports only on some paths (``deferred=True``) is not imported by
:func:`install_all`: a one-module import hook applies it right after that module's first
import (or at once, if it is already imported).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["PURPOSES", "Patch", "install_all", "uninstall_all", "installed", "original", "is_replacement"]

logger = logging.getLogger("vllm.marlin_pack")

_MISSING = object()  # the target attribute did not exist on its owner (inherited or new)

# Why a patch exists, in the order ``marlin-pack env`` lists them:
# ``correctness``: a bundle is loaded right (its layers finished, not re-processed; placeholders without memory);
# ``weight_cache``: vLLM's weight cache (``vllm preload`` daemons, ``--load-format ipc_cache``) works for
#   AWQ/GPTQ/compressed-tensors Marlin layers;
# ``speed``: nothing but faster starts (inert outside marlin-pack's paths: :mod:`.scope`).
PURPOSES = ("correctness", "weight_cache", "speed")


@dataclass(frozen=True)
class Patch:
    """One replaced attribute of vLLM.

    Attributes:
        target: ``"package.module:Owner.attr"``; ``Owner`` may be a dotted class path or
            absent (a module-level function: ``"package.module:func"``).
        make: builds the replacement from the original (the raw ``__dict__`` entry, so a
            classmethod arrives as a ``classmethod``; ``None`` if the owner had none).
        remove_when: the upstream vLLM change that makes this patch unnecessary.
        purpose: one of :data:`PURPOSES`.
        deferred: apply when the module is first imported instead of importing it now.
    """

    target: str
    make: Callable[[Any], Any]
    remove_when: str
    purpose: str
    deferred: bool = False

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"{self.target}: purpose {self.purpose!r} is not one of {PURPOSES}")
        if not self.remove_when.strip():
            raise ValueError(f"{self.target}: remove_when must name the upstream change that retires it")

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]


# target -> (owner, attribute, original, replacement)
_INSTALLED: dict[str, tuple[Any, str, Any, Any]] = {}
_PENDING: dict[str, list[Patch]] = {}  # module name -> deferred patches waiting for its import
_REPLACEMENTS: set[int] = set()  # id() of every replacement function we installed
_WARNED: set[str] = set()  # versions already warned about (once per process)


def _owner(module: ModuleType, target: str) -> tuple[Any, str]:
    path = target.split(":", 1)[1].split(".")
    owner: Any = module
    for name in path[:-1]:
        owner = getattr(owner, name)
    return owner, path[-1]


def _apply(patch: Patch, module: ModuleType) -> None:
    if patch.target in _INSTALLED:  # idempotent
        return
    owner, attr = _owner(module, patch.target)
    previous = vars(owner).get(attr, _MISSING)
    replacement = patch.make(None if previous is _MISSING else previous)
    setattr(owner, attr, replacement)
    _INSTALLED[patch.target] = (owner, attr, previous, replacement)
    _REPLACEMENTS.add(id(getattr(replacement, "__func__", replacement)))


class _ApplyAfterExec(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for patch in _PENDING.pop(module.__name__, []):
            try:
                _apply(patch, module)
            except Exception:
                logger.exception("marlin-pack: could not patch %s", patch.target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DeferredPatchHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of modules with pending patches, so they are patched right after import."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _PENDING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ApplyAfterExec(spec.loader)
        return spec


def install_all(patches: Sequence[Patch], *, running: str, served: bool, reason: str = "") -> bool:
    """Install ``patches`` (idempotent) if marlin-pack serves the running vLLM release.

    Args:
        running: the running vLLM's version.
        served: whether marlin-pack serves it (the caller picked ``patches`` for it).
        reason: the one line logged (once per process) where it does not.

    Returns:
        Whether the patches are installed; False (after one warning) on a release not served.
    """
    if not served:
        if running in _WARNED:
            return False
        _WARNED.add(running)
        logger.warning("marlin-pack: %s; nothing patched", reason or f"vLLM {running} is not served")
        return False
    for patch in patches:
        if patch.target in _INSTALLED:
            continue
        module = sys.modules.get(patch.module)
        if module is None and patch.deferred:
            pending = _PENDING.setdefault(patch.module, [])
            if patch not in pending:
                pending.append(patch)
            continue
        _apply(patch, module or importlib.import_module(patch.module))
    if _PENDING and not any(isinstance(f, _DeferredPatchHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferredPatchHook())
    return True


def uninstall_all() -> None:
    """Restore every original and forget pending patches (tests use it between cases)."""
    for owner, attr, previous, _ in reversed(list(_INSTALLED.values())):
        if previous is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, previous)
    _INSTALLED.clear()
    _PENDING.clear()
    _REPLACEMENTS.clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeferredPatchHook)]


def installed() -> list[str]:
    """Targets patched in this process, in installation order."""
    return list(_INSTALLED)


def original(target: str) -> Any:
    """The attribute a patch replaced (``KeyError`` if the patch is not installed)."""
    previous = _INSTALLED[target][2]
    return None if previous is _MISSING else previous


def is_replacement(fn: object) -> bool:
    """Whether ``fn`` (a function, or a classmethod/bound method of one) was installed by a patch."""
    return id(getattr(fn, "__func__", fn)) in _REPLACEMENTS
