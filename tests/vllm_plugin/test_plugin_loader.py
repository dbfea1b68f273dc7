"""``loader.MarlinPrepackedLoader`` on the CPU: model creation is faked with real vLLM layers
(built as ``vllm_reference`` builds them), everything else is the loader's and vLLM's own code;
the placed and post-processed layers are compared with stock vLLM's (``vllm_reference``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from marlin_pack.errors import LoadRefusedError
from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.layer_check import LayerFacts
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked
from marlin_pack.vllm_plugin.stubs import is_stub

vr = pytest.importorskip("vllm_reference")


def fake_engine(
    model: Path, quantization: str, monkeypatch: pytest.MonkeyPatch, tp_size: int = 1, rank: int = 0
) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A vllm_config / model_config pair with what the loader reads; this worker is ``rank`` of ``tp_size``."""
    from vllm.config.kernel import KernelConfig
    from vllm.distributed import parallel_state as ps

    if tp_size > 1:  # as if distributed were up: engine_facts asks parallel_state for the rank
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp_size)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1, world_size_across_dp=tp_size),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model_config = SimpleNamespace(
        model=str(model), dtype=torch.float16, quantization=quantization, word_embeddings_untied_by_checkpoint=False,
        enable_sleep_mode=False,
    )
    return vllm_config, model_config


def fake_create_model(monkeypatch: pytest.MonkeyPatch, model: Path, tp_size: int = 1) -> list[dict]:
    """BaseModelLoader.create_model -> the four linears per decoder layer, built by vLLM's real
    classes; ``model.load_weights`` records the common tensors. Returns the kernel settings seen."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    cfg = json.loads((model / "config.json").read_text())
    seen: list[dict] = []

    def create_model(self: object, vllm_config: SimpleNamespace, model_config: object, prefix: str = "") -> object:
        seen.append(dict(vllm_config.kernel_config.linear_backend_per_quant or {}))
        v = vr._vllm()
        qc = vr._quant_config(v, model, cfg["quantization_config"], v.default_model_class)
        root = vr._build_layers(v, vr._model_facts(cfg), qc, set(), tp_size)
        root.common = []
        root.load_weights = lambda weights: {root.common.append((n, t.device)) or n for n, t in weights}
        return root

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    return seen


def on_reader_copy(monkeypatch: pytest.MonkeyPatch, seen: Callable[[str], object]) -> None:
    """Call ``seen(file name)`` for each file as every ``ParallelReader.copy_files`` (which ``copy`` calls) begins
    (on the reader's caller's thread)."""
    from marlin_pack.vllm_plugin import gpu_reader

    copy_files = gpu_reader.ParallelReader.copy_files

    def seen_copy(self: Any, jobs: Any) -> int:
        for path, _ in jobs:
            seen(Path(path).name)
        return copy_files(self, jobs)

    monkeypatch.setattr(gpu_reader.ParallelReader, "copy_files", seen_copy)


def with_vllm_embeddings(monkeypatch: pytest.MonkeyPatch, model_dir: Path, padding: int = 0) -> dict[str, Any]:
    """The fake model of ``model_dir`` with vLLM's own ``VocabParallelEmbedding``/``ParallelLMHead`` (built
    inside the loader's construction, so the embedding method's stubs apply), the tiny embedding and head
    counted as large common tensors, and a ``load_weights`` running vLLM's weight loaders (``model.fed``: the
    names fed to it). Returns a dict that gets ``stubs``: the parameters that were stubs right after building."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import marlin_pack.vllm_plugin.loader as loader_mod

    monkeypatch.setattr(loader_mod, "_LARGE_COMMON", 1 << 10)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    fake_create_model(monkeypatch, model_dir)
    build = BaseModelLoader.create_model
    during: dict[str, Any] = {}

    def create_model(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, **({"padding_size": vocab + padding} if padding else {}))
        model.lm_head = ParallelLMHead(vocab, hidden)
        during["stubs"] = {n for n, p in model.named_parameters() if is_stub(p)}
        fed: list[str] = []
        params = dict(model.named_parameters())

        def load_weights(weights: Any) -> set[str]:  # vLLM's weight loaders for the model's own parameters
            for name, t in weights:
                fed.append(name)
                if name in params:
                    params[name].weight_loader(params[name], t)
            return set(fed)

        model.load_weights, model.fed = load_weights, fed
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    return during


def machete_for_down_proj(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader sees vLLM's choice of Machete for every ``down_proj`` layer (a model that does not fit a bundle)."""
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.vllm_plugin.engine import layer_facts

    def facts(module: torch.nn.Module, skips_when_marked: bool) -> LayerFacts:
        f = layer_facts(module, skips_when_marked)
        return dataclasses.replace(f, kernel="MacheteLinearKernel") if module.prefix.endswith("down_proj") else f

    monkeypatch.setattr(loader_mod, "layer_facts", facts)


def make_loader(**extra: object) -> Any:
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    return MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=dict(extra)))


