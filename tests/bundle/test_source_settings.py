"""The manifest records the quantization settings that decide a bundle, not the whole quantization_config.

Quantizers store calibration data, temporary paths, dates and tool versions there: none of it goes
into the manifest, and changing it does not make a bundle stale. Changing a setting that decides the
bundle (or what vLLM reads) does, in verify, ``marlin-pack check`` and the loader alike. Bundles of
format version 1 (which embedded the whole config) are refused with a one-line upgrade message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marlin_pack import convert, verify
from marlin_pack._constants import FORMAT_VERSION, READABLE_FORMAT_VERSIONS
from marlin_pack.vllm_plugin.preflight import preflight

# Modelled on real checkpoints: optimum keeps its calibration dataset (here ~20 KB of text),
# GPTQModel a meta block with its version and a temporary path, others a date.
JUNK = {
    "dataset": [f"calibration sample {i}: " + "the quick brown fox jumps over the lazy dog " * 22 for i in range(20)],
    "meta": {"quantizer": ["gptqmodel:1.4.0"], "uri": "https://github.com/modelcloud/gptqmodel", "damp_auto_increment": 0.0025},
    "tmp_dir": "/tmp/gptqmodel-3f9c2a/quantize",
    "quantized_at": "2025-03-01T12:00:00Z",
    "damp_percent": 0.01,
}


def _with_junk(edit_config, model: Path) -> None:
    edit_config(model, **{f"q_{k}": v for k, v in JUNK.items()})


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_manifest_holds_no_calibration_data_or_paths(fmt: str, make_bundle, damaged_copy, edit_config) -> None:
    clean = make_bundle(fmt)
    model = damaged_copy(clean, lambda d: _with_junk(edit_config, d))
    assert len(json.dumps(json.loads((model / "config.json").read_text()))) > 20_000
    convert(model, force=True)
    text = (model / "marlin-pack/manifest.json").read_text()
    assert "calibration sample" not in text and "/tmp/gptqmodel" not in text and "gptqmodel:1.4.0" not in text
    # Same weights, same settings: the very manifest of the checkpoint without the junk.
    assert text == (clean / "marlin-pack/manifest.json").read_text()
    source = json.loads(text)["source"]
    assert source["quant_settings"]["quant_method"] == fmt and source["quant_settings_file"] == "config.json"
    assert "quantization_config" not in source and len(json.dumps(source["quant_settings"])) < 300


def _edit_quantization_config(model: Path, edit) -> None:
    cfg = json.loads((model / "config.json").read_text())
    edit(cfg["quantization_config"])
    (model / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit",
    [
        lambda qc: [qc.pop(k) for k in JUNK],
        lambda qc: qc.update(dataset=["another calibration text"], tmp_dir="/tmp/elsewhere", quantized_at="2026-01-01", damp_percent=0.1),
        lambda qc: qc.update(true_sequential=False, model_seqlen=4096, tokenizer=None),
        lambda qc: qc.update(quant_method="GPTQ", checkpoint_format="GPTQ"),  # the same settings, read case-insensitively
    ],
    ids=["removed", "changed", "added", "case"],
)
def test_irrelevant_change_keeps_the_bundle(edit, make_bundle, damaged_copy, edit_config) -> None:
    model = damaged_copy(make_bundle("gptq"), lambda d: _with_junk(edit_config, d))
    convert(model, force=True)
    _edit_quantization_config(model, edit)
    report = verify(model / "marlin-pack")
    assert report.ok, report.first_failure
    assert preflight(model).decision == "load"


@pytest.mark.parametrize(
    "fmt,changes,message",
    [
        ("awq", {"q_zero_point": False}, "zero_point is false, the bundle was made with true"),
        ("awq", {"q_bits": 8}, "bits is 8, the bundle was made with 4"),
        ("awq", {"q_w_bit": 8}, "bits is 8, the bundle was made with 4"),  # vLLM reads w_bit first
        ("awq", {"q_group_size": 64}, "group_size is 64, the bundle was made with 128"),
        ("awq", {"q_version": "gemv"}, 'version is "gemv", the bundle was made with "gemm"'),
        ("awq", {"q_modules_to_not_convert": ["mlp"]}, 'modules_to_not_convert is ["mlp"], the bundle was made with []'),
        ("awq", {"q_dynamic": {"-:.*mlp.*": {}}}, "dynamic is true, the bundle was made with false"),
        ("awq", {"q_quant_method": "gptq"}, 'quant_method is "gptq", the bundle was made with "awq"'),
        ("gptq", {"q_sym": False}, "sym is false, the bundle was made with true"),
        ("gptq", {"q_desc_act": True}, "desc_act is true, the bundle was made with false"),
        ("gptq", {"q_bits": 8}, "bits is 8, the bundle was made with 4"),
        ("gptq", {"q_checkpoint_format": "gptq_v2"}, 'checkpoint_format is "gptq_v2", the bundle was made with "gptq"'),
        ("gptq", {"q_lm_head": True}, "lm_head is true, the bundle was made with false"),
        ("gptq", {"q_modules_in_block_to_quantize": [["self_attn.q_proj"]]}, 'modules_in_block_to_quantize is ["self_attn.q_proj"]'),
    ],
)
def test_relevant_change_makes_the_bundle_stale(fmt: str, changes: dict, message: str, make_bundle, damaged_copy, edit_config) -> None:
    model = damaged_copy(make_bundle(fmt))
    edit_config(model, **changes)
    report = verify(model / "marlin-pack")
    failed = report.first_failure
    assert failed is not None and failed.name == "source"
    assert f"{model / 'config.json'}: quantization setting {message}" in failed.detail
    # the whole command, with the bundle's settings: it rewrites a stale bundle (no --force: convert heals)
    assert f"re-run `marlin-pack convert {model} --tp 1 --dtype float16 --kernel marlin`" in failed.detail
    outcome = preflight(model).ranks[0]
    assert outcome.decision == "refuse" and outcome.field == "source.quant_settings" and message in outcome.message


def test_malformed_setting_makes_the_bundle_stale(make_bundle, damaged_copy, edit_config) -> None:
    model = damaged_copy(make_bundle("awq"))
    edit_config(model, q_bits="4")
    outcome = preflight(model).ranks[0]
    assert outcome.field == "source.quant_settings" and "quantization_config bits is '4', expected an integer" in outcome.message


def test_settings_moved_to_another_file_make_the_bundle_stale(make_bundle, damaged_copy) -> None:
    # GPTQ checkpoints keep a copy in quantize_config.json; vLLM reads it only without config.json's.
    model = damaged_copy(make_bundle("gptq"))
    cfg = json.loads((model / "config.json").read_text())
    del cfg["quantization_config"]
    (model / "config.json").write_text(json.dumps(cfg))
    outcome = preflight(model).ranks[0]
    assert outcome.field == "source.quant_settings"
    assert "quantization settings are in quantize_config.json, the bundle was made from config.json's" in outcome.message


# --- bundles of format version 1 -----------------------------------------------------------


def _as_version_1(model: Path) -> None:
    """Rewrite the manifest as marlin-pack with format version 1 wrote it (the whole quantization_config inside)."""
    path = model / "marlin-pack/manifest.json"
    m = json.loads(path.read_text())
    source = m["source"]
    del source["quant_settings"], source["quant_settings_file"]
    source["quantization_config"] = json.loads((model / "config.json").read_text())["quantization_config"]
    source["quantization_config_sha256"] = "0" * 64
    m["format_version"] = 1
    path.write_text(json.dumps(m, indent=2, sort_keys=True))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_version_1_bundle_gets_a_one_line_upgrade_message(make_bundle, damaged_copy) -> None:
    model = damaged_copy(make_bundle("awq"), _as_version_1)
    bundle = model / "marlin-pack"
    advice = (
        "has format_version 1, this marlin-pack reads formats 3 to 5 (made by an older marlin-pack); "
        f"re-convert it with `marlin-pack convert {model} --force`"
    )
    for args in (["verify", str(bundle)], ["inspect", str(bundle)]):
        r = _cli(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        error = r.stderr.splitlines()[0]
        assert error.startswith("error: ") and advice in error, r.stderr
    r = _cli("check", str(model))
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "refuse" in lines[0] and "[format_version]" in lines[0] and advice in lines[0], r.stdout
    # The advice works, and convert needs no --force for it: a bundle of an older format version is rewritten.
    r = _cli("convert", str(model), "--kernel", "marlin")
    assert r.returncode == 0 and "made by an older marlin-pack (format_version 1)" in r.stdout, r.stdout + r.stderr
    assert verify(bundle).ok and json.loads((bundle / "manifest.json").read_text())["format_version"] == FORMAT_VERSION
    assert _cli("convert", str(model), "--force").returncode == 0


def test_force_still_refuses_to_replace_foreign_files_beside_an_old_bundle(make_bundle, damaged_copy) -> None:
    from marlin_pack.errors import OutputExistsError

    model = damaged_copy(make_bundle("awq"), _as_version_1)
    (model / "marlin-pack/notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"it holds notes.txt, which no conversion writes"):
        convert(model, force=True)


def test_bundle_elsewhere_names_the_output_option(make_bundle, tmp_path: Path) -> None:
    import shutil

    from marlin_pack.bundle.reader import read_manifest
    from marlin_pack.errors import BundleMismatchError

    elsewhere = tmp_path / "bundles/llama"
    shutil.copytree(make_bundle("awq") / "marlin-pack", elsewhere)
    m = json.loads((elsewhere / "manifest.json").read_text())
    newer = max(READABLE_FORMAT_VERSIONS) + 1
    (elsewhere / "manifest.json").write_text(json.dumps({**m, "format_version": newer}))
    with pytest.raises(BundleMismatchError, match=rf"format_version {newer}, .* \(not a format this marlin-pack knows") as e:
        read_manifest(elsewhere)
    assert f"`marlin-pack convert MODEL --output {elsewhere} --force`" in str(e.value)
