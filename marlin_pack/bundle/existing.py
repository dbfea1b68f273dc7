"""What ``convert`` finds at its output and what it does about it: why ``convert`` is idempotent and heals a bundle.

An init container runs ``marlin-pack convert MODEL`` at every pod start, often in several pods at once. A bundle is
derived data, so ``convert`` makes the one at the output match the checkpoint and the settings asked:

* nothing there, or an empty directory (a fresh volume): every TP size asked is written;
* a bundle: each TP size asked is kept when its files are intact and were made from this checkpoint with these
  settings (serving dtype, layers in the same layouts: ``--kernel``), else written; the common file likewise. Files
  are checked as ``marlin-pack check`` checks them: sizes and BLAKE3 digests, hashing only files without a stamp of
  this user for their identity (:mod:`marlin_pack.io.stamps`), and the headers the manifest implies. The checkpoint is
  checked as the loader checks it (settings, files, sizes, headers, digests). TP sizes held and not asked are kept as
  they are (not checked) when the bundle stays of this checkpoint and settings, and dropped otherwise;
* a bundle of another checkpoint, serving dtype, or one made by an older marlin-pack: rewritten whole;
* a bundle of a newer format (made by a newer marlin-pack): refused, ``--force`` replaces it;
* anything else (a file, a non-empty directory without a marlin-pack manifest): refused, with or without ``--force``.

``--force`` writes every TP size asked and drops the others. What is kept stays untouched (its stamps too): the files
written go in beside it (:mod:`marlin_pack.bundle.in_place`). A bundle rewritten whole is built beside the output and
swapped in at once, as a new one is renamed into place, and a directory holding files no conversion writes is then
refused (:func:`~marlin_pack.bundle.writer.foreign_entry`); an empty directory, or a volume mounted at the output, is
written into. Deciding reads only, so it comes before the output's lock: an up-to-date bundle on a read-only volume
is reported up to date without the write access the lock needs. Under the lock the decision is taken again only where
the output changed meanwhile (:func:`output_state`).

:func:`look` and :func:`assess` gather the facts (:class:`Findings`, plain data); :func:`decide` is the pure decision.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from marlin_pack._constants import COMMON_FILE, FORMAT_VERSION, MACHETE_FORMAT_VERSION, MANIFEST_NAME, READABLE_FORMAT_VERSIONS
from marlin_pack.bundle.integrity import HashReport, check_source, file_problems
from marlin_pack.bundle.rank_files import check_rank_header, common_metadata
from marlin_pack.bundle.reader import _read_raw, listed_files, read_manifest, resolve_file
from marlin_pack.errors import BundleError, BundleMismatchError, MarlinPackError, OutputExistsError
from marlin_pack.io.safetensors_io import SafetensorsFormatError, read_header
from marlin_pack.schemas import LayerEntry, LayerKernel, Manifest, MoeLayerEntry, ServingDtype

__all__ = ["State", "Held", "Findings", "Update", "output_state", "look", "assess", "decide", "is_own_entry"]


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


class State(str, Enum):
    """What is at the output."""

    missing = "missing"  # nothing: the bundle is made beside it and renamed into place
    empty = "empty"  # an empty directory (a fresh volume): the bundle is written into it
    bundle = "bundle"  # a directory with a marlin-pack manifest (of any format version)
    other = "other"  # anything else: refused


def is_own_entry(name: str, out: Path) -> bool:
    """Whether ``name``, inside the output directory ``out``, is marlin-pack's own and no content: the lock of a
    volume mounted at ``out``, a temporary directory of a conversion, or a fresh file system's ``lost+found``."""
    if name == f".{out.name}.lock" or re.fullmatch(rf"\.{re.escape(out.name)}\.tmp-\d+-[0-9a-f]+", name):
        return True
    return name == "lost+found" and os.path.ismount(out)


@dataclass(frozen=True)
class Held:
    """What :func:`look` found at the output: its :class:`State`, and for a bundle its manifest or why it cannot be read."""

    state: State
    why: str | None = None  # State.other: the refusal; State.bundle: why its manifest cannot be read (manifest is None)
    manifest: Manifest | None = None
    newer: bool = False  # a bundle of a format version this marlin-pack does not know (a newer one's)
    format_version: int | None = None


