"""``convert``: an AWQ/GPTQ checkpoint into a Marlin bundle, streamed layer by layer."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlin_pack import __version__
from marlin_pack._constants import COMMON_FILE, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, STAMPS_NAME, TARGET_VLLM_VERSION
from marlin_pack.bundle import default_bundle_dir
from marlin_pack.checkpoint import Checkpoint
from marlin_pack.errors import CheckpointError, MarlinPackError, OutputExistsError, UnsupportedCheckpointError
from marlin_pack.hashing import StampCache, safetensors_header_bytes, sha256_bytes, sha256_file
from marlin_pack.layout import SERVING_DTYPES, build_rank_tensors, tensor_specs
from marlin_pack.plan import LayerSpec, ModelDims, layer_entry, layer_specs, model_dims, rank_slices
from marlin_pack.schemas import (
    FileEntry,
    LayerEntry,
    Manifest,
    Producer,
    RankEntry,
    ServingDtype,
    Source,
    SourceFile,
    Target,
    TensorParallelSet,
)
from marlin_pack.sources import ModuleTensors, QuantSource, source_from_quant_config
from marlin_pack.stream_writer import StreamWriter

__all__ = ["convert", "resolve_dtype", "ProgressFn"]

ProgressFn = Callable[[int, int, str], None]
_DTYPES = SERVING_DTYPES


def resolve_dtype(config: dict, dtype: str | None) -> str:
    """The serving dtype: ``dtype`` if given, else the checkpoint's 16-bit dtype, else float16."""
    if dtype is not None:
        name = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
        if name not in _DTYPES:
            raise MarlinPackError(f"--dtype {dtype!r} is not supported; expected float16 or bfloat16")
        return name
    found = config.get("torch_dtype") or config.get("dtype")
    return found if found in _DTYPES else "float16"


def _canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class ConversionPlan:
    dims: ModelDims
    source: QuantSource
    dtype: torch.dtype
    layers: list[LayerSpec] = field(default_factory=list)
    bias: dict[str, bool] = field(default_factory=dict)
    entries: dict[int, list[LayerEntry]] = field(default_factory=dict)
    common: list[str] = field(default_factory=list)


def plan_conversion(ckpt: Checkpoint, source: QuantSource, tp_sizes: list[int], dtype: torch.dtype) -> ConversionPlan:
    """Validate everything that can be validated without reading tensor data."""
    plan = ConversionPlan(dims=model_dims(ckpt.config), source=source, dtype=dtype)
    owned: set[str] = set()
    for i in range(plan.dims.num_layers):
        for spec in layer_specs(plan.dims, i):
            quantized = [f"{p.prefix}.qweight" in ckpt.tensors for p in spec.parts]
            if not any(quantized):
                continue  # left unquantized (modules_to_not_convert): loaded by vLLM from common
            if not all(quantized):
                missing = next(p.prefix for p, q in zip(spec.parts, quantized) if not q)
                raise CheckpointError(f"tensor {missing}.qweight is missing although its fused siblings are quantized; the checkpoint is incomplete")
            biases = [f"{p.prefix}.bias" in ckpt.tensors for p in spec.parts]
            if any(biases) and not all(biases):
                raise UnsupportedCheckpointError(f"{spec.name}: only some fused parts have a bias; vLLM needs all or none")
            for p in spec.parts:
                source.validate(ckpt, p.prefix, p.size_k, p.size_n)
                owned.update(n for n in source.tensor_names(p.prefix) if n in ckpt.tensors)
                if biases[0]:
                    owned.add(f"{p.prefix}.bias")
                    bias_info = ckpt.info(f"{p.prefix}.bias")
                    if bias_info.shape != (p.size_n,):
                        raise CheckpointError(f"tensor {p.prefix}.bias has shape {list(bias_info.shape)}, expected [{p.size_n}]")
            plan.layers.append(spec)
            plan.bias[spec.name] = biases[0]
    if not plan.layers:
        raise UnsupportedCheckpointError("no quantized decoder linear layers (…qweight) found; nothing to convert")
    stray = sorted(n for n in ckpt.tensors if n.endswith(".qweight") and n not in owned)
    if stray:
        kind = "MoE expert" if ".experts." in stray[0] else "unsupported"
        raise UnsupportedCheckpointError(f"{stray[0]} is an {kind} quantized module; marlin-pack converts dense decoder linears only")
    awq = source.scheme.zero_points
    for tp in tp_sizes:
        plan.entries[tp] = [
            layer_entry(s, plan.dims, tp, source.scheme.group_size, awq, plan.bias[s.name]) for s in plan.layers
        ]
    plan.common = sorted(n for n in ckpt.tensors if n not in owned)
    return plan


