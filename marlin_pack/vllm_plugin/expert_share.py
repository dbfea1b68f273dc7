"""Where a rank's experts come from when vLLM does not shard them as its attention: expert parallelism, and
data-parallel replicas.

vLLM builds each fused experts layer with ``FusedMoEParallelConfig.make`` (``fused_moe/config.py``): it flattens
the TP ranks of every data-parallel replica into one group (``flatten_tp_across_dp_and_pcp``: size ``tp x dp``,
rank ``dp_rank x tp + tp_rank``) and then

- without ``--enable-expert-parallel`` shards every expert's intermediate size over that group: the experts
  layers of TP rank ``dp_rank x tp + tp_rank`` of ``tp x dp``, i.e. of the bundle's ``tp<tp*dp>`` rank file;
- with it (and a group of more than one GPU) gives each GPU whole experts (TP size 1, EP size ``tp x dp``, EP rank
  the flattened rank), the ones ``determine_expert_map`` (``fused_moe/expert_map_manager.py``) places there:
  ``linear`` a contiguous run (the first ``E mod ep`` ranks one more), ``round_robin`` every ``ep``-th expert
  from the EP rank. Its weight loader (``RoutedExperts.weight_loader``) skips the experts mapped to -1 and
  writes the others at their local index, and the Marlin MoE post-processing (``_process_weights_marlin`` /
  ``_process_awq_weights_marlin`` in ``fused_moe/oracle/int_wna16.py``: tile padding, ``gptq_marlin_moe_repack``
  / ``awq_marlin_moe_repack``, ``marlin_moe_permute_scales``, the zero points) works expert by expert. So a GPU
  holds, stacked in local order, exactly those experts of the bundle's ``tp1/rank-0`` experts tensors.

Its attention and dense layers stay those of its TP rank of ``tp`` (``tp<tp>/rank-<r>``). :func:`expert_share`
says which file, which experts and so which bytes; the loader reads only them. Pure: no vLLM, no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from marlin_pack.errors import RESTORE_CONFIG, BundleMismatchError, MismatchField, UnsupportedCheckpointError
from marlin_pack.io.safetensors_io import SafetensorsHeader, TensorInfo
from marlin_pack.marlin.hf_config import language_config
from marlin_pack.schemas import Manifest, MoeLayerEntry, TensorParallelSet

__all__ = ["ROUND_ROBIN_BACKENDS", "ExpertShare", "MoeRanks", "check_experts_source", "expert_share", "local_experts", "moe_ranks",
           "needs_share", "num_expert_group", "placement"]

# The all2all backends with which vLLM keeps round-robin placement across data-parallel replicas
# (FusedMoEParallelConfig.needs_round_robin_routing_tables: DeepEP low-latency, NIXL EP).
ROUND_ROBIN_BACKENDS = ("deepep_low_latency", "nixl_ep")
# Where DeepSeek's shared experts are built unsharded (DeepseekV2MoE: disable_tp=parallel_config.use_sequence_parallel_moe).
_SEQUENCE_PARALLEL_MOE = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MoeRanks:
    """How vLLM shards the experts layers on one GPU (``FusedMoEParallelConfig``'s sizes and ranks)."""

    tp_size: int  # the experts' tensor-parallel size (1 with expert parallelism)
    tp_rank: int
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1


def moe_ranks(tp_size: int, tp_rank: int, dp_size: int, dp_rank: int, expert_parallel: bool, pcp_size: int = 1,
              pcp_rank: int = 0) -> MoeRanks:
    """``FusedMoEParallelConfig.make``: the TP ranks of all replicas (and prefill-context-parallel ranks) flattened
    (``flatten_tp_across_dp_and_pcp``); with ``--enable-expert-parallel`` over more than one GPU, that group is the EP
    group and the experts' TP size is 1."""
    size, rank = tp_size * pcp_size * dp_size, (dp_rank * pcp_size + pcp_rank) * tp_size + tp_rank
    if expert_parallel and size > 1:
        return MoeRanks(1, 0, size, rank)
    return MoeRanks(size, rank)


def placement(requested: str, *, ep_size: int, num_expert_group: int | None, dp_size: int, all2all_backend: str,
              pcp_size: int = 1) -> str:
    """The placement vLLM uses (``determine_expert_placement_strategy`` and
    ``ExpertMapManager._determine_placement_strategy``): ``round_robin`` only for a model routing over several
    expert groups (DeepSeek's ``n_group`` > 1; EPLB is not available to AWQ/GPTQ experts), and across data-parallel
    replicas (its all2all kernels) only with the DeepEP low-latency or NIXL EP backend; else ``linear``."""
    if requested != "round_robin" or ep_size == 1 or not (num_expert_group or 0) > 1:
        return "linear"
    if (dp_size > 1 or pcp_size > 1) and all2all_backend not in ROUND_ROBIN_BACKENDS:
        return "linear"
    return "round_robin"


def local_experts(num_experts: int, ep_size: int, ep_rank: int, strategy: str) -> tuple[int, ...]:
    """The global experts EP rank ``ep_rank`` holds, in its local order (``determine_expert_map``)."""
    base, remainder = divmod(num_experts, ep_size)
    count = base + 1 if ep_rank < remainder else base
    if strategy == "round_robin":
        return tuple(range(ep_rank, num_experts, ep_size))[:count]
    start = ep_rank * base + min(ep_rank, remainder)
    return tuple(range(start, start + count))


def num_expert_group(architecture: str, config: dict) -> int | None:
    """The expert groups vLLM's model class routes over (``num_expert_group``): DeepSeek's ``n_group`` as transformers'
    config class holds it (:mod:`~marlin_pack.marlin.hf_config`: the class default where the file omits it, None for
    DeepSeek-V2, 8 for V3); None for the others marlin-pack reads (Mixtral, Qwen2-MoE, Qwen3-MoE pass none).

    Raises:
        UnsupportedCheckpointError: ``n_group`` is not an integer >= 1 or null (a bool, a float, a string, a list...).
    """
    if architecture not in _SEQUENCE_PARALLEL_MOE:
        return None
    value = language_config(config).get("n_group")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise UnsupportedCheckpointError(
            f"config.json n_group is {value!r}, expected an integer from 1 to 4096 or null ({architecture}); {RESTORE_CONFIG}"
        )
    return value


@dataclass(frozen=True)
class ExpertShare:
    """The experts one GPU loads: experts ``experts`` (global ids, local order) of rank ``rank`` of ``tp<tp_size>``."""

    ranks: MoeRanks
    placement: str
    experts: tuple[int, ...]
    num_experts: int  # every expert of the model
    tp_size: int  # of the file the experts come from
    rank: int
    rank_file: Path
    header: SafetensorsHeader  # that file's header with only the experts tensors of the layers loaded
    moe_layers: tuple[MoeLayerEntry, ...]  # as loaded: ``num_experts`` is the local count

    def pieces(self, info: TensorInfo) -> list[tuple[int, int]]:
        """The file ranges ``(start, nbytes)`` of this GPU's experts of a stacked experts tensor, in local order
        (consecutive experts in one range)."""
        per = info.nbytes // info.shape[0]
        runs: list[list[int]] = []
        for e in self.experts:
            if runs and runs[-1][1] == e:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        return [(info.start + a * per, (b - a) * per) for a, b in runs]

    @property
    def read_bytes(self) -> int:
        """Tensor bytes read of :attr:`rank_file`."""
        return sum(n for info in self.header.tensors.values() for _, n in self.pieces(info))

    def text(self) -> str:
        """``experts 2-3 of 4 (ep rank 1/2, linear) from tp1/rank-0``, or (DP without EP) ``experts of tp4/rank-3 (sharded
        over 4 GPUs)``."""
        where = f"tp{self.tp_size}/rank-{self.rank}"
        if not self.ranks.expert_parallel:
            return f"experts of {where} (sharded over {self.ranks.tp_size} GPUs)"
        ids = self.experts
        span = (f"{ids[0]}-{ids[-1]}" if list(ids) == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))) if ids else "none"
        return (f"experts {span} of {self.num_experts} (ep rank {self.ranks.ep_rank}/{self.ranks.ep_size}, {self.placement}) "
                f"from {where}")

    def to_dict(self) -> dict[str, object]:
        return {"ep_size": self.ranks.ep_size, "ep_rank": self.ranks.ep_rank, "placement": self.placement,
                "experts": list(self.experts), "experts_file": f"tp{self.tp_size}/rank-{self.rank}",
                "experts_file_bytes": self.read_bytes}


