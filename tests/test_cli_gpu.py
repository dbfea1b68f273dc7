"""The GPU a bundle is for: `convert --compute-capability X.Y` takes that GPU's kernel layout (SM90: Machete where vLLM
gives a layer Machete; else Marlin) and says which and why; `check` says when it could not check the kernel fit; one
spelling of a compute capability (9.0), the others refused naming the one meant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.commands.console import BadParameter
from marlin_pack.commands.gpu import parse_capability

runner = CliRunner()


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("marlin_pack.kernel_choice.visible_gpu", lambda: None)


@pytest.fixture
def ckpt(make_checkpoint, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("awq", "tiny"), d)
    return d


@pytest.mark.parametrize("text, value", [("9.0", 90), ("8.0", 80), ("8.6", 86), ("8.9", 89), ("7.5", 75), ("12.0", 120), (" 9.0 ", 90)])
def test_a_compute_capability_is_major_dot_minor(text: str, value: int) -> None:
    assert parse_capability(text) == value


@pytest.mark.parametrize("text, meant", [
    ("80", "for SM80 pass --compute-capability 8.0"),  # once read as 80.0, a GPU that does not exist
    ("90", "for SM90 pass --compute-capability 9.0"),
    ("sm_90", "for SM90 pass --compute-capability 9.0"),
    ("sm90a", "for SM90 pass --compute-capability 9.0"),
    ("9", "for SM90 pass --compute-capability 9.0"),
    ("120", "for SM120 pass --compute-capability 12.0"),
    ("hopper", ""), ("9.0.1", ""), ("9.", ""), (".9", ""), ("9,0", ""),
])
def test_other_spellings_are_refused_naming_the_one_meant(text: str, meant: str) -> None:
    with pytest.raises(BadParameter, match=r"expected MAJOR\.MINOR as nvidia-smi --query-gpu=compute_cap prints it") as e:
        parse_capability(text)
    assert (meant in str(e.value.message)) and (meant != "" or "pass" not in str(e.value.message)), e.value.message


@pytest.mark.parametrize("command", ["convert", "check"])
def test_an_ambiguous_capability_is_a_usage_error_before_any_work(command: str, ckpt: Path) -> None:
    r = runner.invoke(app, [command, str(ckpt), "--compute-capability", "80"])
    assert r.exit_code == 2 and "'80': expected MAJOR.MINOR" in r.output and "pass --compute-capability 8.0" in r.output, r.output
    assert not (ckpt / "marlin-pack").exists()


def _kernels(bundle: Path) -> set[str]:
    from marlin_pack.bundle.reader import read_manifest

    return {e.kernel.value for s in read_manifest(bundle).tensor_parallel for e in s.layers}


def test_convert_for_a_named_hopper_gpu_writes_machete_and_says_why(no_gpu: None, ckpt: Path) -> None:
    r = runner.invoke(app, ["convert", str(ckpt), "--compute-capability", "9.0", "--tp", "1,2"])  # the deployment recipes' words
    assert r.exit_code == 0, r.output
    assert _kernels(ckpt / "marlin-pack") == {"machete"}
    assert ("marlin-pack: --kernel machete: --compute-capability 9.0 (SM90): vLLM serves these layers with Machete where it "
            "implements them, Marlin elsewhere") in r.output, r.output


@pytest.mark.parametrize("cc", ["8.0", "8.9", "12.0"])
def test_convert_for_another_named_gpu_writes_marlin_and_says_why(no_gpu: None, ckpt: Path, cc: str) -> None:
    r = runner.invoke(app, ["convert", str(ckpt), "--compute-capability", cc])
    assert r.exit_code == 0, r.output
    assert _kernels(ckpt / "marlin-pack") == {"marlin"}
    sm = cc.replace(".", "")
    assert f"marlin-pack: --kernel marlin: --compute-capability {cc} (SM{sm}): vLLM serves these layers with Marlin" in r.output


def test_the_named_gpu_wins_over_the_visible_one(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    monkeypatch.setattr("marlin_pack.kernel_choice.visible_gpu", lambda: ("NVIDIA A100-SXM4-80GB", 80))
    r = runner.invoke(app, ["convert", str(ckpt), "--compute-capability", "9.0", "--json"])
    assert r.exit_code == 0 and _kernels(ckpt / "marlin-pack") == {"machete"}, r.output


def test_convert_with_no_gpu_visible_or_named_says_how_to_name_one(no_gpu: None, ckpt: Path) -> None:
    r = runner.invoke(app, ["convert", str(ckpt)])
    assert r.exit_code == 0 and _kernels(ckpt / "marlin-pack") == {"marlin"}, r.output
    assert "marlin-pack: --kernel marlin: no GPU visible and none named" in r.output
    assert "for H100/H200 engines pass --compute-capability 9.0" in r.output


def test_machete_for_a_named_gpu_other_than_sm90_is_refused(no_gpu: None, ckpt: Path) -> None:
    r = runner.invoke(app, ["convert", str(ckpt), "--kernel", "machete", "--compute-capability", "8.6"])
    assert r.exit_code == 2 and "--kernel machete for --compute-capability 8.6 (SM86)" in r.output, r.output
    assert not (ckpt / "marlin-pack").exists()


def test_machete_converted_on_another_gpu_for_hopper_engines_is_fine(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    monkeypatch.setattr("marlin_pack.kernel_choice.visible_gpu", lambda: ("NVIDIA A100-SXM4-80GB", 80))
    r = runner.invoke(app, ["convert", str(ckpt), "--kernel", "machete"])
    assert r.exit_code == 0 and _kernels(ckpt / "marlin-pack") == {"machete"}, r.output


def test_marlin_named_for_hopper_is_written_and_says_what_it_costs(no_gpu: None, ckpt: Path) -> None:
    r = runner.invoke(app, ["convert", str(ckpt), "--kernel", "marlin", "--compute-capability", "9.0"])
    assert r.exit_code == 0 and _kernels(ckpt / "marlin-pack") == {"marlin"}, r.output
    assert "--kernel marlin for --compute-capability 9.0 (SM90): loads there with Marlin forced" in r.output


def test_check_says_plainly_when_it_could_not_check_the_kernel_fit(no_gpu: None, make_bundle) -> None:
    d = make_bundle("awq", "tiny", kernel="machete")
    r = runner.invoke(app, ["check", str(d)])
    assert r.exit_code == 0 and "rank 0/1: load" in r.stdout, r.output
    assert ("kernel fit not checked: no GPU is visible here and none was named; pass --compute-capability X.Y for the "
            "engine's GPU") in r.stdout, r.stdout
    data = json.loads(runner.invoke(app, ["check", str(d), "--json"]).stdout)
    assert data["kernel_fit_checked"] is False and data["gpu"] is None
    r = runner.invoke(app, ["check", str(d), "--compute-capability", "9.0"])
    assert r.exit_code == 0 and "not checked" not in r.stdout and "on MacheteLinearKernel" in r.stdout, r.output
    data = json.loads(runner.invoke(app, ["check", str(d), "--compute-capability", "9.0", "--json"]).stdout)
    assert data["kernel_fit_checked"] is True and data["gpu"] == {"compute_capability": "9.0", "named": True, "name": None}
    r = runner.invoke(app, ["check", str(d), "--compute-capability", "8.0"])
    assert r.exit_code == 1 and "refuse" in r.stdout and "not checked" not in r.stdout, r.output


def test_check_on_a_machine_with_a_gpu_checks_for_it(monkeypatch: pytest.MonkeyPatch, make_bundle) -> None:
    monkeypatch.setattr("marlin_pack.kernel_choice.visible_gpu", lambda: ("NVIDIA A100-SXM4-80GB", 80))
    d = make_bundle("awq", "tiny", kernel="machete")
    r = runner.invoke(app, ["check", str(d), "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and data["decision"] == "refuse" and data["gpu"]["named"] is False, r.output
    assert data["gpu"] == {"compute_capability": "8.0", "named": False, "name": "NVIDIA A100-SXM4-80GB"}
