"""``verify``: prove a bundle is intact and faithful to its source, by reading it back.

Never trusts the writer: sizes and hashes of every file, every tensor's presence,
dtype and shape, then a numerical round trip against the source checkpoint, bit for bit:
the weights are compared with the checkpoint's codes laid out by the index-based definition
of Marlin's layout (:func:`~marlin_pack.marlin.repack.pack_marlin_weights`, not the
converter's word repack; padding included), and a shard that differs is decoded to name the
first differing code; scales, zero points and bias are decoded from Marlin's layout and
compared, with their padding checked to be zero.

Every tensor is read with ``pread`` (:class:`~marlin_pack.io.preads.TensorFile`), never through a memory
map: a bundle or checkpoint file truncated while it is verified fails its check in one line ("changed
while it was read"), where a mapped page past the new end would kill the process with SIGBUS.

Each file is read once. With a checkpoint to compare with, the "files" and "source" checks check sizes and headers
and leave the BLAKE3 digests to the comparisons' reads (:class:`~marlin_pack.io.preads.HashedTensorFile`): every
tensor read for a comparison is hashed from the same bytes, and only what no comparison reads (headers, padding,
tensors nobody compares) is read for the digest alone. The round trip runs before "common" (a checkpoint file holds its
non-quantized tensors after its codes), each reported in its place. The digests are compared once the comparisons are
done, or stopped at a failure (:func:`_settle`): a file whose digest differs fails "files" (a bundle file) or "source"
(a checkpoint file) in the words of those checks, and the report ends there, whatever a later check found, as when the
files were hashed before anything read them (the bundle's files before the checkpoint's). A file a comparison read
changing under it is that comparison's failure ("changed while it was read"); one that changed after the comparisons,
while the rest of it was read for its digest, fails "files" or "source" ("changed while it was hashed"). Without a
checkpoint (``integrity_only``), "files" hashes the bundle whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from marlin_pack._constants import BUNDLE_DIRNAME, COMMON_FILE
from marlin_pack.bundle.integrity import PendingHash, check_files, check_source, settle_pending
from marlin_pack.bundle.rank_files import check_rank_header, rank_tensor_specs
from marlin_pack.bundle.reader import read_manifest, resolve_file
from marlin_pack.errors import BundleError, CheckpointError, MarlinPackError
from marlin_pack.io.hashing import HashedFile, HeldBytes, file_digests
from marlin_pack.io.preads import FileChangedError, HashedTensorFile
from marlin_pack.io.safetensors_io import SafetensorsFormatError, SafetensorsHeader, TensorInfo, read_header, unpacked
from marlin_pack.machete.layout import machete_zero_points, prepack_codes, prepack_offsets_slow, stream_code
from marlin_pack.machete.tensors import decode_machete_tensors
from marlin_pack.marlin.packed_codes import PackedCodes
from marlin_pack.marlin.rank_tensors import decode_rank_tensors, param_names, tensor_specs
from marlin_pack.marlin.repack import awq_to_natural, pack_marlin_weights, pad2d, unpack_awq_cols, unpack_marlin_weights
from marlin_pack.marlin.sharding import fuse_rank_slices, rank_slices, read_layer_parts
from marlin_pack.moe_verification import check_moe_layers
from marlin_pack.planning import ConversionPlan, layer_weight_shape, plan_conversion
from marlin_pack.remedies import convert_command
from marlin_pack.schemas import LayerEntry, LayerKernel, Manifest, torch_dtype
from marlin_pack.sources import Checkpoint, source_from_quant_config
from marlin_pack.sources.hub import cache_root, resolve_model

__all__ = ["Check", "VerifyReport", "verify"]


Status = Literal["ok", "failed", "skipped"]
_SOURCE_STAGES = ("source", "plan", "layout", "common", "round-trip")


@dataclass
class Check:
    """One stage of :func:`verify`: its name, its status, and what it found."""

    name: str
    status: Status
    detail: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "status": self.status, "detail": self.detail}


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`: one :class:`Check` per stage, in order.

    ``ok`` is True only if no check failed and every check ran, except the source checks
    when ``integrity_only`` was asked for: a skipped check is never silently "ok".
    """

    bundle: Path
    source: Path | None
    integrity_only: bool = False
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == "failed" for c in self.checks) and not self.incomplete

    @property
    def incomplete(self) -> bool:
        """Some check did not run although it was asked for."""
        return any(c.status == "skipped" and not self.integrity_only for c in self.checks)

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if c.status == "failed"), None)


