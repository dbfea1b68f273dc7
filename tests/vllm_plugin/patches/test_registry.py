"""``patches.registry`` and ``version_guard``: version-guarded, idempotent, removable patches of vLLM,
deferred ones applied when their module is first imported; and the inventory ``patches.PATCHES``
(its purposes and exits: test_catalog.py)."""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from marlin_pack.vllm_plugin import releases
from marlin_pack.vllm_plugin.patches import PATCHES, Patch, registry
from marlin_pack.vllm_plugin.patches.weight_cache import DAEMON_MODULE, RUN_DAEMON

_MISSING = object()

_CT = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:CompressedTensorsLinearMethod"
_CT_MOE = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16:"
           "CompressedTensorsWNA16MoEMethod")
_WORKER_LOAD_MODEL = "vllm.v1.worker.gpu_worker:Worker.load_model"
_WORKER_INIT_DEVICE = "vllm.v1.worker.gpu_worker:Worker.init_device"
_WORKER_INITIALIZE_FROM_CONFIG = "vllm.v1.worker.gpu_worker:Worker.initialize_from_config"
_KEY_TARGET = "vllm.model_executor.model_loader.weight_cache.protocol:WeightCacheKey.from_model_config"
EXPECTED_TARGETS = {
    "vllm.model_executor.layers.quantization.auto_awq:AutoAWQMarlinLinearMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.auto_awq:AutoAWQMarlinLinearMethod.supports_pre_processed_weights",
    "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQLinearMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQLinearMethod.supports_pre_processed_weights",
    f"{_CT}.process_weights_after_loading",
    f"{_CT}.supports_pre_processed_weights",
    f"{_CT}.create_weights",
    "vllm.model_executor.layers.quantization.auto_awq:AutoAWQMarlinLinearMethod.create_weights",
    "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQLinearMethod.create_weights",
    "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.create_weights",
    "vllm.model_executor.layers.quantization.auto_awq:AutoAWQMoEMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.auto_awq:AutoAWQMoEMethod.supports_pre_processed_weights",
    "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQMoEMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQMoEMethod.supports_pre_processed_weights",
    f"{_CT_MOE}.process_weights_after_loading",
    f"{_CT_MOE}.supports_pre_processed_weights",
    ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
     "CompressedTensorsKVCacheMethod.process_weights_after_loading"),
    "vllm.model_executor.model_loader.weight_cache.protocol:WeightCacheKey.from_model_config",
    "vllm.model_executor.model_loader.weight_cache.ipc_loader:IpcModelLoader._build_model",
    "vllm.model_executor.model_loader.weight_cache.ipc_loader:IpcModelLoader._fallback_load",
    _WORKER_LOAD_MODEL,
    _WORKER_INIT_DEVICE,
    _WORKER_INITIALIZE_FROM_CONFIG,
    f"{DAEMON_MODULE}:WeightCacheDaemon.get_model",
    f"{DAEMON_MODULE}:get_draft_daemon_config",
    RUN_DAEMON,
    "vllm.model_executor.layers.quantization.utils.gptq_utils:deepcopy",
    "vllm.model_executor.layers.quantization.auto_gptq:deepcopy",
    "vllm.model_executor.layers.quantization.utils.gptq_utils:is_layer_gptq_quantized",
    "vllm.model_executor.model_loader.reload.meta:_parameter_storage_ptrs",
    "vllm.model_executor.model_loader.utils:record_metadata_for_reloading",
    "vllm.model_executor.model_loader.weight_cache.protocol:filter_duplicate_safetensors_files",
}


def resolve(target: str) -> tuple[Any, str]:
    """(owner, attribute) of a ``module:Owner.attr`` target, importing the module."""
    module, path = target.split(":", 1)
    owner: Any = importlib.import_module(module)
    *owners, attr = path.split(".")
    for name in owners:
        owner = getattr(owner, name)
    return owner, attr


def raw(target: str) -> Any:
    """The owner's own ``__dict__`` entry (a classmethod stays a classmethod), or _MISSING."""
    owner, attr = resolve(target)
    return vars(owner).get(attr, _MISSING)


def unique_version() -> str:
    """The guard warns once per process per version: a version no other test uses."""
    return f"0.0.0+test{uuid.uuid4().hex[:8]}"


# --- the inventory --------------------------------------------------------------------------


