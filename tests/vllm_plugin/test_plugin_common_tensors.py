"""``common_tensors``: which common tensors are copied beside the construction, which parameters they bind, and which
large ones are read straight into their parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from marlin_pack.io.safetensors_io import TensorInfo
from marlin_pack.vllm_plugin.common_tensors import CommonPrefill, PrefillSlot, direct_target, plain_copy_target


def _param(shape: tuple[int, ...], loader: object = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float16), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _prefill(*slots: tuple[tuple[str, ...], tuple[int, ...]]) -> CommonPrefill:
    made, start = [], 0
    for names, shape in slots:
        nbytes = torch.Size(shape).numel() * 2
        made.append(PrefillSlot(names, torch.float16, shape, start, nbytes))
        start += nbytes
    return CommonPrefill(tuple(made), [torch.full(s.shape, i + 1, dtype=torch.float16) for i, s in enumerate(made)])


def test_plain_copy_target() -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    sharded_loader = ColumnParallelLinear.weight_loader

    plain = _param((4, 8), default_weight_loader)
    assert plain_copy_target(plain, (4, 8), torch.float16) is plain
    assert plain_copy_target(_param((4, 8)), (4, 8), torch.float16) is not None  # no loader: default_weight_loader
    assert plain_copy_target(_param((4, 8), sharded_loader), (4, 8), torch.float16) is None
    assert plain_copy_target(plain, (8, 8), torch.float16) is None  # a padded vocabulary
    assert plain_copy_target(plain, (4, 8), torch.bfloat16) is None
    assert plain_copy_target(None, (4, 8), torch.float16) is None
    stub = nn.Parameter(torch.zeros(1, dtype=torch.float16).expand(4, 8), requires_grad=False)
    assert plain_copy_target(stub, (4, 8), torch.float16) is stub  # bound, not written into: contiguity does not matter


def test_bind_points_plain_copy_parameters_at_the_copies() -> None:
    prefill = _prefill((("embed",), (4, 8)), (("head",), (4, 8)), (("padded",), (4, 8)))
    params = {"embed": _param((4, 8)), "head": _param((4, 8)), "padded": _param((6, 8)), "norm": _param((8,))}
    done = prefill.bind(params, ["embed", "head", "padded", "norm"])
    assert done == {"embed", "head"}
    assert params["embed"].data_ptr() == prefill.tensors[0].data_ptr()
    assert params["head"].data_ptr() == prefill.tensors[1].data_ptr()
    assert torch.equal(params["padded"], torch.zeros(6, 8, dtype=torch.float16))  # left to vLLM's loader


def test_bind_a_tied_parameter_stored_twice_takes_the_later_tensor() -> None:
    prefill = _prefill((("embed",), (4, 8)), (("head",), (4, 8)))
    tied = _param((4, 8))
    params = {"embed": tied, "head": tied}
    assert prefill.bind(params, ["embed", "head"]) == {"embed", "head"}
    assert tied.data_ptr() == prefill.tensors[1].data_ptr()  # file order: the later one wins


def test_bind_leaves_aliases_of_distinct_parameters_and_clashes_to_vllm() -> None:
    # One tensor stored for two untied parameters: each gets its own memory the ordinary way.
    prefill = _prefill((("embed", "head"), (4, 8)))
    params = {"embed": _param((4, 8)), "head": _param((4, 8))}
    assert prefill.bind(params, ["embed", "head"]) == set()
    assert params["embed"].data_ptr() != prefill.tensors[0].data_ptr()
    # A parameter another (unbound) name loads too: vLLM's loader would write into a tensor still filling.
    prefill = _prefill((("embed",), (4, 8)), (("other",), (4, 8)))
    shared = _param((4, 8))
    params = {"embed": shared, "other": shared, "alias": shared}
    assert prefill.bind(params, ["embed", "other", "alias"]) == set()
    assert shared.data_ptr() not in {t.data_ptr() for t in prefill.tensors}


def _bundle(tp_size: int, tensors: dict[str, tuple[tuple[int, ...], int]], aliases: dict[str, str] | None = None) -> SimpleNamespace:
    infos, start = {}, 100
    for name, (shape, nbytes) in tensors.items():
        infos[name] = TensorInfo(name, "common.safetensors", "F16", shape, start, start + nbytes)
        start += nbytes
    return SimpleNamespace(
        tp_set=SimpleNamespace(tp_size=tp_size),
        manifest=SimpleNamespace(common_aliases=aliases or {}),
        common_header=SimpleNamespace(tensors=dict(reversed(list(infos.items())))),  # not in file order
    )


def test_allocate_takes_the_large_tensors_at_tp1_in_file_order() -> None:
    bundle = _bundle(1, {"embed": ((64, 32), 4096), "norm": ((32,), 64), "head": ((64, 32), 4096)}, {"tied.alias": "head"})
    prefill = CommonPrefill.allocate(bundle, 1024)  # type: ignore[arg-type]
    assert prefill is not None
    assert [s.names for s in prefill.slots] == [("embed",), ("head", "tied.alias")]
    assert [tuple(t.shape) for t in prefill.tensors] == [(64, 32), (64, 32)] and prefill.nbytes == 8192
    items = prefill.copy_items()
    assert [(i.offset, i.nbytes) for i in items] == [(100, 4096), (100 + 4096 + 64, 4096)]
    assert all(i.dst is t for i, t in zip(items, prefill.tensors, strict=True))
    assert CommonPrefill.allocate(bundle, 1 << 20) is None  # type: ignore[arg-type]  # nothing that large
    assert CommonPrefill.allocate(_bundle(2, {"embed": ((64, 32), 4096)}), 1024) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("fail", [False, True])
def test_background_copy_hands_every_job_to_one_reader_at_once(fail: bool) -> None:
    from marlin_pack.vllm_plugin.arena import BackgroundCopy

    readers: list[object] = []
    calls: list[tuple[str, int]] = []

    class Reader:
        modes_used = {"registered"}

        def __init__(self) -> None:
            readers.append(self)

        def __enter__(self) -> Reader:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def copy_files(self, jobs: list) -> int:
            calls.append([(path, len(items)) for path, items in jobs])  # one call for every file
            if fail:
                raise OSError("read failed")
            return sum(10 * len(items) for _, items in jobs)

    dst = torch.empty(4)
    item = SimpleNamespace(dst=dst)
    copy = BackgroundCopy(Reader, "rank", [item, item], then=[("common", [item])])  # type: ignore[arg-type, list-item]
    if fail:
        with pytest.raises(OSError, match="read failed"):
            copy.join()
    else:
        copy.join()
        assert copy.bytes == 30
    assert calls == [[("rank", 2), ("common", 1)]]
    assert len(readers) == 1


def test_direct_target_only_for_plain_copy_loaders() -> None:
    """Large common tensors skip vLLM's weight loader only where it would do a plain copy at TP=1."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader


    p = torch.nn.Parameter(torch.empty(4, 8, dtype=torch.float16), requires_grad=False)
    assert direct_target(p, (4, 8), torch.float16) is p  # no weight_loader: vLLM uses default_weight_loader
    p.weight_loader = default_weight_loader
    assert direct_target(p, (4, 8), torch.float16) is p
    p.weight_loader = VocabParallelEmbedding.weight_loader.__get__(object())  # a bound method, as vLLM sets it
    assert direct_target(p, (4, 8), torch.float16) is p
    assert direct_target(p, (8, 4), torch.float16) is None
    assert direct_target(p, (4, 8), torch.bfloat16) is None
    assert direct_target(None, (4, 8), torch.float16) is None
    p.weight_loader = lambda param, w: param.data.copy_(w * 2)
    assert direct_target(p, (4, 8), torch.float16) is None
