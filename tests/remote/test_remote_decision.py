"""The loader's pre-GPU decision over a published bundle (CPU): the local decision's checks, in its order, then this
rank's plan; each refusal names its field."""

from __future__ import annotations

import pytest

from marlin_pack.errors import BundleMismatchError, MismatchField
from marlin_pack.remote.decision import select_remote
from marlin_pack.remote.push import push
from marlin_pack.vllm_plugin.decision import EngineFacts


def _facts(model, **kw) -> EngineFacts:  # type: ignore[no-untyped-def]
    return EngineFacts(model=str(model), vllm_version="0.33.0", quantization="auto_awq", **kw)


def test_a_rank_of_a_published_bundle_is_selected(make_bundle, s3) -> None:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("m"))
    plan, _ = select_remote(s3.url("m"), _facts(model, tp_size=2, tp_rank=1))
    assert [f.entry.path for f in plan.files] == ["tp2/rank-1.safetensors", "common.safetensors"]
    staged, _ = select_remote(s3.url("m"), _facts(model, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1))
    assert staged.files[0].tensor_bytes < plan.files[0].tensor_bytes


@pytest.mark.parametrize(("kw", "field", "match"), [
    ({"tp_size": 4}, MismatchField.tp_size, r"bundle has tp 1,2, the engine runs --tensor-parallel-size 4"),
    ({"dtype": "bfloat16"}, MismatchField.serving_dtype, r"bundle holds float16 scales, the engine runs bfloat16"),
    ({"vllm_version": "0.29.0"}, MismatchField.vllm_version, r"0\.29\.0"),
])
def test_engine_refusals(make_bundle, s3, kw: dict, field: MismatchField, match: str) -> None:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("m"))
    base = {"tp_size": 1, **kw}
    version = base.pop("vllm_version", "0.33.0")
    with pytest.raises(BundleMismatchError, match=match) as e:
        select_remote(s3.url("m"), EngineFacts(model=str(model), vllm_version=version, quantization="auto_awq", **base))
    assert e.value.field == field


def test_another_checkpoint_is_refused(make_bundle, make_checkpoint, s3) -> None:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32)
    push(model / "marlin-pack", s3.url("m"))
    other = make_checkpoint("awq", "tiny", group_size=32, seed=3)
    with pytest.raises(BundleMismatchError) as e:
        select_remote(s3.url("m"), _facts(other))
    assert e.value.field.value.startswith("source")
