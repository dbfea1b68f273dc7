"""The ``marlin_prepacked`` loader with ``{"bundle": "s3://bucket/prefix"}``, on the CPU, against a real S3 server
(moto's, ``conftest.s3``): the loader's own flow with vLLM's real layers (``test_plugin_loader``'s and
``test_plugin_stage``'s fakes), the bundle pushed, then each rank's verified blocks streamed into the rank's arena and
its common tensors from the streamed image. The layers hold what stock vLLM's post-processing leaves (so exactly what
a local load places); a rank streams only its own files, a pipeline stage only its layers' blocks; every refusal is
made before the model is built, ``fallback`` loading the checkpoint the ordinary way."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_plugin"))  # the loader tests' fakes

from marlin_pack.errors import BundleMismatchError, LoadRefusedError  # noqa: E402
from marlin_pack.remote.push import push  # noqa: E402
from marlin_pack.remote.record import RECORD_NAME  # noqa: E402
from marlin_pack.vllm_plugin.patches.post_processing import is_prepacked  # noqa: E402

vr = pytest.importorskip("oracles.vllm_reference")
sr = pytest.importorskip("oracles.vllm_stage_reference")
from stage_checkpoints import dtype_of, write_stage_bundle  # noqa: E402
from test_plugin_loader import fake_create_model, fake_engine, make_loader  # noqa: E402
from test_plugin_stage import _engine as stage_engine  # noqa: E402

BLOCK = 64 << 10  # the tiny bundles' files are a few blocks of this


@contextmanager
def stock_vllm_no_preload(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As the plugin tests: marlin-pack's patches registered for the test only; no early helpers of another test."""
    from marlin_pack.vllm_plugin import patches, preload, register

    register()
    patches.uninstall_all()
    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.delenv("MARLIN_PACK_IO", raising=False)
    assert patches.install()
    try:
        yield
    finally:
        patches.uninstall_all()


