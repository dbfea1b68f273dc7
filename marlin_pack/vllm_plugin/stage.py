"""A pipeline stage's share of a bundle: what one rank of ``pipeline_parallel_size > 1`` loads, and reads.

A TP-size bundle holds every decoder layer of its TP rank (``tp<T>/rank-<r>.safetensors``) and every common
tensor once (``common.safetensors``): pipeline parallelism needs no other files. Stage ``s`` of ``P`` builds
only the decoder layers :func:`marlin_pack.pipeline.stage_layers` gives it (vLLM's ``make_layers`` over
``get_pp_indices``), so its rank loads only their tensors of the rank file, and only the common tensors
:func:`marlin_pack.pipeline.stage_common` gives it (a layer's own norms with the layer; embedding, final norm
and head where vLLM builds them). :func:`stage_share` restricts the TP set and both headers to that share:
the arena, the copy, the layer checks and the common tensors fed to vLLM then follow from them alone, and
the bytes it reads are :attr:`StageShare.rank_bytes` + :attr:`StageShare.common_bytes`.

Pure: plain facts in (manifest, headers, ``config.json``), no vLLM, no GPU; shared by the loader and ``check``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from marlin_pack.errors import BundleMismatchError, MismatchField
from marlin_pack.io.safetensors_io import SafetensorsHeader
from marlin_pack.marlin.architectures import architecture_for
from marlin_pack.pipeline import layer_index, stage_common, stage_layers
from marlin_pack.schemas import Manifest, TensorParallelSet

__all__ = ["StageShare", "check_nothing_left_out", "model_facts", "stage_share", "stage_text"]


@dataclass(frozen=True)
class StageShare:
    """What pipeline stage ``pp_rank`` of ``pp_size`` loads of one TP rank's files."""

    pp_size: int
    pp_rank: int
    layers: tuple[int, int]  # decoder layers [start, end)
    num_layers: int
    tp_set: TensorParallelSet  # the rank's TP set with only this stage's layers
    rank_header: SafetensorsHeader  # the rank file's header with only their tensors
    common_header: SafetensorsHeader  # the common file's header with only the common tensors this stage loads
    rank_file_bytes: int  # the whole rank file's tensor bytes
    common_file_bytes: int  # the whole common file's tensor bytes
    left_out: tuple[str, ...] = ()  # checkpoint names of the common file (aliases too) this stage does not load

    @property
    def rank_bytes(self) -> int:
        """Tensor bytes this stage reads of the rank file."""
        return sum(i.nbytes for i in self.rank_header.tensors.values())

    @property
    def common_bytes(self) -> int:
        """Tensor bytes this stage reads (at most: vLLM reads what it narrows) of the common file."""
        return sum(i.nbytes for i in self.common_header.tensors.values())

    def to_dict(self) -> dict[str, object]:
        """What ``check --json`` says a stage reads: its layers and tensor bytes of each file (and of the whole file)."""
        return {"layers": list(self.layers), "num_layers": self.num_layers, "rank_file_bytes": self.rank_bytes,
                "rank_file_total": self.rank_file_bytes, "common_file_bytes": self.common_bytes,
                "common_file_total": self.common_file_bytes}

    def text(self) -> str:
        """``stage 1/2 (layers 16-31 of 32 layers): 4.10 GB of 8.21 GB of the rank file, 0.53 GB of 1.05 GB of the common file``."""
        start, end = self.layers
        span = f"layers {start}-{end - 1}" if end > start + 1 else f"layer {start}" if end > start else "none"
        return (
            f"stage {self.pp_rank}/{self.pp_size} ({span} of {self.num_layers} layer{'s' * (self.num_layers != 1)}): "
            f"{_size(self.rank_bytes)} of "
            f"{_size(self.rank_file_bytes)} of the rank file, {_size(self.common_bytes)} of {_size(self.common_file_bytes)} "
            "of the common file"
        )


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def model_facts(config: dict, common_names: list[str]) -> tuple[str, int, bool]:
    """The prefix of the checkpoint's decoder layers, their number and whether the embeddings are tied, read from
    ``config.json`` as vLLM reads it (:func:`marlin_pack.marlin.sharding.model_dims`)."""
    from marlin_pack.marlin.sharding import model_dims

    dims = model_dims(config, common_names)
    # Tied where the text config (read with its class's defaults) or the top level says so: a stage that also
    # reads the embedding it does not build costs bytes; one that leaves out an embedding it builds is refused.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tied = bool(dims.tie_word_embeddings or config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return dims.checkpoint_layers, dims.num_layers, tied