def needs_share(tp_set: TensorParallelSet, tp_size: int, tp_rank: int, dp_size: int, expert_parallel: bool,
                pcp_size: int = 1) -> bool:
    """Whether the experts do not come from this rank's own TP rank file."""
    ranks = moe_ranks(tp_size, tp_rank, dp_size, 0, expert_parallel, pcp_size)
    return bool(tp_set.moe_layers) and (ranks.expert_parallel or ranks.tp_size != tp_size)


def check_experts_source(manifest: Manifest, model: str, *, architecture: str, tp_size: int, dp_size: int, expert_parallel: bool,
                         accepted: Callable[[list[int]], list[int]] | None = None, pcp_size: int = 1) -> int:
    """The TP size of the rank files the experts come from, checked to be in the bundle.

    ``accepted``: which of the given TP sizes ``convert`` accepts for the checkpoint (asked only for the advice).

    Raises:
        BundleMismatchError: ``ep_size`` (expert parallelism) or ``dp_size``, naming the ``convert --tp`` to run.
    """
    field = MismatchField.ep_size if expert_parallel else MismatchField.dp_size
    if expert_parallel and tp_size > 1 and dp_size > 1 and architecture in _SEQUENCE_PARALLEL_MOE:
        raise BundleMismatchError(
            field, f"{architecture} with --enable-expert-parallel at --tensor-parallel-size {tp_size} x --data-parallel-size "
            f"{dp_size}: vLLM builds its shared experts unsharded there (DeepseekV2MoE, disable_tp="
            "use_sequence_parallel_moe), which no TP rank file holds; serve it with --tensor-parallel-size 1 or "
            "--data-parallel-size 1",
        )
    size = moe_ranks(tp_size, 0, dp_size, 0, expert_parallel, pcp_size).tp_size
    if size in manifest.tp_sizes:
        return size
    if expert_parallel:
        why = (f"--enable-expert-parallel over {tp_size * pcp_size * dp_size} GPUs: vLLM gives each whole experts, "
               "which the tp1 rank file holds")
        instead = "serve it without --enable-expert-parallel"
    else:
        over = (f"{tp_size} x {dp_size} tensor x data parallel" if pcp_size == 1 else
                f"{tp_size} x {pcp_size} x {dp_size} tensor x prefill-context x data parallel")
        why = (f"--data-parallel-size {dp_size}: vLLM shards each experts layer over the {over} ranks, which the "
               f"tp{size} rank files hold")
        instead = "serve it with --enable-expert-parallel (whole experts, from tp1) or a smaller --data-parallel-size"
    held = ",".join(map(str, manifest.tp_sizes))
    ok = None if accepted is None else accepted(sorted({1, 2, 4, 8, size, *manifest.tp_sizes}))
    if ok is not None and size not in ok:
        raise BundleMismatchError(field, f"{why}, and this checkpoint cannot be split into tp {size} (marlin-pack convert "
                                  f"accepts --tp {','.join(map(str, ok)) or 'none of 1,2,4,8'}); {instead}")
    sizes = ",".join(map(str, sorted({*manifest.tp_sizes, size})))
    raise BundleMismatchError(field, f"{why}; the bundle has tp {held}: run `marlin-pack convert {model} --tp {sizes}`")