def test_patches_inventory() -> None:
    assert {p.target for p in PATCHES} == EXPECTED_TARGETS
    assert len(PATCHES) == len(EXPECTED_TARGETS)
    assert {p.target for p in PATCHES if p.deferred} == {
        f"{DAEMON_MODULE}:WeightCacheDaemon.get_model",
        f"{DAEMON_MODULE}:get_draft_daemon_config",
        RUN_DAEMON,
        _WORKER_LOAD_MODEL,
        _WORKER_INIT_DEVICE,
        _WORKER_INITIALIZE_FROM_CONFIG,
    }


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target.rsplit(":", 1)[1])
def test_every_patch_names_its_exit_and_resolves_on_vllm(patch: Patch) -> None:
    assert patch.remove_when.strip(), patch.target
    assert patch.purpose in registry.PURPOSES, patch.target
    assert patch.module == patch.target.split(":", 1)[0]
    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    if patch.target not in {p.target for p in patches.for_release(vllm_version())}:
        pytest.skip(f"not a patch of vLLM {vllm_version()} (its row needs what that release lacks)")
    owner, attr = resolve(patch.target)
    assert hasattr(owner, attr), f"{patch.target} does not exist in this vLLM"


def test_a_patch_needs_a_purpose_and_an_exit() -> None:
    with pytest.raises(ValueError, match="purpose 'faster' is not one of"):
        Patch("m:f", lambda original: original, remove_when="x", purpose="faster")
    with pytest.raises(ValueError, match="remove_when must name the upstream change"):
        Patch("m:f", lambda original: original, remove_when=" ", purpose="speed")


# --- the version guard ----------------------------------------------------------------------


def test_version_guard_reads_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    monkeypatch.setattr(vllm, "__version__", "0.33.0+cu130")
    assert vllm_version() == "0.33.0" and releases.release(vllm_version()) is not None
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    assert vllm_version() == "0.33.1" and releases.release(vllm_version()) is None


def test_install_all_on_another_version_patches_nothing_and_warns_once(marlin_log: list[str]) -> None:
    gptq_pwal = "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQLinearMethod.process_weights_after_loading"
    before = raw(gptq_pwal)
    running = unique_version()
    reason = f"vLLM {running} is not a release marlin-pack supports (supported: {releases.supported_text()})"
    assert registry.install_all(PATCHES, running=running, served=False, reason=reason) is False
    assert registry.install_all(PATCHES, running=running, served=False, reason=reason) is False
    assert registry.installed() == []
    warnings = [m for m in marlin_log if "not a release marlin-pack supports" in m]
    assert warnings == [f"marlin-pack: {reason}; nothing patched"]
    assert raw(gptq_pwal) is before and not registry.is_replacement(before)


def test_patches_install_follows_the_running_vllm(monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]) -> None:
    import vllm

    from marlin_pack.vllm_plugin import patches

    running = unique_version()
    monkeypatch.setattr(vllm, "__version__", running)
    assert patches.install() is False and patches.installed() == []
    monkeypatch.undo()
    assert patches.install() is True and len(patches.installed()) >= 7
    assert sum("is not a release marlin-pack supports" in m for m in marlin_log) == 1


# --- install, idempotence, uninstall --------------------------------------------------------


def test_install_is_idempotent(patched: Any) -> None:
    target = "vllm.model_executor.layers.quantization.auto_gptq:AutoGPTQLinearMethod.process_weights_after_loading"
    targets = registry.installed()
    wrapper = raw(target)
    assert registry.is_replacement(wrapper)
    assert patched.install() and patched.install()
    assert registry.installed() == targets
    assert raw(target) is wrapper  # no second wrapper
    assert wrapper.__wrapped__ is registry.original(target)  # wraps vLLM's own function directly
    assert not registry.is_replacement(wrapper.__wrapped__)


