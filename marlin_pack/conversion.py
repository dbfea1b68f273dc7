"""``convert``: an AWQ/GPTQ checkpoint into a Marlin bundle, streamed layer by layer.

A thin orchestration: :func:`~marlin_pack.planning.plan_conversion` validates everything it can from headers
(``sources`` and ``marlin.sharding``), then each layer is read, sliced per rank, laid out
(``marlin.rank_tensors``) and streamed into the rank files of a
:class:`~marlin_pack.bundle.writer.BundleWriter`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from marlin_pack._constants import MADE_WITH_VLLM
from marlin_pack._version import __version__
from marlin_pack.bundle.existing import Findings, State, Update, assess, decide, look, output_state
from marlin_pack.bundle.integrity import HashReport, source_digest
from marlin_pack.bundle.output_lock import output_lock
from marlin_pack.bundle.writer import BundleWriter, check_output, follow_output
from marlin_pack.dtypes import serving_dtype_for
from marlin_pack.errors import CheckpointError, MarlinPackError, OutputExistsError
from marlin_pack.io.hashing import FileChangedError, HashedFile, hash_file, hash_workers
from marlin_pack.io.residency import WRITE_ENV, available_memory, write_through_cache
from marlin_pack.io.safetensors_io import StreamWriter
from marlin_pack.io.sampling import sample_digest
from marlin_pack.kernel_choice import parse_kernel
from marlin_pack.marlin.moe import ExpertTensors, naming_paths
from marlin_pack.marlin.rank_tensors import build_rank_tensors, tensor_specs
from marlin_pack.marlin.sharding import (
    ModuleTensors,
    checkpoint_modules,
    fuse_rank_slices,
    rank_slices,
    read_layer_parts,
)
from marlin_pack.marlin.transformers_backend import recorded_transformers
from marlin_pack.moe_conversion import build_moe_layer, read_moe_layer
from marlin_pack.planning import ConversionPlan, layer_weight_shape, plan_conversion
from marlin_pack.progress import as_progress_fn
from marlin_pack.remote.url import refuse_url
from marlin_pack.schemas import (
    LayerKernel,
    Manifest,
    Producer,
    ServingDtype,
    Source,
    SourceFile,
    Target,
    output_head_problem,
    target_kernel,
    torch_dtype,
)
from marlin_pack.sources import Checkpoint, QuantSource, source_from_quant_config
from marlin_pack.sources.hub import bundle_dir_for, cache_root, resolve_model
from marlin_pack.stages import Device, ReadAhead

__all__ = ["convert", "Converted", "resolve_dtype", "ProgressFn"]

ProgressFn = Callable[[int, int, str], None]


def resolve_dtype(config: dict, dtype: str | None, weight_dtypes: Iterable[str] = ()) -> ServingDtype:
    """The serving dtype: what ``vllm serve --dtype DTYPE`` runs in (default ``auto``: from the config), so a
    default bundle fits a default engine (:func:`~marlin_pack.dtypes.serving_dtype_for`)."""
    try:
        return serving_dtype_for(dtype, config, weight_dtypes)
    except ValueError as e:
        raise MarlinPackError(str(e)) from e


def tied_copies(ckpt: Checkpoint, plan: ConversionPlan) -> dict[str, str]:
    """A tied output head saved as a byte-identical copy of the input embeddings: ``{head: embeddings}``.

    Quantizers often save the tied ``lm_head`` anyway; vLLM loads it, finds it equal and
    ties the two again. The bundle stores it once and feeds it under both names. Only the head is
    considered (never, say, two norms that happen to be equal: a weight loader may change what it
    is given in place), and only against tensors of its dtype and shape whose name says embedding.
    """
    def raw(name: str) -> torch.Tensor:
        return ckpt.get(name).reshape(-1).view(torch.uint8)

    def spec(name: str) -> tuple[str, tuple[int, ...]]:
        return ckpt.tensors[name].dtype, tuple(ckpt.tensors[name].shape)

    copies: dict[str, str] = {}
    for head in (n for n in plan.common if output_head_problem(n, plan.dims.architecture) is None):  # the manifest's rule
        candidates = [n for n in plan.common if "embed" in n and spec(n) == spec(head)]
        if not candidates:
            continue
        head_bytes = raw(head)  # read once, whatever the number of candidates
        match = next((n for n in candidates if torch.equal(raw(n), head_bytes)), None)
        if match is not None:
            copies[head] = match
    return copies


def _source_hash(name: str, fut: Future[HashedFile]) -> HashedFile:
    """A source file's hash; a file written or replaced while it was hashed is a one-line refusal."""
    try:
        return fut.result()
    except FileChangedError as e:
        raise CheckpointError(
            f"{name} {e.strerror}; nothing was written, re-run when the checkpoint is no longer being written"
        ) from e


