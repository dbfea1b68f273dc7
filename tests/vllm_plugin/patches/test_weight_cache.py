"""``patches.weight_cache``: vLLM's weight cache (``vllm preload`` / ``--load-format ipc_cache``)
for AWQ/GPTQ Marlin layers.

* Marlin forced for weight-cache processes, with an unchanged ``WeightCacheKey``;
* the IPC loader and the daemon wrapped (hint on refusal, timing);
* a daemon -> IPC round trip on real vLLM layers (vLLM's ``export_entries``,
  ``IpcModelLoader._apply_entries`` and ``process_weights_after_loading`` under
  ``weights_already_processed()``);
* spawned daemon processes: vLLM's real ``_run_daemon`` in a ``spawn`` child, started as
  ``vllm preload`` starts it, sees the loader and the patches (and, as a control, does not
  without marlin-pack's spawn target).

Run as a script (``python tests/vllm_plugin/patches/test_weight_cache.py spawn-probe``) this
file is the parent of that spawn test.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from marlin_pack.vllm_plugin.patches import registry, scope
from marlin_pack.vllm_plugin.patches.weight_cache import (
    CACHE_QUANTIZATIONS,
    DAEMON_MODULE,
    PATCHES,
    RUN_DAEMON,
    force_marlin_for_cache,
    run_daemon,
)

ROOT = Path(__file__).resolve().parents[3]
IPC_LOADER = "vllm.model_executor.model_loader.weight_cache.ipc_loader:IpcModelLoader"


def _configs(quantization: str | None = "auto_awq", **kernel: Any) -> tuple[Any, Any]:
    from vllm.config.kernel import KernelConfig

    return SimpleNamespace(kernel_config=KernelConfig(**kernel)), SimpleNamespace(quantization=quantization)


def _patch(suffix: str) -> Any:
    return next(p for p in PATCHES if p.target.endswith(suffix))


# --- Marlin for weight-cache processes ------------------------------------------------------


@pytest.mark.parametrize(
    ("quantization", "kernel", "forced"),
    [
        ("auto_awq", {}, True),
        ("auto_gptq", {"linear_backend_per_quant": {"fp8": "cutlass"}}, True),
        ("auto_gptq", {"linear_backend_per_quant": {"mixed_precision": "auto"}}, True),
        ("gptq_marlin", {}, True),
        ("auto_gptq", {"linear_backend": "marlin"}, False),  # already Marlin
        ("auto_awq", {"linear_backend": "machete"}, False),  # explicit: kept (and refused later)
        ("auto_gptq", {"linear_backend_per_quant": {"mixed_precision": "exllama"}}, False),
        ("fp8", {}, False),  # not AWQ/GPTQ
        (None, {}, False),
    ],
)
def test_force_marlin_for_cache(quantization: Any, kernel: dict, forced: bool) -> None:
    vllm_config, model_config = _configs(quantization, **kernel)
    before = dict(vllm_config.kernel_config.linear_backend_per_quant or {})
    assert force_marlin_for_cache(vllm_config, model_config) is forced
    after = dict(vllm_config.kernel_config.linear_backend_per_quant or {})
    assert after == ({**before, "mixed_precision": "marlin"} if forced else before)
    assert (quantization in CACHE_QUANTIZATIONS) or not forced


def test_forcing_makes_vllm_choose_marlin_and_keeps_the_cache_key(patched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config as vllm_config_mod
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS, _resolve_backend_kernels
    from vllm.platforms import PlatformEnum

    vllm_config, model_config = _configs("auto_awq")
    kc = vllm_config.kernel_config
    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: vllm_config)

    def candidates() -> list[str]:
        kernels = _POSSIBLE_KERNELS[PlatformEnum.CUDA]
        return [k.__name__ for k in _resolve_backend_kernels(list(kernels), "mp", quantization="mixed_precision", compute_capability=90)]

    assert candidates()[0] != "MarlinLinearKernel"  # H200: Machete (or Humming) first
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "awq"})
    text = SimpleNamespace(rope_parameters={"rope_theta": 1e4}, max_position_embeddings=4096)
    mc = SimpleNamespace(
        hf_config=hf,
        hf_text_config=text,
        model="/not/a/dir",
        dtype=torch.float16,
        quantization="auto_awq",
        quantization_config=None,
        revision=None,
    )
    cache = SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[])

    def key(kernel_config: Any) -> Any:
        import plugin_fakes

        return plugin_fakes.weight_cache_key(mc, 1, 0, cache_config=cache, kernel_config=kernel_config)

    import inspect

    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    keyed_by_kernel = "kernel_config" in inspect.signature(WeightCacheKey.from_model_config).parameters  # 0.33+

    daemon_key = key(KernelConfig())  # computed before loading, as WeightCacheDaemon.__init__ does
    assert force_marlin_for_cache(vllm_config, model_config)
    assert candidates() == ["MarlinLinearKernel"]
    assert key(kc) == daemon_key  # the engine's key (and a later reload's) still matches
    assert kc.linear_backend_per_quant == {"mixed_precision": "marlin"}  # hashed for compile caches
    forced_elsewhere = KernelConfig(linear_backend_per_quant={"mixed_precision": "marlin"})
    if keyed_by_kernel:  # before 0.33.0 the key holds no kernel settings at all
        assert key(forced_elsewhere) != daemon_key  # a user's explicit setting is part of the key


# --- the IPC loader and the daemon ----------------------------------------------------------


def test_ipc_loader_and_daemon_are_wrapped(patched: Any) -> None:
    import importlib

    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader

    daemon_mod = importlib.import_module(DAEMON_MODULE)  # patched on import (or at install, if imported before)
    assert registry.is_replacement(IpcModelLoader._build_model) and registry.is_replacement(IpcModelLoader._fallback_load)
    assert registry.is_replacement(daemon_mod.WeightCacheDaemon.get_model)
    assert daemon_mod._run_daemon is run_daemon
    original = registry.original(RUN_DAEMON)
    assert original is not run_daemon and original.__module__ == DAEMON_MODULE and original.__name__ == "_run_daemon"
    for name in ("_build_model", "_fallback_load"):
        assert getattr(IpcModelLoader, name).__wrapped__ is registry.original(f"{IPC_LOADER}.{name}")


def test_ipc_loader_steps_force_marlin_and_hint_on_refusal(marlin_log: list[str]) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError

    seen: list[Any] = []

    def build_model(self: Any, vllm_config: Any, model_config: Any, prefix: str) -> str:
        seen.append(dict(vllm_config.kernel_config.linear_backend_per_quant or {}))
        assert scope.active()  # vLLM's step runs inside marlin-pack's scope
        return "model"

    for suffix in ("._build_model", "._fallback_load"):
        wrapped = _patch(suffix).make(build_model)
        vllm_config, model_config = _configs("auto_gptq")
        assert wrapped(None, vllm_config, model_config, "") == "model"
    assert seen == [{"mixed_precision": "marlin"}] * 2  # forced before vLLM builds the model
    assert not scope.active()
    assert any("ipc_cache engine: AWQ/GPTQ/compressed-tensors linear layers use MarlinLinearKernel" in m for m in marlin_log)

    def refuse(self: Any, vllm_config: Any, model_config: Any) -> Any:
        raise UnsupportedQuantForIPCError("layer x: AutoGPTQLinearMethod does not support ...")

    with pytest.raises(UnsupportedQuantForIPCError):
        _patch("._build_model").make(refuse)(None, *_configs("auto_gptq"))
    assert any("only when vLLM serves them with MarlinLinearKernel and 16-bit activations" in m for m in marlin_log)


def test_daemon_get_model_forces_marlin_times_and_hints(marlin_log: list[str]) -> None:
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError

    def refuse(self: Any) -> Any:
        raise UnsupportedQuantForIPCError("layer x: AutoGPTQLinearMethod does not support ...")

    fake = SimpleNamespace(
        role="target",
        global_rank=0,
        vllm_config=_configs()[0],
        model_config=SimpleNamespace(quantization="auto_gptq"),
    )
    fake.vllm_config.load_config = SimpleNamespace(load_format="marlin_prepacked")
    get_model = _patch("WeightCacheDaemon.get_model").make
    from marlin_pack.gpu.helpers import exits_in_background

    inside: list[tuple[bool, bool]] = []
    assert get_model(lambda self: inside.append((exits_in_background(), scope.active())) or "model")(fake) == "model"
    # The loader's copy helpers exit in the background, and marlin-pack's scope holds, during the fill only.
    assert inside == [(True, True)] and not exits_in_background() and not scope.active()
    assert fake.vllm_config.kernel_config.linear_backend_per_quant == {"mixed_precision": "marlin"}
    with pytest.raises(UnsupportedQuantForIPCError):
        get_model(refuse)(fake)
    text = "\n".join(marlin_log)
    assert "weight-cache target daemon rank 0 filled its model in" in text and "marlin_prepacked" in text
    assert "only when vLLM serves them with MarlinLinearKernel and 16-bit activations" in text


def test_daemon_fill_says_when_it_began_after_run_daemon(
    registered: None, monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]
) -> None:
    """The fill's line says how long vLLM's daemon initialisation took before it (what a change there moves)."""
    import importlib
    import time

    from marlin_pack.vllm_plugin import daemon_process, patches

    daemon_mod = importlib.import_module(DAEMON_MODULE)
    monkeypatch.setattr(daemon_process, "_DAEMON_STARTED", [])
    monkeypatch.setattr(daemon_mod, "_run_daemon", lambda *a, **k: time.sleep(0.05))  # vLLM building the daemon
    try:
        run_daemon(0, 0, SimpleNamespace(), "tcp://127.0.0.1:9")
    finally:
        patches.uninstall_all()
    fake = SimpleNamespace(role="target", global_rank=0, vllm_config=_configs()[0], model_config=SimpleNamespace(quantization="x"))
    fake.vllm_config.load_config = SimpleNamespace(load_format="marlin_prepacked")
    _patch("WeightCacheDaemon.get_model").make(lambda self: "model")(fake)
    line = next(m for m in marlin_log if "filled its model" in m)
    began = float(line.split("the fill began ")[1].split(" s after the daemon process began its run")[0])
    assert began >= 0.05


# --- a daemon -> IPC round trip on real vLLM layers -----------------------------------------

ROUND_TRIPS = {
    "awq4": dict(fmt="awq", preset="tiny"),
    "gptq4-padded": dict(fmt="gptq", preset="tiny-padded", group_size=32),
    "gptq8-bias": dict(fmt="gptq", preset="tiny-qwen2", bits=8),
}


@pytest.mark.usefixtures("weight_cache_scope")
@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_daemon_to_engine_round_trip_on_real_layers(patched: Any, make_checkpoint: Any, case: str) -> None:
    """Stock post-processing (the daemon), vLLM's export, then a meta-built model filled by vLLM's
    IPC loader code and post-processed in pre-processed mode: the engine holds the daemon's
    very tensors (CPU stand-ins for the IPC mappings), equal to stock vLLM's."""
    vr = pytest.importorskip("oracles.vllm_reference")
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.daemon import export_entries
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheState, check_ipc_quant_support
    from vllm.model_executor.utils import weights_already_processed

    ckpt = make_checkpoint(**ROUND_TRIPS[case])
    reference = vr.reference_rank_tensors(ckpt, 1, 0, torch.float16)
    cfg = json.loads((ckpt / "config.json").read_text())
    biases = {n.rsplit(".", 1)[0] for n in reference if n.endswith(".bias")}
    v = vr._vllm()
    model_cls = v.model_classes.get(cfg["architectures"][0], v.default_model_class)
    with vr._patched(1, 0), v.set_default_torch_dtype(torch.float16):
        qc = vr._quant_config(v, ckpt, cfg["quantization_config"], model_cls)
        facts = vr._model_facts(cfg)
        # The daemon's layers, post-processed the stock way, with reference contents.
        daemon = vr._build_layers(v, facts, qc, biases, 1)
        for name, tensor in reference.items():
            module, leaf = name.rsplit(".", 1)
            setattr(daemon.get_submodule(module), leaf, nn.Parameter(tensor.clone(), requires_grad=False))
        for module in daemon.modules():
            if hasattr(module, "quant_method"):
                module.input_global_scale = None
        entries, aliases = export_entries(daemon)
        # The engine: built on meta, checked, filled and post-processed as IpcModelLoader does.
        with torch.device("meta"):
            engine = vr._build_layers(v, facts, qc, biases, 1)
        check_ipc_quant_support(engine)
        loader = SimpleNamespace(mode="zero_copy")
        IpcModelLoader._apply_entries(loader, engine, WeightCacheState(entries, aliases, {}), 0)  # type: ignore[arg-type]
        model_config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, dtype=torch.float16, quantization=qc.get_name())
        with weights_already_processed():
            process_weights_after_loading(engine, model_config, torch.device("cpu"))
    got = dict(engine.named_parameters())
    shared = dict(daemon.named_parameters())
    assert got.keys() == shared.keys() and set(reference) <= set(got)  # (0.34.0 also keeps GPTQ's retired qzeros)
    for name, want in reference.items():
        assert not got[name].is_meta, name
        assert got[name].data_ptr() == shared[name].data_ptr(), name  # the same memory, not a copy
        assert got[name].dtype == want.dtype and torch.equal(got[name].detach(), want), name
    for module in engine.modules():
        if hasattr(module, "quant_method"):
            assert getattr(module, "input_global_scale", None) is None