def look(out: Path) -> Held:
    """What is at ``out`` (reads only; ``out`` as :func:`~marlin_pack.bundle.writer.follow_output` leaves it)."""
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):  # (a file above it: writing there says so)
        return Held(State.missing)
    except OSError as e:
        return Held(State.other, f"{out} cannot be read ({e.strerror or e}); choose another output (`output=DIR`)")
    if not stat.S_ISDIR(st.st_mode):
        kind = "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "special file"
        return Held(State.other, f"{out} is a {kind}, expected a directory (a bundle or an empty one) or nothing; "
                                 "remove it or choose another output (`output=DIR`)")
    try:
        names = sorted(n for n in os.listdir(out) if not is_own_entry(n, out))
    except OSError as e:
        return Held(State.other, f"{out} cannot be listed ({e.strerror or e}); choose another output (`output=DIR`)")
    if not names:
        return Held(State.empty)
    if MANIFEST_NAME not in names:
        return Held(State.other, f"{out} exists and is not a marlin-pack bundle (no {MANIFEST_NAME}); refusing to replace it "
                                 f"(it holds {names[0]}; expected a bundle, an empty directory or nothing): "
                                 "choose another output (`output=DIR`)")
    try:
        listed_files(out)  # a marlin-pack manifest, of any format version, whose file list parses
    except BundleError as e:
        return Held(State.other, f"{out} exists and is not a marlin-pack bundle ({e}); refusing to replace it, remove it yourself "
                                 "or use another `output=DIR`")
    try:
        return Held(State.bundle, manifest=read_manifest(out))
    except BundleMismatchError:  # another format version
        found = _read_raw(out)[2].get("format_version")
        if not isinstance(found, int) or isinstance(found, bool):
            return Held(State.bundle, why=f"its manifest has format_version {found!r}, which no marlin-pack writes")
        if found < min(READABLE_FORMAT_VERSIONS):
            return Held(State.bundle, why=f"it was made by an older marlin-pack (format_version {found})", format_version=found)
        readable = f"{min(READABLE_FORMAT_VERSIONS)} to {max(READABLE_FORMAT_VERSIONS)}"
        return Held(State.bundle, newer=True, format_version=found, why=(
            f"{out} holds a bundle this marlin-pack cannot use (format_version {found}: a newer marlin-pack's; this one reads "
            f"formats {readable})"))
    except BundleError as e:
        return Held(State.bundle, why=f"its manifest is damaged ({_fact(str(e))})")


def _fact(message: str) -> str:
    """A check's message without its advice (``...; re-run `marlin-pack convert --force```): the fact, for a summary."""
    head, _, tail = message.rpartition("; ")
    return head if head and ("convert" in tail or tail.startswith(("check ", "restore "))) else message


@dataclass(frozen=True)
class Findings:
    """Everything :func:`decide` needs, as plain data."""

    state: State
    why: str | None = None  # State.other: the refusal; a newer bundle: what it is
    newer: bool = False
    held: tuple[int, ...] = ()  # TP sizes the bundle holds
    whole: str | None = None  # why nothing of the bundle can be kept (another checkpoint, dtype, an older format)
    sets: Mapping[int, str] = field(default_factory=dict)  # held TP size -> why it cannot be kept (absent: it can)
    common: str | None = None  # why common.safetensors cannot be kept (a phrase: "changed since it was written")
    held_format: int | None = None  # the bundle's format version
    machete: frozenset[int] = frozenset()  # TP sizes whose layers, as asked, include Machete's layout (format 5)
    manifest: Manifest | None = None
    hashed: HashReport = HashReport()