def fuse_rank_slices(slices: list, parts: dict[str, ModuleTensors], group_size: int) -> tuple:
    def rows(t: torch.Tensor, s) -> torch.Tensor:  # scale/zero rows of a K slice
        return t if group_size == -1 else t[s.k0 // group_size : (s.k0 + s.k) // group_size]

    codes = torch.cat([parts[s.part.name].codes[s.k0 : s.k0 + s.k, s.n0 : s.n0 + s.n] for s in slices], 1)
    scales = torch.cat([rows(parts[s.part.name].scales, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)
    zeros = None
    if parts[slices[0].part.name].zeros is not None:
        zeros = torch.cat([rows(parts[s.part.name].zeros, s)[:, s.n0 : s.n0 + s.n] for s in slices], 1)  # type: ignore[index]
    bias = None
    if parts[slices[0].part.name].bias is not None:
        bias = torch.cat([parts[s.part.name].bias[s.n0 : s.n0 + s.n] for s in slices])  # type: ignore[index]
    return codes, scales, zeros, bias


def _hash_source(ckpt: Checkpoint, pool: ThreadPoolExecutor) -> list[tuple[str, Future[str]]]:
    return [(f, pool.submit(sha256_file, ckpt.dir / f)) for f in ckpt.files]


def _source_entry(ckpt: Checkpoint, plan: ConversionPlan, hashes: list[tuple[str, Future[str]]]) -> Source:
    qc = ckpt.quantization_config() or {}
    files = [
        SourceFile(
            name=name,
            size=(ckpt.dir / name).stat().st_size,
            sha256=fut.result(),
            header_sha256=sha256_bytes(safetensors_header_bytes(ckpt.dir / name)),
        )
        for name, fut in hashes
    ]
    qc_sha = sha256_bytes(_canonical_json(qc))
    digest = sha256_bytes("".join(f"{f.name} {f.sha256}\n" for f in files).encode() + _canonical_json(qc))
    return Source(
        format=plan.source.format,
        architecture=plan.dims.architecture,
        model_type=plan.dims.model_type,
        files=files,
        quantization_config=qc,
        quantization_config_sha256=qc_sha,
        digest=digest,
    )


def _rank_path(tp: int, rank: int) -> str:
    return f"tp{tp}/rank-{rank}.safetensors"


def convert(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    tp_sizes: tuple[int, ...] | list[int] = (1,),
    dtype: str | None = None,
    force: bool = False,
    device: str = "cpu",
    progress: ProgressFn | None = None,
) -> Manifest:
    """Convert an AWQ (GEMM) or GPTQ (v1) checkpoint into a Marlin bundle.

    The bundle holds, for every tensor-parallel size in ``tp_sizes`` and every rank,
    the tensors stock vLLM 0.33.0 holds after ``process_weights_after_loading`` with
    ``MarlinLinearKernel``, plus the checkpoint's non-quantized tensors. Output is
    written to a temporary directory and renamed into place at the end.

    Args:
        model_dir: HuggingFace checkpoint directory.
        out_dir: bundle directory; default ``MODEL_DIR/marlin-pack`` (where the loader looks).
        tp_sizes: tensor-parallel sizes to write.
        dtype: serving dtype (``float16``/``bfloat16``); default from config.json.
        force: replace an existing ``out_dir``.
        device: ``cpu`` or ``cuda`` for the tensor work.
        progress: called as ``progress(done, total, layer_name)``.

    Returns:
        The written :class:`~marlin_pack.schemas.Manifest`.

    Raises:
        CheckpointError, UnsupportedCheckpointError, OutputExistsError, MarlinPackError.

    Example:
        >>> manifest = convert("llama-awq", tp_sizes=(1, 2))
        >>> manifest.tp_sizes
        [1, 2]
    """
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else default_bundle_dir(model_dir)
    tps = sorted(set(int(t) for t in tp_sizes))
    if not tps or tps[0] < 1:
        raise MarlinPackError(f"--tp {tp_sizes} is invalid; expected positive sizes such as 1,2,4,8")
    if device != "cpu" and not device.startswith("cuda"):
        raise MarlinPackError(f"--device {device!r} is not supported; expected cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MarlinPackError(f"--device {device} asked for, but no CUDA GPU is available; use --device cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MarlinPackError(f"--device {device!r} is not a valid device; expected cpu or cuda[:N]") from None
    _check_output(model_dir, out, force)

    ckpt = Checkpoint(model_dir)
    source = source_from_quant_config(ckpt.quantization_config())
    dtype_name = resolve_dtype(ckpt.config, dtype)
    tdtype = _DTYPES[dtype_name]
    plan = plan_conversion(ckpt, source, tps, tdtype)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a vLLM run by another user must read it
    except OSError as e:
        raise MarlinPackError(f"cannot write to {out.parent} ({e.strerror}); choose a writable location with -o") from None
    writers = []
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        hashes = _hash_source(ckpt, pool)
        common_entry = _write_common(ckpt, plan, tmp)
        rank_files = {}
        for tp in tps:
            (tmp / f"tp{tp}").mkdir()
            for rank in range(tp):
                specs = [s for e in plan.entries[tp] for s in tensor_specs(e, source.scheme, tdtype)]
                meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "tp_size": str(tp), "rank": str(rank)}
                w = StreamWriter(tmp / _rank_path(tp, rank), specs, meta)
                writers.append(w)
                rank_files[(tp, rank)] = w
        total = len(plan.layers)
        for li, spec in enumerate(plan.layers):
            parts = {p.name: source.read(ckpt, p.prefix, p.size_k, p.size_n, dev) for p in spec.parts}
            for tp in tps:
                entry = plan.entries[tp][li]
                for rank in range(tp):
                    fused = fuse_rank_slices(rank_slices(spec, plan.dims, tp, rank), parts, source.scheme.group_size)
                    slots = parts[spec.parts[0].name].column_slots
                    for name, t in build_rank_tensors(entry, source.scheme, tdtype, *fused, slots).items():
                        rank_files[(tp, rank)].write(name, t)
            del parts
            if progress:
                progress(li + 1, total, spec.name)
        sets = []
        for tp in tps:
            ranks = []
            for rank in range(tp):
                size, sha = rank_files[(tp, rank)].close()
                ranks.append(RankEntry(rank=rank, file=FileEntry(path=_rank_path(tp, rank), size=size, sha256=sha)))
            sets.append(TensorParallelSet(tp_size=tp, ranks=ranks, layers=plan.entries[tp]))
        manifest = Manifest(
            producer=Producer(version=__version__),
            target=Target(vllm_version=TARGET_VLLM_VERSION),
            quant=source.scheme,
            serving_dtype=ServingDtype(dtype_name),
            activation_dtype=ServingDtype(dtype_name),
            source=_source_entry(ckpt, plan, hashes),
            common=common_entry,
            tensor_parallel=sets,
        )
        _write_text_durably(tmp / MANIFEST_NAME, manifest.to_json())
        _record_stamps(tmp, manifest, ckpt)
        _swap_into_place(tmp, out)
    except BaseException as e:
        for w in writers:
            with contextlib.suppress(Exception):
                w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise MarlinPackError(
                f"writing the bundle under {out.parent} failed ({e.strerror or e}); free space or choose another place with -o"
            ) from None
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        ckpt.close()
    return manifest


def _check_output(model_dir: Path, out: Path, force: bool) -> None:
    """Refuse to replace anything but an existing bundle, and never the checkpoint itself."""
    if not out.exists():
        return
    if not force:
        raise OutputExistsError(f"{out} already exists; pass --force to replace it or -o to write elsewhere")
    if model_dir.resolve().is_relative_to(out.resolve()):
        raise OutputExistsError(f"{out} holds the checkpoint itself; choose another output with -o")
    if not (out / MANIFEST_NAME).is_file():
        raise OutputExistsError(f"{out} exists and is not a marlin-pack bundle (no {MANIFEST_NAME}); refusing to replace it")


def _write_common(ckpt: Checkpoint, plan: ConversionPlan, tmp: Path) -> FileEntry:
    specs = [(n, ckpt.tensors[n].dtype, ckpt.tensors[n].shape) for n in plan.common]
    w = StreamWriter(tmp / COMMON_FILE, specs, {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
    try:
        for n in plan.common:
            w.write(n, ckpt.get(n))
    except BaseException:
        w.abort()
        raise
    size, sha = w.close()
    return FileEntry(path=COMMON_FILE, size=size, sha256=sha)


def _write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _record_stamps(tmp: Path, manifest: Manifest, ckpt: Checkpoint) -> None:
    # The hashes were just computed from these exact files: let the loader's first start skip re-hashing.
    stamps = StampCache(tmp / STAMPS_NAME)
    for entry in manifest.files():
        stamps.record(entry.path, tmp / entry.path, entry.sha256)
    for f in manifest.source.files:
        stamps.record(f"source:{f.name}", ckpt.dir / f.name, f.sha256)
    stamps.save()


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (``--force``) is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
