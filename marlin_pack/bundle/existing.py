"""Is the bundle already at the output the one ``convert`` was asked for? What makes ``convert`` idempotent.

An init container runs ``marlin-pack convert MODEL`` at every pod start, often in several pods at once.
A bundle already at the output is reused (``convert`` exits 0 and writes nothing) when it is for the
same checkpoint and the same settings: every tensor-parallel size asked for, the same serving dtype,
the same layers in the same layouts (``--kernel``), a manifest this marlin-pack reads. The checkpoint is
checked as the loader checks it with ``verify: auto``: settings, file set, sizes, headers and BLAKE3
digests, hashing only files without a stamp of this user (the user who converted has stamps of every
file no one else may write; see :mod:`marlin_pack.io.stamps`). The bundle's files are checked by size:
the loader hashes them as it decides, and ``verify`` proves them.

A bundle for other settings is refused with the difference named and the command that replaces it;
nothing is extended in place (a bundle is published whole, by one rename).

Deciding reads only, so it comes before the output's lock: an up-to-date bundle on a read-only volume,
or another user's, is reported up to date without the write access the lock needs. Under the lock the
decision is taken again only where the output changed meanwhile (:func:`output_state`: another
conversion published).
"""

from __future__ import annotations

import os
from pathlib import Path

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.bundle.integrity import HashReport, check_files, check_source
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.errors import BundleError, OutputExistsError
from marlin_pack.schemas import LayerEntry, Manifest, ServingDtype

__all__ = ["reusable_bundle", "output_state"]


def output_state(out: Path) -> tuple[tuple[int, ...], ...]:
    """What is at ``out`` and its manifest, as identities (device, inode, mtime, ctime): changes when a bundle is published there."""
    state = []
    for path in (out, out / MANIFEST_NAME):
        try:
            st = os.lstat(path)
        except OSError:
            state.append(())
            continue
        state.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(state)


def _kernels(layers: list[LayerEntry]) -> str:
    """``marlin``, ``machete`` or ``machete and marlin``: the layouts a TP set's layers hold."""
    return " and ".join(sorted({e.kernel.value for e in layers}))


def _sizes(tps: list[int]) -> str:
    return ",".join(str(t) for t in tps)


def reusable_bundle(
    out: Path, model_dir: Path, tp_sizes: list[int], serving_dtype: ServingDtype,
    entries: dict[int, list[LayerEntry]] | None = None,
) -> tuple[Manifest, HashReport] | None:
    """The manifest of the bundle at ``out`` (and what checking its checkpoint hashed) if it is the one asked for;
    None where there is no bundle at ``out`` (nothing, or something :func:`~marlin_pack.bundle.writer.check_output`
    reports).

    Raises:
        OutputExistsError: a bundle is there, but for other settings, another checkpoint, another format
            version, or with a file missing or of another size; the message names it and says
            ``--force`` replaces it.
    """
    if not (out / MANIFEST_NAME).is_file():
        return None
    replace = "pass --force to replace it, or -o to write another bundle elsewhere"
    try:
        manifest = read_manifest(out)
    except BundleError as e:
        raise OutputExistsError(f"{out} holds a bundle this marlin-pack cannot use ({e}); {replace}") from e
    wanted = [t for t in tp_sizes if t not in manifest.tp_sizes]
    if wanted or manifest.serving_dtype != serving_dtype:
        held = f"tp {_sizes(manifest.tp_sizes)} in {manifest.serving_dtype.value}"
        asked = f"tp {_sizes(tp_sizes)} in {serving_dtype.value}"
        if manifest.serving_dtype == serving_dtype:
            advice = f"pass --tp {_sizes(sorted(set(tp_sizes) | set(manifest.tp_sizes)))} --force to replace it with one holding both"
        else:
            advice = "pass --force to replace it"
        raise OutputExistsError(f"{out} holds a bundle for {held}, asked for {asked}; {advice}, or -o to write another bundle elsewhere")
    for tp in tp_sizes if entries else []:
        held_kernels = _kernels(manifest.tensor_parallel_set(tp).layers)
        if manifest.tensor_parallel_set(tp).layers != entries[tp]:  # type: ignore[index]
            asked_kernels = _kernels(entries[tp])  # type: ignore[index]
            what = (f"layers in {held_kernels}'s layout, asked for {asked_kernels}" if held_kernels != asked_kernels
                    else "other layer shapes than this checkpoint implies")
            raise OutputExistsError(f"{out} holds a bundle with {what} at tp {tp}; {replace}")
    try:
        hashed = check_source(manifest, model_dir)
        check_files(out, manifest, full_hash=False)
    except BundleError as e:  # BundleMismatchError included: another checkpoint, or one changed since
        raise OutputExistsError(f"{out} is not an up-to-date bundle of {model_dir}: {e}; {replace}") from e
    return manifest, hashed