def assess(
    out: Path, held: Held, model_dir: Path, asked: Sequence[int], serving_dtype: ServingDtype,
    entries: Mapping[int, list[LayerEntry]], moe_entries: Mapping[int, list[MoeLayerEntry]] | None,
    common: Mapping[str, tuple[str, tuple[int, ...]]], force: bool = False,
) -> Findings:
    """The facts about the bundle at ``out`` (:func:`look`'s ``held``) against what is asked: the checkpoint at ``model_dir``,
    TP sizes ``asked``, ``serving_dtype``, the layers (``entries``/``moe_entries`` per TP size, for every size asked and
    every size held that the checkpoint can take) and the common file's tensors (name -> safetensors dtype and shape, before
    aliases). Hashes only where :func:`decide` can use it: nothing with ``force``, nothing once the whole bundle is stale.
    """
    machete = frozenset(tp for tp, layers in entries.items() if any(e.kernel is LayerKernel.machete for e in layers))
    if held.state is not State.bundle:
        return Findings(held.state, held.why, machete=machete)
    m = held.manifest
    if m is None:  # another format version, or a damaged manifest
        return Findings(State.bundle, held.why, newer=held.newer, whole=held.why or "its manifest cannot be read",
                        held_format=held.format_version, machete=machete)
    base = Findings(State.bundle, held=tuple(m.tp_sizes), held_format=m.format_version, machete=machete, manifest=m)
    if force:
        return base
    if m.serving_dtype != serving_dtype:
        return _replace(base, whole=f"it holds {m.serving_dtype.value} scales, asked for {serving_dtype.value}")
    try:
        hashed = check_source(m, model_dir)
    except BundleError as e:  # BundleMismatchError: another checkpoint, or one changed since
        return _replace(base, whole=_fact(str(e)))
    sets: dict[int, str] = {}
    for tp in m.tp_sizes:
        held_set = m.tensor_parallel_set(tp)
        if tp not in entries:
            sets[tp] = f"this checkpoint cannot be split {tp} ways"
        elif held_set.layers != entries[tp]:
            have, want = _kernels(held_set.layers), _kernels(entries[tp])
            sets[tp] = (f"its layers are in {have}'s layout, asked for {want}" if have != want
                        else "its layers have other shapes than this checkpoint implies")
        elif moe_entries is not None and held_set.moe_layers != moe_entries.get(tp, []):
            sets[tp] = "its experts layers have other shapes than this checkpoint implies"
    checked = [m.common] + [r.file for tp in asked if tp in m.tp_sizes and tp not in sets for r in m.tensor_parallel_set(tp).ranks]
    problems, also = file_problems(out, m, checked)
    hashed = hashed.add(also)
    common_why = problems.get(m.common.path) or _common_header_problem(out, m, common)
    for tp in (t for t in asked if t in m.tp_sizes and t not in sets):
        why = next((f"{r.file.path} {problems[r.file.path]}" for r in m.tensor_parallel_set(tp).ranks if r.file.path in problems),
                   None) or _rank_header_problem(out, m, tp)
        if why is not None:
            sets[tp] = why
    return _replace(base, sets=sets, common=common_why, hashed=hashed)


def _replace(f: Findings, **changes: object) -> Findings:
    return replace(f, **changes)  # type: ignore[arg-type]


def _kernels(layers: list[LayerEntry]) -> str:
    """``marlin``, ``machete`` or ``machete and marlin``: the layouts a TP set's layers hold."""
    return " and ".join(sorted({e.kernel.value for e in layers}))


def _rank_header_problem(out: Path, m: Manifest, tp: int) -> str | None:
    """Why a rank file of ``tp`` does not hold exactly what the manifest implies (its header), or None."""
    tp_set = m.tensor_parallel_set(tp)
    for r in tp_set.ranks:
        try:
            check_rank_header(m, tp_set, r.rank, read_header(resolve_file(out, r.file)))
        except (MarlinPackError, SafetensorsFormatError, OSError, ValueError) as e:
            return _fact(str(e))
    return None