# --- spawned daemon processes ---------------------------------------------------------------


class Probe:
    """Stands in for the VllmConfig vLLM's ``_run_daemon`` receives: when ``WeightCacheDaemon``
    reads ``parallel_config`` (its first step), report the process's state and stop."""

    def __init__(self, queue: Any, tag: str) -> None:
        from vllm.config.logging import LoggingConfig

        self.queue, self.tag = queue, tag
        self.logging_config = LoggingConfig()  # _run_daemon configures logging from it first

    @property
    def parallel_config(self) -> Any:
        import vllm.plugins
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

        from marlin_pack.vllm_plugin import is_registered
        from marlin_pack.vllm_plugin.patches.registry import is_replacement

        self.queue.put(
            {
                "tag": self.tag,
                "pid": os.getpid(),
                "registered": "marlin_prepacked" in _LOAD_FORMAT_TO_MODEL_LOADER,
                "plugin_registered": is_registered(),
                # marlin-pack's opt-in (vLLM 0.34.0 has a property of its own there)
                "quant_patch": is_replacement(AutoGPTQLinearMethod.__dict__.get("supports_pre_processed_weights")),
                "general_plugins_loaded": vllm.plugins.plugins_loaded,
            }
        )
        raise SystemExit(0)


def test_run_daemon_installs_marlin_pack_then_runs_vllms_daemon(
    registered: None, monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]
) -> None:
    """In-process: run_daemon installs the patches (also where register() already ran) and calls
    the _run_daemon the registry replaced, with the spawn arguments unchanged."""
    import importlib

    from marlin_pack.vllm_plugin import patches

    daemon_mod = importlib.import_module(DAEMON_MODULE)
    importlib.import_module("vllm.v1.worker.gpu_worker")  # imported: its deferred patch is installed at once (any test order)
    calls: list[Any] = []

    def stock(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs, daemon_mod._run_daemon, sorted(patches.installed())))
        return "done"

    monkeypatch.setattr(daemon_mod, "_run_daemon", stock)  # stands for vLLM's (unpatched now)
    try:
        config = SimpleNamespace()  # no logging_config: logging is left alone
        assert run_daemon(0, 1, config, "tcp://127.0.0.1:9", queue="q") == "done"
        assert len(calls) == 1
        args, kwargs, current, installed = calls[0]
        assert args == (0, 1, config, "tcp://127.0.0.1:9") and kwargs == {"queue": "q"}
        assert current is run_daemon  # the daemon module spawns marlin-pack's target from now on
        from marlin_pack.vllm_plugin.version_guard import vllm_version

        assert set(installed) == {p.target for p in patches.for_release(vllm_version())}
        assert registry.original(RUN_DAEMON) is stock
        assert any("plugin active in weight-cache daemon process" in m for m in marlin_log)
    finally:
        patches.uninstall_all()  # before monkeypatch restores vLLM's function
    assert daemon_mod._run_daemon is stock


