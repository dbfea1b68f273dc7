"""What a new user meets first, said precisely: an unquantized, GGUF or other-method checkpoint says it has nothing to
convert and what to do instead; a model without its bundle names the command that writes it (never a MODEL_DIR
placeholder); a model id missing from the hub's cache says why it was not fetched (HF_HUB_OFFLINE only when set)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlin_pack.cli import app
from marlin_pack.remedies import convert_command

runner = CliRunner()


@pytest.fixture
def unquantized(tmp_path: Path) -> Path:
    from marlin_pack.testing.synthetic import PRESETS, write_unquantized_checkpoint

    return write_unquantized_checkpoint(tmp_path / "plain", PRESETS["tiny"], tokenizer=False)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    d = tmp_path / "gguf"
    d.mkdir()
    (d / "model-Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return d


def _error(r) -> str:  # type: ignore[no-untyped-def]
    assert r.exit_code == 1 and r.exception is not None, r.output
    return str(r.exception)


def test_an_unquantized_checkpoint_has_nothing_to_convert_and_says_what_to_do(unquantized: Path) -> None:
    said = "the checkpoint is not quantized, so it has no bundle"
    advice = "serve this one with vLLM as it is (no --load-format marlin_prepacked), or use an AWQ or GPTQ checkpoint"
    message = _error(runner.invoke(app, ["convert", str(unquantized)]))
    assert said in message and advice in message, message
    for command in ("verify", "inspect"):
        message = _error(runner.invoke(app, [command, str(unquantized)]))
        assert message.startswith(f"no bundle at {unquantized}/marlin-pack: {unquantized} cannot have one: "), message
        assert said in message and "MODEL_DIR" not in message, message
    r = runner.invoke(app, ["check", str(unquantized)])
    assert r.exit_code == 1 and "MODEL_DIR" not in r.stdout, r.stdout
    assert f"why: {unquantized} cannot have a bundle: " in r.stdout and said in r.stdout, r.stdout


def test_a_gguf_checkpoint_says_vllm_loads_it_itself(gguf: Path) -> None:
    message = _error(runner.invoke(app, ["convert", str(gguf)]))
    assert message.startswith(f"{gguf} holds GGUF weights (model-Q4_K_M.gguf), no *.safetensors files;"), message
    assert f"vLLM loads GGUF itself (`vllm serve {gguf}/model-Q4_K_M.gguf`)" in message
    message = _error(runner.invoke(app, ["convert", str(gguf / "model-Q4_K_M.gguf")]))
    assert message.startswith(f"{gguf}/model-Q4_K_M.gguf is a GGUF file;") and "vLLM loads GGUF itself" in message, message
    message = _error(runner.invoke(app, ["verify", str(gguf)]))
    assert f"{gguf} cannot have one: {gguf} holds GGUF weights" in message, message


def test_another_quantization_method_says_what_to_do(make_checkpoint, tmp_path: Path) -> None:
    d = tmp_path / "fp8"
    shutil.copytree(make_checkpoint("awq"), d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (d / "config.json").write_text(json.dumps(config))
    message = _error(runner.invoke(app, ["convert", str(d)]))
    assert message.startswith("quant_method is 'fp8', expected 'awq', 'gptq' or 'compressed-tensors'"), message
    assert "serve it with vLLM as it is (no --load-format marlin_prepacked)" in message


def test_a_model_without_its_bundle_names_the_command_that_writes_it(make_checkpoint, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(make_checkpoint("awq"), d)
    for command in ("verify", "inspect"):
        message = _error(runner.invoke(app, [command, str(d)]))
        assert message == f"no bundle at {d}/marlin-pack: run `marlin-pack convert {d}` first", message
    r = runner.invoke(app, ["check", str(d)])
    assert r.exit_code == 1 and f"run `marlin-pack convert {d}` first" in r.stdout and "MODEL_DIR" not in r.stdout, r.stdout
    assert "why:" not in r.stdout  # convertible: the refusal's command is the advice


def test_the_convert_command_is_read_off_the_bundles_place() -> None:
    assert convert_command("/models/m/marlin-pack") == "marlin-pack convert /models/m"
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert convert_command(f"/c/models--acme--m-AWQ/{commit}", tp_sizes=[2, 1]) == (
        f"marlin-pack convert acme/m-AWQ --revision {commit} --tp 1,2")
    assert convert_command("/vol/my bundle") == "marlin-pack convert MODEL --output '/vol/my bundle'"
    assert convert_command("/b", model="/m") == "marlin-pack convert /m --output /b"


def test_a_model_id_missing_from_the_cache_says_why_it_was_not_fetched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    from marlin_pack.errors import CheckpointError
    from marlin_pack.sources.hub import resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(CheckpointError) as e:
        resolve_model("acme/missing", download=False)  # what check, verify and inspect do: read the cache only
    assert "HF_HUB_OFFLINE" not in str(e.value), e.value
    assert "which this step only reads; `marlin-pack convert acme/missing` downloads and converts it" in str(e.value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="and HF_HUB_OFFLINE is set; download it once .*unset HF_HUB_OFFLINE"):
        resolve_model("acme/missing")


def test_the_advised_command_is_whole_and_mends_the_bundle(make_checkpoint, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged bundle file: check refuses naming the whole command (model, TP sizes, dtype, kernel; no --force: convert heals),
    and running exactly that command makes check load again."""
    import re
    import shlex

    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    d = tmp_path / "m"
    shutil.copytree(make_checkpoint("awq"), d)
    assert runner.invoke(app, ["convert", str(d), "--tp", "1,2", "--kernel", "marlin"]).exit_code == 0
    rank = d / "marlin-pack" / "tp2" / "rank-1.safetensors"
    data = bytearray(rank.read_bytes())
    data[-3] ^= 1
    rank.write_bytes(bytes(data))
    r = runner.invoke(app, ["check", str(d), "-tp", "2", "--verify", "full", "--compute-capability", "8.0"])
    assert r.exit_code == 1 and "refuse" in r.stdout, r.stdout
    advised = re.search(r"re-run `(marlin-pack convert [^`]*)`", r.stdout)
    assert advised is not None and advised[1] == f"marlin-pack convert {d} --tp 1,2 --dtype float16 --kernel marlin", r.stdout
    r = runner.invoke(app, shlex.split(advised[1])[1:])
    assert r.exit_code == 0 and "rewrote tp2" in r.stdout, r.output
    assert runner.invoke(app, ["check", str(d), "-tp", "2", "--verify", "full", "--compute-capability", "8.0"]).exit_code == 0
