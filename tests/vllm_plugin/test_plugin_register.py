"""``marlin_pack.vllm_plugin``: the entry point, ``register()``, and what importing the plugin costs."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from marlin_pack.vllm_plugin import LOAD_FORMAT
from marlin_pack.vllm_plugin.options import LoaderOptions

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_plugin_does_not_import_vllm() -> None:
    modules = [
        "marlin_pack",
        "marlin_pack.vllm_plugin",
        "marlin_pack.vllm_plugin.options",
        "marlin_pack.vllm_plugin.decision",
        "marlin_pack.vllm_plugin.layer_check",
        "marlin_pack.vllm_plugin.preflight",
        "marlin_pack.vllm_plugin.preload",
        "marlin_pack.vllm_plugin.io_facts",
        "marlin_pack.gpu.plan",
        "marlin_pack.gpu.gpu_room",
        "marlin_pack.gpu.helper_protocol",
        "marlin_pack.patch_list",
        "marlin_pack.vllm_plugin.version_guard",
        "marlin_pack.vllm_plugin.launcher",
        "marlin_pack.vllm_plugin.patches",
        "marlin_pack.vllm_plugin.patches.registry",
        "marlin_pack.vllm_plugin.patches.post_processing",
        "marlin_pack.vllm_plugin.patches.weight_cache",
    ]
    code = (
        f"import sys, importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_entry_point_resolves_to_register() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from marlin_pack.vllm_plugin import register

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    ep = EntryPoint(name="marlin_pack", value=declared["marlin_pack"], group="vllm.general_plugins")
    assert ep.load() is register
    installed = [e for e in entry_points(group="vllm.general_plugins") if e.name == "marlin_pack"]
    if installed:  # when the package is installed, the real metadata must agree
        assert installed[0].load() is register


def test_register_is_idempotent_and_get_model_loader_returns_ours(registered: None) -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from marlin_pack.vllm_plugin import is_registered, register
    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    register()
    register()
    assert is_registered()
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT))
    assert isinstance(loader, MarlinPrepackedLoader)
    assert loader.options == LoaderOptions()
    loader = get_model_loader(
        LoadConfig(load_format="marlin_prepacked", model_loader_extra_config={"bundle": "/b", "fallback": True})
    )
    assert loader.options.bundle == Path("/b") and loader.options.fallback
    with pytest.raises(ValueError, match=r"unknown key 'bogus' for load format marlin_prepacked"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"bogus": 1}))


# A fresh process: register() caches its success and vLLM's loader registry cannot be undone.
_FRESH_PROCESS = r"""
import importlib.metadata, json, logging
import vllm
import vllm.plugins as plugins
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as formats
import marlin_pack.vllm_plugin as plugin
from marlin_pack.vllm_plugin import patches

messages = []
class Record(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("vllm.marlin_pack").addHandler(Record())

out = {"before": plugin.is_registered()}
real = vllm.__version__
vllm.__version__ = "0.35.0+cu130"  # a release not served: register() patches nothing, its load format refuses
plugin.register()
plugin.register()
out["other"] = {
    "registered": plugin.is_registered(),
    "patched": patches.installed(),
    "format": "marlin_prepacked" in formats,
    "warnings": [m for m in messages if "not a release" in m],
    "loader": formats.get("marlin_prepacked").__name__ if "marlin_prepacked" in formats else None,
}
vllm.__version__ = real

ep = importlib.metadata.EntryPoint(name="marlin_pack", value="marlin_pack.vllm_plugin:register", group="vllm.general_plugins")
importlib.metadata.entry_points = lambda group=None: [ep]
loaded = plugins.load_plugins_by_group("vllm.general_plugins")
out["loaded"] = {name: fn is plugin.register for name, fn in loaded.items()}
loaded["marlin_pack"]()
out["target"] = {"registered": plugin.is_registered(), "patched": len(patches.installed()), "format": "marlin_prepacked" in formats}
print("FRESH " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_vllm_plugin_machinery_calls_register_and_the_version_guard_holds() -> None:
    """vLLM's plugin loading calls register(), which registers the loader and installs the
    patches; on a release marlin-pack does not serve it warns once, patches nothing and registers the refusing loader."""
    r = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("FRESH ")), None)
    assert line is not None, (r.stdout + r.stderr)[-4000:]
    out = json.loads(line.removeprefix("FRESH "))
    assert out["before"] is False
    assert out["other"] == {
        "registered": False,
        "patched": [],
        "format": True,
        "warnings": [("marlin-pack: vLLM 0.35.0 is not a release marlin-pack supports "
                      "(supported: 0.34.0, 0.33.0, 0.32.0, 0.31.0, 0.30.0); nothing patched")],
        "loader": "UnservedReleaseLoader",
    }
    assert out["loaded"] == {"marlin_pack": True}
    assert out["target"]["registered"] and out["target"]["format"] and out["target"]["patched"] > 0