def expert_share(manifest: Manifest, tp_set: TensorParallelSet, source: TensorParallelSet, header: SafetensorsHeader,
                 rank_file: Path, ranks: MoeRanks, strategy: str) -> ExpertShare:
    """The experts of ``tp_set``'s experts layers (already a stage's, at pipeline parallelism) this GPU loads, from
    rank ``ranks.tp_rank`` of ``source`` (whose ``header`` is already checked whole)."""
    entries = {e.name: e for e in source.moe_layers}
    missing = [e.name for e in tp_set.moe_layers if e.name not in entries]
    if missing:
        raise BundleMismatchError(MismatchField.layers, f"the experts layer {missing[0]} of tp{tp_set.tp_size} is not in "
                                  f"tp{source.tp_size}, whose rank files hold this GPU's experts; the manifest is corrupt, re-convert")
    wanted = [entries[e.name] for e in tp_set.moe_layers]
    counts = {e.num_experts for e in wanted}
    num = max(counts, default=0)
    if len(counts) > 1 and ranks.expert_parallel:
        raise BundleMismatchError(MismatchField.ep_size, f"the bundle's experts layers hold {sorted(counts)} experts, vLLM "
                                  "places one number over the EP ranks; serve it without --enable-expert-parallel")
    experts = local_experts(num, ranks.ep_size, ranks.ep_rank, strategy) if ranks.expert_parallel else tuple(range(num))
    names = {e.name for e in wanted}
    tensors = {n: i for n, i in header.tensors.items() if n.rsplit(".", 1)[0] in names}
    return ExpertShare(
        ranks=ranks, placement=strategy if ranks.expert_parallel else "linear", experts=experts, num_experts=num,
        tp_size=source.tp_size, rank=ranks.tp_rank, rank_file=rank_file,
        header=SafetensorsHeader(header.path, header.raw, tensors, header.metadata),
        moe_layers=tuple(e.model_copy(update={"num_experts": len(experts)}) for e in wanted),
    )