def quantization_of(fmt: str) -> str:
    if fmt.startswith("ct"):
        return "compressed-tensors"
    return "auto_awq" if fmt == "awq" else "auto_gptq"


# --- placement equals stock vLLM -------------------------------------------------------------

# case -> (make_bundle arguments, tp_size, rank)
CASES: dict[str, tuple[dict, int, int]] = {
    "awq4": (dict(fmt="awq", preset="tiny", tp_sizes=(1, 2)), 1, 0),
    "gptq4": (dict(fmt="gptq", preset="tiny", tp_sizes=(1, 2)), 1, 0),
    "gptq8": (dict(fmt="gptq", preset="tiny", bits=8), 1, 0),
    "awq4-padded": (dict(fmt="awq", preset="tiny-padded", group_size=32), 1, 0),
    "gptq4-padded": (dict(fmt="gptq", preset="tiny-padded", group_size=32), 1, 0),
    "gptq4-tp2-rank1": (dict(fmt="gptq", preset="tiny", tp_sizes=(1, 2)), 2, 1),
    "awq4-tp2-rank0": (dict(fmt="awq", preset="tiny", tp_sizes=(1, 2)), 2, 0),
    # compressed-tensors WNA16: weight_packed / weight_scale / weight_zero_point / weight_shape.
    "ct4": (dict(fmt="ct", preset="tiny", tp_sizes=(1, 2)), 1, 0),
    "ct8-channel": (dict(fmt="ct", preset="tiny", bits=8, group_size=-1), 1, 0),
    "ct4-asym": (dict(fmt="ct-asym", preset="tiny", group_size=64, tp_sizes=(1, 2)), 1, 0),
    "ct4-asym-padded": (dict(fmt="ct-asym", preset="tiny-padded", group_size=32), 1, 0),
    "ct4-asym-tp2-rank1": (dict(fmt="ct-asym", preset="tiny", group_size=64, tp_sizes=(1, 2)), 2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_placed_layers_equal_stock_vllm_post_processing(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """The daemon's path: create_model (checks), load_weights (placement, marks, common tensors),
    then vLLM's patched post-processing; the layers hold stock vLLM's post-processed tensors."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers

    bundle_args, tp_size, rank = CASES[case]
    model_dir = make_bundle(**bundle_args)
    reference = vr.reference_rank_tensors(model_dir, tp_size, rank, torch.float16)
    fake_create_model(monkeypatch, model_dir, tp_size)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(bundle_args["fmt"]), monkeypatch, tp_size, rank)
    loader = make_loader(io_threads=2, chunk_mb=1)
    with vr._patched(tp_size, rank), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        assert all(is_patched(m.quant_method) for m in layers.values())  # create_model installs the patches
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        assert all(is_prepacked(m) for m in layers.values())
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert not any(is_prepacked(m) for m in layers.values())
    assert all(m.input_global_scale is None for m in layers.values())
    common = load_file(str(model_dir / "marlin-pack/common.safetensors"))
    assert sorted(n for n, _ in model.common) == sorted(common)
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        t = got[name]
        assert isinstance(t, torch.nn.Parameter), name
        assert t.dtype == want.dtype and t.shape == want.shape and t.is_contiguous(), name
        assert torch.equal(t.detach(), want), name
    # One arena holds every placed tensor (the daemon exports it as one IPC handle), each view aligned.
    storages = {t.untyped_storage().data_ptr() for n, t in got.items() if t.numel() and "w_zp" not in n}
    assert len(storages) == 1, {n: (t.untyped_storage().data_ptr(), t.numel()) for n, t in got.items()}
    base = min(t.data_ptr() for n, t in got.items() if t.numel() and "w_zp" not in n)
    assert all((t.data_ptr() - base) % 512 == 0 for n, t in got.items() if t.numel() and "w_zp" not in n)


# --- the loader's own flow -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct", "ct-asym"])
def test_load_model_flow_on_cpu(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """load_model: forced Marlin at creation, checks, placement, marks, common tensors through
    model.load_weights, vLLM's real process_weights_after_loading (finishing the layers only)."""
    model_dir = make_bundle(fmt, "tiny", tp_sizes=(1, 2))
    reference = vr.reference_rank_tensors(model_dir, 1, 0, torch.float16)
    seen = fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(fmt), monkeypatch)
    loader = make_loader(io_threads=2)
    with vr._patched(1, 0):
        model = loader.load_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert seen == [{"mixed_precision": "marlin"}]
    assert vllm_config.kernel_config.linear_backend_per_quant == {"mixed_precision": "marlin"}  # stays set
    common = load_file(str(model_dir / "marlin-pack/common.safetensors"))
    assert sorted(n for n, _ in model.common) == sorted(common)
    for name, want in reference.items():
        layer, _, pname = name.rpartition(".")
        got = getattr(model.get_submodule(layer), pname)
        assert torch.equal(got.detach(), want), name
    assert not any(is_prepacked(m) for m in model.modules())
    assert not model.training


@pytest.mark.parametrize(("fmt", "during_build"), [("awq", True), ("gptq", True), ("ct-asym", True), ("gptq", False)])
def test_rank_file_copies_beside_the_construction(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, during_build: bool) -> None:
    """Dense bundles: the arena is allocated and the rank file's copy into it starts before vLLM builds the
    model, whose quantized placeholders are memory-less stubs meanwhile; load_weights binds, waits, and the
    layers hold stock vLLM's tensors. ``copy_during_build: false``: vLLM's placeholders, the copy after."""
    import threading

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers

    model_dir = make_bundle(fmt, "tiny")
    reference = vr.reference_rank_tensors(model_dir, 1, 0, torch.float16)
    rank_copy_started = threading.Event()
    on_reader_copy(monkeypatch, lambda name: name == "rank-0.safetensors" and rank_copy_started.set())
    fake_create_model(monkeypatch, model_dir)
    build = BaseModelLoader.create_model
    during: dict[str, Any] = {}

    def create_model(*args: Any, **kwargs: Any) -> Any:
        # Not yet built: only the copy can set it (waiting for it only where it should come).
        during["copy started"] = rank_copy_started.wait(timeout=60 if during_build else 0)
        model = build(*args, **kwargs)
        layers = quantized_layers(model).items()
        during["stubs"] = {f"{n}.{p}" for n, m in layers for p, t in m.named_parameters(recurse=False) if is_stub(t)}
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(fmt), monkeypatch)
    loader = make_loader(io_threads=2, chunk_mb=1, copy_during_build=during_build)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert during["copy started"] is during_build
    # The quant methods' placeholders the bundle replaces (GPTQ's zero points: int32[0] once finished).
    quantized = {n for n, t in reference.items() if t.numel() > 1 and not n.endswith(".bias")}
    if during_build:
        assert quantized and quantized <= during["stubs"], sorted(quantized - during["stubs"])
    else:
        assert not during["stubs"]
    assert not any(n.endswith(".bias") for n in during["stubs"])  # made by vLLM's linear layer, not the quant method
    got = {f"{n}.{p}": t for n, m in quantized_layers(model).items() for p, t in m.named_parameters(recurse=False)}
    assert not [n for n, t in got.items() if is_stub(t)]
    for name, want in reference.items():
        assert torch.equal(got[name].detach(), want), name
    assert loader._timings.beside is during_build and loader._timings.copy_bytes == sum(t.nbytes for t in reference.values())


@pytest.mark.parametrize("common_io", ["with_rank_file", "staged", "daemon default", "daemon without helpers"])
@pytest.mark.parametrize("padded_vocab", [False, True])
def test_common_tensors_copy_beside_the_construction(
    make_bundle: Any, monkeypatch: pytest.MonkeyPatch, padded_vocab: bool, common_io: str
) -> None:
    """``common_during_build``: the large common tensors are read beside vLLM's construction, by the rank file's
    background job after the rank file (``common_io`` with_rank_file) or by a job of their own at the same time
    (staged), started before vLLM builds the model, whose embedding and head (vLLM's own classes) are memory-less
    stubs meanwhile; once built they point at those copies and are not fed to vLLM. A parameter of another shape
    (a padded vocabulary) gets memory before vLLM's weight loader writes into it, and holds what that loader
    writes. In a weight-cache daemon's fill (``exit_in_background``) that copies with helpers this is the default;
    without helpers (not measured there) it is not."""
    import contextlib
    import threading

    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.copy_helpers import exit_in_background

    model_dir = make_bundle("gptq", "tiny")
    common = load_file(str(model_dir / "marlin-pack" / "common.safetensors"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reads: list[tuple[str, str]] = []
    on_reader_copy(monkeypatch, lambda name: reads.append((name, threading.current_thread().name)))
    during = with_vllm_embeddings(monkeypatch, model_dir, padding=64 if padded_vocab else 0)
    vllm_config, model_config = fake_engine(model_dir, "auto_gptq", monkeypatch)
    daemon = common_io.startswith("daemon")
    options: dict[str, Any] = {"common_during_build": True, "common_io": common_io}
    if common_io == "daemon default":  # helpers started (they leave CPU destinations to this process)
        import marlin_pack.vllm_plugin.loader as loader_mod

        monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        options = {"io_mode": "processes"}
    elif common_io == "daemon without helpers":
        options = {}
    loader = make_loader(io_threads=2, chunk_mb=1, **options)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        from marlin_pack.vllm_plugin import patches

        patches.install()  # the engine's worker has them: the embedding method's stubs
        with exit_in_background() if daemon else contextlib.nullcontext():  # as the daemon's get_model
            model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
            loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    if common_io == "daemon without helpers":
        assert not during["stubs"] & {"model.embed_tokens.weight", "lm_head.weight"} and loader._timings.common_beside is None
        return
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= during["stubs"]
    background = [name for name, thread in reads if thread == "marlin-pack-arena-copy"]
    own = [name for name, thread in reads if thread == "marlin-pack-common-copy"]
    if common_io == "staged":  # two jobs, at the same time
        assert background == ["rank-0.safetensors"] and own == ["common.safetensors"]
    else:  # one job, the common tensors after the rank file
        assert background == ["rank-0.safetensors", "common.safetensors"] and own == []
    assert not [n for n, p in model.named_parameters() if is_stub(p)]
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert torch.equal(head, common["lm_head.weight"]) and "lm_head.weight" not in model.fed
    if padded_vocab:  # vLLM's loader: the rows it has, zeros after them
        assert embed.shape[0] > vocab and "model.embed_tokens.weight" in model.fed
        assert torch.equal(embed[:vocab], common["model.embed_tokens.weight"]) and not embed[vocab:].any()
    else:
        assert torch.equal(embed, common["model.embed_tokens.weight"]) and "model.embed_tokens.weight" not in model.fed
    assert set(model.fed) | {"lm_head.weight"} | (set() if padded_vocab else {"model.embed_tokens.weight"}) == set(common)
    rank = load_file(str(model_dir / "marlin-pack" / "tp1" / "rank-0.safetensors"))
    large = ("model.embed_tokens.weight", "lm_head.weight")
    assert loader._timings.common_beside == (1 if padded_vocab else 2)
    text = loader._timings.common_text()
    assert f"({loader._timings.common_beside} of its names copied beside the construction" in text
    assert (", staged in " in text) is (common_io == "staged")
    beside = 0 if common_io == "staged" else sum(common[n].nbytes for n in large)
    assert loader._timings.copy_bytes == sum(t.nbytes for t in rank.values()) + beside


def test_stub_placeholders_are_left_to_finishing(make_bundle: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placeholders the bundle does not replace (symmetric GPTQ's qzeros) stay memory-less stubs through
    load_weights: finishing replaces them (int32[0]) without their ever being allocated and filled. A stub
    finishing keeps is given memory there, with the value its factory would have written."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers
    from marlin_pack.vllm_plugin.patches import post_processing

    model_dir = make_bundle("gptq", "tiny")
    reference = vr.reference_rank_tensors(model_dir, 1, 0, torch.float16)
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, quantization_of("gptq"), monkeypatch)
    loader = make_loader(io_threads=2, chunk_mb=1)
    materialized: list[int] = []
    materialize = post_processing.materialize_stubs
    monkeypatch.setattr(post_processing, "materialize_stubs", lambda m: materialized.append(materialize(m)) or materialized[-1])
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        assert layers and all(is_stub(m.qzeros) for m in layers.values())  # never allocated
        kept = next(iter(layers.values()))
        kept.register_buffer("kept_stub", torch.ones(1, dtype=torch.int32).expand(3, 5))  # finishing does not set it
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert sum(materialized) == 1 and len(materialized) == len(layers)  # only the one finishing kept
    assert not is_stub(kept.kept_stub) and kept.kept_stub.is_contiguous()
    assert torch.equal(kept.kept_stub, torch.ones(3, 5, dtype=torch.int32))
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    assert all(got[n].numel() == 0 for n in got if n.endswith(".qzeros"))
    for name, want in reference.items():
        assert torch.equal(got[name].detach(), want), name


def test_own_share_after_build_waits_for_the_construction(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``io_own_share: after_build``: the copy's gate (the reader's ``own_after``) is shut while vLLM builds
    the model and opened as soon as it is built; the default has no gate."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.vllm_plugin.arena import BackgroundCopy

    copies: list[BackgroundCopy] = []

    class Recorded(BackgroundCopy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            copies.append(self)

    monkeypatch.setattr(loader_mod, "BackgroundCopy", Recorded)
    fake_create_model(monkeypatch, awq_bundle)
    build = BaseModelLoader.create_model
    shut_while_building: list[bool] = []
    monkeypatch.setattr(BaseModelLoader, "create_model",
                        lambda *a, **k: shut_while_building.append(not copies[-1].gate.is_set()) or build(*a, **k))
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    for own_share in ("after_build", "during_build"):
        loader = make_loader(io_own_share=own_share)
        with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
            if own_share == "after_build":
                model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
                assert shut_while_building == [True] and copies[-1].gate.is_set()
                loader.load_weights(model, model_config)  # type: ignore[arg-type]
            else:
                monkeypatch.setattr(BaseModelLoader, "create_model", build)
                loader.load_weights(loader.create_model(vllm_config, model_config), model_config)  # type: ignore[arg-type]
                assert copies[-1].gate is None
    assert len(copies) == 2 and all(c.bytes > 0 for c in copies)


@pytest.mark.parametrize("end", ["join", "abandon"])
def test_background_copy_opens_its_gate_before_waiting(end: str) -> None:
    """A copy waiting on its gate (the engine's share waits for the construction) cannot deadlock the
    loader: join and abandon open the gate before they wait, on every path (a failed construction too)."""
    import threading

    from marlin_pack.vllm_plugin.arena import BackgroundCopy

    gate = threading.Event()

    class GatedReader:
        modes_used = {"processes"}

        def __enter__(self) -> GatedReader:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def copy_files(self, jobs: Any) -> int:
            assert gate.wait(timeout=30), "the gate stayed shut"
            return 7

    copy = BackgroundCopy(GatedReader, "rank-0.safetensors", [], gate=gate)  # type: ignore[arg-type]
    assert not gate.is_set()
    getattr(copy, end)()
    assert gate.is_set() and copy.bytes == 7 and copy.modes_used == {"processes"}


def test_rank_file_copy_failure_surfaces_in_load_weights(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read error in the background copy is raised by load_weights (after the copy ended), not lost."""
    from marlin_pack.vllm_plugin import gpu_reader

    copy_files = gpu_reader.ParallelReader.copy_files

    def failing(self: Any, jobs: Any) -> int:
        if any(Path(path).name == "rank-0.safetensors" for path, _ in jobs):
            raise OSError(5, "Input/output error")
        return copy_files(self, jobs)

    monkeypatch.setattr(gpu_reader.ParallelReader, "copy_files", failing)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    loader = make_loader()
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        with pytest.raises(OSError, match="Input/output error"):
            loader.load_weights(model, model_config)  # type: ignore[arg-type]


def test_construction_failure_ends_the_copy_first(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM failing to build the model (e.g. out of memory): create_model raises that error once the rank
    file's copy has ended (it writes into the arena and reads with the helpers), then ends the helpers."""
    import threading

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import marlin_pack.vllm_plugin.loader as loader_mod

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def fails(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(BaseModelLoader, "create_model", fails)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    loader = make_loader(io_mode="processes", io_processes=2)
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "marlin-pack-arena-copy"]
    assert events[0] == "start 2 helpers for device 0" and events[-1] == "joined"


def test_create_model_kernel_mismatch_refuses_or_falls_back(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    machete_for_down_proj(monkeypatch)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)

    fp16 = vr._vllm().set_default_torch_dtype(torch.float16)  # as the daemon and load_model do
    with fp16, vr._patched(1, 0), pytest.raises(LoadRefusedError, match=r"\[kernel\] vLLM chose MacheteLinearKernel") as e:
        make_loader().create_model(vllm_config, model_config)
    assert e.value.field == "kernel"

    calls: list = []
    monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: calls.append(m))
    fallback = make_loader(fallback=True)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = fallback.create_model(vllm_config, model_config)
        fallback.load_weights(model, model_config)
    assert calls == [model]  # the ordinary loader loads the checkpoint
    assert not any(is_prepacked(m) for m in model.modules())
    # Built with memory-less placeholders for the bundle; vLLM's weight loaders need real ones.
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if is_stub(t)]


@pytest.mark.parametrize("common_io", ["with_rank_file", "staged"])
@pytest.mark.parametrize("fallback", [False, True])
def test_common_copies_dropped_when_the_built_model_does_not_fit(
    make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fallback: bool, common_io: str
) -> None:
    """``common_during_build`` and a layer vLLM built on another kernel: the load is refused, or (fallback)
    the checkpoint loads the ordinary way into a model without stubs; the embedding and the head are
    tensors of their own with vLLM's loaders' bytes, not the copies made beside the construction."""
    import threading

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    machete_for_down_proj(monkeypatch)
    model_dir = make_bundle("gptq", "tiny")
    common = load_file(str(model_dir / "marlin-pack" / "common.safetensors"))
    reads: list[str] = []
    on_reader_copy(monkeypatch, reads.append)
    during = with_vllm_embeddings(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_gptq", monkeypatch)
    loader = make_loader(io_threads=2, chunk_mb=1, common_during_build=True, fallback=fallback, common_io=common_io)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        from marlin_pack.vllm_plugin import patches

        patches.install()
        if not fallback:
            with pytest.raises(LoadRefusedError, match=r"\[kernel\] vLLM chose MacheteLinearKernel"):
                loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        else:
            monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: m.load_weights(common.items()))
            model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
            loader.load_weights(model, model_config)  # type: ignore[arg-type]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= during["stubs"]
    assert sorted(reads[:2]) == ["common.safetensors", "rank-0.safetensors"]  # the copies beside the construction ran, and ended
    assert not [t for t in threading.enumerate() if t.name in ("marlin-pack-arena-copy", "marlin-pack-common-copy")]
    if fallback:
        assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if is_stub(t)]
        assert not any(is_prepacked(m) for m in model.modules())
        for name, param in (("model.embed_tokens.weight", model.model.embed_tokens.weight), ("lm_head.weight", model.lm_head.weight)):
            assert name in model.fed and torch.equal(param, common[name])


def test_fallback_decision_loads_the_ordinary_way(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle that does not fit the engine (here: bfloat16) with fallback on: vLLM's default
    loader loads the checkpoint; without fallback the load is refused before the model is built."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    seen = fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    model_config.dtype = torch.bfloat16
    with pytest.raises(LoadRefusedError, match=r"\[serving_dtype\]"):
        make_loader().create_model(vllm_config, model_config)
    assert seen == []

    calls: list = []
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, **kw: calls.append(kw) or "ordinary")
    assert make_loader(fallback=True).load_model(vllm_config, model_config) == "ordinary"
    assert [c["model_config"] for c in calls] == [model_config]
    assert vllm_config.kernel_config.linear_backend_per_quant is None  # Marlin not forced


def test_malformed_rank_header_is_refused_before_the_gpu(awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank file whose header is broken (its hash recorded anew) is refused by create_model, naming the file,
    before any layer is built; with fallback the engine loads the checkpoint instead."""
    import json

    from marlin_pack.errors import LoadRefusedError
    from marlin_pack.io.hashing import file_digest

    def damage(model_dir: Path) -> None:
        rank_file = model_dir / "marlin-pack/tp1/rank-0.safetensors"
        data = rank_file.read_bytes()
        rank_file.write_bytes(b"\xff" * 8 + data[8:])  # an impossible header length
        m = json.loads((model_dir / "marlin-pack/manifest.json").read_text())
        m["tensor_parallel"][0]["ranks"][0]["file"]["blake3"] = file_digest(rank_file)
        (model_dir / "marlin-pack/manifest.json").write_text(json.dumps(m))

    model_dir = damaged_copy(awq_bundle, damage)
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        with pytest.raises(LoadRefusedError, match=r"\[files\] rank-0.safetensors declares a .*-byte header") as e:
            make_loader().create_model(vllm_config, model_config)
        assert e.value.field == "files"


def test_load_weights_needs_its_own_model() -> None:
    with pytest.raises(RuntimeError, match="only load weights into a model built by its own create_model"):
        make_loader().load_weights(torch.nn.Module(), SimpleNamespace())


def test_direct_target_only_for_plain_copy_loaders() -> None:
    """Large common tensors skip vLLM's weight loader only where it would do a plain copy at TP=1."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from marlin_pack.vllm_plugin.loader import _direct_target

    p = torch.nn.Parameter(torch.empty(4, 8, dtype=torch.float16), requires_grad=False)
    assert _direct_target(p, (4, 8), torch.float16) is p  # no weight_loader: vLLM uses default_weight_loader
    p.weight_loader = default_weight_loader
    assert _direct_target(p, (4, 8), torch.float16) is p
    p.weight_loader = VocabParallelEmbedding.weight_loader.__get__(object())  # a bound method, as vLLM sets it
    assert _direct_target(p, (4, 8), torch.float16) is p
    assert _direct_target(p, (8, 4), torch.float16) is None
    assert _direct_target(p, (4, 8), torch.bfloat16) is None
    assert _direct_target(None, (4, 8), torch.float16) is None
    p.weight_loader = lambda param, w: param.data.copy_(w * 2)
    assert _direct_target(p, (4, 8), torch.float16) is None


class _FakeHelpers:
    """Stands in for copy_helpers.HelperPool: records when it is started and how it is ended."""

    events: list[str] = []

    settings: dict[str, object] = {}

    def __init__(self, count: int | None, device_index: int, **settings: object) -> None:
        self.events.append(f"start {count} helpers for device {device_index}")
        _FakeHelpers.settings = settings
        self.closed = False
        self.ready_after = 0.25
        self.source = "own"
        self.retained_bytes: int | None = None

    def close(self, wait: bool = True) -> None:
        if not self.closed:  # as HelperPool.close: a second call ends nothing more...
            self.events.append(f"close wait={wait}")
        self.closed = True
        if wait:  # ...but waits for helpers an earlier close(wait=False) ended
            self.join()

    def join(self, timeout: float | None = None) -> None:
        self.events.append("joined")


@pytest.mark.parametrize("case", ["loads", "refused", "falls back", "common by helpers", "daemon"])
def test_processes_mode_helpers_start_before_creation_and_always_end(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, case: str, marlin_log: list[str]
) -> None:
    """io_mode processes: the helpers start before vLLM builds the model (their CUDA contexts come up
    meanwhile, and the rank file's copy starts at once) and end once the copy is done (without waiting,
    on the copy's thread, so maybe before the construction ends; but gone before loading returns: vLLM
    measures the free GPU memory next), or when the bundle is refused or not used. With
    ``io_common_by_helpers`` they copy the common tensors next (the common reader is given them), so
    they end only once those are loaded. In a weight-cache daemon (``exit_in_background``), which measures
    no memory after its fill, loading ends them without waiting for them to exit."""
    import contextlib

    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.vllm_plugin.copy_helpers import exit_in_background
    from marlin_pack.vllm_plugin.engine import layer_facts

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    seen = fake_create_model(monkeypatch, awq_bundle)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    created = BaseModelLoader.create_model
    monkeypatch.setattr(BaseModelLoader, "create_model", lambda *a, **k: events.append("create") or created(*a, **k))
    if case in ("refused", "falls back"):  # the model vLLM built does not fit the bundle
        monkeypatch.setattr(
            loader_mod, "layer_facts", lambda m, skips_when_marked: dataclasses.replace(layer_facts(m, skips_when_marked), kernel="X")
        )
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    by_helpers = case == "common by helpers"
    staging = {"io_staged": 2, "io_stage_mib": 16} if case == "loads" else {}
    no_service = {"io_helper_service": False} if case == "refused" else {}  # the option reaches the pool
    loader = make_loader(io_mode="processes", io_processes=2, fallback=case == "falls back", io_common_by_helpers=by_helpers,
                         **staging, **no_service)
    readers: list[tuple[object, object]] = []
    make_reader = loader._reader

    def reader(helpers: object, mode: object = None, **kw: object) -> object:
        readers.append((helpers, mode))
        return make_reader(helpers, mode, **kw)

    monkeypatch.setattr(loader, "_reader", reader)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        if case == "refused":
            with pytest.raises(LoadRefusedError):
                loader.create_model(vllm_config, model_config)
        else:
            with exit_in_background() if case == "daemon" else contextlib.nullcontext():  # as the daemon's get_model
                model = loader.create_model(vllm_config, model_config)
                if case in ("loads", "common by helpers", "daemon"):
                    assert events[:1] == ["start 2 helpers for device 3"] and "create" in events
                    loader.load_weights(model, model_config)  # CPU destinations: read here, the helpers unused
    assert len(seen) == 1
    assert events[0] == "start 2 helpers for device 3"
    staged, stage_mib = (2, 16) if case == "loads" else (0, 64)
    # A daemon's defaults: deferred unregistering (and the common tensors copied with the rank file, see
    # test_common_tensors_copy_beside_the_construction[daemon default]).
    deferred = case == "daemon"
    assert _FakeHelpers.settings == {
        "staged": staged, "stage_mib": stage_mib, "defer_unregister": deferred, "nice": 0, "service": case != "refused",
        "service_dir": None,  # no daemon or engine page-locked its bundle ahead of the copy (preload)
    }
    if by_helpers:  # ended by loading, after the common tensors; the common reader had them
        assert events[1:] == ["create", "close wait=False", "joined"]
        assert readers[-1][1] == "processes" and isinstance(readers[-1][0], _FakeHelpers)
        return
    # The copy's thread ends them as its copy ends (before or after the construction); then joined (not by a daemon).
    assert sorted(events[1:3]) == ["close wait=False", "create"]
    assert events[3:] == ([] if case == "daemon" else ["joined"])
    if case == "daemon":
        assert any("the copy helpers exit in the background" in m for m in marlin_log)
        assert not any("for the copy helpers to exit" in m for m in marlin_log)
    elif case == "loads":
        assert any("for the copy helpers to exit" in m for m in marlin_log)
    if case == "loads":
        assert readers[-1] == (None, "registered")  # the common tensors: read here, beside the helpers' copy
        assert any("placed" in m and "helpers ready after 0.25 s" in m for m in marlin_log)  # the pool's own figure


@pytest.mark.parametrize(
    ("change", "starts"),
    [
        ("none", True),
        ("more ranks", False),  # tensor, pipeline or data parallel: each rank would start helpers
        ("sleep mode", False),  # the cumem allocator's memory cannot be opened with legacy CUDA IPC
        ("expandable segments", False),
        ("few cores", False),
        ("tmpfs", False),  # staged
        ("gpu nearly full", False),  # no room for their CUDA contexts beside the weights
    ],
)
def test_auto_io_mode_starts_helpers_only_where_they_help(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, change: str, starts: bool
) -> None:
    """io_mode auto: copy helpers (the processes mode) for one engine process on a file on disk with
    enough cores and PyTorch's ordinary allocator; otherwise none are started (registered or staged)."""
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.vllm_plugin import gpu_reader

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    files = (awq_bundle / "marlin-pack/tp1/rank-0.safetensors", awq_bundle / "marlin-pack/common.safetensors")
    bundle_bytes = sum(f.stat().st_size for f in files)
    room = 4 * (512 << 20) - (1 if change == "gpu nearly full" else 0)  # 4 helpers by default, 512 MiB each
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (bundle_bytes + room, 80 << 30))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4 if change == "few cores" else 16)))
    monkeypatch.setattr(gpu_reader, "in_base_memory_pages", lambda path: change == "tmpfs")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    if change == "expandable segments":
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6, expandable_segments:True")
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    if change == "more ranks":
        vllm_config.parallel_config.world_size_across_dp = 2
    if change == "sleep mode":
        model_config.enable_sleep_mode = True
    loader = make_loader()
    assert loader.options.io_mode == "auto"
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        loader.create_model(vllm_config, model_config)
    # None: HelperPool's default count (the rank file's copy, started with the construction, may have ended them already)
    assert [e for e in events if e.startswith("start")] == (["start None helpers for device 0"] if starts else [])


