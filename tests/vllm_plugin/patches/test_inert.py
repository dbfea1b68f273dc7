"""Where marlin-pack is not used, its patches are inert: a vLLM process without ``--load-format marlin_prepacked``,
``--load-format ipc_cache`` or ``marlin-pack daemon`` behaves exactly as without the plugin.

* Every ``speed`` patch, with marlin-pack's scope inactive (and, for the GPU worker's steps, an ``auto`` engine):
  its replacement and vLLM's original called on the same input give the same output and the same side effects
  (nothing frozen, nothing started, no index built, no shortcut taken). A new speed patch without a case fails
  :func:`test_every_speed_patch_has_an_inert_case`.
* The ``correctness`` patches act only on what the loader produces: an unmarked layer outside
  ``weights_already_processed()`` gets vLLM's post-processing with the same arguments and nothing else; outside the
  loader's stub context and the scope, ``create_weights`` makes what vLLM makes.
* The ``weight_cache`` patches act only in weight-cache processes: vLLM reads the opt-in
  (``supports_pre_processed_weights``) and enters ``weights_already_processed()`` only there, and an unforced
  kernel configuration keys the cache as vLLM does.
"""

from __future__ import annotations

import copy
import gc
import importlib
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from marlin_pack.vllm_plugin import preload
from marlin_pack.vllm_plugin.patches import PATCHES, Patch, catalog, construct, scope

_GPTQ_UTILS = "vllm.model_executor.layers.quantization.utils.gptq_utils"


def _patch(target: str) -> Patch:
    return next(p for p in PATCHES if p.target == target)


def _vllm_original(target: str) -> Any:
    """vLLM's own attribute (the conftest leaves vLLM unpatched around each test)."""
    module, path = target.split(":", 1)
    owner: Any = importlib.import_module(module)
    *owners, attr = path.split(".")
    for name in owners:
        owner = getattr(owner, name)
    return vars(owner)[attr] if owners else getattr(owner, attr)


def _both(target: str, call: Callable[[Callable[..., Any]], Any]) -> tuple[Any, Any]:
    """``call`` on vLLM's original and on the replacement built from it, outside marlin-pack's scope."""
    assert not scope.active()
    original = _vllm_original(target)
    return call(original), call(_patch(target).make(original))


# --- speed patches --------------------------------------------------------------------------------------------


def _gptq_config() -> Any:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    # Without dynamic rules: the case the shortcut would take in marlin-pack's scope.
    return AutoGPTQConfig.from_config(
        {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "modules_in_block_to_quantize": [["mlp.down_proj"]]}
    )


def _deepcopy_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _gptq_config()

    def describe(deepcopy: Callable[..., Any]) -> Any:
        out = deepcopy(config)
        shared = out.modules_in_block_to_quantize is config.modules_in_block_to_quantize
        return type(out), repr(vars(out)), shared, out is config

    stock, ours = _both(target, describe)
    assert ours == stock and stock[2:] == (False, False)  # a deep copy, its own lists, as vLLM's


def _layer_quantized_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [
        ("model.layers.0.mlp.down_proj", ["mlp.down_proj"], None),
        ("model.layers.0.mlp.down_proj", [["self_attn.q_proj"], ["mlp.down_proj"]], None),
        ("model.layers.0.self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}),
        ("model.layers.3.mlp.experts", ["mlp.experts.0.down_proj"], None),
        ("lm_head", [], None),
    ]
    construct._LAST.clear()

    def answers(fn: Callable[..., Any]) -> list[Any]:
        out = []
        for prefix, names, fused in cases:
            try:
                out.append(fn(prefix, copy.deepcopy(names), *(() if fused is None else (fused,))))
            except Exception as e:  # vLLM's own errors, if any, raised alike
                out.append((type(e).__name__, str(e)))
        return out

    stock, ours = _both(target, answers)
    assert ours == stock and construct._LAST == []  # no name index built


def _storage_ptrs_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # no non-persistent buffers: the shortcut's case
    stock, ours = _both(target, lambda fn: fn(layer))
    assert ours == stock and len(stock) == 4


def _record_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model.register_buffer("steps", torch.zeros(2), persistent=False)

    def record(fn: Callable[[nn.Module], Any]) -> Any:
        for module in model.modules():
            layerwise.LAYERWISE_INFO.pop(module, None)
        returned = fn(model)
        entries = []
        for module in model.modules():
            info = layerwise.LAYERWISE_INFO.pop(module)
            params, buffers = info.restore_metadata
            entries.append((
                {n: (tuple(t.shape), t.dtype, t.device.type, type(t).__name__) for n, t in params.items()},
                {n: (tuple(t.shape), t.dtype, t.device.type) for n, t in buffers.items()},
                info.restore_device,
            ))
        return returned, entries

    assert not scope.active()
    original, delegated = _vllm_original(target), []
    stock = record(original)
    ours = record(_patch(target).make(lambda m: delegated.append(m) or original(m)))
    assert ours == stock and delegated == [model]  # vLLM's own record ran (the shortcut records the same)


def _filter_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from marlin_pack.vllm_plugin.patches import cache_key

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in [*shards, "consolidated.safetensors"]:
        (tmp_path / name).write_bytes(b"")
    index = "model.safetensors.index.json"
    (tmp_path / index).write_text(json.dumps({"weight_map": {f"layers.{i}.w": shards[i % 2] for i in range(20)}}))
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    monkeypatch.setattr(cache_key, "indexed_files", lambda *a: pytest.fail("the shortcut ran outside marlin-pack's scope"))
    stock, ours = _both(target, lambda fn: fn(list(files), str(tmp_path), index))
    assert ours == stock and len(stock) == 2


def _auto_worker(events: list[Any]) -> Any:
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="auto"))
    return SimpleNamespace(vllm_config=config, local_rank=0, events=events)


