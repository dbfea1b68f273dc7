"""The files of a bundle: their names, their ``__metadata__``, and exactly which tensors each holds.

Written once and used by the writer, ``verify`` and the loader, so that "a rank file holds
exactly these tensors" means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from marlin_pack._constants import FORMAT_NAME, FORMAT_VERSION
from marlin_pack.errors import BundleMismatchError, MismatchField
from marlin_pack.io.safetensors_io import SafetensorsHeader, dtype_code
from marlin_pack.marlin.moe import moe_entry_specs
from marlin_pack.marlin.rank_tensors import TensorSpec, tensor_specs
from marlin_pack.schemas import Manifest, QuantScheme, ServingDtype, SourceFormat, TensorParallelSet, torch_dtype

__all__ = ["rank_file_path", "rank_metadata", "common_metadata", "rank_tensor_specs", "check_rank_header"]


def rank_file_path(tp_size: int, rank: int) -> str:
    """Path of a rank file inside the bundle, e.g. ``tp2/rank-1.safetensors``."""
    return f"tp{tp_size}/rank-{rank}.safetensors"


def common_metadata(version: int = FORMAT_VERSION) -> dict[str, str]:
    """``__metadata__`` of ``common.safetensors`` (of a bundle of format ``version``)."""
    return {"format": FORMAT_NAME, "format_version": str(version)}


def rank_metadata(tp_size: int, rank: int, version: int = FORMAT_VERSION) -> dict[str, str]:
    """``__metadata__`` of a rank file: the format and which rank of which TP size it is."""
    return {**common_metadata(version), "tp_size": str(tp_size), "rank": str(rank)}


def rank_tensor_specs(
    tp_set: TensorParallelSet, quant: QuantScheme, serving_dtype: ServingDtype, fmt: SourceFormat | None = None
) -> list[TensorSpec]:
    """``(name, dtype, shape)`` of every tensor of one rank file of ``tp_set``, in file order (dense layers, then experts)."""
    dtype = torch_dtype(serving_dtype)
    dense = [spec for entry in tp_set.layers for spec in tensor_specs(entry, quant, dtype, fmt)]
    return dense + [spec for entry in tp_set.moe_layers for spec in moe_entry_specs(entry, quant, dtype, fmt)]


def _sample(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def check_rank_header(manifest: Manifest, tp_set: TensorParallelSet, rank: int, header: SafetensorsHeader) -> None:
    """Check a rank file's header: its metadata and exactly the tensors the manifest implies.

    Raises:
        BundleMismatchError: field ``files``, naming the first difference.
    """
    rel = tp_set.ranks[rank].file.path
    want_meta = rank_metadata(tp_set.tp_size, rank, manifest.format_version)
    if dict(header.metadata) != want_meta:
        raise BundleMismatchError(
            MismatchField.files, f"bundle file {rel} has metadata {dict(header.metadata)}, expected {want_meta}"
        )
    want = {
        name: (dtype_code(dtype), tuple(shape))
        for name, dtype, shape in rank_tensor_specs(tp_set, manifest.quant, manifest.serving_dtype, manifest.source.format)
    }
    found: Mapping[str, tuple[str, tuple[int, ...]]] = {n: (i.dtype, i.shape) for n, i in header.tensors.items()}
    missing = sorted(set(want) - set(found))
    extra = sorted(set(found) - set(want))
    if missing or extra:
        raise BundleMismatchError(
            MismatchField.files,
            f"bundle file {rel} lacks {_sample(missing) or 'nothing'} and has unexpected "
            f"{_sample(extra) or 'nothing'}; re-convert",
        )
    for name, spec in want.items():
        if found[name] != spec:
            raise BundleMismatchError(
                MismatchField.files, f"bundle file {rel}: tensor {name} is {found[name]}, the manifest implies {spec}"
            )