@pytest.mark.parametrize("tied", [False, True])
def test_large_common_tensors_are_copied_in_one_batch(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, tied: bool) -> None:
    """At TP=1 on a GPU the large common tensors a plain copy loads go straight into their parameters, all
    in one reader call (its threads share every window), and are not fed to vLLM; the rest is fed as it is.
    ``tied``: the head *is* the embedding parameter though the bundle stores both tensors: one
    destination, so the later tensor in the file is copied after the batch and its bytes win, as
    copying in file order gives. (CPU parameters stand in for the GPU's: the reader reads into them.)"""
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.vllm_plugin.decision import decide
    from marlin_pack.vllm_plugin.engine import engine_facts
    from marlin_pack.vllm_plugin.gpu_reader import HostMap, ParallelReader

    monkeypatch.setattr(loader_mod, "_LARGE_COMMON", 1 << 10)  # the tiny model's embedding and head count as large
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    bundle = decide(make_loader().options, engine_facts(vllm_config, model_config)).bundle
    assert bundle is not None
    header = read_header(bundle.common_file)
    want = load_file(str(bundle.common_file))
    large = sorted((n for n, i in header.tensors.items() if i.nbytes >= 1 << 10), key=lambda n: header.tensors[n].start)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(large)

    model = torch.nn.Module()
    for name in large:  # a parameter of each large tensor's shape and dtype, filled with garbage
        *path, leaf = name.split(".")
        owner = model
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.full_like(want[name], 7), requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight

    calls: list[int] = []

    class Counting(ParallelReader):
        def copy(self, path: object, items: object) -> int:
            items = list(items)  # type: ignore[call-overload]
            calls.append(len(items))
            return super().copy(path, items)  # type: ignore[arg-type]

    with Counting(2, 1 << 16) as reader, HostMap(bundle.common_file) as host:
        fed = dict(loader_mod.MarlinPrepackedLoader._common_weights(reader, host, bundle, model, torch.device("cuda")))
    assert set(fed) == set(header.tensors) - set(large)  # the direct ones are not fed to vLLM
    for name in set(fed):
        assert torch.equal(fed[name], want[name]), name
    params = dict(model.named_parameters(remove_duplicate=False))
    if tied:
        later = max(["model.embed_tokens.weight", "lm_head.weight"], key=lambda n: header.tensors[n].start)
        assert calls == [len(large) - 1, 1]  # the batch, then the tensor whose destination was taken
        assert torch.equal(params["lm_head.weight"], want[later])
        others = [n for n in large if n not in ("model.embed_tokens.weight", "lm_head.weight")]
    else:
        assert calls == [len(large)]
        others = large
    for name in others:
        assert torch.equal(params[name], want[name]), name


