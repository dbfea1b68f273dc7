"""``loader.MarlinPrepackedLoader`` on the CPU: model creation is faked with real vLLM layers
(built as ``vllm_reference`` builds them), everything else is the loader's and vLLM's own code;
the placed and post-processed layers are compared with stock vLLM's (``vllm_reference``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import plugin_fakes as fakes
import pytest
import torch
from safetensors.torch import load_file

from marlin_pack.errors import LoadRefusedError
from marlin_pack.gpu.plan import HELPER_CONTEXT_BYTES, GpuRoom, IoPlan
from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.layer_check import LayerFacts
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked
from marlin_pack.vllm_plugin.stubs import is_stub

vr = pytest.importorskip("oracles.vllm_reference")


@pytest.fixture(autouse=True)
def _no_preload_no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early helpers of another test for the loader to take (preload.take_pool); the plan is the machine's."""
    from marlin_pack.vllm_plugin import preload

    monkeypatch.setattr(preload, "_CURRENT", None)
    monkeypatch.delenv("MARLIN_PACK_IO", raising=False)


def io_plan(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    """Pick the copy's variant as tests and benchmarks do: ``$MARLIN_PACK_IO`` overrides the loader's I/O plan."""
    monkeypatch.setenv("MARLIN_PACK_IO", json.dumps(fields))


def machine_for_helpers(monkeypatch: pytest.MonkeyPatch, device: int = 0, room: bool = True) -> None:
    """The machine as the plan sees it is one where copy helpers pay and work: CUDA device ``device``, 16 cores, the
    bundle on disk, PyTorch's ordinary allocator and (``room``) an almost empty GPU; else NVML cannot say."""
    from marlin_pack.vllm_plugin import io_facts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    monkeypatch.setattr(io_facts, "gpu_room", lambda d: GpuRoom(free=140 << 30, total=141 << 30) if room else None)
    monkeypatch.setattr(io_facts, "usable_cores", lambda: 16)
    monkeypatch.setattr(io_facts, "in_base_memory_pages", lambda path: False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


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
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
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
    from marlin_pack.gpu import reader as gpu_reader

    copy_files = gpu_reader.ParallelReader.copy_files

    def seen_copy(self: Any, jobs: Any, **kw: Any) -> int:
        for path, _ in jobs:
            seen(Path(path).name)
        return copy_files(self, jobs, **kw)

    monkeypatch.setattr(gpu_reader.ParallelReader, "copy_files", seen_copy)


def with_vllm_embeddings(monkeypatch: pytest.MonkeyPatch, model_dir: Path, padding: int = 0) -> dict[str, Any]:
    """The fake model of ``model_dir`` with vLLM's own ``VocabParallelEmbedding``/``ParallelLMHead`` (built
    inside the loader's construction, so the embedding method's stubs apply), the tiny embedding and head
    counted as large common tensors, and a ``load_weights`` running vLLM's weight loaders (``model.fed``: the
    names fed to it). Returns a dict that gets ``stubs``: the parameters that were stubs right after building."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from marlin_pack.vllm_plugin import common_tensors

    monkeypatch.setattr(common_tensors, "LARGE_COMMON", 1 << 10)
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
    io_plan(monkeypatch, threads=2, window_mib=1)
    loader = make_loader()
    with vr._patched(tp_size, rank), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        assert all(is_patched(m.quant_method) for m in layers.values())  # create_model installs the patches
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        assert all(is_prepacked(m) for m in layers.values())
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert not any(is_prepacked(m) for m in layers.values())
    assert all(getattr(m, "input_global_scale", None) is None for m in layers.values())  # (0.34: not set)
    common = load_file(str(model_dir / "marlin-pack/common.safetensors"))
    assert sorted(n for n, _ in model.common) == sorted(common)
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    # besides: only what vLLM retired (0.34.0: GPTQ's unused qzeros, as stock keeps it)
    assert set(reference) <= set(got) and all(getattr(got[n], "retired", False) for n in set(got) - set(reference))
    for name, want in reference.items():
        t = got[name]
        assert isinstance(t, torch.nn.Parameter), name
        assert t.dtype == want.dtype and t.shape == want.shape and t.is_contiguous(), name
        assert torch.equal(t.detach(), want), name
    # One arena holds every placed tensor (the daemon exports it as one IPC handle), each view aligned; retired
    # parameters (0.34.0: GPTQ's qzeros, the checkpoint's word) are no bundle tensor: memory of their own, as in stock.
    placed = {n: t for n, t in got.items() if t.numel() and "w_zp" not in n and not getattr(t, "retired", False)}
    storages = {t.untyped_storage().data_ptr() for t in placed.values()}
    assert len(storages) == 1, {n: (t.untyped_storage().data_ptr(), t.numel()) for n, t in got.items()}
    base = min(t.data_ptr() for t in placed.values())
    assert all((t.data_ptr() - base) % 512 == 0 for t in placed.values())


MACHETE_CASES: dict[str, tuple[dict, int, int]] = {
    "awq4": (dict(fmt="awq", preset="tiny", tp_sizes=(1, 2)), 1, 0),
    "gptq4": (dict(fmt="gptq", preset="tiny", tp_sizes=(1, 2)), 2, 1),
    "gptq8": (dict(fmt="gptq", preset="tiny", bits=8, group_size=64), 1, 0),
    "ct4": (dict(fmt="ct", preset="tiny"), 1, 0),
    "ct4-asym-tp2-rank1": (dict(fmt="ct-asym", preset="tiny", group_size=64, tp_sizes=(1, 2)), 2, 1),
    "gptq4-g32-stays-marlin": (dict(fmt="gptq", preset="tiny", group_size=32), 1, 0),
}


@pytest.mark.parametrize("case", list(MACHETE_CASES))
def test_machete_bundles_place_what_vllm_holds_on_sm90(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A ``--kernel machete`` bundle: nothing is forced, vLLM (seeing an SM90 GPU) picks Machete per layer, the
    layer checks pass, and after the patched post-processing every parameter equals stock vLLM's on SM90
    (``machete_prepack_B`` stood in for by marlin-pack's layout, see ``vllm_reference``): zero points change
    dtype (int32 placeholders, ``-s*z`` in the bundle), GPTQ keeps its unused ``qzeros``."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.vllm_plugin.engine import quantized_layers

    bundle_args, tp_size, rank = MACHETE_CASES[case]
    model_dir = make_bundle(**bundle_args, kernel="machete")
    kernels: dict[str, str] = {}
    reference = vr.reference_rank_tensors(model_dir, tp_size, rank, torch.float16, kernel="machete", kernels=kernels)
    seen = fake_create_model(monkeypatch, model_dir, tp_size)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(bundle_args["fmt"]), monkeypatch, tp_size, rank)
    io_plan(monkeypatch, threads=2, window_mib=1)
    loader = make_loader()
    with vr._patched(tp_size, rank, "machete"), vr._vllm().set_default_torch_dtype(torch.float16):
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        layers = quantized_layers(model)
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    machete = "MacheteLinearKernel" in kernels.values()
    assert seen == [{} if machete else {"mixed_precision": "marlin"}]  # Marlin forced only for a Marlin bundle
    assert machete is (case != "gptq4-g32-stays-marlin")
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    # besides: only what vLLM retired (0.34.0: a Marlin layer's unused GPTQ qzeros), as stock keeps it
    assert set(reference) <= set(got) and all(getattr(got[n], "retired", False) for n in set(got) - set(reference))
    for name, want in reference.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].detach(), want), name


def test_a_machete_bundle_is_refused_off_sm90_and_with_marlin_forced(make_bundle: Any) -> None:
    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.errors import BundleMismatchError
    from marlin_pack.vllm_plugin.decision import EngineFacts, check_engine

    manifest = read_manifest(make_bundle("gptq", "tiny", kernel="machete") / "marlin-pack")
    base = dict(model="m", vllm_version="0.33.0", dtype="float16", quantization="gptq")
    check_engine(manifest, EngineFacts(**base, capability=90))
    check_engine(manifest, EngineFacts(**base))  # `check` without a GPU: the family is not known
    with pytest.raises(BundleMismatchError, match=r"Machete's layout \(SM90 only\), this GPU has compute capability 8.0"):
        check_engine(manifest, EngineFacts(**base, capability=80))
    with pytest.raises(BundleMismatchError, match=r"--linear-backend is 'marlin'"):
        check_engine(manifest, EngineFacts(**base, capability=90, linear_backend="marlin"))
    with pytest.raises(BundleMismatchError, match=r"VLLM_DISABLED_KERNELS disables MacheteLinearKernel"):
        check_engine(manifest, EngineFacts(**base, capability=90, disabled_kernels=("MacheteLinearKernel",)))


def test_a_marlin_bundle_on_sm90_counts_the_layers_vllm_would_give_machete(make_bundle: Any) -> None:
    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.vllm_plugin.decision import EngineFacts, hopper_machete_layers

    manifest = read_manifest(make_bundle("gptq", "tiny") / "marlin-pack")
    tp_set = manifest.tensor_parallel[0]
    base = dict(model="m", vllm_version="0.33.0", dtype="float16", quantization="gptq")
    assert hopper_machete_layers(manifest, tp_set, EngineFacts(**base, capability=90)) == len(tp_set.layers)
    assert hopper_machete_layers(manifest, tp_set, EngineFacts(**base, capability=89)) == 0
    assert hopper_machete_layers(manifest, tp_set, EngineFacts(**base, capability=90, linear_backend="marlin")) == 0


# --- the loader's own flow -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct", "ct-asym"])
def test_load_model_flow_on_cpu(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """load_model: forced Marlin at creation, checks, placement, marks, common tensors through
    model.load_weights, vLLM's real process_weights_after_loading (finishing the layers only)."""
    model_dir = make_bundle(fmt, "tiny", tp_sizes=(1, 2))
    reference = vr.reference_rank_tensors(model_dir, 1, 0, torch.float16)
    seen = fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(fmt), monkeypatch)
    io_plan(monkeypatch, threads=2)
    loader = make_loader()
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


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct", "ct-asym"])
def test_finished_layers_hold_what_stock_post_processing_leaves(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Attribute for attribute, in the running vLLM release: every parameter a layer filled from the bundle holds after
    vLLM's post-processing (class, dtype, shape, whether retired, data) and what else it carries (the kernel's
    zero-point name, ``input_global_scale``, a workspace) is what stock post-processing of the checkpoint leaves,
    including a parameter vLLM retired (0.34.0: symmetric GPTQ's loaded ``qzeros``, which no kernel reads and no
    bundle carries: the loader gives it the checkpoint's word)."""
    from marlin_pack.vllm_plugin.engine import quantized_layers

    model_dir = make_bundle(fmt, "tiny")
    stock: dict[str, dict[str, Any]] = {}
    vr.reference_rank_tensors(model_dir, 1, 0, torch.float16, states=stock)
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, quantization_of(fmt), monkeypatch)
    io_plan(monkeypatch, threads=2)
    with vr._patched(1, 0):
        model = make_loader().load_model(vllm_config, model_config)  # type: ignore[arg-type]
    got = {n: vr.layer_state(m) for n, m in quantized_layers(model).items()}
    assert sorted(got) == sorted(stock)
    for name, want in stock.items():
        have = got[name]
        assert {k: have[k] for k in ("plain", "kernel", "names", "workspace")} == {
            k: want[k] for k in ("plain", "kernel", "names", "workspace")}, name
        assert sorted(have["params"]) == sorted(want["params"]), name
        for pname, w in want["params"].items():
            h = have["params"][pname]
            assert {k: h[k] for k in ("class", "dtype", "shape", "retired")} == {
                k: w[k] for k in ("class", "dtype", "shape", "retired")}, f"{name}.{pname}"
            assert torch.equal(h["data"], w["data"]), f"{name}.{pname}"


@pytest.mark.parametrize(("fmt", "during_build"), [("awq", True), ("gptq", True), ("ct-asym", True), ("gptq", False)])
def test_rank_file_copies_beside_the_construction(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, during_build: bool) -> None:
    """Dense bundles: the arena is allocated and the rank file's copy into it starts before vLLM builds the
    model, whose quantized placeholders are memory-less stubs meanwhile; load_weights binds, waits, and the
    layers hold stock vLLM's tensors. A plan without ``during_build``: vLLM's placeholders, the copy after."""
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
    io_plan(monkeypatch, threads=2, window_mib=1, during_build=during_build)
    loader = make_loader()
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


@pytest.mark.parametrize("case", ["engine override", "daemon default", "daemon without helpers", "override without helpers"])
@pytest.mark.parametrize("padded_vocab", [False, True])
def test_common_tensors_copy_beside_the_construction(
    make_bundle: Any, monkeypatch: pytest.MonkeyPatch, padded_vocab: bool, case: str
) -> None:
    """``plan.common_during_build``: the large common tensors are read beside vLLM's construction, by the rank file's
    background job after the rank file (one job: with helpers, each gets its share of both files), started before
    vLLM builds the model, whose embedding and head (vLLM's own classes) are memory-less stubs meanwhile; once
    built they point at those copies and are not fed to vLLM. A parameter of another shape (a padded vocabulary)
    gets memory before vLLM's weight loader writes into it, and holds what that loader writes. The plan of a
    weight-cache daemon's fill (``exit_in_background``) that copies with helpers says so; without helpers it does
    not (the rank file alone beside the construction), but an override without helpers is obeyed."""
    import contextlib

    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.gpu.helpers import exit_in_background

    model_dir = make_bundle("gptq", "tiny")
    common = load_file(str(model_dir / "marlin-pack" / "common.safetensors"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reads: list[tuple[str, str]] = []
    on_reader_copy(monkeypatch, lambda name: reads.append((name, threading.current_thread().name)))
    during = with_vllm_embeddings(monkeypatch, model_dir, padding=64 if padded_vocab else 0)
    vllm_config, model_config = fake_engine(model_dir, "auto_gptq", monkeypatch)
    daemon = case.startswith("daemon")
    with_helpers = case in ("engine override", "daemon default")
    _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    if with_helpers:  # helpers started (they leave CPU destinations to this process)
        machine_for_helpers(monkeypatch)
    overrides: dict[str, Any] = {"threads": 2, "window_mib": 1}
    if "override" in case:
        overrides["common_during_build"] = True
    io_plan(monkeypatch, **overrides)
    loader = make_loader()
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        from marlin_pack.vllm_plugin import patches

        patches.install()  # the engine's worker has them: the embedding method's stubs
        with exit_in_background() if daemon else contextlib.nullcontext():  # as the daemon's get_model
            model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
            loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert bool(_FakeHelpers.events) is with_helpers
    if case == "daemon without helpers":
        assert not during["stubs"] & {"model.embed_tokens.weight", "lm_head.weight"} and loader._timings.common_beside is None
        assert [name for name, _ in reads] == ["rank-0.safetensors"]  # the rank file alone beside the construction
        return
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= during["stubs"]
    background = [name for name, thread in reads if thread == "marlin-pack-arena-copy"]
    assert background == ["rank-0.safetensors", "common.safetensors"]  # one job, the common tensors after the rank file
    assert [name for name, thread in reads if thread != "marlin-pack-arena-copy"] == []
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
    assert loader._timings.copy_bytes == sum(t.nbytes for t in rank.values()) + sum(common[n].nbytes for n in large)


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
    io_plan(monkeypatch, threads=2, window_mib=1)
    loader = make_loader()
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
    # Up to vLLM 0.33 finishing replaces qzeros (int32[0]); 0.34.0 retires it, kept with the checkpoint's word
    retired = fakes.running_release().finish == "w_zp"
    assert len(materialized) == len(layers) and sum(materialized) == 1 + (len(layers) if retired else 0)
    assert not is_stub(kept.kept_stub) and kept.kept_stub.is_contiguous()
    assert torch.equal(kept.kept_stub, torch.ones(3, 5, dtype=torch.int32))
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    qzeros = [got[n] for n in got if n.endswith(".qzeros")]
    if retired:  # what stock loading leaves: the v1 checkpoint's stored zero 7 in every nibble
        assert all(t.retired and not is_stub(t) and bool((t == 0x77777777).all()) for t in qzeros)
    else:
        assert all(t.numel() == 0 for t in qzeros)
    for name, want in reference.items():
        assert torch.equal(got[name].detach(), want), name


@pytest.mark.parametrize("end", ["join", "abandon"])
@pytest.mark.parametrize("fails", [False, True])
def test_background_copy_waits_for_its_reader_and_hands_over_its_outcome(end: str, fails: bool) -> None:
    """The copy runs on a thread of its own, every file in one ``copy_files`` call of one reader; ``on_done`` runs on
    that thread once it ended (done or failed); join waits and raises what the copy raised, abandon waits and drops it."""
    from marlin_pack.vllm_plugin.arena import BackgroundCopy

    release, done = threading.Event(), []

    class SlowReader:
        modes_used = {"helpers", "registered"}

        def __enter__(self) -> SlowReader:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def copy_files(self, jobs: Any) -> int:
            assert release.wait(timeout=30), "never released"
            assert [path for path, _ in jobs] == ["rank-0.safetensors", "common.safetensors"]
            if fails:
                raise OSError(5, "Input/output error")
            return 7

    copy = BackgroundCopy(SlowReader, "rank-0.safetensors", [], on_done=lambda: done.append(threading.current_thread().name),  # type: ignore[arg-type]
                          then=[("common.safetensors", [])])
    assert done == []
    threading.Timer(0.05, release.set).start()
    if end == "join" and fails:
        with pytest.raises(OSError, match="Input/output error"):
            copy.join()
    else:
        getattr(copy, end)()
    assert done == ["marlin-pack-arena-copy"] and release.is_set()
    assert (copy.bytes, copy.modes_used) == ((0, set()) if fails else (7, {"helpers", "registered"}))
    if end == "join" and fails:
        copy.join()  # raised once


def test_rank_file_copy_failure_surfaces_in_load_weights(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read error in the background copy is raised by load_weights (after the copy ended), not lost."""
    from marlin_pack.gpu import reader as gpu_reader

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
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import marlin_pack.vllm_plugin.loader as loader_mod

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    machine_for_helpers(monkeypatch, room=False)  # NVML cannot say: registered, but for the override
    io_plan(monkeypatch, mode="helpers", helpers=2)

    def fails(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(BaseModelLoader, "create_model", fails)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    loader = make_loader()
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "marlin-pack-arena-copy"]
    # the copy's thread ended them as its copy ended; create_model closed them again and waited for their exit
    assert events == ["start 2 helpers for device 0", "close wait=False", "joined"]


def assert_falls_back_to_the_ordinary_loader(monkeypatch: pytest.MonkeyPatch, vllm_config: Any, model_config: Any) -> None:
    """With fallback on, the model vLLM built is loaded by vLLM's default loader from the checkpoint: nothing marked
    prepacked, and no memory-less placeholder left (built for the bundle; vLLM's weight loaders need real ones)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    calls: list = []
    monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: calls.append(m))
    fallback = make_loader(fallback=True)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = fallback.create_model(vllm_config, model_config)
        fallback.load_weights(model, model_config)
    assert calls == [model]  # the ordinary loader loads the checkpoint
    assert not any(is_prepacked(m) for m in model.modules())
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if is_stub(t)]


def test_create_model_kernel_mismatch_refuses_or_falls_back(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    machete_for_down_proj(monkeypatch)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)

    fp16 = vr._vllm().set_default_torch_dtype(torch.float16)  # as the daemon and load_model do
    with fp16, vr._patched(1, 0), pytest.raises(LoadRefusedError, match=r"\[kernel\] vLLM chose MacheteLinearKernel") as e:
        make_loader().create_model(vllm_config, model_config)
    assert e.value.field == "kernel"

    assert_falls_back_to_the_ordinary_loader(monkeypatch, vllm_config, model_config)


def test_a_parameter_of_another_dtype_refuses_or_falls_back_when_the_model_is_built(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parameter the bundle replaces that vLLM built with another dtype (the layer check does not see parameter dtypes):
    the same one-line refusal as the layer check's, before any byte is placed, or with fallback the checkpoint loads
    the ordinary way; never the arena's BundleError out of load_weights."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from marlin_pack.bundle.reader import read_manifest

    layer = read_manifest(awq_bundle / "marlin-pack").tensor_parallel[0].layers[0].name
    fake_create_model(monkeypatch, awq_bundle)
    built = BaseModelLoader.create_model

    def with_a_retyped_parameter(self: object, *args: Any, **kwargs: Any) -> Any:
        model = built(self, *args, **kwargs)
        module = model.get_submodule(layer)
        name, param = next((n, p) for n, p in module.named_parameters(recurse=False) if p.dtype == torch.int32)
        setattr(module, name, torch.nn.Parameter(torch.zeros(param.shape, dtype=torch.float32), requires_grad=False))
        return model

    monkeypatch.setattr(BaseModelLoader, "create_model", with_a_retyped_parameter)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    io_plan(monkeypatch, threads=2)
    fp16 = vr._vllm().set_default_torch_dtype(torch.float16)
    with fp16, vr._patched(1, 0), pytest.raises(LoadRefusedError, match=rf"\[layers\] layer {re.escape(layer)}: parameter .* is "
                                                                        r"Parameter torch.float32, the bundle holds") as e:
        make_loader().create_model(vllm_config, model_config)
    assert e.value.field == "layers" and "\n" not in str(e.value)

    assert_falls_back_to_the_ordinary_loader(monkeypatch, vllm_config, model_config)


@pytest.mark.parametrize("fallback", [False, True])
def test_common_copies_dropped_when_the_built_model_does_not_fit(make_bundle: Any, monkeypatch: pytest.MonkeyPatch, fallback: bool) -> None:
    """``common_during_build`` (helpers) and a layer vLLM built on another kernel: the load is refused, or (fallback)
    the checkpoint loads the ordinary way into a model without stubs; the embedding and the head are
    tensors of their own with vLLM's loaders' bytes, not the copies made beside the construction."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import marlin_pack.vllm_plugin.loader as loader_mod

    machete_for_down_proj(monkeypatch)
    model_dir = make_bundle("gptq", "tiny")
    common = load_file(str(model_dir / "marlin-pack" / "common.safetensors"))
    reads: list[str] = []
    on_reader_copy(monkeypatch, reads.append)
    during = with_vllm_embeddings(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_gptq", monkeypatch)
    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    machine_for_helpers(monkeypatch)
    io_plan(monkeypatch, threads=2, window_mib=1, common_during_build=True)
    loader = make_loader(fallback=fallback)
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
    assert reads[:2] == ["rank-0.safetensors", "common.safetensors"]  # the copy beside the construction ran, and ended
    assert not [t for t in threading.enumerate() if t.name == "marlin-pack-arena-copy"]
    assert events == ["start 4 helpers for device 0", "close wait=False", "joined"]  # ended with the unused bundle
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


class _FakeHelpers:
    """Stands in for gpu.helpers.HelperPool (its API: ``copy_files``, ``let_go``, ``close(wait)``, ``join``, ``ready_after``,
    ``retained_bytes``, ``failures``): records when it is started and how it is ended. CPU destinations are never given
    to helpers (the reader reads them itself); a pool asked to copy copies nothing and leaves every window."""

    events: list[str] = []

    settings: dict[str, object] = {}

    def __init__(self, count: int = 4, device_index: int = 0, **settings: object) -> None:
        self.events.append(f"start {count} helpers for device {device_index}")
        _FakeHelpers.settings = settings
        self.closed = False
        self.ready_after = 0.25
        self.retained_bytes: int | None = None
        self.failures: list[str] = []

    def ready(self) -> int:
        return 4

    def copy_files(self, parts: Any, threads: int) -> list[list[Any]]:
        self.events.append(f"copy {[Path(p).name for p, _ in parts]} with {threads} threads")
        return [list(windows) for _, windows in parts]

    def let_go(self, wait: bool = True) -> None:
        self.events.append("let go" if wait else "let go in the background")

    def close(self, wait: bool = True) -> None:
        if not self.closed:  # as HelperPool.close: a second call ends nothing more...
            self.events.append(f"close wait={wait}")
        self.closed = True
        if wait:  # ...but waits for helpers an earlier close(wait=False) ended
            self.join()

    def join(self, timeout: float | None = None) -> None:
        self.events.append("joined")


def record_readers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[IoPlan, object]]:
    """The (plan, helpers) of every ParallelReader the loader makes (its background copy's and its own)."""
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.gpu.reader import ParallelReader

    readers: list[tuple[IoPlan, object]] = []

    class Recorded(ParallelReader):
        def __init__(self, plan: IoPlan | None = None, helpers: Any = None, populate: bool = True) -> None:
            readers.append((plan, helpers))  # type: ignore[arg-type]
            super().__init__(plan, helpers, populate)

    monkeypatch.setattr(loader_mod, "ParallelReader", Recorded)
    return readers


@pytest.mark.parametrize("case", ["loads", "refused", "falls back", "daemon", "after build", "two helpers"])
def test_helpers_start_before_creation_and_end_as_the_plan_says(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, case: str, marlin_log: list[str]
) -> None:
    """A helpers plan: the loader's own helpers start before vLLM builds the model (their CUDA contexts come up
    meanwhile, and the rank file's copy starts at once) and end once the copy is done (without waiting, on the
    copy's thread, so maybe before the construction ends; but gone before loading returns: vLLM measures the
    free GPU memory next), or when the bundle is refused or not used. This process reads the common tensors
    itself beside them (``plan.local()``). Without ``during_build`` the copy after the construction has them,
    and they end as the rank file is copied. In a weight-cache daemon (``exit_in_background``), which measures no
    memory after its fill, they defer unregistering and loading ends them without waiting for them to exit."""
    import contextlib

    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.gpu.helpers import exit_in_background
    from marlin_pack.vllm_plugin.engine import layer_facts

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    machine_for_helpers(monkeypatch, device=3)  # the plan picks helpers itself
    if case == "after build":
        io_plan(monkeypatch, during_build=False)
    elif case == "two helpers":
        io_plan(monkeypatch, helpers=2)  # the plan's count reaches the pool
    seen = fake_create_model(monkeypatch, awq_bundle)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    created = BaseModelLoader.create_model
    monkeypatch.setattr(BaseModelLoader, "create_model", lambda *a, **k: events.append("create") or created(*a, **k))
    if case in ("refused", "falls back"):  # the model vLLM built does not fit the bundle
        monkeypatch.setattr(
            loader_mod, "layer_facts", lambda m, skips_when_marked: dataclasses.replace(layer_facts(m, skips_when_marked), kernel="X")
        )
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    loader = make_loader(fallback=case == "falls back")
    readers = record_readers(monkeypatch)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        if case == "refused":
            with pytest.raises(LoadRefusedError):
                loader.create_model(vllm_config, model_config)
        else:
            with exit_in_background() if case == "daemon" else contextlib.nullcontext():  # as the daemon's get_model
                model = loader.create_model(vllm_config, model_config)
                if case != "falls back":
                    assert events[0].startswith("start ") and "create" in events
                    loader.load_weights(model, model_config)  # CPU destinations: read here, the helpers unused
    assert len(seen) == 1
    assert events[0] == f"start {2 if case == 'two helpers' else 4} helpers for device 3"
    assert _FakeHelpers.settings == {"defer_unregister": case == "daemon"}  # a daemon's fill: deferred unregistering
    assert any(m.startswith("marlin-pack: I/O plan helpers: ") for m in marlin_log)
    pool = readers[0][1]
    assert isinstance(pool, _FakeHelpers)
    if case == "after build":  # no copy beside the construction: one reader, with the helpers, after it
        assert events[1:] == ["create", "close wait=False", "joined"]
        assert [(p.mode, h) for p, h in readers] == [("helpers", pool)] and not loader._timings.beside
        return
    # The copy's thread ends them as its copy ends (before or after the construction); then joined (not by a daemon).
    assert sorted(events[1:3]) == ["close wait=False", "create"]
    assert events[3:] == ([] if case == "daemon" else ["joined"])
    if case == "daemon":
        assert any("the copy helpers exit in the background" in m for m in marlin_log)
        assert not any("for the copy helpers to exit" in m for m in marlin_log)
    elif case in ("loads", "two helpers"):
        assert any("for the copy helpers to exit" in m for m in marlin_log)
    if case in ("loads", "daemon", "two helpers"):
        # the rank file beside the construction with the helpers; the common tensors read here, beside the helpers' copy
        assert sorted((p.mode, h is pool) for p, h in readers) == [("helpers", True), ("registered", False)]
        assert any("placed" in m and "helpers ready after 0.25 s" in m for m in marlin_log)  # the pool's own figure


@pytest.mark.parametrize("role", ["engine", "daemon"])
@pytest.mark.parametrize("outcome", ["loads", "falls back", "another rank file"])
def test_a_preloaded_pool_is_borrowed_and_ended_as_preload_says(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, role: str, outcome: str, marlin_log: list[str]
) -> None:
    """The early helpers of ``preload`` (page-locking this rank file) are taken with their plan, not started anew;
    the loader does not close them: in an engine they let go of its memory and the pages (they exit once vLLM has
    measured its memory again), in a daemon preload stops them. Early helpers for another file are not taken."""
    import contextlib

    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.gpu.helpers import exit_in_background
    from marlin_pack.vllm_plugin import preload
    from marlin_pack.vllm_plugin.engine import layer_facts

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    machine_for_helpers(monkeypatch)
    pool = _FakeHelpers(4, 0)
    pool.retained_bytes = 3_400_000
    events.clear()
    daemon = role == "daemon"
    plan = IoPlan("helpers", threads=2, window=1 << 20, helpers=4, common_during_build=daemon, defer_unregister=daemon,
                  preload=True, why="planned ahead")
    bundle_dir = awq_bundle / "marlin-pack"
    rank_file = bundle_dir / ("tp2/rank-1.safetensors" if outcome == "another rank file" else "tp1/rank-0.safetensors")
    early = preload.Preload([str(rank_file.resolve()), str((bundle_dir / "common.safetensors").resolve())], 0, plan, engine=not daemon)
    early.pool = pool
    early.helpers_up.set()
    early.done.set()
    monkeypatch.setattr(preload, "_CURRENT", early)
    stops: list[str] = []
    monkeypatch.setattr(preload, "stop", lambda: stops.append("stop"))
    if outcome == "falls back":
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        monkeypatch.setattr(
            loader_mod, "layer_facts", lambda m, skips_when_marked: dataclasses.replace(layer_facts(m, skips_when_marked), kernel="X")
        )
        monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, m, c: None)  # the checkpoint the ordinary way
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    loader = make_loader(fallback=outcome == "falls back")
    readers = record_readers(monkeypatch)
    in_daemon = exit_in_background() if daemon else contextlib.nullcontext()
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16), in_daemon:
        model = loader.create_model(vllm_config, model_config)
        loader.load_weights(model, model_config)
    if outcome == "another rank file":  # the loader's own helpers, ended by the loader
        assert events[0] == "start 4 helpers for device 0" and "close wait=False" in events
        assert stops == [] and not any(e.startswith("let go") for e in events) and readers[0][1] is not pool
        return
    assert not [e for e in events if e.startswith(("start", "close", "joined"))]  # neither started nor closed here
    # After a copy the helpers let go beside vLLM's next steps; where none was made (a fallback), at once.
    let_go = "let go in the background" if outcome == "loads" else "let go"
    assert (events, stops) == (([], ["stop"]) if daemon else ([let_go], []))
    assert any(m == "marlin-pack: I/O plan helpers: planned ahead" for m in marlin_log)
    if outcome == "loads":
        assert readers[0] == (plan, pool)  # the background copy: the carried plan (its threads and window), the pool
        assert any("placed" in m and "helpers ready after 0.25 s, 3.4 MB page-locked ahead" in m for m in marlin_log)
        if not daemon:
            assert any("copy helpers let go of this process's memory and the pages in the background" in m for m in marlin_log)
    else:
        assert not any(is_prepacked(m) for m in model.modules())


@pytest.mark.parametrize(
    ("change", "mode"),
    [
        ("none", "helpers"),
        ("more ranks", "registered"),  # tensor, pipeline or data parallel: each rank would start helpers
        ("sleep mode", "registered"),  # the cumem allocator's memory cannot be opened with legacy CUDA IPC
        ("expandable segments", "registered"),
        ("few cores", "registered"),
        ("tmpfs", "staged"),
        ("gpu nearly full", "registered"),  # no room for their CUDA contexts beside the bundle
        ("gpu unknown", "registered"),  # NVML cannot say
        ("no gpu", "registered"),
    ],
)
def test_the_plan_starts_helpers_only_where_they_help(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, change: str, mode: str, marlin_log: list[str]
) -> None:
    """Without overrides the plan is the machine's: copy helpers for one engine process on a file on disk with
    enough cores, PyTorch's ordinary allocator and room on the GPU; otherwise none are started (registered or staged)."""
    import marlin_pack.vllm_plugin.loader as loader_mod
    from marlin_pack.gpu import plan as plan_mod
    from marlin_pack.vllm_plugin import io_facts

    events = _FakeHelpers.events = []
    monkeypatch.setattr(loader_mod, "HelperPool", _FakeHelpers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: change != "no gpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # The loader's helpers start after vLLM's memory snapshot and are gone before it measures again: they need
    # room beside the bundle (4 contexts and this process's own), not the --gpu-memory-utilization share.
    total = 80 << 30
    bundle = sum(os.stat(awq_bundle / "marlin-pack" / f).st_size for f in ("tp1/rank-0.safetensors", "common.safetensors"))
    free = bundle + 4 * HELPER_CONTEXT_BYTES + plan_mod._PROCESS_BASELINE_BYTES - (change == "gpu nearly full")
    assert free < 0.9 * total
    rooms: list[int] = []
    monkeypatch.setattr(io_facts, "gpu_room", lambda d: rooms.append(d) or (None if change == "gpu unknown" else GpuRoom(free, total)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4 if change == "few cores" else 16)))
    monkeypatch.setattr(io_facts, "in_base_memory_pages", lambda path: change == "tmpfs")
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
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        loader.load_weights(loader.create_model(vllm_config, model_config), model_config)
    assert [e for e in events if e.startswith("start")] == (["start 4 helpers for device 0"] if mode == "helpers" else [])
    assert rooms == ([] if change == "no gpu" else [0])  # NVML asked for this process's device, not where there is none
    (line,) = [m for m in marlin_log if m.startswith("marlin-pack: I/O plan ")]
    assert line.startswith(f"marlin-pack: I/O plan {mode}: ")
    assert ("no copy helpers: " in line) is (mode == "registered")


@pytest.mark.parametrize("tied", [False, True])
def test_large_common_tensors_are_copied_in_one_batch(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, tied: bool) -> None:
    """At TP=1 on a GPU the large common tensors a plain copy loads go straight into their parameters, all
    in one reader call (its threads share every window), and are not fed to vLLM; the rest is fed as it is.
    ``tied``: the head *is* the embedding parameter though the bundle stores both tensors: one
    destination, so the later tensor in the file is copied after the batch and its bytes win, as
    copying in file order gives. (CPU parameters stand in for the GPU's: the reader reads into them.)"""
    from marlin_pack.gpu.host_map import HostMap
    from marlin_pack.gpu.reader import ParallelReader
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.vllm_plugin import common_tensors
    from marlin_pack.vllm_plugin.decision import decide
    from marlin_pack.vllm_plugin.engine import engine_facts

    monkeypatch.setattr(common_tensors, "LARGE_COMMON", 1 << 10)  # the tiny model's embedding and head count as large
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

    with Counting(IoPlan(threads=2, window=1 << 16)) as reader, HostMap(bundle.common_file) as host:
        fed = dict(common_tensors.common_weights(reader, host, bundle, model, torch.device("cuda")))
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
    # the rank file and the common file (the checkpoint is sampled, not hashed)
    assert re.match(r"marlin-pack: rank 0 hashed [\d.]+ [MG]B \(2 files\) in [\d.]+ s; stamped in ", hashed[0]), hashed
    assert str(tmp_path / "stamps") in hashed[0]


# --- fallback covers every failure before the GPU, whatever its type (issue 68, items 10 and 11) ---------------------


def _ordinary(monkeypatch: pytest.MonkeyPatch) -> list:
    """vLLM's DefaultModelLoader.load_model, recorded instead of run."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    calls: list = []
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, **kw: calls.append(kw) or "ordinary")
    return calls


@pytest.mark.parametrize("where", ["decision", "engine facts"])
def test_an_internal_error_before_the_gpu_falls_back(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, marlin_log: list[str], where: str
) -> None:
    """Not a refusal (a KeyError in the checks, vLLM internals not as expected): ``fallback`` loads the checkpoint the
    ordinary way with one WARNING naming it as an internal error; without ``fallback`` it propagates as it was."""
    from marlin_pack.vllm_plugin import decision, loader

    def broken(*args: object) -> object:
        raise KeyError("model.layers.0.mlp.experts")

    monkeypatch.setattr(decision if where == "decision" else loader, "load_manifest" if where == "decision" else "engine_facts", broken)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts"):
        make_loader().load_model(vllm_config, model_config)
    calls = _ordinary(monkeypatch)
    assert make_loader(fallback=True).load_model(vllm_config, model_config) == "ordinary"
    assert [c["model_config"] for c in calls] == [model_config]
    warned = [m for m in marlin_log if "internal error KeyError" in m]
    assert len(warned) == 1 and "\n" not in warned[0] and "loading the checkpoint the ordinary way because fallback is on" in warned[0]
    assert vllm_config.kernel_config.linear_backend_per_quant is None  # Marlin not forced


def test_an_internal_error_forcing_the_kernels_falls_back(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]) -> None:
    """After the decision, before the I/O plan (no GPU work yet): create_model builds the model the ordinary way."""
    from marlin_pack.vllm_plugin import loader

    def broken(kernel_config: object) -> None:
        raise AttributeError("'KernelConfig' object has no attribute 'linear_backend_per_quant'")

    monkeypatch.setattr(loader, "force_marlin", broken)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        with pytest.raises(AttributeError):
            make_loader().create_model(vllm_config, model_config)
        fallback = make_loader(fallback=True)
        model = fallback.create_model(vllm_config, model_config)
    assert fallback._models[model].bundle is None
    assert any("internal error AttributeError" in m for m in marlin_log)


def test_an_error_once_gpu_work_began_still_propagates(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the I/O plan on (copy helpers, the arena, the model's construction) fallback does not hide an error."""
    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    def broken(*args: object) -> object:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(MarlinPrepackedLoader, "_plan_and_helpers", broken)
    fake_create_model(monkeypatch, awq_bundle)
    vllm_config, model_config = fake_engine(awq_bundle, "auto_awq", monkeypatch)
    with pytest.raises(RuntimeError, match="out of memory"):
        make_loader(fallback=True).create_model(vllm_config, model_config)


def test_an_alias_that_is_no_output_head_is_refused_by_the_loader(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.layers.0.mlp.lm_head.weight`` merely ends like a head: refused before the GPU (fallback: ordinary loading)."""
    def edit(d: Path) -> None:
        path = d / "marlin-pack" / "manifest.json"
        m = json.loads(path.read_text())
        m["common_aliases"] = {"model.layers.0.mlp.lm_head.weight": "model.embed_tokens.weight"}
        path.write_text(json.dumps(m))

    model_dir = damaged_copy(awq_bundle, edit)
    seen = fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
    with pytest.raises(LoadRefusedError, match=r"\[manifest\] .*common_aliases maps 'model.layers.0.mlp.lm_head.weight'"):
        make_loader().create_model(vllm_config, model_config)
    assert seen == []
    calls = _ordinary(monkeypatch)
    assert make_loader(fallback=True).load_model(vllm_config, model_config) == "ordinary" and len(calls) == 1