def _common_header_problem(out: Path, m: Manifest, common: Mapping[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Why the common file does not hold this checkpoint's common tensors (less the aliases), with the manifest's metadata."""
    try:
        header = read_header(resolve_file(out, m.common))
    except (MarlinPackError, SafetensorsFormatError, OSError, ValueError) as e:
        return f"cannot be read ({e})"
    if dict(header.metadata) != common_metadata(m.format_version):
        return f"has metadata {dict(header.metadata)}, expected {common_metadata(m.format_version)}"
    want = {n: spec for n, spec in common.items() if n not in m.common_aliases}
    found = {n: (i.dtype, tuple(i.shape)) for n, i in header.tensors.items()}
    if found != want:
        name = next(iter(sorted(set(want) ^ set(found)) or sorted(n for n in want if want[n] != found[n])))
        what = "lacks" if name not in found else "has unexpected" if name not in want else "has another shape or dtype of"
        return f"{what} {name} (this checkpoint's common tensors)"
    return None


@dataclass(frozen=True)
class Update:
    """What :func:`decide` decided: the TP sizes written, kept and dropped, whether the common file is written, the
    format version of the bundle, and one line saying what is done and why."""

    write: tuple[int, ...] = ()
    keep: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    common: bool = False
    format_version: int = FORMAT_VERSION
    summary: str = ""
    why: str = ""  # the reason, for a message where it cannot be done

    @property
    def up_to_date(self) -> bool:
        return not self.write and not self.common

    @property
    def whole(self) -> bool:
        """Every file is written: nothing of what is there is kept."""
        return self.common and not self.keep


def _sizes(tps: Iterable[int]) -> str:
    return ", ".join(f"tp{t}" for t in tps)


def _version(sizes: Iterable[int], machete: frozenset[int]) -> int:
    return MACHETE_FORMAT_VERSION if set(sizes) & machete else FORMAT_VERSION


def decide(f: Findings, asked: Sequence[int], force: bool = False) -> Update:
    """What ``convert`` does at its output, from :func:`assess`'s findings (pure).

    Raises:
        OutputExistsError: the output is not a bundle (nor nothing, nor an empty directory), or (without ``force``) a
            bundle of a newer format.
    """
    want = tuple(sorted(set(asked)))
    version = _version(want, f.machete)
    if f.state is State.other:
        raise OutputExistsError(f.why or "the output is not a bundle")
    if f.state is State.missing:
        return Update(write=want, common=True, format_version=version, summary=f"{_sizes(want)} (a new bundle)", why="there is no bundle")
    if f.state is State.empty:
        return Update(write=want, common=True, format_version=version, summary=f"{_sizes(want)} into the empty directory",
                      why="the directory is empty")
    if f.newer and not force:
        raise OutputExistsError(f"{f.why}; pass `force=True` to replace it with this marlin-pack's, or `output=DIR` to write it elsewhere")
    dropped = tuple(t for t in f.held if t not in want)
    if force or f.whole:
        return _whole(want, dropped, version, "`force=True`" if force else f.whole or "")
    write = tuple(t for t in want if t not in f.held or t in f.sets)
    if not write and f.common is None:
        return Update(keep=f.held, format_version=f.held_format or version, summary="up to date")
    keep = tuple(t for t in f.held if t not in f.sets)
    drop = tuple(t for t in f.held if t in f.sets and t not in want)
    parts, whys = [], []
    added = [t for t in write if t not in f.held]
    if added:
        parts.append(f"added {_sizes(added)}")
        whys.append(f"{_sizes(added)} {'is' if len(added) == 1 else 'are'} not in it")
    for t in write:
        if t in f.held:
            parts.append(f"rewrote tp{t}: {f.sets[t]}")
            whys.append(f.sets[t])
    if f.common is not None:
        parts.append(f"rewrote {COMMON_FILE}: it {f.common}")
        whys.append(f"{COMMON_FILE} {f.common}")
    version = _version(write + keep, f.machete)
    if f.held_format != version and (keep or f.common is None):  # the files kept carry the format version in their metadata
        why = f"{'; '.join(whys)} (format {version}; the bundle's other files are format {f.held_format}: none kept)"
        return _whole(want, dropped, version, why)
    if keep:
        parts.append(f"{_sizes(keep)} kept")
    for t in drop:
        parts.append(f"dropped tp{t} (not asked): {f.sets[t]}")
    return Update(write=write, keep=keep, drop=drop, common=f.common is not None, format_version=version,
                  summary="; ".join(parts), why="; ".join(whys))


def _whole(want: tuple[int, ...], dropped: tuple[int, ...], version: int, why: str) -> Update:
    summary = f"rewrote {_sizes(want)} and {COMMON_FILE}: {why}"
    if dropped:
        summary += f"; dropped {_sizes(dropped)} (not asked)"
    return Update(write=want, drop=dropped, common=True, format_version=version, summary=summary, why=why)