def _worker_case(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU worker's methods need a GPU: a stand-in records what vLLM's would be asked, and what state it sees."""
    threads = {t.name for t in threading.enumerate()}
    monkeypatch.setattr(preload, "_CURRENT", None)
    gc.unfreeze()
    try:
        def stand_in(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.events.append((args, kwargs, scope.active(), gc.get_freeze_count(), preload.current()))
            return "result"

        def run(make: Callable[[Any], Any] | None) -> Any:
            events: list[Any] = []
            fn = stand_in if make is None else make(stand_in)
            returned = fn(_auto_worker(events), "kv-config") if target.endswith("initialize_from_config") else fn(
                _auto_worker(events), load_dummy_weights=False)
            return returned, events, gc.get_freeze_count(), preload.current()

        stock, ours = run(None), run(_patch(target).make)
        assert ours == stock and stock[0] == "result" and stock[2] == 0 and stock[3] is None
        assert {t.name for t in threading.enumerate()} <= threads  # no helper thread started
    finally:
        gc.unfreeze()


_WORKER = "vllm.v1.worker.gpu_worker:Worker"
SPEED_CASES: dict[str, Callable[..., None]] = {
    f"{_GPTQ_UTILS}:deepcopy": _deepcopy_case,
    "vllm.model_executor.layers.quantization.auto_gptq:deepcopy": _deepcopy_case,
    f"{_GPTQ_UTILS}:is_layer_gptq_quantized": _layer_quantized_case,
    "vllm.model_executor.model_loader.reload.meta:_parameter_storage_ptrs": _storage_ptrs_case,
    "vllm.model_executor.model_loader.utils:record_metadata_for_reloading": _record_case,
    "vllm.model_executor.model_loader.weight_cache.protocol:filter_duplicate_safetensors_files": _filter_case,
    f"{_WORKER}.load_model": _worker_case,
    f"{_WORKER}.init_device": _worker_case,
    f"{_WORKER}.initialize_from_config": _worker_case,
}


def test_every_speed_patch_has_an_inert_case() -> None:
    assert set(SPEED_CASES) == {p.target for p in PATCHES if p.purpose == "speed"}


@pytest.mark.parametrize("target", list(SPEED_CASES), ids=lambda t: t.rsplit(":", 1)[1])
def test_speed_patch_outside_the_scope_is_vllms(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    SPEED_CASES[target](target, tmp_path, monkeypatch)


def test_the_construct_shortcuts_do_act_inside_the_scope() -> None:
    """The control of the cases above: in marlin-pack's scope the same inputs take the shortcuts."""
    config = _gptq_config()
    copier = _patch(f"{_GPTQ_UTILS}:deepcopy").make(copy.deepcopy)
    ptrs = _patch("vllm.model_executor.model_loader.reload.meta:_parameter_storage_ptrs").make(lambda layer: {1})
    with scope.in_use():
        assert copier(config).modules_in_block_to_quantize is config.modules_in_block_to_quantize
        assert ptrs(nn.Linear(2, 2)) == set()


# --- correctness patches: only what the loader marked -------------------------------------------------------


_PWAL = [r.target for r in catalog.ROWS if r.purpose == "correctness" and r.target.endswith(".process_weights_after_loading")]


@pytest.mark.parametrize("target", _PWAL, ids=lambda t: t.rsplit(":", 1)[1])
def test_post_processing_of_an_unmarked_layer_is_vllms(target: str) -> None:
    """Outside ``weights_already_processed()`` and without the loader's mark: vLLM's method, the same arguments,
    nothing else touched (the layer's and the method's state as vLLM leaves them)."""
    calls: list[tuple[Any, Any]] = []

    def stock(self: Any, layer: nn.Module) -> None:
        calls.append((self, layer))
        layer.processed = True  # what vLLM's would change

    method, layer = SimpleNamespace(), nn.Linear(2, 2)
    before = dict(vars(layer)), dict(vars(method))
    assert _patch(target).make(stock)(method, layer) is None
    assert calls == [(method, layer)]
    assert {k: v for k, v in vars(layer).items() if k != "processed"} == before[0] and vars(method) == before[1]


_CREATE = [r.target for r in catalog.ROWS if r.target.endswith(".create_weights")]


@pytest.mark.parametrize("target", _CREATE, ids=lambda t: t.rsplit(":", 1)[1])
def test_create_weights_outside_the_loaders_context_is_vllms(target: str) -> None:
    """No stub context (only the loader enters one) and no scope: what vLLM's create_weights makes, nothing recorded."""

    def stock(self: Any, layer: nn.Module, size: int, *, dtype: torch.dtype) -> None:
        layer.register_parameter("qweight", nn.Parameter(torch.zeros(size, 8, dtype=dtype), requires_grad=False))

    def describe(fn: Callable[..., Any]) -> Any:
        method, layer = SimpleNamespace(), nn.Module()
        fn(method, layer, 16, dtype=torch.int32)
        q = layer.qweight
        return vars(method), (tuple(q.shape), q.stride(), q.dtype, q.untyped_storage().nbytes(), torch.equal(q, torch.zeros_like(q)))

    assert not scope.active()
    assert describe(_patch(target).make(stock)) == describe(stock)


# --- weight-cache patches: only in weight-cache processes ----------------------------------------------------


def _vllm_sources() -> dict[str, str]:
    import vllm

    root = Path(vllm.__file__).parent
    return {str(p.relative_to(root)): p.read_text(errors="replace") for p in root.rglob("*.py") if "tests" not in p.parts}


def test_vllm_reads_the_opt_in_and_enters_pre_processed_mode_only_in_the_weight_cache() -> None:
    """``supports_pre_processed_weights`` (patched for AWQ/GPTQ/compressed-tensors Marlin methods) is read on a quant
    method only by the weight cache's check and by the post-processing under ``weights_already_processed()``, which
    only the IPC loader enters; so an ordinary engine never sees the opt-in nor the pre-processed branches."""
    sources = _vllm_sources()
    reads = {f for f, text in sources.items() if re.search(r"(?<!self)(?<!kernel)\.supports_pre_processed_weights\b", text)}
    assert reads == {"model_executor/model_loader/weight_cache/protocol.py", "model_executor/model_loader/utils.py"}
    utils = sources["model_executor/model_loader/utils.py"]
    assert re.search(r"is_weights_pre_processed\(\)\s*and not quant_method\.supports_pre_processed_weights", utils)
    check_callers = {f for f, text in sources.items() if re.search(r"\bcheck_ipc_quant_support\(", text)}
    assert check_callers <= {f"model_executor/model_loader/weight_cache/{m}.py" for m in ("protocol", "daemon", "ipc_loader")}
    entered = {f for f, text in sources.items() if re.search(r"(?<!def )\bweights_already_processed\(\)", text)}
    # vLLM 0.34.0 also enters it where an engine reloads kernel-format weights (reload_weights(is_checkpoint_format=False)):
    # outside marlin-pack's scope the opt-in and the branches are vLLM's own there
    # (test_pre_processed_post_processing_outside_the_weight_cache_is_vllms)
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    reload = "kernel_format_reload" in releases.release(vllm_version()).upstream  # type: ignore[union-attr]
    assert entered == {"model_executor/model_loader/weight_cache/ipc_loader.py"} | (
        {"model_executor/model_loader/reload/inplace.py"} if reload else set())
    setters = {f for f, text in sources.items() if "_weights_pre_processed.set(" in text}
    assert setters == {"model_executor/utils.py"}  # only through weights_already_processed()


_OPT_IN = [r.target for r in catalog.ROWS if r.target.endswith(".supports_pre_processed_weights")]
_PRE_PROCESSED = [r.target for r in catalog.ROWS if r.target.endswith(".process_weights_after_loading")]


@pytest.mark.parametrize("target", _PRE_PROCESSED, ids=lambda t: t.rsplit(":", 1)[1])
def test_pre_processed_post_processing_outside_the_weight_cache_is_vllms(target: str) -> None:
    """Under ``weights_already_processed()`` but outside marlin-pack's scope (vLLM 0.34's kernel-format
    ``reload_weights`` in any engine): vLLM's method with the same arguments; inside the scope (an ``ipc_cache``
    engine's build, a daemon's fill) it is marlin-pack's, which refuses what it cannot finish."""
    from vllm.model_executor.utils import weights_already_processed

    calls: list[tuple[Any, Any]] = []

    def stock(self: Any, layer: nn.Module) -> None:
        calls.append((self, layer))

    method, layer = SimpleNamespace(), nn.Linear(2, 2)
    ours = _patch(target).make(stock)
    assert not scope.active()
    with weights_already_processed():
        assert ours(method, layer) is None
    assert calls == [(method, layer)]
    if "KVCacheMethod" in target:
        return
    with scope.in_use(), weights_already_processed(), pytest.raises(Exception):  # noqa: B017 (not vLLM's: a plain object)
        ours(method, layer)
    assert calls == [(method, layer)]


@pytest.mark.parametrize("target", _OPT_IN, ids=lambda t: t.rsplit(":", 1)[1])
@pytest.mark.parametrize("original", [None, False, True, "property"])
def test_the_opt_in_outside_the_weight_cache_is_the_releases_own(target: str, original: Any) -> None:
    """``supports_pre_processed_weights`` outside marlin-pack's scope: what the class had (its own property, e.g.
    0.34.0's dense AWQ/GPTQ one for MarlinLinearKernel only; a value; None: the base class's False)."""
    seen: list[Any] = []
    if original == "property":
        original = property(lambda self: seen.append(self) or "upstream")
    prop = _patch(target).make(original)
    owner = type("Method", (), {"supports_pre_processed_weights": prop, "kernel": None})
    method = owner()
    assert not scope.active()
    want = {None: False, False: False, True: True}.get(original, True) if not isinstance(original, property) else True
    assert method.supports_pre_processed_weights is want
    assert seen == ([method] if isinstance(original, property) else [])


def test_an_unforced_kernel_config_keys_the_cache_as_vllm_does() -> None:
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    from marlin_pack.vllm_plugin.version_guard import vllm_version

    target = "vllm.model_executor.model_loader.weight_cache.protocol:WeightCacheKey.from_model_config"
    if not next(r for r in catalog.ROWS if r.target == target).applies_to(vllm_version()):
        pytest.skip(f"vLLM {vllm_version()}'s key takes no kernel configuration: the patch is not installed there")
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "gptq"})
    text = SimpleNamespace(rope_parameters={"rope_theta": 1e4}, max_position_embeddings=4096)
    mc = SimpleNamespace(hf_config=hf, hf_text_config=text, model="/not/a/dir", dtype=torch.float16,
                         quantization="auto_gptq", quantization_config=None, revision=None)
    cache = SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[])
    stock = _vllm_original(target)
    ours = _patch(target).make(stock)
    for kernel_config in (None, KernelConfig(), KernelConfig(linear_backend="machete")):
        want = stock.__get__(None, WeightCacheKey)(mc, 1, 0, cache_config=cache, kernel_config=kernel_config)
        assert ours.__get__(None, WeightCacheKey)(mc, 1, 0, cache_config=cache, kernel_config=kernel_config) == want


def test_a_plain_preload_plans_no_page_locking(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm preload --load-format auto``: get_draft_daemon_config answers as vLLM's, the environment is untouched."""
    target = f"{catalog.DAEMON_MODULE}:get_draft_daemon_config"
    monkeypatch.delenv(preload.ENV, raising=False)
    config = SimpleNamespace(load_config=SimpleNamespace(load_format="auto", model_loader_extra_config={}))
    env = dict(os.environ)
    for draft in (None, object()):
        assert _patch(target).make(lambda c, draft=draft: draft)(config) is draft
    assert dict(os.environ) == env