def _source_sample(path: Path) -> tuple[str, str]:
    """A source file's header digest and samples (marlin_pack.io.sampling: what a start compares instead of its BLAKE3)."""
    try:
        return sample_digest(path)
    except FileChangedError as e:
        raise CheckpointError(
            f"{path.name} {e.strerror}; nothing was written, re-run when the checkpoint is no longer being written"
        ) from e


def _source_entry(ckpt: Checkpoint, plan: ConversionPlan, hashes: list[tuple[str, Future[HashedFile]]]) -> Source:
    found = ckpt.quant_settings()
    if found is None:  # plan.source was read from these settings: unreachable unless the config changed meanwhile
        raise CheckpointError(f"{ckpt.dir}'s quantization settings disappeared while converting; re-run when the checkpoint is complete")
    files = [
        SourceFile(
            name=name,
            size=(ckpt.dir / name).stat().st_size,
            blake3=_source_hash(name, fut).digest,
            header_sha256=header,
            sample_sha256=sample,
        )
        for name, fut in hashes
        for header, sample in [_source_sample(ckpt.dir / name)]
    ]
    # Only the settings that decide the bundle: the rest of quantization_config (calibration
    # data, paths, dates) neither goes into the manifest nor makes the bundle stale.
    digest = source_digest([(f.name, f.blake3) for f in files], found.settings, found.file)
    return Source(
        format=plan.source.format,
        architecture=plan.dims.architecture,
        model_type=plan.dims.model_type,
        files=files,
        quant_settings=found.settings,
        quant_settings_file=found.file,
        digest=digest,
    )


def _device(device: str) -> torch.device:
    if device != "cpu" and not device.startswith("cuda"):
        raise MarlinPackError(f"`device={device!r}` is not supported; expected 'cpu' or 'cuda[:N]'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MarlinPackError(f"`device={device!r}` asked for, but no CUDA GPU is available; use `device='cpu'`")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise MarlinPackError(f"`device={device!r}` is not a valid device; expected 'cpu' or 'cuda[:N]'") from e


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads (None: unchanged), restoring the setting after.

    On CPU the conversion's parallelism is its own threads (writing, hashing) beside the tensor
    work; torch's OpenMP workers would compete with them for the cores and spin while waiting
    (measured on 2 cores: 1.1 s of the 2.5 s of user time of llama-1gb went to spinning).
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)


def _layer_tensors(parts: dict[str, ModuleTensors]) -> Iterator[torch.Tensor]:
    """Every tensor a layer's parts hold (views included): what the repack's stream takes over from the read's."""
    for m in parts.values():
        yield m.codes.words
        yield m.scales
        yield from (t for t in (m.zeros, m.bias, m.weight_shape) if t is not None)