def _stock_spawn_target(*args: Any) -> None:
    """The control: vLLM's own ``_run_daemon``, as a plain ``vllm preload`` child runs it."""
    from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon

    _run_daemon(*args)


def _spawn_probe_main() -> None:
    """As ``vllm preload``: plugins load in the parent (the CLI's parser does it), then
    ``PreloadSubcommand.cmd`` imports ``_run_daemon`` and spawns it."""
    from vllm.plugins import load_general_plugins

    installed_ep = any(e.name == "marlin_pack" for e in entry_points(group="vllm.general_plugins"))
    if installed_ep:
        load_general_plugins()  # what `vllm preload`'s argument parser runs (arg_utils.py L3256)
    else:
        from marlin_pack.vllm_plugin import register

        register()
    from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon  # as preload.py L214

    ctx = multiprocessing.get_context("spawn")  # as preload.py
    queue = ctx.Queue()
    assert registry.original(RUN_DAEMON) is not _run_daemon
    targets = {"marlin-pack": _run_daemon, "vllm": _stock_spawn_target}
    procs = [
        ctx.Process(target=target, args=(0, 0, Probe(queue, tag), "tcp://127.0.0.1:9", None, queue))
        for tag, target in targets.items()
    ]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        r = queue.get(timeout=300)
        reports[r["tag"]] = r
    for p in procs:
        p.join(60)
    print(
        "SPAWN_PROBE "
        + json.dumps(
            {
                "entry_point": installed_ep,
                "parent_target_is_ours": _run_daemon is run_daemon,
                "reports": reports,
                "exitcodes": [p.exitcode for p in procs],
            }
        ),
        flush=True,
    )