def test_the_timings_line_says_whose_helpers_and_what_they_retained() -> None:
    from marlin_pack.vllm_plugin.loader import _Timings

    t = _Timings(copy=1.0, copy_bytes=40_000_000_000, helpers_ready=0.02, helpers_source="service", helpers_retained=39_500_000_000)
    assert "40.0 GB/s), helpers ready after 0.02 s (the helper service's), 39.50 GB of pages retained registered" in t.copy_text()
    t.helpers_retained = 3_400_000
    assert "(the helper service's), 3.4 MB of pages retained registered" in t.copy_text()
    t.helpers_source, t.helpers_retained = "own", None
    assert t.copy_text().endswith("helpers ready after 0.02 s")


def test_a_start_that_hashes_says_how_much_and_how_long_once(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A start whose files this user has no stamps for hashes them and logs one WARNING line (gigabytes, seconds,
    where the stamps went); the next start, stamped, logs nothing of the kind."""
    import logging

    from marlin_pack.io import hashing

    monkeypatch.setattr(hashing, "RACY_NS", -1)  # the copy's files count as settled
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    model_dir = damaged_copy(awq_bundle)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("vllm.marlin_pack").addHandler(handler)
    try:
        for _ in range(2):
            vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
            assert make_loader()._decide(vllm_config, model_config).bundle is not None
    finally:
        logging.getLogger("vllm.marlin_pack").removeHandler(handler)
    hashed = [r.getMessage() for r in records if "hashed" in r.getMessage()]
    assert len(hashed) == 1 and records[0].levelno == logging.WARNING, hashed
    assert re.match(r"marlin-pack: rank 0 hashed [\d.]+ [MG]B \(3 files\) in [\d.]+ s; stamped in ", hashed[0]), hashed
    assert str(tmp_path / "stamps") in hashed[0]
