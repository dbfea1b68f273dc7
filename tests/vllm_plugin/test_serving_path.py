"""``marlin-pack check`` and the loader's decision say which path a release takes for a model: vLLM's own class, or its
Transformers backend (``releases.serving_path``), and refuse a bundle whose layers are the other path's (pure, no vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from marlin_pack import convert
from marlin_pack.cli import app
from marlin_pack.vllm_plugin import preflight as preflight_module
from marlin_pack.vllm_plugin.preflight import preflight

pytest.importorskip("transformers")
from arch_checkpoints import write_arch_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_arch_checkpoint(tmp_path_factory.mktemp("olmo2") / "m", "Olmo2ForCausalLM", "gptq", group_size=32,
                                  dtype=torch.bfloat16)
    convert(model, tp=(1,))
    return model


@pytest.fixture(scope="module")
def neox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = write_arch_checkpoint(tmp_path_factory.mktemp("neox") / "m", "GPTNeoXForCausalLM", "awq", group_size=32,
                                  dtype=torch.float16)
    convert(model, tp=(1,))
    return model


def test_check_names_the_transformers_backend_and_its_transformers(olmo2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_module, "_installed", lambda name: "5.22.2")
    report = preflight(olmo2, vllm_version="0.34.0", dtype="bfloat16")
    assert report.decision == "load", report.first_problem
    assert report.path == "transformers"
    assert report.path_text == "Olmo2ForCausalLM: vLLM 0.34.0 builds it through its Transformers backend (transformers 5.22.2)"
    assert report.to_dict()["serving_path"] == "transformers" and report.to_dict()["architecture"] == "Olmo2ForCausalLM"
    r = CliRunner().invoke(app, ["check", str(olmo2), "--dtype", "bfloat16"])
    assert "Olmo2ForCausalLM: vLLM" in r.output and "builds it through its Transformers backend" in r.output


def test_a_transformers_outside_the_checked_range_is_refused_in_one_line(olmo2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_module, "_installed", lambda name: "5.23.0")
    report = preflight(olmo2, vllm_version="0.34.0", dtype="bfloat16")
    problem = report.first_problem
    assert report.decision == "refuse" and problem is not None and problem.field == "transformers_version"
    assert "\n" not in problem.message and '{"fallback": true}' in problem.message
    assert "transformers 5.23.0 is installed; the bundle holds the Transformers backend's layers as transformers 5.16-5.22" \
        in problem.message
    fallback = preflight(olmo2, vllm_version="0.34.0", dtype="bfloat16", fallback=True)
    assert fallback.decision == "fallback"


def test_a_release_building_its_own_class_refuses_the_backend_bundle(neox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_module, "_installed", lambda name: "5.16.1")
    report = preflight(neox, vllm_version="0.30.0", dtype="float16")
    problem = report.first_problem
    assert report.path == "native" and report.path_text == "GPTNeoXForCausalLM: vLLM 0.30.0 builds it with its own model class"
    assert report.decision == "refuse" and problem is not None and problem.field == "vllm_version"
    assert ("vLLM 0.30.0 serves GPTNeoXForCausalLM with its own model class, whose layers differ from those of vLLM's "
            "Transformers backend the bundle holds; serve it with vLLM 0.34.0, 0.33.0, 0.32.0") in problem.message
    assert preflight(neox, vllm_version="0.32.0", dtype="float16").decision == "load"


def test_a_model_of_vllm_s_own_class_names_it(make_bundle, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(preflight_module, "_installed", lambda name: None)  # no transformers: nothing to check
    model = make_bundle("gptq", "tiny")
    report = preflight(model, vllm_version="0.34.0")
    assert report.decision == "load" and report.path == "native"
    assert report.path_text == "LlamaForCausalLM: vLLM 0.34.0 builds it with its own model class (llama.LlamaForCausalLM)"


def test_check_says_an_architecture_no_registry_lists_goes_through_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HeliumForCausalLM: no release's registry lists it, every one serves transformers' class through its backend (the
    registry's fallback); check says so, and the bundle loads on every release."""
    from marlin_pack.vllm_plugin import releases

    model = write_arch_checkpoint(tmp_path / "m", "HeliumForCausalLM", "awq", group_size=32, dtype=torch.bfloat16)
    manifest = convert(model, tp=(1,)).manifest
    assert manifest.target.transformers == "5.16-5.22"
    monkeypatch.setattr(preflight_module, "_installed", lambda name: "5.20.2")
    for version in releases.supported():
        report = preflight(model, vllm_version=version, dtype="bfloat16")
        assert report.decision == "load", report.first_problem
        assert report.path == "transformers" and report.to_dict()["serving_path"] == "transformers"
        assert report.path_text == (
            f"HeliumForCausalLM: vLLM {version} builds it through its Transformers backend (transformers 5.20.2): its "
            "model registry lists no such architecture, so vLLM takes transformers' class")
    monkeypatch.setattr(preflight_module, "_installed", lambda name: "5.23.0")  # the backend's layers: checked range only
    refused = preflight(model, vllm_version="0.34.0", dtype="bfloat16").first_problem
    assert refused is not None and refused.field == "transformers_version"