def _writer_hash_threads(n_writers: int) -> int:
    """BLAKE3 threads per rank writer: one on small machines (the cores are busy converting); on large
    ones a few, so that hashing a 70B model's single rank file is not one core's work."""
    return max(1, min(8, (os.cpu_count() or 1) // (4 * n_writers)))


def _expert_tensors(experts: list[ExpertTensors]) -> Iterator[torch.Tensor]:
    """Every tensor one experts layer's read holds (see :func:`_layer_tensors`)."""
    for ex in experts:
        yield from _layer_tensors({"gate": ex.gate, "up": ex.up, "down": ex.down})


def _experts_memory(w: StreamWriter, dev: torch.device) -> Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor]:
    """Where one rank's stacked experts tensors are built: the writer's recycled buffers on the CPU;
    on a GPU device memory, copied back into pinned writer buffers like a dense layer's results."""
    if dev.type == "cuda":
        return lambda name, dtype, shape: torch.empty(shape, dtype=dtype, device=dev)
    return lambda name, dtype, shape: w.empty(name)


def _spec_bytes(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(d.itemsize * math.prod(shape) for _, d, shape in specs)


def _bundle_bytes_estimate(ckpt: Checkpoint, plan: ConversionPlan, tps: list[int]) -> int:
    """About the bundle's size before it is written: the common tensors once, the quantized ones once per TP size
    (repacking keeps a weight's bytes; scales and padding differ by a few percent). Decides the write path only."""
    common = sum(ckpt.tensors[n].nbytes for n in plan.common if n in ckpt.tensors)
    total = sum(t.nbytes for t in ckpt.tensors.values())
    return common + (total - common) * len(tps)


def _layer_read_bytes(ckpt: Checkpoint, plan: ConversionPlan) -> list[int]:
    """Each step's checkpoint bytes (its modules' tensors: what its read takes in), dense layers then experts layers."""
    by_module: dict[str, int] = {}
    for name, t in ckpt.tensors.items():
        module = name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + t.nbytes
    sizes = [sum(by_module.get(m.prefix, 0) for m in checkpoint_modules(spec)) for spec in plan.layers]
    if plan.moe and plan.moe.layers:
        moe, n_experts = plan.moe, next(iter(plan.moe.shapes.values())).num_experts
        leaves = (moe.naming.gate, moe.naming.up, moe.naming.down)
        sizes += [
            sum(by_module.get(f"{moe.expert(layer, e)}.{leaf}", 0) for e in range(n_experts) for leaf in leaves) for layer in moe.layers
        ]
    return sizes


def _convert_layers(
    ckpt: Checkpoint, plan: ConversionPlan, tps: list[int], dev: torch.device, bundle: BundleWriter, progress: ProgressFn | None
) -> None:
    """Read, repack and write every layer into the rank files, the three stages overlapping (see :mod:`marlin_pack.stages`).

    Layer N+1 (one fused linear: a :class:`LayerSpec`) is read on a thread while layer N is
    repacked here, and the rank writers' threads write and hash what came before, each holding
    at most two layers' bytes of output in flight (memory stays a few layers, whatever the model).

    A mixture-of-experts model's routed experts follow its dense layers (the rank files' order),
    one decoder layer's experts per step of the same read-ahead: read on the thread, stacked per
    rank by :func:`~marlin_pack.moe_conversion.build_moe_layer` (into the writer's recycled
    buffers on the CPU; on a GPU into device memory copied back like a dense layer's results).
    """
    source, scheme, tdtype = plan.source, plan.source.scheme, plan.dtype
    moe, moe_layers = plan.moe, plan.moe.layers if plan.moe else []
    n_dense, total = len(plan.layers), len(plan.layers) + len(moe_layers)
    device = Device(dev)
    report = as_progress_fn(progress) if progress else None
    read_bytes = _layer_read_bytes(ckpt, plan) if report else []  # the progress protocol's bytes: the checkpoint's, read
    bytes_total, bytes_done = sum(read_bytes), 0
    ranks: dict[tuple[int, int], StreamWriter] = {}
    for tp in tps:
        specs = [tensor_specs(e, scheme, tdtype, source.format) for e in plan.entries[tp]]
        experts_specs = moe.specs(tp, scheme, tdtype) if moe else []
        # Every experts layer has the same tensors: the first one's bytes are each one's.
        experts_bytes = _spec_bytes(experts_specs[: len(experts_specs) // len(moe_layers)]) if moe_layers else 0
        layer_bytes = max([experts_bytes] + [_spec_bytes(layer) for layer in specs])
        for rank in range(tp):
            ranks[(tp, rank)] = bundle.open_rank(
                # Bounded by bytes, not tensors: a small tensor after a large one need not wait for it.
                tp, rank, [s for layer in specs for s in layer] + experts_specs, max_in_flight=None,
                max_bytes_in_flight=2 * layer_bytes, pin_memory=device.cuda, hash_threads=_writer_hash_threads(sum(tps)),
            )

    def read(i: int) -> tuple[object, object]:
        with device.reading():
            if i < n_dense:
                read_layer = plan.layers[i]
                data: object = read_layer_parts(read_layer, lambda prefix, k, n: source.read(ckpt, prefix, k, n, dev))
            else:
                assert moe is not None
                data = read_moe_layer(moe, source, ckpt, moe_layers[i - n_dense], dev)  # one decoder layer's experts
            return data, device.read_done()

    def write(w: StreamWriter, built: dict[str, torch.Tensor]) -> None:
        for name, t in built.items():
            host, ready = device.to_host(t, functools.partial(w.empty, name))
            w.write(name, host, ready)

    with ReadAhead(read, total, depth=1) as layers:
        for li, (data, done) in enumerate(layers):
            if li >= n_dense:
                assert moe is not None
                experts: list[ExpertTensors] = data  # type: ignore[assignment]
                device.receive(done, _expert_tensors(experts))  # type: ignore[arg-type]
                layer = moe_layers[li - n_dense]
                for tp in tps:
                    for rank in range(tp):
                        w = ranks[(tp, rank)]
                        write(w, build_moe_layer(moe, scheme, tdtype, tp, rank, layer, experts, _experts_memory(w, dev)))
                del experts, data
                if report:
                    bytes_done += read_bytes[li]
                    report(li + 1, total, moe.name(layer), bytes_done=bytes_done, bytes_total=bytes_total)
                continue
            parts: dict[str, ModuleTensors] = data  # type: ignore[assignment]
            spec = plan.layers[li]
            device.receive(done, _layer_tensors(parts))  # type: ignore[arg-type]
            slots = parts[spec.parts[0].name].column_slots
            shape = layer_weight_shape(ckpt, spec, parts)
            gptq_zero = getattr(source, "stored_zero", None)
            for tp in tps:
                entry = plan.entries[tp][li]
                for rank in range(tp):
                    # Fused into scratch memory (each rank's slices are repacked before the next rank's are fused).
                    fused = fuse_rank_slices(rank_slices(spec, plan.dims, tp, rank), parts, scheme.group_size, lazy=True)
                    w = ranks[(tp, rank)]
                    # On the CPU the weight is built straight into the writer's recycled buffer.
                    empty = None if device.cuda else w.empty
                    write(w, build_rank_tensors(entry, scheme, tdtype, *fused, slots, source.format, shape, empty, gptq_zero))
            del parts, data, fused
            if report:
                bytes_done += read_bytes[li]
                report(li + 1, total, spec.name, bytes_done=bytes_done, bytes_total=bytes_total)


@dataclass(frozen=True)
class Converted:
    """What :func:`convert` made, or found up to date: the bundle's directory and its manifest, and what was done."""

    bundle: Path
    manifest: Manifest
    reused: bool = False  # an up-to-date bundle was already there: nothing was written
    hashed: HashReport = HashReport()  # what checking the checkpoint and the bundle hashed
    summary: str = ""  # what was done and why, in one line ("added tp4; tp1, tp2 kept"; "up to date")


def convert(
    model: str | Path,
    output: str | Path | None = None,
    *,
    tp: tuple[int, ...] | list[int] = (1,),
    dtype: str | None = None,
    force: bool = False,
    device: str = "cpu",
    revision: str | None = None,
    progress: ProgressFn | None = None,
    on_wait: Callable[[str], None] | None = None,
    kernel: str | LayerKernel | None = None,
) -> Converted:
    """Convert an AWQ (GEMM), GPTQ (v1) or compressed-tensors (pack-quantized) checkpoint into a Marlin bundle.

    The bundle holds, for every tensor-parallel size in ``tp`` and every rank, the tensors stock vLLM
    holds after ``process_weights_after_loading`` with ``MarlinLinearKernel``, plus the
    checkpoint's non-quantized tensors. Output is written to a temporary directory and renamed into
    place at the end.

    Idempotent and self-healing (:mod:`marlin_pack.bundle.existing`): a bundle already at the output is made to match
    the checkpoint and these settings, nothing written where it does (nor locked); TP sizes it lacks are added, its
    files that are damaged or stale rewritten, the rest kept; an empty directory is written into; anything else that
    is not a bundle is refused. Another conversion of the same output is waited for (at most
    ``$MARLIN_PACK_LOCK_WAIT_S``, default 600 s), then decided on again. A symlink at the output is followed only where
    this user or root owns it. Named as the CLI's options.

    Args:
        model: HuggingFace checkpoint directory, or a Hugging Face model id (``org/name``),
            resolved through the hub's cache (downloading unless ``HF_HUB_OFFLINE``).
        output: bundle directory; default ``MODEL_DIR/marlin-pack``, or for a model id marlin-pack's
            cache entry of that repo and commit (where the loader looks).
        tp: tensor-parallel sizes to write.
        dtype: serving dtype as vLLM's ``--dtype`` takes it (``auto``, ``half``, ``float16``, ``bfloat16``);
            default ``auto``: what ``vllm serve`` picks from config.json.
        force: rewrite the whole bundle, even an up-to-date one, holding exactly the sizes ``tp``.
        device: ``cpu`` or ``cuda`` for the tensor work.
        revision: branch, tag or commit of a model id (an error for a local directory).
        progress: called as ``progress(done, total, layer_name)`` after each layer, and with
            ``bytes_done=``/``bytes_total=`` (the checkpoint bytes of the layers read so far / of
            all of them) where it takes those keywords (see :mod:`marlin_pack.progress`).
        on_wait: called with a line while another conversion of the same output is waited for.
        kernel: ``marlin`` (every layer in Marlin's layout) or ``machete`` (vLLM's choice on an SM90 GPU, per layer:
            Machete where it implements the layer, else Marlin); default
            :func:`~marlin_pack.kernel_choice.default_kernel`.

    Returns:
        :class:`Converted`: the bundle's path and manifest, whether it was reused, and what was done.

    Raises:
        CheckpointError, UnsupportedCheckpointError, OutputExistsError, MarlinPackError.

    Example:
        >>> result = convert("llama-awq", tp=(1, 2))
        >>> result.bundle.name, result.manifest.tp_sizes
        ('marlin-pack', [1, 2])
    """
    refuse_url(output, "output", "a directory", "write the bundle to a directory, then publish it with `marlin-pack push DIR {url}`")
    resolved = resolve_model(model, revision)
    model_dir = resolved.dir
    parse_kernel(kernel)  # a bad value before any work
    out = Path(output) if output is not None else bundle_dir_for(resolved)
    tps = sorted(set(int(t) for t in tp))
    if not tps or tps[0] < 1:
        raise MarlinPackError(f"`tp={list(tp)!r}` is invalid; expected positive sizes such as [1, 2, 4, 8]")
    dev = _device(device)
    # A symlink at the output (or in a model id's cache entry) is followed only where this user or root owns it.
    out = follow_output(out, cache_root() if output is None and resolved.repo_id is not None else None)
    if os.path.lexists(out) and model_dir.resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{out} holds the checkpoint itself; choose another output (`output=DIR`)")

    ckpt = Checkpoint(model_dir)
    try:
        source = source_from_quant_config(ckpt.quantization_config())
        serving_dtype = resolve_dtype(ckpt.config, dtype, {t.dtype for t in ckpt.tensors.values()})
        layers_kernel = parse_kernel(kernel)
        # Decided before the lock, which needs write access: an up-to-date bundle on a read-only volume is up to date.
        seen = output_state(out)
        plan, found, update = _decide(ckpt, source, tps, serving_dtype, layers_kernel, out, force)
        if update.up_to_date:
            return _reused(out, found)
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(output_lock(out, on_wait))
            except MarlinPackError as e:  # what is wrong with the bundle is the news, then why it cannot be mended
                if force or found.state is not State.bundle:
                    raise
                raise MarlinPackError(f"{out} is not up to date ({update.why}) and cannot be updated: {e}") from None
            now = output_state(out)
            if now != seen:  # another conversion published meanwhile: decide again
                plan, found, update = _decide(ckpt, source, tps, serving_dtype, layers_kernel, out, force)
                if update.up_to_date:
                    return _reused(out, found)
            identity = (now[0][0], now[0][1]) if now[0] else None  # the output decided on (device, inode)
            manifest = _write_bundle(ckpt, source, plan, serving_dtype, dev, out, found, update, identity, progress)
    finally:
        ckpt.close()
    return Converted(out, manifest, hashed=found.hashed, summary=update.summary)


def _reused(out: Path, found: Findings) -> Converted:
    assert found.manifest is not None
    return Converted(out, found.manifest, reused=True, hashed=found.hashed, summary="up to date")


def _decide(
    ckpt: Checkpoint, source: QuantSource, tps: list[int], serving_dtype: ServingDtype, kernel: LayerKernel, out: Path, force: bool,
) -> tuple[ConversionPlan, Findings, Update]:
    """The plan (every size asked, and every size the bundle at ``out`` holds that the checkpoint can take), what is at
    ``out`` against it, and what to do (:mod:`marlin_pack.bundle.existing`)."""
    held = look(out)
    extra = [t for t in (held.manifest.tp_sizes if held.manifest and not force else []) if t not in tps]
    dtype = torch_dtype(serving_dtype)
    try:
        plan = plan_conversion(ckpt, source, sorted(tps + extra), dtype, kernel)
    except MarlinPackError:
        if not extra:
            raise
        plan = plan_conversion(ckpt, source, tps, dtype, kernel)  # a size held that this checkpoint cannot take is dropped
    moe = {tp: plan.moe.entries(tp) for tp in plan.entries} if plan.moe else None
    common = {n: (ckpt.tensors[n].dtype, tuple(ckpt.tensors[n].shape)) for n in plan.common if n in ckpt.tensors}
    found = assess(out, held, ckpt.dir, tps, serving_dtype, plan.entries, moe, common, force)
    return plan, found, decide(found, tps, force)


def _write_bundle(
    ckpt: Checkpoint, source: QuantSource, plan: ConversionPlan, serving_dtype: ServingDtype, dev: torch.device, out: Path,
    found: Findings, update: Update, identity: tuple[int, int] | None, progress: ProgressFn | None,
) -> Manifest:
    """The conversion proper, the output's lock held: the TP sizes and files ``update`` names streamed into a bundle
    published at ``out``: a new one (nothing there), one replacing the bundle there at once (everything rewritten), or
    in place (sizes added or rewritten beside the ones kept; an empty directory, a volume mounted at ``out``: the one
    decided on, ``identity``)."""
    write = list(update.write)
    kept = found.manifest if (update.keep or not update.common) else None  # files of it stay: its record of the source too
    replace, in_place, expect = False, False, None
    if found.state is State.missing:
        pass
    elif kept is not None or found.state is State.empty or os.path.ismount(out):
        in_place, expect = True, identity
    else:  # everything rewritten: built beside and swapped in at once, as --force does (never over a non-bundle)
        check_output(ckpt.dir, out, force=True)
        replace = True
    # Through the page cache where memory holds the bundle: the first start after convert is then a warm one.
    try:
        direct = not write_through_cache(_bundle_bytes_estimate(ckpt, plan, write), available_memory(), os.environ.get(WRITE_ENV))
    except ValueError as e:
        raise MarlinPackError(str(e)) from None
    layers = {tp: plan.entries[tp] for tp in write}
    # Source files hash on their own threads while the main thread converts (hashlib releases the GIL); where files
    # are kept, the checkpoint was checked against the bundle's record of it, which stays.
    pool = ThreadPoolExecutor(max_workers=hash_workers(len(ckpt.files)))
    try:
        with _torch_threads(1 if dev.type == "cpu" else None), BundleWriter.create(
            out, force=replace, locked=True, format_version=update.format_version, direct=direct, in_place=in_place, expect=expect
        ) as bundle:
            hashes = [] if kept is not None else [(f, pool.submit(hash_file, ckpt.dir / f, 1)) for f in ckpt.files]
            aliases = kept.common_aliases if kept is not None and not update.common else {}
            if update.common:
                aliases = tied_copies(ckpt, plan) if plan.dims.tie_word_embeddings else {}
                stored = [n for n in plan.common if n not in aliases]
                bundle.write_common([(n, ckpt.tensors[n].torch_dtype, ckpt.tensors[n].shape) for n in stored], ckpt.get)
            if write:
                _convert_layers(ckpt, plan, write, dev, bundle, progress)
            sets = bundle.close_ranks(layers, {tp: plan.moe.entries(tp) for tp in write} if plan.moe else None)
            if kept is not None:
                sets = sorted(sets + [s for s in kept.tensor_parallel if s.tp_size in update.keep], key=lambda s: s.tp_size)
            layer_kernels = (e.kernel for s in sets for e in s.layers)
            manifest = Manifest(
                format_version=update.format_version,
                producer=Producer(version=__version__),
                target=Target(vllm_version=MADE_WITH_VLLM, kernel=target_kernel(layer_kernels),
                              transformers=recorded_transformers(plan.dims.arch),
                              paths=naming_paths(plan.dims.arch.paths, plan.moe.naming if plan.moe else None)),
                quant=source.scheme,
                serving_dtype=serving_dtype,
                activation_dtype=serving_dtype,
                source=_source_entry(ckpt, plan, hashes) if kept is None else kept.source,
                common=bundle.close_common() if update.common or kept is None else kept.common,
                common_aliases=aliases,
                tensor_parallel=sets,
            )
            ckpt.check_unchanged()  # after hashing and reading: the hashes describe the data converted
            bundle.finish(manifest, [fut.result() for _, fut in hashes])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return manifest