def test_uninstall_all_restores_the_exact_originals() -> None:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    importlib.import_module(DAEMON_MODULE)  # imported: its deferred patches apply at once too
    applied = {p.target for p in patches.for_release(vllm_version())}  # the rows of the running release
    before = {p.target: raw(p.target) for p in PATCHES if p.target in applied}
    # inherited from QuantizeMethodBase before 0.34.0, vLLM's own property (Marlin only) from it
    stock = vars(AutoGPTQLinearMethod).get("supports_pre_processed_weights", _MISSING)
    from_model_config = vars(WeightCacheKey)["from_model_config"]
    assert isinstance(from_model_config, classmethod)

    assert patches.install()
    assert sorted(registry.installed()) == sorted(EXPECTED_TARGETS & applied)
    for target, original in before.items():
        assert raw(target) is not original, target
        assert registry.is_replacement(raw(target)), target
        assert registry.original(target) is (None if original is _MISSING else original), target
    assert isinstance(vars(WeightCacheKey)["from_model_config"], classmethod)
    key_patched = f"{_KEY_TARGET}" in applied  # the key takes kernel_config from 0.33.0 only
    assert registry.is_replacement(WeightCacheKey.from_model_config) is key_patched  # a bound classmethod
    assert isinstance(vars(AutoGPTQLinearMethod)["supports_pre_processed_weights"], property)

    patches.uninstall_all()
    assert registry.installed() == []
    for target, original in before.items():
        assert raw(target) is original, target
    assert vars(AutoGPTQLinearMethod).get("supports_pre_processed_weights", _MISSING) is stock
    assert vars(WeightCacheKey)["from_model_config"] is from_model_config
    assert not registry.is_replacement(WeightCacheKey.from_model_config)
    with pytest.raises(KeyError):
        registry.original(RUN_DAEMON)


# --- deferred patches -----------------------------------------------------------------------

_MODULE_SOURCE = '''
def greet():
    return "stock"


class Thing:
    def meth(self):
        return "stock"
'''


@pytest.fixture
def throwaway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``throwaway()`` -> the name of a new, not yet imported module on sys.path (removed afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def make() -> str:
        name = f"marlin_pack_deferred_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(_MODULE_SOURCE)
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def _patches(name: str) -> list[Patch]:
    def prefix(original: Any) -> Any:
        def replacement(*args: Any) -> str:
            return "patched " + original(*args)

        return replacement

    return [
        Patch(f"{name}:greet", prefix, remove_when="never (test)", purpose="speed", deferred=True),
        Patch(f"{name}:Thing.meth", prefix, remove_when="never (test)", purpose="speed", deferred=True),
    ]


def test_deferred_patches_apply_on_first_import(throwaway: Any) -> None:
    name = throwaway()
    meta_path = list(sys.meta_path)
    assert registry.install_all(_patches(name), running="1", served=True)
    assert name not in sys.modules  # not imported by install_all
    assert registry.installed() == []
    mod = importlib.import_module(name)
    assert mod.greet() == "patched stock" and mod.Thing().meth() == "patched stock"
    assert registry.installed() == [f"{name}:greet", f"{name}:Thing.meth"]
    assert registry.is_replacement(mod.greet) and registry.is_replacement(mod.Thing.meth)
    assert registry.original(f"{name}:greet")() == "stock"
    assert registry.install_all(_patches(name), running="1", served=True)  # idempotent
    assert mod.greet() == "patched stock"
    registry.uninstall_all()
    assert mod.greet() == "stock" and mod.Thing().meth() == "stock"
    assert sys.meta_path == meta_path  # the import hook is gone too


def test_deferred_patches_of_an_imported_module_apply_at_once(throwaway: Any) -> None:
    name = throwaway()
    mod = importlib.import_module(name)
    assert registry.install_all(_patches(name), running="1", served=True)
    assert mod.greet() == "patched stock" and registry.installed() == [f"{name}:greet", f"{name}:Thing.meth"]


def test_uninstall_all_forgets_pending_patches(throwaway: Any) -> None:
    name = throwaway()
    assert registry.install_all(_patches(name), running="1", served=True)
    registry.uninstall_all()
    assert importlib.import_module(name).greet() == "stock"
    assert registry.installed() == []


def test_a_failing_deferred_patch_is_logged_and_the_import_succeeds(throwaway: Any, marlin_log: list[str]) -> None:
    name = throwaway()
    broken = Patch(f"{name}:Missing.attr", lambda original: original, remove_when="never (test)", purpose="speed",
                   deferred=True)
    assert registry.install_all([broken, *_patches(name)], running="1", served=True)
    mod = importlib.import_module(name)
    assert mod.greet() == "patched stock"
    assert f"marlin-pack: could not patch {name}:Missing.attr" in marlin_log
    assert f"{name}:Missing.attr" not in registry.installed()