@pytest.mark.slow
def test_spawned_daemons_register_marlin_pack() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "spawn-probe"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("SPAWN_PROBE ")), None)
    assert line is not None, (r.stdout + r.stderr)[-4000:]
    out = json.loads(line.removeprefix("SPAWN_PROBE "))
    assert out["parent_target_is_ours"]
    ours, stock = out["reports"]["marlin-pack"], out["reports"]["vllm"]
    # A spawned daemon never runs load_general_plugins(): without marlin-pack's target it
    # lacks the loader and the patches; with it, vLLM's own _run_daemon runs with both.
    assert stock == {**stock, "registered": False, "plugin_registered": False, "quant_patch": False, "general_plugins_loaded": False}
    assert ours == {**ours, "registered": True, "plugin_registered": True, "quant_patch": True, "general_plugins_loaded": False}
    assert "plugin active in weight-cache daemon process" in r.stdout + r.stderr
    assert out["exitcodes"] == [0, 0]


if __name__ == "__main__":
    if sys.argv[1:] == ["spawn-probe"]:
        _spawn_probe_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} spawn-probe")


def test_the_weight_cache_keeps_vllms_choice_for_a_bundle_with_machete_layers(make_bundle: Any) -> None:
    """Daemon and engine both find the model's bundle: Machete layers in it, nothing is forced (vLLM's SM90 choice
    on both sides, shared); a Marlin bundle, or none, and both force Marlin as before."""
    from types import SimpleNamespace

    from vllm.config.kernel import KernelConfig

    from marlin_pack.vllm_plugin.patches.weight_cache import force_marlin_for_cache

    for kernel, forced in (("machete", False), ("marlin", True)):
        model = make_bundle("gptq", "tiny", kernel=kernel)
        cfg = SimpleNamespace(kernel_config=KernelConfig())
        assert force_marlin_for_cache(cfg, SimpleNamespace(model=str(model), quantization="gptq", revision=None)) is forced
        assert (cfg.kernel_config.linear_backend_per_quant or {}).get("mixed_precision") == ("marlin" if forced else None)