@pytest.fixture(autouse=True)
def _stock_vllm_no_preload(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with stock_vllm_no_preload(monkeypatch):
        yield



def _placed(model_dir: Path, monkeypatch: pytest.MonkeyPatch, tp: int, rank: int, before_post: Any = None,
            quantization: str = "auto_awq", kernel: str = "marlin", **extra: object) -> dict[str, torch.Tensor]:
    """create_model, load_weights, vLLM's post-processing (the daemon's path, then the engine's last step): every
    quantized layer's parameters (``kernel``: the kernels vLLM is made to choose, as on SM90 for ``machete``)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers

    fake_create_model(monkeypatch, model_dir, tp)
    vllm_config, model_config = fake_engine(model_dir, quantization, monkeypatch, tp, rank)
    loader = make_loader(**extra)
    with vr._patched(tp, rank, kernel), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        assert layers and all(is_prepacked(m) for m in layers.values())
        if before_post is not None:
            before_post(model)
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    common = sorted(n for n, _ in model.common)
    return {"__common__": common, **{f"{n}.{p}": t.detach() for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}}  # type: ignore[dict-item]


@pytest.fixture
def published(make_bundle, s3) -> tuple[Path, str]:  # type: ignore[no-untyped-def]
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("llama"), block_size=BLOCK)
    return model, s3.url("llama")


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_each_rank_streams_its_own_files_into_what_a_local_load_places(
    published: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, streamed: list[Any], tp: int, rank: int,
) -> None:
    model, url = published
    local = _placed(model, monkeypatch, tp, rank)
    remote = _placed(model, monkeypatch, tp, rank, bundle=url)
    assert remote.keys() == local.keys() and remote.pop("__common__") == local.pop("__common__")
    for name, want in local.items():
        got = remote[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
    reference = vr.reference_rank_tensors(model, tp, rank, torch.float16)
    assert all(torch.equal(remote[n], t) for n, t in reference.items())  # stock vLLM's post-processing, as locally
    [(plan, done)] = streamed  # the local load streamed nothing
    rank_path = f"tp{tp}/rank-{rank}.safetensors"
    assert set(done.bytes_read) == {rank_path, "common.safetensors"}  # never another rank's file
    for path, n in done.bytes_read.items():
        assert n == (model / "marlin-pack" / path).stat().st_size  # a whole rank: its files once each


KINDS = {
    # make_bundle arguments, tp, rank
    "gptq4-tp2-rank1": (dict(fmt="gptq", tp_sizes=(1, 2)), 2, 1),
    "gptq8": (dict(fmt="gptq", bits=8), 1, 0),
    "awq4-padded": (dict(fmt="awq", preset="tiny-padded", group_size=32), 1, 0),
    "ct8-channel": (dict(fmt="ct", bits=8, group_size=-1), 1, 0),
    "ct4-asym-tp2-rank1": (dict(fmt="ct-asym", group_size=64, tp_sizes=(1, 2)), 2, 1),
    "machete-gptq4-tp2-rank1": (dict(fmt="gptq", tp_sizes=(1, 2), kernel="machete"), 2, 1),
    "machete-ct4-asym": (dict(fmt="ct-asym", group_size=64, kernel="machete"), 1, 0),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_dense_kind_streams_into_what_a_local_load_places(
    make_bundle: Any, s3: Any, monkeypatch: pytest.MonkeyPatch, streamed: list[Any], kind: str,
) -> None:
    """GPTQ 4/8-bit, padded shapes, compressed-tensors (channel-wise, asymmetric), Machete bundles (on SM90, as vLLM
    chooses there): the bucket's load places every quantized parameter as the local load does, bit for bit."""
    from test_plugin_loader import quantization_of

    args, tp, rank = KINDS[kind]
    model = make_bundle(**args)
    url = s3.url(kind)
    push(model / "marlin-pack", url, block_size=BLOCK)
    how = dict(quantization=quantization_of(args["fmt"]), kernel=args.get("kernel", "marlin"))
    local = _placed(model, monkeypatch, tp, rank, **how)
    remote = _placed(model, monkeypatch, tp, rank, bundle=url, **how)
    assert remote.keys() == local.keys() and remote.pop("__common__") == local.pop("__common__")
    for name, want in local.items():
        got = remote[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
    [(_, done)] = streamed
    assert set(done.bytes_read) == {f"tp{tp}/rank-{rank}.safetensors", "common.safetensors"}


def test_a_gcs_bundle_loads_as_the_local_one(make_bundle: Any, gcs: Any, monkeypatch: pytest.MonkeyPatch, streamed: list[Any]) -> None:
    """``{"bundle": "gs://..."}``: GCS through its XML API (conftest.gcs), TP 2 rank 1 placed byte for byte as locally."""
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    url = gcs.url("llama")
    push(model / "marlin-pack", url, block_size=BLOCK)
    local = _placed(model, monkeypatch, 2, 1)
    remote = _placed(model, monkeypatch, 2, 1, bundle=url)
    assert remote.keys() == local.keys() and remote.pop("__common__") == local.pop("__common__")
    for name, want in local.items():
        assert torch.equal(remote[name].contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
    [(plan, done)] = streamed
    assert str(plan.bundle.url) == url and set(done.bytes_read) == {"tp2/rank-1.safetensors", "common.safetensors"}


def test_a_weight_cache_daemon_is_filled_from_the_bucket(
    published: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, streamed: list[Any],
) -> None:
    """vLLM's weight-cache daemon builds its model with the loader's create_model/load_weights, inside marlin-pack's
    scope and with its helpers exiting in the background: filled from the bucket, every layer shareable as loaded
    (vLLM's own check) and, post-processed, what stock vLLM holds. Nothing of the daemon page-locks ahead."""
    from vllm.model_executor.model_loader.weight_cache.protocol import check_ipc_quant_support

    from marlin_pack.gpu.helpers import exit_in_background
    from marlin_pack.vllm_plugin import preload
    from marlin_pack.vllm_plugin.patches import scope

    model, url = published
    vllm_config, _ = fake_engine(model, "auto_awq", monkeypatch)
    vllm_config.load_config = make_loader(bundle=url).load_config
    assert preload.plan(vllm_config) is None
    checked: list[Any] = []
    with exit_in_background(), scope.in_use():
        placed = _placed(model, monkeypatch, 1, 0, bundle=url, before_post=lambda m: checked.append(check_ipc_quant_support(m)))
    reference = vr.reference_rank_tensors(model, 1, 0, torch.float16)
    assert checked and all(torch.equal(placed[n], t) for n, t in reference.items())
    [(plan, done)] = streamed
    assert set(done.bytes_read) == {"tp1/rank-0.safetensors", "common.safetensors"}


def test_a_pipeline_stage_streams_only_its_layers(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: list[Any],
) -> None:
    """Stage 1 of 2 (TP 1) of vLLM's own Llama stage model: every parameter as stock vLLM holds it there, and the rank
    file's bytes streamed are the stage's layers widened to whole blocks, not the file."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin import LOAD_FORMAT

    monkeypatch.setenv("MARLIN_PACK_IO", '{"threads": 2, "window_mib": 1}')
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    model_dir = write_stage_bundle(tmp_path / "m", "llama", 5)
    push(model_dir / "marlin-pack", s3.url("stage"), block_size=BLOCK)
    dtype = dtype_of("llama")
    want = sr.stage_params(model_dir, 1, 0, dtype, (2, 1))
    vllm_config, model_config = stage_engine(model_dir, dtype, monkeypatch, 1, 2)
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    loader = MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"bundle": s3.url("stage")}))
    with sr.stage_model(model_dir, 1, 0, dtype, (2, 1), build=False):
        model = loader.create_model(vllm_config, model_config)
        loader.load_weights(model, model_config)
        process_weights_after_loading(model, model._real_model_config, torch.device("cpu"))
    got = {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
    [(plan, done)] = streamed
    share = plan.stage
    assert share is not None and (share.pp_size, share.pp_rank) == (2, 1)
    rank = plan.files[0]
    assert done.bytes_read[rank.entry.path] == rank.span_bytes < rank.entry.size  # its layers' blocks, not the file
    assert rank.span_bytes <= share.rank_bytes + 2 * BLOCK * len(rank.spans)


def _ordinary(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    calls: list[Any] = []
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, **kw: calls.append(kw) or "ordinary")
    return calls


@pytest.mark.parametrize("problem", ["credentials", "half-published", "truncated", "missing", "tp size"])
def test_refused_before_the_model_is_built_or_fallen_back_from(
    published: tuple[Path, str], s3: Any, monkeypatch: pytest.MonkeyPatch, streamed: list[Any], problem: str,
) -> None:
    model, url = published
    tp, field, match = 1, "bundle", ""
    if problem == "credentials":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY000000000")
        match = "credentials were refused"
    elif problem == "half-published":
        s3.client().delete_object(Bucket=s3.bucket, Key=f"llama/{RECORD_NAME}")
        match = "half-published"
    elif problem == "truncated":
        s3.client().put_object(Bucket=s3.bucket, Key="llama/tp1/rank-0.safetensors", Body=b"\0" * 100)
        field, match = "files", "truncated"
    elif problem == "missing":
        s3.client().delete_object(Bucket=s3.bucket, Key="llama/common.safetensors")
        field, match = "files", "common.safetensors is missing"
    else:
        tp, field, match = 4, "tp_size", "has tp 1,2, .*publish it again"
    built = fake_create_model(monkeypatch, model, tp)
    vllm_config, model_config = fake_engine(model, "auto_awq", monkeypatch, tp, 0)
    with pytest.raises(LoadRefusedError, match=rf"from bundle {url}: \[{field}\] .*{match}") as e:
        make_loader(bundle=url).create_model(vllm_config, model_config)
    assert "\n" not in str(e.value)
    calls = _ordinary(monkeypatch)
    assert make_loader(bundle=url, fallback=True).load_model(vllm_config, model_config) == "ordinary"
    assert len(calls) == 1 and built == [] and streamed == []  # nothing built, nothing streamed


def test_a_block_changed_after_the_decision_stops_the_load(
    published: tuple[Path, str], s3: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Re-published (another object of the same size) between the decision and the copy: the block that is not the
    record's is refused as it arrives, before any layer is marked loaded (the arena is bound by then: no fallback)."""
    model, url = published
    fake_create_model(monkeypatch, model, 1)
    vllm_config, model_config = fake_engine(model, "auto_awq", monkeypatch)
    loader = make_loader(bundle=url, fallback=True)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        built = loader.create_model(vllm_config, model_config)
        key = "llama/tp1/rank-0.safetensors"
        body = bytearray(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
        body[-1] ^= 0xFF
        s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
        with pytest.raises(BundleMismatchError, match=r"rank-0.safetensors: block \d+ .* does not match the publication record"):
            loader.load_weights(built, model_config)
    assert not any(is_prepacked(m) for m in built.modules())


def test_the_daemon_launcher_leaves_a_bucket_bundle_to_the_loader(s3: Any, make_bundle: Any) -> None:
    """``marlin-pack daemon MODEL --model-loader-extra-config '{"bundle": "s3://..."}'``: the daemon's fill is the
    loader's (create_model/load_weights, as above), which decides in the daemon; the launcher looks for no directory."""
    from marlin_pack.vllm_plugin.launcher import preload_argv

    model = make_bundle("awq", group_size=32)
    argv = preload_argv(str(model), ["--model-loader-extra-config", f'{{"bundle": "{s3.url("x")}"}}'])
    assert "marlin_prepacked" in argv