def stage_share(
    manifest: Manifest, tp_set: TensorParallelSet, rank_header: SafetensorsHeader, common_header: SafetensorsHeader,
    model_dir: Path, pp_size: int, pp_rank: int,
) -> StageShare:
    """Stage ``pp_rank``'s share of a rank's files (headers already checked whole).

    Raises:
        BundleMismatchError: ``pp_size``: the stage is outside the pipeline, ``VLLM_PP_LAYER_PARTITION`` does not
            fit the model, or a quantized layer of the bundle is not a decoder layer (no stage can be said to own it).
    """
    f = MismatchField.pp_size
    if not 0 <= pp_rank < pp_size:
        raise BundleMismatchError(f, f"pipeline rank {pp_rank} is outside --pipeline-parallel-size {pp_size}")
    arch = architecture_for(manifest.source.architecture)
    if arch is None:
        raise BundleMismatchError(f, f"the bundle's architecture {manifest.source.architecture} is not one marlin-pack reads")
    common_names = list(common_header.tensors)
    checkpoint_layers, num_layers, tied = model_facts(json.loads((model_dir / "config.json").read_text()), common_names)
    try:
        start, end = stage_layers(num_layers, pp_size, pp_rank)
        held_common = stage_common(common_names, architecture=arch.name, checkpoint_layers=checkpoint_layers,
                                   num_layers=num_layers, tied=tied, pp_size=pp_size, pp_rank=pp_rank)
    except ValueError as e:
        raise BundleMismatchError(f, f"{e}; fix VLLM_PP_LAYER_PARTITION or unset it") from None

    def mine(layer: str) -> bool:
        index = layer_index(layer, arch.layers)
        if index is None:
            raise BundleMismatchError(
                f, f"quantized layer {layer} of the bundle is not one of vLLM's decoder layers ({arch.layers}.<i>), so no "
                f"pipeline stage is known to own it; serve this model with --pipeline-parallel-size 1",
            )
        return start <= index < end

    layers = [e for e in tp_set.layers if mine(e.name)]
    moe_layers = [e for e in tp_set.moe_layers if mine(e.name)]
    names = {e.name for e in (*layers, *moe_layers)}
    rank_tensors = {n: i for n, i in rank_header.tensors.items() if n.rsplit(".", 1)[0] in names}
    aliases: dict[str, list[str]] = {}
    for alias, original in manifest.common_aliases.items():
        aliases.setdefault(original, []).append(alias)
    left_out = tuple(n for name in common_names if name not in held_common for n in (name, *aliases.get(name, ())))
    return StageShare(
        pp_size=pp_size,
        pp_rank=pp_rank,
        layers=(start, end),
        num_layers=num_layers,
        tp_set=tp_set.model_copy(update={"layers": layers, "moe_layers": moe_layers}),
        rank_header=dataclasses.replace(rank_header, tensors=rank_tensors),
        common_header=dataclasses.replace(
            common_header, tensors={n: i for n, i in common_header.tensors.items() if n in held_common}
        ),
        rank_file_bytes=sum(i.nbytes for i in rank_header.tensors.values()),
        common_file_bytes=sum(i.nbytes for i in common_header.tensors.values()),
        left_out=left_out,
    )


def check_nothing_left_out(stage: StageShare, built: list[str]) -> None:
    """Refuse where vLLM's stage model built a parameter for a common tensor the stage does not load.

    ``built``: the names of :attr:`StageShare.left_out` that name a parameter of the model vLLM built for the
    stage (through its checkpoint-name mapping; :func:`~marlin_pack.vllm_plugin.engine.built_parameters`). The
    stage rules (:func:`marlin_pack.pipeline.stage_common`) are checked against vLLM's model classes; this makes a
    class they misjudge a refusal instead of a parameter left unloaded.

    Raises:
        BundleMismatchError: ``pp_size``, naming the first such tensor.
    """
    if built:
        raise BundleMismatchError(
            MismatchField.pp_size,
            f"vLLM's model for pipeline stage {stage.pp_rank}/{stage.pp_size} holds {built[0]}"
            f"{f' (and {len(built) - 1} more)' if len(built) > 1 else ''}, which marlin-pack's stage rules leave to another "
            "stage; serve this model with --pipeline-parallel-size 1, or report it",
        )


def stage_text(bundle: object) -> str:
    """``, pp stage 1/2 (layers 16-31 of 32 layers): ...`` for a selected bundle of a pipeline stage, and
    ``, experts 2-3 of 4 (ep rank 1/2, linear) from tp1/rank-0`` where its experts come from another rank file
    (:class:`~marlin_pack.vllm_plugin.expert_share.ExpertShare`); empty otherwise."""
    stage, experts = getattr(bundle, "stage", None), getattr(bundle, "experts", None)
    return ("" if stage is None else f", pp {stage.text()}") + ("" if experts is None else f", {experts.text()}")