class _Failed(Exception):
    pass


def _source(source: str | Path) -> Path:
    """``--source``: a directory, or a repo id in the Hugging Face cache (never downloaded by verify)."""
    try:
        return resolve_model(source, download=False).dir
    except CheckpointError:
        return Path(source)  # the source check reports what is wrong with it


def _default_source(bundle: Path) -> Path | None:
    """The checkpoint of a bundle at a default location: ``MODEL_DIR/marlin-pack``, or the
    marlin-pack cache entry ``models--ORG--NAME/COMMIT`` of a repo id in the Hugging Face cache."""
    resolved = bundle.resolve()
    parent = resolved.parent
    if resolved.name == BUNDLE_DIRNAME and (parent / "config.json").is_file():
        return parent
    if parent.name.startswith("models--") and parent.parent == cache_root().resolve():
        repo = parent.name.removeprefix("models--").replace("--", "/", 1)
        try:
            return resolve_model(repo, resolved.name, download=False).dir
        except CheckpointError:
            return None
    return None


def verify(
    bundle_dir: str | Path,
    source_dir: str | Path | None = None,
    *,
    integrity_only: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> VerifyReport:
    """Verify a bundle; never raises on a bad bundle, reports instead.

    Args:
        bundle_dir: the bundle directory.
        source_dir: the checkpoint it was made from (a directory, or a repo id in the Hugging
            Face cache); default: the bundle's parent when the bundle sits at its default location
            ``MODEL_DIR/marlin-pack``, or the cached repo snapshot of a bundle in marlin-pack's cache.
        integrity_only: check the bundle alone (manifest, files, tensors); the source
            checks are reported as skipped and do not make the report fail. Without it, a
            bundle whose source is unknown fails as incomplete.
        progress: called as ``progress(done, total, layer_name)`` during the round trip.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True only if every check asked for ran and passed.
    """
    bundle = Path(bundle_dir)
    source = None if integrity_only else _source(source_dir) if source_dir is not None else _default_source(bundle)
    report = VerifyReport(bundle=bundle, source=source, integrity_only=integrity_only)
    reads = _Reads()
    pending: dict[str, tuple[PendingHash, ...]] = {}  # per check ("files", "source"): digests left to the comparisons' reads
    try:
        with contextlib.suppress(_Failed):  # (the failed check is in the report)
            _stages(report, reads, pending, progress)
        _settle(report, reads, pending)
    finally:
        reads.close()
    return report


def _stages(
    report: VerifyReport, reads: _Reads, pending: dict[str, tuple[PendingHash, ...]],
    progress: Callable[[int, int, str], None] | None,
) -> None:
    """Run the checks in order, each appended to ``report``; :class:`_Failed` at the first that fails."""
    bundle, source = report.bundle, report.source

    def stage(name: str, fn: Callable[[], str]) -> None:
        try:
            report.checks.append(Check(name, "ok", fn()))
            return
        except MarlinPackError as e:
            error, detail = e, str(e)
        except FileChangedError as e:  # a bundle file read short: truncated while it was verified
            error, detail = e, f"bundle file {Path(e.filename).name} {e.strerror}; verify again once nothing writes it"
        except Exception as e:  # a malformed file that slipped past the header checks: still a report
            error, detail = e, f"{type(e).__name__}: {e}"
        report.checks.append(Check(name, "failed", detail))
        reads.changed = isinstance(error, FileChangedError) or isinstance(error.__cause__, FileChangedError)
        raise _Failed from error

    manifest: Manifest | None = None

    def _manifest() -> str:
        nonlocal manifest
        manifest = read_manifest(bundle)
        return f"format v{manifest.format_version}, vLLM {manifest.target.vllm_version}, tp {manifest.tp_sizes}"

    stage("manifest", _manifest)
    assert manifest is not None
    m = manifest
    files = f"{len(m.files())} files, sizes and BLAKE3 digests match"
    if source is None:  # nothing else reads the bundle: hashed whole here
        stage("files", lambda: (check_files(bundle, m, full_hash=True), files)[1])
        stage("tensors", lambda: _check_tensor_specs(bundle, m))
        why = (
            "skipped (`integrity_only=True`)"
            if report.integrity_only
            else "skipped: no checkpoint to compare with; pass `source=MODEL_DIR`, or `integrity_only=True` to check the bundle alone"
        )
        report.checks.extend(Check(name, "skipped", why) for name in _SOURCE_STAGES)
        return

    def _files() -> str:  # sizes now; the digests from the comparisons' reads (_settle)
        pending["files"] = check_files(bundle, m, full_hash=True, leave_to_copy=lambda _: True).pending
        return files

    def _source_files() -> str:
        pending["source"] = check_source(m, source, full_hash=True, leave_to_copy=lambda _: True).pending
        return "checkpoint files match the manifest"

    stage("files", _files)
    stage("tensors", lambda: _check_tensor_specs(bundle, m))
    stage("source", _source_files)
    ckpt: Checkpoint | None = None
    plan: ConversionPlan | None = None

    def _open(path: Path, identity: tuple[int, ...]) -> HashedTensorFile:
        assert ckpt is not None
        return reads.open(path, identity=identity, expected=_compared(ckpt, plan, path.name))

    def _plan() -> str:
        nonlocal ckpt, plan
        ckpt = Checkpoint(source, open_file=_open)
        qc = ckpt.quantization_config()
        kernel = LayerKernel.machete if m.has_machete_layers else LayerKernel.marlin
        plan = plan_conversion(ckpt, source_from_quant_config(qc), m.tp_sizes, torch_dtype(m.serving_dtype), kernel)
        return f"{plan.source.describe()}, {len(plan.layers)} quantized layers"

    stage("plan", _plan)
    assert ckpt is not None and plan is not None
    stage("layout", lambda: _check_layout(m, plan))
    # The round trip runs before "common" and is reported after it, as if it ran after: a checkpoint file holds its
    # non-quantized tensors among the scales, after the codes, where its hash gets only once the round trip read those.
    round_trip = _ran(lambda: _round_trip(bundle, m, ckpt, plan, progress, reads))
    stage("common", lambda: _check_common(bundle, m, ckpt, plan, reads))
    stage("round-trip", round_trip)


def _ran(check: Callable[[], str]) -> Callable[[], str]:
    """Run ``check`` now; what it returned or raised, given again by the callable returned."""
    try:
        detail = check()
    except Exception as e:  # noqa: BLE001 - raised again where the check is reported
        error = e

        def again() -> str:
            raise error

        return again
    return lambda: detail


class _Reads:
    """The bundle's and the checkpoint's files as the comparisons read them: each opened once, as a
    :class:`~marlin_pack.io.preads.HashedTensorFile` whose reads also give its digest; the bytes kept for the digests
    (ranges read before those ahead of them in their file) share one limit (:data:`~marlin_pack.io.hashing.HELD`)."""

    def __init__(self) -> None:
        self.held = HeldBytes()
        self.files: dict[str, HashedTensorFile] = {}
        self.changed = False  # the check that failed read a file changing under it (FileChangedError) and said so

    def open(
        self, path: Path, tensors: Mapping[str, TensorInfo] | None = None, identity: tuple[int, ...] | None = None,
        expected: Iterable[TensorInfo] = (),
    ) -> HashedTensorFile:
        """The file at ``path``, opened at the first call (``tensors``, ``identity``: :class:`~marlin_pack.io.preads.TensorFile`'s;
        ``expected``: the tensors the comparisons will read); the same object after. Closed by :meth:`close`."""
        f = self.files.get(str(path))
        if f is None:
            f = self.files[str(path)] = HashedTensorFile(path, tensors, identity, expected=expected, held=self.held)
        return f

    def digests(self, paths: list[Path]) -> dict[str, HashedFile | OSError]:
        """Per file (by ``str(path)``), its digest or the OSError why there is none: a file the comparisons opened from
        their reads and what they left (:meth:`~marlin_pack.io.preads.HashedTensorFile.finish`), another hashed whole."""
        found: dict[str, HashedFile | OSError] = {}
        for path in paths:
            if (f := self.files.get(str(path))) is not None:
                try:
                    found[str(path)] = f.finish()
                except OSError as e:
                    found[str(path)] = e
        rest = [p for p in paths if str(p) not in found]
        found.update(zip(map(str, rest), file_digests(rest), strict=True))
        return found

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def _settle(report: VerifyReport, reads: _Reads, pending: dict[str, tuple[PendingHash, ...]]) -> None:
    """The digests left to the comparisons' reads, compared (and stamped, as ``check`` stamps) now that the comparisons
    are done or stopped: the first file, in order, whose digest differs or that changed while it was hashed fails its
    check ("files" for the bundle's, "source" for the checkpoint's) in that check's words, and the checks after it are
    dropped, as if it had failed first (it did: the checks after it read a file it refuses). Except where the check that
    failed read a file changing under it and said so ("changed while it was read", as before digests came from the
    comparisons' reads): then the files that changed while hashed are that failure, which stands; the digests of the
    others still come first."""
    for name in ("files", "source"):
        left = pending.get(name)
        if not left:
            continue
        try:
            found = reads.digests([p.path for p in left])
            if reads.changed:
                left = tuple(p for p in left if not isinstance(found[str(p.path)], FileChangedError))
            settle_pending(left, found, every_time=True)
        except Exception as e:  # noqa: BLE001 - a report, as a check's own failure is
            at = next(i for i, c in enumerate(report.checks) if c.name == name)
            report.checks[at:] = [Check(name, "failed", str(e) if isinstance(e, MarlinPackError) else f"{type(e).__name__}: {e}")]
            return


def _compared(ckpt: Checkpoint, plan: ConversionPlan | None, file: str) -> list[TensorInfo]:
    """The tensors of the checkpoint file ``file`` the comparisons read: all but those of the layers vLLM skips."""
    skipped = plan.dims.skipped_prefixes if plan is not None else ()
    return [i for n, i in ckpt.tensors.items() if i.file == file and not (skipped and n.startswith(skipped))]


def _redo(bundle: Path, m: Manifest) -> str:
    """The advice for a damaged bundle file: the whole command that writes it again."""
    return f"re-run `{convert_command(bundle, manifest=m)}`"


def _header(path: Path, redo: str) -> SafetensorsHeader:
    try:
        return read_header(path)
    except (SafetensorsFormatError, OSError) as e:
        raise BundleError(f"{e}; {redo}") from e


def _tensors(path: Path, redo: str, reads: _Reads) -> HashedTensorFile:
    """A bundle file's tensors, read with ``pread`` and hashed as read (``reads``); its header checked first, and its
    layout as safetensors checks it."""
    header = _header(path, redo)
    try:
        f = reads.open(path, header.tensors, expected=header.tensors.values())
    except OSError as e:
        raise BundleError(f"cannot open {path.name} ({e.strerror or e}); {redo}") from e
    if (why := unpacked(header, f.size)) is not None:
        raise BundleError(f"{path.name} is not a file safetensors reads ({why}); {redo}")
    return f


def _check_tensor_specs(bundle: Path, m: Manifest) -> str:
    n = 0
    for tp_set in m.tensor_parallel:
        for r in tp_set.ranks:
            check_rank_header(m, tp_set, r.rank, _header(resolve_file(bundle, r.file), _redo(bundle, m)))
        n += len(tp_set.ranks) * len(rank_tensor_specs(tp_set, m.quant, m.serving_dtype, m.source.format))
    _header(resolve_file(bundle, m.common), _redo(bundle, m))
    return f"{n} layer tensors present with the declared dtype and shape"


def _check_layout(m: Manifest, plan: ConversionPlan) -> str:
    if m.quant != plan.source.scheme:
        raise MarlinPackError(f"manifest quant {m.quant} differs from the checkpoint's {plan.source.scheme}")
    for tp_set in m.tensor_parallel:
        if tp_set.layers != plan.entries[tp_set.tp_size]:
            raise MarlinPackError(f"tp {tp_set.tp_size}: layer shapes in the manifest differ from those the checkpoint implies")
        if tp_set.moe_layers != (plan.moe.entries(tp_set.tp_size) if plan.moe else []):
            raise MarlinPackError(f"tp {tp_set.tp_size}: experts layers in the manifest differ from those the checkpoint implies")
    experts = f", {len(plan.moe.layers)} experts layers" if plan.moe else ""
    return f"{len(plan.layers)} layers{experts}, shapes agree with the checkpoint"


def _check_common(bundle: Path, m: Manifest, ckpt: Checkpoint, plan: ConversionPlan, reads: _Reads) -> str:
    path = resolve_file(bundle, m.common)
    found = set(_header(path, _redo(bundle, m)).tensors)
    aliases = m.common_aliases
    if found & set(aliases) or sorted(found | set(aliases)) != plan.common:
        names = found | set(aliases)
        missing = sorted(set(plan.common) - names) or sorted(names - set(plan.common)) or sorted(found & set(aliases))
        raise MarlinPackError(f"{COMMON_FILE}: tensor set differs from the checkpoint's non-quantized tensors ({missing[0]})")
    by_stored: dict[str, list[str]] = {}  # each stored tensor read once, for every name it stands for
    for name in plan.common:
        stored = aliases.get(name, name)
        if stored not in found:
            raise MarlinPackError(f"{COMMON_FILE}: common_aliases maps {name} to {stored}, which the file does not hold")
        by_stored.setdefault(stored, []).append(name)
    f = _tensors(path, _redo(bundle, m), reads)
    for stored in sorted(by_stored, key=lambda n: f.tensors[n].start):  # in file order
        got = f.get_tensor(stored)
        for name in by_stored[stored]:
            if not _bitwise_equal(got, ckpt.get(name)):
                raise MarlinPackError(f"{COMMON_FILE}: tensor {name} differs from the checkpoint")
    once = f", {len(aliases)} stored once for two names" if aliases else ""
    return f"{len(plan.common)} non-quantized tensors equal the checkpoint's{once}"


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _round_trip(
    bundle: Path, m: Manifest, ckpt: Checkpoint, plan: ConversionPlan, progress: Callable[[int, int, str], None] | None,
    reads: _Reads,
) -> str:
    redo = _redo(bundle, m)
    handles = {(s.tp_size, r.rank): _tensors(resolve_file(bundle, r.file), redo, reads) for s in m.tensor_parallel for r in s.ranks}
    return _round_trip_ranks(m, ckpt, plan, progress, handles)


def _round_trip_ranks(
    m: Manifest, ckpt: Checkpoint, plan: ConversionPlan, progress: Callable[[int, int, str], None] | None,
    handles: dict[tuple[int, int], HashedTensorFile],
) -> str:
    dtype = torch_dtype(m.serving_dtype)
    g = m.quant.group_size
    checked = 0
    for li, spec in enumerate(plan.layers):
        parts = read_layer_parts(spec, lambda prefix, k, n: plan.source.read(ckpt, prefix, k, n, torch.device("cpu")))
        for tp_set in m.tensor_parallel:
            entry = tp_set.layers[li]
            for rank in range(tp_set.tp_size):
                f = handles[(tp_set.tp_size, rank)]
                tensors = {n: f.get_tensor(n) for n, _, _ in tensor_specs(entry, m.quant, dtype, m.source.format)}
                packed, scales, zeros, bias = fuse_rank_slices(rank_slices(spec, plan.dims, tp_set.tp_size, rank), parts, g)
                if parts[spec.parts[0].name].column_slots is not None:  # AWQ zero points' slot order -> natural
                    zeros = awq_to_natural(zeros)
                where = f"{entry.name} (tp {tp_set.tp_size} rank {rank})"
                weights = tensors[f"{entry.name}.{param_names(m.source.format).weight}"]
                if entry.kernel is LayerKernel.machete:
                    _check_machete_shard(entry, m, tensors, packed, scales.to(dtype), zeros, bias, where)
                    checked += 1
                    continue
                got = decode_rank_tensors(entry, m.quant, tensors, m.source.format)
                _compare_weights(weights, packed, entry.padded_k, entry.padded_n, where)
                _compare_padded(got["scales"], scales.to(dtype), f"{where}: scales")
                if zeros is not None:
                    _compare_padded(got["zeros"], zeros, f"{where}: zero points")
                if bias is not None:
                    _compare_padded(got["bias"].view(1, -1), bias.to(dtype).view(1, -1), f"{where}: bias")
                shape_name = param_names(m.source.format).shape
                if shape_name is not None:
                    want_shape = layer_weight_shape(ckpt, spec, parts)
                    if want_shape is None or not torch.equal(tensors[f"{entry.name}.{shape_name}"], want_shape.to(torch.int64)):
                        raise MarlinPackError(f"{where}: {shape_name} differs from the checkpoint's")
                checked += 1
        if progress:
            progress(li + 1, len(plan.layers), spec.name)
    experts = ""
    if plan.moe is not None:
        experts = f"; {check_moe_layers(m, ckpt, plan.moe, plan.source, handles)} experts layer shards equal their rebuild"
    layouts = "Machete's or Marlin's layout" if m.has_machete_layers else "Marlin's layout"
    return f"{checked} layer shards equal the checkpoint's codes, scales and zero points in {layouts}, bit for bit{experts}"


def _check_machete_shard(
    entry: LayerEntry, m: Manifest, tensors: dict[str, torch.Tensor], packed: PackedCodes, scales: torch.Tensor,
    zeros: torch.Tensor | None, bias: torch.Tensor | None, where: str,
) -> None:
    """A Machete shard against the checkpoint: its code stream equal to the codes laid out by the fast path, and
    at sampled positions by the index-based definition (:func:`~marlin_pack.machete.layout.prepack_offsets_slow`);
    scales, pre-scaled zero points (``-s*z`` rebuilt from the checkpoint's codes) and bias bit for bit."""
    names = tuple(param_names(m.source.format))
    got = decode_machete_tensors(entry, m.quant, tensors, names)  # type: ignore[arg-type]
    codes = packed.unpack().to(torch.uint8)
    weights = tensors[f"{entry.name}.{names[0]}"]
    if not _bitwise_equal(weights, prepack_codes(codes, m.quant.bits)):
        _compare_padded(got["codes"], codes, f"{where}: integer codes")
        raise MarlinPackError(f"{where}: integer codes differ from the checkpoint")
    k, n = entry.size_k, entry.size_n
    gen = torch.Generator().manual_seed(k * 131 + n)
    for kk, nn in zip(torch.randint(k, (256,), generator=gen).tolist(), torch.randint(n, (256,), generator=gen).tolist(), strict=True):
        offset = prepack_offsets_slow(kk, nn, k, n, m.quant.bits)
        if stream_code(weights, offset, m.quant.bits) != int(codes[kk, nn]):
            raise MarlinPackError(f"{where}: code ({kk}, {nn}) is not where Machete's layout definition puts it")
    _compare_padded(got["scales"], scales, f"{where}: scales")
    if zeros is not None:
        want = machete_zero_points(zeros, scales)  # zeros: natural column order already
        _compare_padded(got["zp_scaled"], want, f"{where}: zero points (-scale * zero)")
    if bias is not None:
        _compare_padded(got["bias"].view(1, -1), bias.to(scales.dtype).view(1, -1), f"{where}: bias")


def _compare_weights(weights: torch.Tensor, packed: PackedCodes, padded_k: int, padded_n: int, where: str) -> None:
    """A shard's Marlin weights against the checkpoint's codes, zero-padded and laid out by the index-based
    definition (AWQ's column order folded into its gather index); on a difference, decode the shard to name
    the first differing code. Comparing in Marlin's layout moves a fraction of the bytes that decoding
    every shard would (figures: docs/performance.md, "verify")."""
    if packed.along == "n" and packed.slots is not None:
        codes, slots = unpack_awq_cols(packed.words), packed.slots
    else:
        codes, slots = packed.unpack(), None
    want = pack_marlin_weights(pad2d(codes, padded_k, padded_n), packed.bits, slots)
    if _bitwise_equal(weights, want):
        return
    _compare_padded(unpack_marlin_weights(weights, packed.bits), packed.unpack().to(torch.uint8), f"{where}: integer codes")
    raise MarlinPackError(f"{where}: integer codes differ from the checkpoint")  # the layouts differ where decoding agrees


def _compare_padded(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    rows, cols = want.shape
    if not _bitwise_equal(got[:rows, :cols].contiguous(), want.contiguous()):
        bad = (got[:rows, :cols] != want).nonzero()
        at = tuple(bad[0].tolist()) if len(bad) else "?"
        raise MarlinPackError(f"{what} differ from the checkpoint (first at {at})")
    pad = torch.cat([got[rows:, :].reshape(-1), got[:rows, cols:].reshape(-1)])
    if pad.numel() and bool((pad != 0).any()):
        raise MarlinPackError(f"{what}: padding is not zero")
