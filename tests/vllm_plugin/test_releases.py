"""``vllm_plugin.releases``: the table of vLLM releases served, and the decisions read from it (pure, no vLLM)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from marlin_pack.bundle.reader import read_manifest
from marlin_pack.errors import BundleMismatchError, LoadRefusedError
from marlin_pack.schemas import Manifest
from marlin_pack.vllm_plugin import releases
from marlin_pack.vllm_plugin.decision import EngineFacts, bundle_layouts, check_engine, decide
from marlin_pack.vllm_plugin.options import LoaderOptions
from marlin_pack.vllm_plugin.patches import catalog

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_lists_releases_newest_first_with_what_differs() -> None:
    assert [r.version for r in releases.RELEASES] == ["0.34.0", "0.33.0", "0.32.0", "0.31.0", "0.30.0"]
    by = {r.version: r for r in releases.RELEASES}
    assert [by[v].finish for v in ("0.34.0", "0.33.0", "0.32.0", "0.31.0", "0.30.0")] == [
        "w_zp", "empty_qzeros", "empty_qzeros", "empty_qzeros", "workspace"]
    assert not by["0.34.0"].has_env("VLLM_MARLIN_INPUT_DTYPE") and by["0.33.0"].has_env("VLLM_MARLIN_INPUT_DTYPE")
    assert [v for v, r in by.items() if r.memory_hook] == ["0.34.0", "0.33.0", "0.32.0"]
    assert [v for v, r in by.items() if r.cache_key == "kernel_config"] == ["0.34.0", "0.33.0"]
    assert [v for v, r in by.items() if r.daemon == "module"] == ["0.30.0"]
    assert all(dict(r.layouts) == {"marlin": 1, "machete": 1, "marlin_moe": 1} for r in releases.RELEASES)


def test_supported_releases_and_the_one_line_for_others() -> None:
    assert releases.supported() == ("0.34.0", "0.33.0", "0.32.0", "0.31.0", "0.30.0")
    assert releases.release("0.34.0+cu130") is releases.RELEASES[0]
    assert releases.release("0.35.0") is None and releases.release("0.29.0") is None
    assert releases.unsupported_reason("0.35.0") == (
        "vLLM 0.35.0 is not a release marlin-pack supports (supported: 0.34.0, 0.33.0, 0.32.0, 0.31.0, 0.30.0)")


def test_a_release_listed_before_its_adapter_is_done_is_refused_like_an_unknown_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    table = tuple(replace(r, ready=False) if r.version == "0.32.0" else r for r in releases.RELEASES)
    monkeypatch.setattr(releases, "RELEASES", table)
    monkeypatch.setattr(releases, "_BY_VERSION", {r.version: r for r in table})
    assert releases.release("0.32.0") is None and "0.32.0" not in releases.supported()
    assert releases.release("0.31.0") is not None


def test_patch_rows_apply_to_the_releases_they_list() -> None:
    assert releases.applies("0.34.0", None, None) and releases.applies("0.30.0", None, None)
    assert releases.applies("0.33.0", "0.33.0", None) and not releases.applies("0.32.0", "0.33.0", None)
    assert releases.applies("0.31.0", None, "0.31.0") and not releases.applies("0.32.0", None, "0.31.0")
    with pytest.raises(KeyError):
        releases.applies("0.35.0", None, None)
    key = next(r for r in catalog.ROWS if r.target.endswith("WeightCacheKey.from_model_config"))
    assert key.applies_to("0.33.0") and key.applies_to("0.34.0") and not key.applies_to("0.32.0")  # kernel_config from 0.33
    with pytest.raises(KeyError):
        releases.applies("0.33.0", None, None, needs="no such feature")


@pytest.mark.parametrize(
    ("suffix", "releases_applied"),
    [
        ("WeightCacheKey.from_model_config", ["0.34.0", "0.33.0"]),  # takes kernel_config from 0.33 (TypeError before)
        ("WeightCacheDaemon.get_model", ["0.34.0", "0.33.0", "0.32.0", "0.31.0"]),  # 0.30: python -m ...daemon
        ("get_draft_daemon_config", ["0.34.0", "0.33.0", "0.32.0", "0.31.0"]),
        (":_run_daemon", ["0.34.0", "0.33.0", "0.32.0", "0.31.0"]),
        ("Worker.init_device", ["0.34.0", "0.33.0", "0.32.0"]),  # the memory hook that counts early helpers: 0.32+
        ("Worker.initialize_from_config", ["0.34.0", "0.33.0", "0.32.0"]),
        ("Worker.load_model", ["0.34.0", "0.33.0", "0.32.0", "0.31.0", "0.30.0"]),
    ],
)
def test_rows_that_need_a_feature_apply_where_the_release_has_it(suffix: str, releases_applied: list[str]) -> None:
    row = next(r for r in catalog.ROWS if r.target.endswith(suffix))
    assert [r.version for r in releases.RELEASES if row.applies_to(r.version)] == releases_applied
    # every row names releases of the table
    assert all(v is None or v in {r.version for r in releases.RELEASES} for row in catalog.ROWS for v in (row.first, row.last))


def test_bundles_are_accepted_by_layout_not_by_the_release_they_were_made_with(awq_bundle: Path) -> None:
    manifest = read_manifest(awq_bundle / "marlin-pack")
    assert manifest.target.vllm_version == "0.33.0" and bundle_layouts(manifest) == {"marlin": 1}
    for version in releases.supported():
        check_engine(manifest, EngineFacts(model=str(awq_bundle), vllm_version=version, quantization="auto_awq"))
    assert releases.serves("0.34.0", {"marlin": 1, "machete": 1, "marlin_moe": 1})
    assert not releases.serves("0.34.0", {"marlin": 2}) and not releases.serves("0.35.0", {"marlin": 1})


def test_an_unknown_release_is_refused_in_one_line_or_falls_back(awq_bundle: Path) -> None:
    facts = EngineFacts(model=str(awq_bundle), vllm_version="0.35.0", quantization="auto_awq")
    with pytest.raises(LoadRefusedError) as e:
        decide(LoaderOptions(), facts)
    text = str(e.value)
    assert "\n" not in text and e.value.field == "vllm_version"
    assert f"vLLM 0.35.0 is not a release marlin-pack supports (supported: {releases.supported_text()})" in text
    assert '"fallback": true' in text
    fallback = decide(LoaderOptions(fallback=True), facts)
    assert fallback.fallback and fallback.field == "vllm_version"
    with pytest.raises(BundleMismatchError, match="not a release"):  # before looking for a bundle
        decide(LoaderOptions(bundle=awq_bundle / "nowhere"), facts)


def _as(manifest: Manifest, architecture: str, transformers: str | None = None) -> Manifest:
    source = manifest.source.model_copy(update={"architecture": architecture})
    return manifest.model_copy(update={"source": source, "target": manifest.target.model_copy(update={"transformers": transformers})})


def test_gemma_loads_on_every_release_its_own_class_or_the_transformers_backend(awq_bundle: Path) -> None:
    """vLLM 0.34.0 serves GemmaForCausalLM through its Transformers backend, 0.30.0-0.33.0 with gemma.py: both build the
    same layers (the table's row serves both paths), so a Gemma bundle, made before the record existed too, loads on every
    release; through the backend only under a transformers its layout was checked against, refused in one line else."""
    manifest = read_manifest(awq_bundle / "marlin-pack")
    facts = {v: EngineFacts(model=str(awq_bundle), vllm_version=v, quantization="auto_awq", transformers_version="5.22.2")
             for v in releases.supported()}
    for gemma in (_as(manifest, "GemmaForCausalLM"), _as(manifest, "GemmaForCausalLM", "5.16-5.22")):
        for version in releases.supported():
            check_engine(gemma, facts[version])
    assert releases.serving_path("0.34.0", "GemmaForCausalLM") == "transformers"
    assert releases.serving_path("0.33.0", "GemmaForCausalLM") == "native"
    gemma = _as(manifest, "GemmaForCausalLM", "5.16-5.22")
    for installed in ("5.23.0", "5.15.2", None):
        with pytest.raises(BundleMismatchError) as e:
            check_engine(gemma, dataclasses.replace(facts["0.34.0"], transformers_version=installed))
        assert e.value.field == "transformers_version" and "\n" not in str(e.value)
        assert "the bundle holds the Transformers backend's layers as transformers 5.16-5.22 model them" in str(e.value)
        assert "pip install 'transformers>=5.16,<5.23'" in str(e.value)
        check_engine(gemma, dataclasses.replace(facts["0.33.0"], transformers_version=installed))  # gemma.py: no matter
    check_engine(manifest, dataclasses.replace(facts["0.34.0"], transformers_version=None))  # Llama: vLLM's own class


def test_a_transformers_backend_bundle_is_refused_where_a_release_builds_its_own_class(awq_bundle: Path) -> None:
    """GPT-NeoX: vLLM 0.30.0 and 0.31.0 build gpt_neox.py, whose layers are not the backend's; 0.32.0 on the backend."""
    neox = _as(read_manifest(awq_bundle / "marlin-pack"), "GPTNeoXForCausalLM", "5.16-5.22")
    for version in releases.supported():
        facts = EngineFacts(model=str(awq_bundle), vllm_version=version, quantization="auto_awq", transformers_version="5.20.2")
        if version in ("0.30.0", "0.31.0"):
            with pytest.raises(BundleMismatchError) as e:
                check_engine(neox, facts)
            assert e.value.field == "vllm_version" and "\n" not in str(e.value)
            assert str(e.value).endswith(
                f"vLLM {version} serves GPTNeoXForCausalLM with its own model class, whose layers differ from those of "
                "vLLM's Transformers backend the bundle holds; serve it with vLLM 0.34.0, 0.33.0, 0.32.0")
        else:
            check_engine(neox, facts)
    assert releases.served_natively("0.34.0", "GemmaForCausalLM") is not None  # a bundle of gemma.py's layers alone


def _registry_resolves(architecture: str) -> str | None:
    """What the installed vLLM's registry falls back to for an architecture it does not list, a plain checkpoint (no
    auto_map) under ``model_impl`` auto: its real ``_try_resolve_transformers`` (transformers' class present and
    ``is_backend_compatible()`` or ``_can_set_attn_implementation()``), the class named as a dense causal LM's
    (``ModelConfig._get_transformers_backend_cls``: ``TransformersForCausalLM``); None: no fallback."""
    from types import SimpleNamespace

    from vllm.model_executor.models import registry

    model_config = SimpleNamespace(hf_config=SimpleNamespace(), model_impl="auto", model="/models/m", revision=None,
                                   code_revision=None, trust_remote_code=False,
                                   _get_transformers_backend_cls=lambda: "TransformersForCausalLM")
    return registry.ModelRegistry._try_resolve_transformers(architecture, model_config)


def test_a_bundle_whose_checkpoint_only_the_backend_loads_is_refused_where_the_release_builds_its_own_class(
    awq_bundle: Path,
) -> None:
    """Olmoe's row serves both paths (olmoe.py builds the backend's layers), but olmoe.py maps experts named
    gate_proj/up_proj/down_proj only: a bundle of a checkpoint naming them w1/w3/w2 records the backend as its only path
    (``target.paths``) and loads on 0.34.0 alone; older releases refuse it in one line naming why."""
    manifest = _as(read_manifest(awq_bundle / "marlin-pack"), "OlmoeForCausalLM", "5.16-5.22")
    w_named = manifest.model_copy(update={"target": manifest.target.model_copy(update={"paths": ("transformers",)})})
    for version in releases.supported():
        facts = EngineFacts(model=str(awq_bundle), vllm_version=version, quantization="auto_awq", transformers_version="5.20.2")
        check_engine(manifest, facts)  # gate_proj/up_proj/down_proj: every release
        if version == "0.34.0":
            check_engine(w_named, facts)
            continue
        with pytest.raises(BundleMismatchError) as e:
            check_engine(w_named, facts)
        assert e.value.field == "vllm_version" and "\n" not in str(e.value)
        assert str(e.value).endswith(
            f"vLLM {version} serves OlmoeForCausalLM with its own model class, which does not load the experts named "
            "mlp.experts.N.{w1,w3,w2} of the checkpoint the bundle was made from (only vLLM's Transformers backend does); "
            "serve it with vLLM 0.34.0")
    # the record round-trips, and a bundle without it keeps its bytes
    assert Manifest.model_validate_json(w_named.to_json()).target.paths == ("transformers",)
    assert '"paths"' not in manifest.to_json()


def test_the_transformers_backend_column_is_what_each_release_registers() -> None:
    """Read from the installed vLLM's registry where it is one of the table's releases: every architecture of marlin-pack's
    table is served by vLLM's own class unless the entry lists it (through the backend by a registry entry, through the
    backend by the registry's fallback to transformers' class, or not served at all), and the entry names the
    transformers installed."""
    import transformers
    from vllm.model_executor.models import registry

    from marlin_pack.marlin.architectures import SUPPORTED_ARCHITECTURES
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    entry = releases.release(vllm_version())
    assert entry is not None

    tables = [getattr(registry, n) for n in dir(registry) if n.startswith("_") and n.endswith("_MODELS")]
    tables = [t for t in tables if isinstance(t, dict)]
    through_backend = {a for a in SUPPORTED_ARCHITECTURES if any(t.get(a, (None,))[0] == "transformers" for t in tables)}
    listed_by_none = {a for a in SUPPORTED_ARCHITECTURES if not any(a in t for t in tables)}
    assert not registry.ModelRegistry.models.keys() & listed_by_none
    assert through_backend == set(entry.transformers_backend)
    # an architecture no registry table lists: served through the backend where transformers has a compatible class
    # (the registry's fallback), by nothing where it has none (Kolibri 1 before transformers 5.20)
    assert listed_by_none == entry.unregistered | entry.backend_fallback
    assert not entry.unregistered & entry.backend_fallback
    for a in entry.backend_fallback:
        cls = getattr(transformers, a, None)
        assert cls is not None, f"transformers {transformers.__version__} has no {a}"
        assert cls.is_backend_compatible() or cls._can_set_attn_implementation(), a
        assert _registry_resolves(a) == "TransformersForCausalLM", a
        assert releases.serving_path(entry.version, a) == "transformers" and releases.via_fallback(entry.version, a)
    for a in entry.unregistered:
        assert not hasattr(transformers, a) and _registry_resolves(a) is None, a
        assert releases.serving_path(entry.version, a) == "unregistered"
    assert not [a for a in through_backend if releases.via_fallback(entry.version, a)]
    # the refused architectures whose one line says the registry falls back to the backend for them: so it does
    from marlin_pack.marlin.architectures import UNSUPPORTED_ARCHITECTURES

    refused = [a for a, why in UNSUPPORTED_ARCHITECTURES.items() if why.startswith("vLLM's registry lists no such")]
    assert len(refused) >= 4 and not registry.ModelRegistry.models.keys() & set(refused)
    assert [a for a in refused if _registry_resolves(a) is None] == []
    # the environment's transformers (tools/vllm-env.sh resolves the release's pin) is one the backend rows were checked
    # against; the entry names the one its oracles ran with
    from marlin_pack.marlin.transformers_backend import CHECKED_TRANSFORMERS

    assert releases.transformers_problem(CHECKED_TRANSFORMERS, transformers.__version__) is None
    assert transformers.__version__.split(".")[:2] == entry.transformers.split(".")[:2]


def test_the_table_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys\nimport marlin_pack.vllm_plugin.releases, marlin_pack.vllm_plugin.patches.catalog\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')], 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_on_a_release_not_served_the_load_format_refuses_in_one_line_or_loads_ordinarily(
    monkeypatch: pytest.MonkeyPatch, marlin_log: list[str]
) -> None:
    """The loader registered where the running release has no entry: it imports nothing of marlin-pack's vLLM internals,
    refuses before building anything, and with ``fallback`` hands the whole load to vLLM's DefaultModelLoader."""
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import marlin_pack.vllm_plugin.version_guard as guard
    from marlin_pack.vllm_plugin.unserved import UnservedReleaseLoader

    monkeypatch.setattr(guard, "vllm_version", lambda: "0.35.0")
    calls: list[str] = []
    monkeypatch.setattr(DefaultModelLoader, "load_model", lambda self, **kw: calls.append("load") or "model")
    model_config = SimpleNamespace(model="/models/m")
    loader = UnservedReleaseLoader(LoadConfig(load_format="marlin_prepacked"))
    with pytest.raises(LoadRefusedError) as e:
        loader.load_model(None, model_config)
    assert str(e.value) == (
        "marlin-pack cannot serve /models/m: [vllm_version] vLLM 0.35.0 is not a release marlin-pack supports (supported: "
        "0.34.0, 0.33.0, 0.32.0, 0.31.0, 0.30.0). Install one of them, or pass --model-loader-extra-config "
        "'{\"fallback\": true}' to load the checkpoint the ordinary way."
    )
    assert calls == []
    loader = UnservedReleaseLoader(LoadConfig(load_format="marlin_prepacked", model_loader_extra_config={"fallback": True}))
    assert loader.load_model(None, model_config) == "model" and calls == ["load"]
    assert any("vLLM 0.35.0 is not a release marlin-pack supports" in m and "ordinary way" in m for m in marlin_log)
