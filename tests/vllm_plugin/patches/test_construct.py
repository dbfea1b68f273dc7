"""``patches.construct``: vLLM's per-layer GPTQ bookkeeping made cheap, without changing what vLLM builds.

* ``is_layer_gptq_quantized`` through the name index answers exactly as vLLM's own function
  (cases and a seeded random search over names, prefixes and fused mappings);
* the quant-config copy is shallow only when ``override_config`` provably changes nothing;
* the reload record skips parameter storage pointers only where vLLM never reads them, and
  asks for the default device once per model, recording per module what vLLM records;
* whole models (vLLM's real model classes, built on ``meta`` as an ``ipc_cache`` engine builds
  them) are the same with and without the patches: every module's type, quant method and its
  configuration, kernel, parameters (class, shape, dtype, attributes), buffers and reload
  record; with ``dynamic`` rules and outside marlin-pack's scope vLLM's own path runs.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import gc
import json
import random
import types
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint
from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint
from marlin_pack.vllm_plugin.patches import construct, scope

vmr = pytest.importorskip("oracles.vllm_moe_reference")

GPTQ_UTILS = "vllm.model_executor.layers.quantization.utils.gptq_utils"


@pytest.fixture
def active() -> Iterator[None]:
    """The patched functions act as in a marlin_prepacked / ipc_cache build (inside marlin-pack's scope)."""
    with scope.in_use():
        yield


def _patched_lookup() -> tuple[Any, Any]:
    from vllm.model_executor.layers.quantization.utils import gptq_utils

    return gptq_utils.is_layer_gptq_quantized, construct._layer_quantized(gptq_utils.is_layer_gptq_quantized)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "returned", fn(*args)
    except Exception as e:  # vLLM raises ValueError (mixed shards) or AssertionError (empty shard list)
        return type(e).__name__, str(e)


# --- is_layer_gptq_quantized --------------------------------------------------------------------

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"], "empty": []}
LOOKUPS = [
    ("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                           "model.layers.0.self_attn.v_proj"]),
    ("model.layers.0.self_attn.qkv_proj", ["self_attn.q_proj"]),  # mixed shards: vLLM raises
    ("model.layers.1.mlp.down_proj", ["mlp.down_proj"]),  # a substring, not a full name
    ("model.layers.1.mlp.down_proj", ["model.layers.10.mlp.down_proj"]),  # longer than the prefix
    ("model.layers.1.mlp.gate", ["model.layers.1.mlp.gate_up"]),  # the router is not quantized
    ("lm_head", ["model.layers.0.mlp.down_proj"]),
    ("model.layers.0.mlp.gate_up_proj", [""]),  # the empty name is in every string
    ("x.empty", ["x"]),  # a fused name without shards: vLLM's assert
    ("model.layers.0.mlp.down_proj", []),  # no metadata: quantized
]


@pytest.mark.parametrize(("prefix", "names"), LOOKUPS)
def test_indexed_lookup_answers_as_vllm(active: None, prefix: str, names: list[str]) -> None:
    stock, patched = _patched_lookup()
    assert _outcome(patched, prefix, list(names), FUSED) == _outcome(stock, prefix, list(names), FUSED)


def test_indexed_lookup_random_search(active: None) -> None:
    """Seeded random names and prefixes over a small alphabet, so that substrings collide often."""
    stock, patched = _patched_lookup()
    rng = random.Random(0)
    parts = ["model", "layers", "0", "1", "11", "mlp", "experts", "gate", "up", "proj", "q", "k", "self_attn", "_", "."]

    def word(n: int) -> str:
        return "".join(rng.choice(parts) + rng.choice([".", "_", ""]) for _ in range(n)).strip("._")

    fused = {"qkv": ["q", "k", "v"], "proj": ["up", "gate"], "1": ["11", "0"]}
    disagreements = []
    for _ in range(400):
        names = [word(rng.randint(1, 4)) for _ in range(rng.randint(1, 30))]
        prefix = word(rng.randint(1, 6)) + rng.choice(["", ".qkv", ".proj", ".1"])
        mapping = rng.choice([{}, fused])
        if _outcome(patched, prefix, names, mapping) != _outcome(stock, prefix, names, mapping):
            disagreements.append((prefix, names, mapping))
    assert not disagreements, disagreements[:3]


def test_unusual_name_lists_take_vllms_path(active: None) -> None:
    """Nested lists and non-strings are vLLM's business (it flattens; it raises on non-strings)."""
    stock, patched = _patched_lookup()
    for names in ([["model.layers.0.mlp.down_proj"]], ["model.layers.0.mlp.down_proj", 3], ("mlp.down_proj",)):
        assert _outcome(patched, "model.layers.0.mlp.down_proj", names, {}) == _outcome(stock, "model.layers.0.mlp.down_proj", names, {})


def test_index_follows_changes_of_the_list(active: None) -> None:
    _, patched = _patched_lookup()
    names = ["model.layers.0.mlp.down_proj"]
    assert patched("model.layers.0.mlp.down_proj", names) is True
    assert patched("model.layers.1.mlp.down_proj", names) is False
    names.append("layers.1.mlp")  # same list object, new content: the index is rebuilt
    assert patched("model.layers.1.mlp.down_proj", names) is True
    names[:] = ["other"]
    assert patched("model.layers.0.mlp.down_proj", names) is False


def test_inactive_lookup_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    _, patched = _patched_lookup()
    assert not scope.active()
    monkeypatch.setattr(construct, "_index", lambda names: pytest.fail("indexed outside marlin-pack's scope"))
    assert patched("model.layers.0.mlp.down_proj", ["mlp.down_proj"]) is True


# --- the quant-config copy --------------------------------------------------------------------


def _gptq_config(**extra: Any) -> Any:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    return AutoGPTQConfig.from_config({"bits": 4, "group_size": 128, "desc_act": False, "sym": True, **extra})


def test_copy_is_enough_only_without_dynamic_rules_and_with_consistent_fields() -> None:
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    assert construct.copy_is_enough(_gptq_config(modules_in_block_to_quantize=["mlp.down_proj"]))
    assert not construct.copy_is_enough(_gptq_config(dynamic={r"+:.*\.1\..*": {"bits": 8}}))
    assert not construct.copy_is_enough(_gptq_config(dynamic={"-:.*down_proj": {}}))
    stale = _gptq_config()
    stale.weight_bits = 8  # override_config would recompute pack_factor and quant_type
    assert not construct.copy_is_enough(stale)
    assert not construct.copy_is_enough(AutoAWQConfig.from_config({"bits": 4, "group_size": 128, "zero_point": True}))
    assert not construct.copy_is_enough({"dynamic": {}})


def test_config_copy() -> None:
    copier = construct._config_copy(copy.deepcopy)
    plain, dynamic = _gptq_config(modules_in_block_to_quantize=["mlp.down_proj"]), _gptq_config(dynamic={"-:x": {}})
    with scope.in_use():
        shallow = copier(plain)
        assert shallow is not plain and vars(shallow) == vars(plain)
        assert shallow.modules_in_block_to_quantize is plain.modules_in_block_to_quantize
        assert copier(dynamic).dynamic is not dynamic.dynamic  # per-layer overrides: vLLM's deep copy
        assert copier([1, [2]], {}) == [1, [2]]
    assert copier(plain).modules_in_block_to_quantize is not plain.modules_in_block_to_quantize


# --- the reload record ------------------------------------------------------------------------


def test_storage_pointers_only_for_modules_with_non_persistent_buffers(active: None) -> None:
    from vllm.model_executor.model_loader.reload import meta

    wrapped = construct._storage_ptrs(meta._parameter_storage_ptrs)
    plain, rotary = torch.nn.Linear(2, 2), torch.nn.Module()
    rotary.register_buffer("cos_sin_cache", torch.zeros(2), persistent=False)
    rotary.inner = torch.nn.Linear(2, 2)
    assert wrapped(plain) == set() and meta._parameter_storage_ptrs(plain)  # nothing reads them: not collected
    assert wrapped(rotary) == meta._parameter_storage_ptrs(rotary) != set()


def _record_of(modules: list[torch.nn.Module]) -> list[Any]:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [_value((LAYERWISE_INFO[m].restore_metadata, LAYERWISE_INFO[m].restore_device)) for m in modules]


def _tree() -> torch.nn.Module:
    root = torch.nn.Module()
    root.proj = torch.nn.Linear(3, 4)
    root.proj.weight.extra = "kept"  # attributes ride along on the meta copies
    root.rotary = torch.nn.Module()
    root.rotary.register_buffer("cache", torch.zeros(2), persistent=False)
    root.rotary.register_buffer("table", torch.ones(3))
    return root


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_reload_record_is_vllms_with_the_device_asked_once(active: None, device: str) -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise.record_metadata_for_reloading
    recorded = construct._record(original)
    # LAYERWISE_INFO is weak-keyed: a collection of earlier tests' models while counting would move the count.
    gc.collect()
    gc.disable()
    try:
        with torch.device(device):
            stock, patched = _tree(), _tree()
            original(stock)
            before = len(layerwise.LAYERWISE_INFO)
            recorded(patched)
        assert len(layerwise.LAYERWISE_INFO) == before + len(list(patched.modules()))
    finally:
        gc.enable()
    assert _record_of(list(patched.modules())) == _record_of(list(stock.modules()))
    assert layerwise.LAYERWISE_INFO[patched].restore_device == torch.device(device)
    # A module vLLM already holds an entry for keeps that entry, updated (as get_layerwise_info does).
    entry = layerwise.LAYERWISE_INFO[patched.proj]
    entry.load_numel = 7
    with torch.device("meta"):
        recorded(patched)
    assert layerwise.LAYERWISE_INFO[patched.proj] is entry and entry.load_numel == 7
    assert entry.restore_device == torch.device("meta")


def test_reload_record_inactive_is_vllms() -> None:
    assert not scope.active()
    calls: list[Any] = []
    recorded = construct._record(calls.append)
    model = torch.nn.Linear(2, 2)
    recorded(model)
    assert calls == [model]


# --- whole models -----------------------------------------------------------------------------


def _value(obj: Any, depth: int = 0) -> Any:
    """A comparable description of ``obj``: plain values as they are, objects as their type and attributes."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (torch.dtype, torch.device, enum.Enum)):
        return repr(obj)
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    if isinstance(obj, weakref.ref):
        return "weakref"
    if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)):
        return f"callable {getattr(obj, '__qualname__', type(obj).__qualname__)}"
    if isinstance(obj, torch.Tensor):
        return _tensor(obj)
    if isinstance(obj, torch.nn.Module):
        return f"module {type(obj).__qualname__}"
    if isinstance(obj, Mapping):
        return {repr(k): _value(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_value(v, depth + 1) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(_value(v, depth + 1)) for v in obj)
    attrs = getattr(obj, "__dict__", None)
    if attrs is None or depth > 4:
        return f"{type(obj).__qualname__} {obj!r}" if type(obj).__repr__ is not object.__repr__ else type(obj).__qualname__
    return {"__type__": type(obj).__qualname__, **{k: _value(v, depth + 1) for k, v in attrs.items()}}



def _tensor(t: torch.Tensor) -> dict[str, Any]:
    return {"class": type(t).__qualname__, "shape": tuple(t.shape), "dtype": repr(t.dtype), "device": t.device.type,
            "requires_grad": t.requires_grad, "attrs": {k: _value(v, 1) for k, v in vars(t).items()}}


def fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """Every module of ``model``: type, quant method (its attributes, config and kernel), parameters, buffers,
    and what vLLM recorded for reloading it (``record_metadata_for_reloading``)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        info = LAYERWISE_INFO.get(module)
        out[name] = {
            "type": type(module).__qualname__,
            "quant_method": _value(method),
            "params": {n: _tensor(p) for n, p in module.named_parameters(recurse=False)},
            "buffers": {n: _tensor(b) for n, b in module.named_buffers(recurse=False)},
            "reload": None if info is None else _value((info.restore_metadata, info.restore_device)),
        }
    return out


def _method_configs(model: torch.nn.Module) -> list[Any]:
    return [m.quant_method.quant_config for m in model.modules() if hasattr(getattr(m, "quant_method", None), "quant_config")]


def _build(model_dir: Path, load_format: str, device: str = "meta", in_scope: bool = False) -> torch.nn.Module:
    """vLLM's model for ``model_dir``, built on meta as IpcModelLoader._build_model does (SM90 stand-ins of the oracle),
    or on ``device``; ``in_scope``: inside marlin-pack's scope, as that build runs in an ipc_cache engine."""
    from vllm.config import KernelConfig, LoadConfig

    with vmr._moe_patched(1, 0) as m, m.base.set_default_torch_dtype(torch.float16):
        v = m.base
        model_config = v.ModelConfig(model=str(model_dir), dtype="float16", skip_tokenizer_init=True, enforce_eager=True)
        vllm_config = v.VllmConfig(model_config=model_config, device_config=v.DeviceConfig("cpu"),
                                   load_config=LoadConfig(load_format=load_format),
                                   kernel_config=KernelConfig(moe_backend="marlin", linear_backend="marlin"))
        # vLLM caches rotary embeddings per process (get_rope's _ROPE_DICT): one built on meta here would be
        # handed to a later test's model built on the CPU, with meta buffers. Keep the cache as it was.
        from vllm.model_executor.layers import rotary_embedding

        ropes = dict(rotary_embedding._ROPE_DICT)
        try:
            with torch.device(device), (scope.in_use() if in_scope else contextlib.nullcontext()):
                return v.initialize_model(vllm_config)
        finally:
            rotary_embedding._ROPE_DICT.clear()
            rotary_embedding._ROPE_DICT.update(ropes)


def _edit_quant(model_dir: Path, **changes: Any) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


CHECKPOINTS = {
    # modules_in_block_to_quantize from the safetensors headers (vLLM's maybe_update_config)
    "qwen3moe-gptq": lambda d: write_moe_checkpoint(d, MOE_PRESETS["tiny-qwen3moe"], "gptq", device="meta"),
    "llama-gptq": lambda d: write_gptq_checkpoint(d, PRESETS["tiny"], device="meta", tokenizer=False),
    "qwen2-gptq8-bias": lambda d: write_gptq_checkpoint(d, PRESETS["tiny-qwen2"], bits=8, device="meta", tokenizer=False),
    # from the config (a list of lists, as GPTQModel writes it)
    "llama-gptq-listed": lambda d: _edit_quant(write_gptq_checkpoint(d, PRESETS["tiny"], device="meta", tokenizer=False),
                                               modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj",
                                                                              "self_attn.v_proj"], ["mlp.down_proj"]]),
    # per-layer dynamic rules: vLLM's deep copy must run (a negative rule and a bits override)
    "qwen3moe-gptq-dynamic": lambda d: _edit_quant(
        write_moe_checkpoint(d, MOE_PRESETS["tiny-qwen3moe"], "gptq", device="meta"),
        dynamic={r"-:.*\.0\.self_attn\.o_proj": {}, r"+:.*\.1\..*": {"bits": 8}}),
    "llama-awq": lambda d: write_awq_checkpoint(d, PRESETS["tiny"], device="meta", tokenizer=False),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cache: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in cache:
            d = tmp_path_factory.mktemp(case) / "model"
            CHECKPOINTS[case](d)
            cache[case] = d
        return cache[case]

    yield make


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_models_built_with_and_without_the_patches_are_the_same(registered: None, stock_vllm: None, checkpoint: Any,
                                                                 case: str) -> None:
    from marlin_pack.vllm_plugin import patches

    model_dir = checkpoint(case)
    stock = _build(model_dir, "ipc_cache")
    assert patches.install()
    seen: list[str] = []
    original = construct.copy_is_enough
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(construct, "copy_is_enough", lambda config: seen.append(str(original(config))) or original(config))
        patched = _build(model_dir, "ipc_cache", in_scope=True)
    got, want = fingerprint(patched), fingerprint(stock)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name
    # Which layers share a config object is unchanged too: per layer for GPTQ (a copy each), one for AWQ.
    configs = {"stock": _method_configs(stock), "patched": _method_configs(patched)}
    assert len(configs["stock"]) == len(configs["patched"])
    assert len({id(c) for c in configs["stock"]}) == len({id(c) for c in configs["patched"]})
    if case.endswith("awq"):
        assert not seen  # AWQ makes no copy
    else:
        assert len({id(c) for c in configs["patched"]}) == len(configs["patched"]) > 1
        assert set(seen) == ({"False"} if "dynamic" in case else {"True"})


@pytest.mark.parametrize("case", ["llama-gptq", "qwen3moe-gptq", "llama-awq"])
def test_an_ordinary_build_with_the_patches_installed_is_stock(registered: None, stock_vllm: None, checkpoint: Any,
                                                                monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """An ``auto`` engine's build (outside marlin-pack's scope) with every patch installed: vLLM's own code path
    (no shortcut taken) and the same model as without the plugin, down to which layers share a config object."""
    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.patches import cache_key

    model_dir = checkpoint(case)
    stock = _build(model_dir, "auto")
    assert patches.install()
    for module, name in ((construct, "copy_is_enough"), (construct, "_index"), (cache_key, "indexed_files")):
        monkeypatch.setattr(module, name, lambda *a, _n=name: pytest.fail(f"{_n} ran outside marlin-pack's scope"))
    ordinary = _build(model_dir, "auto")
    assert fingerprint(ordinary) == fingerprint(stock)
    configs = {"stock": _method_configs(stock), "ordinary": _method_configs(ordinary)}
    assert len({id(c) for c in configs["stock"]}) == len({id(c) for c in configs["ordinary"]})
    lists = {k: {id(getattr(c, "modules_in_block_to_quantize", None)) for c in v} for k, v in configs.items()}
    assert len(lists["stock"]) == len(lists["ordinary"])


def test_outside_the_scope_vllms_path_runs(patched: Any, checkpoint: Any) -> None:
    """Outside marlin-pack's scope (an ``auto`` engine) every layer gets vLLM's deep copy (its own lists)."""
    auto = _build(checkpoint("llama-gptq"), "auto")
    ours = _build(checkpoint("llama-gptq"), "marlin_prepacked", in_scope=True)
    lists = [id(c.modules_in_block_to_quantize) for c in _method_configs(auto)]
    assert len(set(lists)) == len(lists) > 1
    assert len({id(c.modules_in_block_to_quantize) for c in _method_configs(ours)}) == 1
    assert fingerprint(auto) == fingerprint(ours)


@pytest.mark.parametrize("case", ["llama-gptq", "qwen2-gptq8-bias", "llama-awq", "qwen3moe-gptq"])
def test_stub_placeholders_change_nothing_but_memory(patched: Any, checkpoint: Any, case: str) -> None:
    """``patches.placeholders`` on vLLM's real models built on the CPU, as the marlin_prepacked loader builds
    them while the bundle copies: the same modules, quant methods, parameters (class, shape, dtype, attributes),
    buffers and reload records; only the dense quantized layers' own placeholders are stubs (not their biases,
    not experts layers, not embeddings, norms or rotary caches), and materialized they are ordinary tensors."""
    from vllm.model_executor.layers.linear import LinearBase

    from marlin_pack.vllm_plugin.patches.placeholders import stub_quantized_placeholders
    from marlin_pack.vllm_plugin.stubs import is_stub, materialize_stubs

    model_dir = checkpoint(case)
    stock = _build(model_dir, "marlin_prepacked", device="cpu")
    with stub_quantized_placeholders():
        stubbed = _build(model_dir, "marlin_prepacked", device="cpu")
    got, want = fingerprint(stubbed), fingerprint(stock)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name
    tensors = {f"{m}.{n}" if m else n: t for m, mod in stubbed.named_modules()
               for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]}
    quantized = {
        f"{m}.{n}"
        for m, mod in stubbed.named_modules()
        if isinstance(mod, LinearBase) and type(mod.quant_method).__name__ in ("AutoGPTQLinearMethod", "AutoAWQMarlinLinearMethod")
        for n, t in mod.named_parameters(recurse=False)
        if n != "bias" and t.numel() > 1
    }
    assert quantized and {n for n, t in tensors.items() if is_stub(t)} == quantized
    for module in stubbed.modules():
        materialize_stubs(module)
    assert not [n for n, t in tensors.items() if is_stub(t)]
    assert all(tensors[n].is_contiguous() for n in quantized)
