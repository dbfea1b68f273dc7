"""The CLI: exit codes, one-line errors, JSON output, and no vLLM import."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlin_pack.cli import app

runner = CliRunner()


def _ckpt(make_checkpoint, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("awq", "tiny", group_size=32), d)
    return d


def test_convert_verify_inspect_json(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    r = runner.invoke(app, ["convert", str(d), "--tp", "1,2", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["manifest"]["quant"]["weight_type"] == "uint4"
    assert [s["tp_size"] for s in data["manifest"]["tensor_parallel"]] == [1, 2]
    r = runner.invoke(app, ["verify", str(d / "marlin-pack"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
    r = runner.invoke(app, ["inspect", str(d / "marlin-pack")])
    assert r.exit_code == 0 and "uint4" in r.stdout and "padded layers" in r.stdout


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_bad_input_is_one_line_exit_1(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    r = _run("convert", str(tmp_path))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "no *.safetensors files" in r.stderr


@pytest.mark.slow
def test_verify_failure_exit_1(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    assert _run("convert", str(d)).returncode == 0
    f = d / "marlin-pack" / "common.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    r = _run("verify", str(d / "marlin-pack"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "verify failed at files: bundle file common.safetensors has blake3" in r.stderr


def test_cli_does_not_import_vllm_or_torch_for_help() -> None:
    code = "import sys; from marlin_pack.cli import app; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_convert_path_never_imports_vllm(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    code = (
        "import sys; from marlin_pack.cli import main; sys.argv=['marlin-pack','convert',sys.argv[1]];\n"
        "try: main()\nexcept SystemExit: pass\nprint('VLLM', 'vllm' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert "VLLM False" in r.stdout, r.stderr


@pytest.mark.slow
def test_verify_exit_code_contract(make_checkpoint, tmp_path: Path) -> None:
    # Exit 0 only when every check ran: a bundle away from its checkpoint needs --source or --integrity-only.
    d = _ckpt(make_checkpoint, tmp_path)
    assert _run("convert", str(d)).returncode == 0
    moved = tmp_path / "moved"
    shutil.copytree(d / "marlin-pack", moved)
    r = _run("verify", str(moved))
    assert r.returncode == 1 and "skipped" in r.stdout and "pass --source MODEL_DIR" in r.stderr, r.stderr
    assert _run("verify", str(moved), "--integrity-only").returncode == 0
    assert _run("verify", str(moved), "--source", str(d)).returncode == 0
    r = runner.invoke(app, ["verify", str(moved), "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and data["ok"] is False
    assert {c["name"]: c["status"] for c in data["checks"]}["round-trip"] == "skipped"


@pytest.mark.slow
def test_strict_manifest_refuses_coerced_values(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    assert _run("convert", str(d)).returncode == 0
    path = d / "marlin-pack" / "manifest.json"
    m = json.loads(path.read_text())
    m["common"]["size"] = str(m["common"]["size"])
    path.write_text(json.dumps(m))
    r = _run("inspect", str(d / "marlin-pack"))
    assert r.returncode == 1 and "field common.size" in r.stderr


def test_help_shows_defaults_choices_and_examples() -> None:
    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"})
    assert "[default: MODEL_DIR/marlin-pack]" in r.stdout and "[default: auto]" in r.stdout
    assert "auto|half|float16|bfloat16|float|float32" in r.stdout and "cpu|cuda" in r.stdout
    assert "Examples:" in r.stdout and "marlin-pack convert ./Llama-3-8B-AWQ --tp 1,2" in r.stdout
    for command in ("verify", "check", "inspect", "daemon", "env"):
        assert "Examples:" in runner.invoke(app, [command, "-h"], env={"COLUMNS": "200"}).stdout, command
    assert "auto|full|size" in runner.invoke(app, ["check", "-h"], env={"COLUMNS": "200"}).stdout


def test_check_path_never_imports_vllm(make_bundle) -> None:
    code = (
        "import sys; from marlin_pack.cli import main; sys.argv=['marlin-pack','check',sys.argv[1]];\n"
        "try: main()\nexcept SystemExit as e: print('RC', e.code)\nprint('VLLM', 'vllm' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(make_bundle("awq"))], capture_output=True, text=True, timeout=120)
    assert "VLLM False" in r.stdout and "RC 0" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["--version"], ["inspect", "/nonexistent-bundle"]])
def test_main_freezes_the_heap_before_python_exits(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command, failed or not, freezes the objects its imports made before the interpreter's
    exit collection would walk them all (torch's: ~0.5 s per command)."""
    import gc

    from marlin_pack import cli

    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(sys, "argv", ["marlin-pack", *argv])
    with pytest.raises(SystemExit):
        cli.main()
    assert frozen == [True]


# --- user text is printed as it is (issue 47, items 10-13) ------------------------------------


def _run_wide(*args: str) -> subprocess.CompletedProcess[str]:
    """``_run`` with a console wide enough that rich wraps no path."""
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["x[/y]", "Llama [old]", "[bold]b:thumbs_up:"])
def test_paths_are_printed_as_they_are_never_as_markup(make_checkpoint, tmp_path: Path, where: str) -> None:
    d = tmp_path / where / "m"
    shutil.copytree(make_checkpoint("awq", "tiny", group_size=32), d)
    r = _run_wide("convert", str(d))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"wrote {d}/marlin-pack" in r.stdout and f"bundle         {d}/marlin-pack" in r.stdout
    r = _run_wide("verify", str(d / "marlin-pack"))
    assert r.returncode == 0 and f"verify {d}/marlin-pack" in r.stdout, r.stdout + r.stderr
    r = _run_wide("check", str(d))
    assert r.returncode == 0 and f"from {d}/marlin-pack" in r.stdout, r.stdout + r.stderr
    r = _run_wide("inspect", str(d / "[red]missing[/]"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: no bundle at {d}/[red]missing[/]: "), r.stderr


def test_progress_bar_shows_names_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from marlin_pack.commands import console as cli

    buf = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=buf, force_terminal=True, width=200, markup=False, color_system=None))
    with cli.progress(True, "converting") as update:
        assert update is not None
        update(1, 2, "x[/y] [bold]z")
    assert "x[/y] [bold]z" in buf.getvalue()


def test_bad_compressed_tensors_regex_is_one_line_exit_1(make_checkpoint, tmp_path: Path) -> None:
    d = tmp_path / "ct"
    shutil.copytree(make_checkpoint("ct"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:("]
    (d / "config.json").write_text(json.dumps(cfg))
    r = _run_wide("convert", str(d))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert r.stderr.startswith("error: compressed-tensors config_groups['group_0'] targets entry 're:(' is not a valid regular expression")
    assert not (d / "marlin-pack").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model 00001.safetensors", "modèle.safetensors", "模型.safetensors"])
def test_weight_file_names_vllm_loads_convert(make_checkpoint, tmp_path: Path, name: str) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    (d / "model.safetensors").rename(d / name)
    r = _run_wide("convert", str(d), "--json")
    assert r.returncode == 0, r.stderr
    assert [f["name"] for f in json.loads(r.stdout)["manifest"]["source"]["files"]] == [name]
    assert _run_wide("verify", str(d / "marlin-pack")).returncode == 0
    assert _run_wide("check", str(d)).returncode == 0


def test_weight_file_name_with_a_newline_is_refused_in_one_line(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    (d / "model.safetensors").rename(d / "a\nb.safetensors")
    r = _run_wide("convert", str(d))
    assert r.returncode == 1 and "internal error" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 2  # the error and the MARLIN_PACK_DEBUG hint
    assert "'a\\nb.safetensors'" in r.stderr and "control characters" in r.stderr
    assert not (d / "marlin-pack").exists()


@pytest.mark.slow
def test_check_refuses_an_alias_naming_a_quantized_tensor(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    assert _run("convert", str(d)).returncode == 0
    path = d / "marlin-pack" / "manifest.json"
    m = json.loads(path.read_text())
    m["common_aliases"] = {"model.layers.0.self_attn.qkv_proj.qweight": "model.embed_tokens.weight"}
    path.write_text(json.dumps(m))
    r = _run_wide("check", str(d))
    assert r.returncode == 1 and "refuse" in r.stdout and "common_aliases" in r.stdout, r.stdout


def test_env_lists_every_patch_by_purpose_without_importing_vllm() -> None:
    """`marlin-pack env`: the supported and installed vLLM, and a row per patch of it (purpose, target, upstream change)."""
    from marlin_pack.patch_list import patch_rows

    done = subprocess.run(
        [sys.executable, "-c", ("import sys; from marlin_pack.cli import app; sys.argv = ['marlin-pack', 'env'];\n"
                                "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
                                "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'")],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"}, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"vllm supported +0\.34\.0, 0\.33\.0", done.stdout)
    assert re.search(r"vllm release +supported", done.stdout)  # the installed vLLM is one of them
    assert re.search(r"plugin entry point +marlin_pack\.vllm_plugin:register", done.stdout)
    assert re.search(r"torch +\d", done.stdout) and "torch cuda" in done.stdout and "gpu " in done.stdout, done.stdout
    from importlib.metadata import version

    rows = patch_rows(version("vllm"))  # the rows of the installed release
    assert {purpose for purpose, _, _ in rows} == {"correctness", "weight_cache", "speed"}
    for _, target, _ in rows:
        assert target.split(":")[-1] in done.stdout, target


def test_the_helper_service_command_is_gone() -> None:
    """`marlin-pack helpers` (a socket service keeping helpers between engines) was retired: it measured no gain."""
    r = _run("helpers")
    assert r.returncode != 0 and "No such command" in r.stderr
    import importlib.util

    assert importlib.util.find_spec("marlin_pack.vllm_plugin.helper_service") is None


# --- deployable: vLLM's words, MODEL everywhere, idempotent convert, --version / -h ---


def test_version_and_short_help() -> None:
    from marlin_pack import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"marlin-pack {__version__}"
    r = runner.invoke(app, ["-h"])
    assert r.exit_code == 0 and "convert" in r.stdout and "cache" in r.stdout
    assert runner.invoke(app, ["convert", "-h"]).exit_code == 0


def test_check_takes_vllms_words(make_bundle) -> None:
    d = make_bundle("gptq", "tiny", tp_sizes=(1, 2))
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"], ["--tp", "2"]):
        r = runner.invoke(app, ["check", str(d), *argv, "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["tp_size"] == 2, (argv, r.output)
    for word in ("auto", "half", "float16"):
        r = runner.invoke(app, ["check", str(d), "--dtype", word])
        assert r.exit_code == 0, (word, r.output)
    r = runner.invoke(app, ["check", str(d), "--dtype", "bfloat16"])
    assert r.exit_code == 1 and "start vLLM with --dtype float16 or convert with --dtype bfloat16" in r.stdout, r.output


@pytest.mark.parametrize("word, expected", [
    ("fp16", "'fp16' is not one of 'auto', 'half', 'float16', 'bfloat16', 'float', 'float32'"),
    ("float32", "float16 or bfloat16 activations only"),
    ("float", "float16 or bfloat16 activations only"),
])
@pytest.mark.slow
def test_dtype_words_vllm_does_not_serve_here_are_refused_in_one_line(make_bundle, word: str, expected: str) -> None:
    d = make_bundle("gptq", "tiny")
    for command in ("check", "convert"):
        r = _run_wide(command, str(d), "--dtype", word)
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, (command, r.stderr)


def test_serving_dtype_for_reads_dtype_as_vllm_does() -> None:
    from marlin_pack.dtypes import serving_dtype_for

    assert serving_dtype_for("half", {}).value == serving_dtype_for("float16", {}).value == "float16"
    assert serving_dtype_for("auto", {"dtype": "bfloat16"}).value == serving_dtype_for(None, {"torch_dtype": "bfloat16"}).value
    with pytest.raises(ValueError, match="did you mean bfloat16"):
        serving_dtype_for("bf16", {})


def test_a_refusal_shared_by_every_rank_is_printed_once(make_bundle) -> None:
    d = make_bundle("gptq", "tiny")  # tp 1 only
    r = runner.invoke(app, ["check", str(d), "-tp", "2"])
    assert r.exit_code == 1 and r.stdout.count("refuse") == 1 and r.stdout.startswith("ranks 0-1/2: refuse"), r.output
    assert f"run `marlin-pack convert {d} --tp 1,2` (it adds the size, the others kept)" in r.stdout  # no --force: convert heals


def test_a_tp_size_the_checkpoint_cannot_take_is_not_suggested(make_bundle) -> None:
    d = make_bundle("gptq", "tiny")
    r = runner.invoke(app, ["check", str(d), "-tp", "3"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and "--tp 1,3" not in r.stdout, r.output
    assert re.search(r"cannot be split into \(marlin-pack convert accepts --tp 1(,2)?(,4)?(,8)? for it\)", r.stdout), r.stdout


def test_revision_with_a_local_directory_is_an_error(make_bundle) -> None:
    d = make_bundle("gptq", "tiny")
    for command in ("check", "convert", "verify", "inspect"):
        r = runner.invoke(app, [command, str(d), "--revision", "main"])
        assert r.exit_code == 2 and "--revision" in r.output, (command, r.output)


def test_verify_and_inspect_take_the_model_directory(make_bundle) -> None:
    d = make_bundle("awq", "tiny")
    r = runner.invoke(app, ["verify", str(d), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] and json.loads(r.stdout)["bundle"] == str(d / "marlin-pack"), r.output
    r = runner.invoke(app, ["inspect", str(d), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["bundle"] == str(d / "marlin-pack")
    r = runner.invoke(app, ["inspect", str(d / "marlin-pack")])
    assert r.exit_code == 0 and str(d / "marlin-pack") in r.stdout.replace("\n", "")


def test_convert_again_is_up_to_date_and_exits_0(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    assert runner.invoke(app, ["convert", str(d), "-tp", "1,2"]).exit_code == 0
    r = _run_wide("convert", str(d), "--tp", "2")
    assert r.returncode == 0 and f"up to date {d}/marlin-pack (tp 1,2, float16); nothing written" in r.stdout, r.stdout + r.stderr
    r = runner.invoke(app, ["convert", str(d), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["reused"] is True
    r = _run_wide("convert", str(d), "--tp", "4", "--kernel", "marlin")  # a size more: added, the others kept
    assert r.returncode == 0 and f"wrote {d}/marlin-pack: added tp4; tp1, tp2 kept" in r.stdout, r.stdout + r.stderr
    rank = d / "marlin-pack" / "tp2" / "rank-1.safetensors"
    data = bytearray(rank.read_bytes())
    data[-3] ^= 1  # one flipped byte: convert rewrites that size, and check then loads
    rank.write_bytes(bytes(data))
    r = runner.invoke(app, ["convert", str(d), "--tp", "2", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["reused"] is False, r.output
    assert json.loads(r.stdout)["done"] == "rewrote tp2: tp2/rank-1.safetensors changed since it was written; tp1, tp4 kept"
    assert runner.invoke(app, ["check", str(d), "-tp", "2"]).exit_code == 0


def test_check_says_which_kernel_each_layer_runs_on_the_gpu_given(make_bundle) -> None:
    marlin, machete = make_bundle("gptq", "tiny"), make_bundle("gptq", "tiny", kernel="machete")
    r = runner.invoke(app, ["check", str(marlin), "--compute-capability", "9.0"], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and "8 layers on MarlinLinearKernel, forced: vLLM's default on this SM90 GPU runs 8" in r.stdout, r.stdout
    r = runner.invoke(app, ["check", str(marlin), "--compute-capability", "8.0"], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and "8 layers on MarlinLinearKernel," in r.stdout and "forced" not in r.stdout, r.stdout
    r = runner.invoke(app, ["check", str(machete), "--compute-capability", "9.0"], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and "(8 on MacheteLinearKernel," in r.stdout, r.stdout
    r = runner.invoke(app, ["check", str(machete), "--compute-capability", "8.0"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and "Machete's layout (SM90 only), this GPU has compute capability 8.0" in r.stdout, r.stdout
    r = runner.invoke(app, ["inspect", str(machete)], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and "8 machete" in r.stdout, r.stdout
    assert runner.invoke(app, ["check", str(machete), "--compute-capability", "nine"]).exit_code == 2


def test_check_takes_pipeline_parallel_size_and_decides_every_stage(make_bundle) -> None:
    """-tp 2 -pp 2: the loader's own decision per (stage, rank), each saying what that stage reads of its files."""
    d = make_bundle("gptq", "tiny", tp_sizes=(1, 2))
    for flag in ("-pp", "--pipeline-parallel-size"):
        r = runner.invoke(app, ["check", str(d), "-tp", "2", flag, "2", "--json"])
        data = json.loads(r.stdout)
        assert r.exit_code == 0 and data["pp_size"] == 2 and data["decision"] == "load", r.output
        assert [(x["stage"], x["rank"], x["decision"]) for x in data["ranks"]] == [
            (0, 0, "load"), (0, 1, "load"), (1, 0, "load"), (1, 1, "load")]
        reads = [x["reads"] for x in data["ranks"]]
        assert [x["layers"] for x in reads] == [[0, 1], [0, 1], [1, 2], [1, 2]]
        for rank in range(2):  # the two stages of a TP rank read its rank file once between them
            assert reads[rank]["rank_file_bytes"] + reads[2 + rank]["rank_file_bytes"] == reads[rank]["rank_file_total"] > 0
        assert all(0 < x["common_file_bytes"] < x["common_file_total"] for x in reads)
    r = runner.invoke(app, ["check", str(d), "-tp", "2", "-pp", "2"], env={"COLUMNS": "400"})
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and [x.split(":")[0] for x in lines[:4]] == [
        "stage 0 rank 0/2", "stage 0 rank 1/2", "stage 1 rank 0/2", "stage 1 rank 1/2"], r.stdout
    assert "tp2/rank-1.safetensors" in lines[1] and "stage 0/2 (layer 0 of 2 layers)" in lines[1]
    assert "stage 1/2 (layer 1 of 2 layers)" in lines[3] and "of the rank file" in lines[3] and "of the common file" in lines[3]


def test_check_decides_each_replica_and_ep_rank_of_a_moe_bundle(tmp_path: Path) -> None:
    """vLLM shards experts over every replica's ranks (tests/vllm_plugin/test_plugin_moe.py shows it): -dp 2 needs the
    tp2 rank files (refused in one line naming dp_size and the convert to run, then loaded per replica); -ep takes
    each GPU's whole experts from the tp1 file; -dp 1 without -ep loads as before."""
    import torch
    from moe_checkpoints import write_moe_checkpoint

    from marlin_pack import convert

    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq", dtype=torch.float16)
    convert(model, tp=(1,), kernel="marlin")
    r = runner.invoke(app, ["check", str(model), "-dp", "2"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and "rank 0/1: refuse" in r.stdout and "[dp_size] --data-parallel-size 2: vLLM shards" in r.stdout
    assert f"run `marlin-pack convert {model} --tp 1,2`" in r.stdout and len(r.stdout.splitlines()) == 2, r.stdout
    assert runner.invoke(app, ["check", str(model)]).exit_code == 0
    convert(model, tp=(1, 2), kernel="marlin", force=True)
    r = runner.invoke(app, ["check", str(model), "-dp", "2"], env={"COLUMNS": "400"})
    lines = [x for x in r.stdout.splitlines() if not x.startswith(("check hashed", "kernel fit not checked"))]
    assert r.exit_code == 0 and [x.split(":")[0] for x in lines] == ["replica 0 rank 0/1", "replica 1 rank 0/1"], r.stdout
    assert "experts of tp2/rank-0" in lines[0] and "experts of tp2/rank-1" in lines[1]
    r = runner.invoke(app, ["check", str(model), "-tp", "2", "-ep"], env={"COLUMNS": "400"})
    lines = [x for x in r.stdout.splitlines() if not x.startswith(("check hashed", "kernel fit not checked"))]
    assert r.exit_code == 0 and [x.split(":")[0] for x in lines] == ["rank 0/2", "rank 1/2"], r.stdout
    assert "experts 0-1 of 4 (ep rank 0/2, linear) from tp1/rank-0" in lines[0] and "experts 2-3 of 4 (ep rank 1/2" in lines[1]
    r = runner.invoke(app, ["check", str(model), "-tp", "2", "-dp", "2", "-ep", "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and [(x["replica"], x["rank"], x["reads"]["experts"]["experts"]) for x in data["ranks"]] == [
        (0, 0, [0]), (0, 1, [1]), (1, 0, [2]), (1, 1, [3])], r.stdout
    r = runner.invoke(app, ["check", str(model), "-ep", "--expert-placement-strategy", "rr"], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "expected linear or round_robin" in r.output


def test_check_refuses_a_partition_that_does_not_fit(make_bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_bundle("gptq", "tiny", tp_sizes=(1, 2))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    r = runner.invoke(app, ["check", str(d), "-pp", "2"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and r.stdout.count("refuse") == 1, r.stdout
    assert "[pp_size] VLLM_PP_LAYER_PARTITION='2,1' sums to 3 layers, the model has 2" in r.stdout


def test_check_takes_data_parallel_size(make_bundle) -> None:
    d = make_bundle("gptq", "tiny", tp_sizes=(1, 2))
    r = runner.invoke(app, ["check", str(d), "-tp", "2", "-dp", "2", "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and data["data_parallel_size"] == 2 and data["decision"] == "load", r.output
    r = runner.invoke(app, ["check", str(d), "--data-parallel-size", "3"], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and r.stdout.startswith("each of the 3 data-parallel replicas decides as follows"), r.stdout
    r = runner.invoke(app, ["check", str(d), "-tp", "2", "-pp", "2", "-dp", "2"], env={"COLUMNS": "400"})
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and lines[0].startswith("each of the 2 data-parallel replicas"), r.stdout
    assert [x.split(":")[0] for x in lines[1:5]] == ["stage 0 rank 0/2", "stage 0 rank 1/2", "stage 1 rank 0/2", "stage 1 rank 1/2"]


# --- untrusted text is shown, never obeyed (issue 68, item 7) ------------------------------------

HOSTILE = "m\x1b]0;title\x07\x1b[2J\nrank 0/1: load"
SHOWN_HOSTILE = "m\\x1b]0;title\\x07\\x1b[2J\\nrank 0/1: load"
# What a terminal would obey: C0 controls but the newlines that end lines, DEL, C1, line separators, bidi controls.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _shown_safely(r, forged_ok: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Nothing a terminal would obey, and no line starting as the hostile name's forged one (``forged_ok``: check's own)."""
    for stream in (r.stdout, r.stderr):
        assert not RAW_CONTROL.search(stream), stream
    lines = (r.stdout + r.stderr).splitlines()
    assert sum(line.startswith("rank 0/1: load") for line in lines) == forged_ok, r.stdout + r.stderr


def test_a_hostile_bundle_path_and_manifest_are_shown_in_check_inspect_and_errors(make_bundle, tmp_path: Path) -> None:
    d = tmp_path / HOSTILE / "model"
    shutil.copytree(make_bundle("awq", "tiny"), d)
    env = {"COLUMNS": "400"}
    r = runner.invoke(app, ["check", str(d)], env=env)
    assert r.exit_code == 0 and f"{SHOWN_HOSTILE}/model/marlin-pack" in r.stdout, r.output
    _shown_safely(r, forged_ok=1)  # check's own first line
    r = runner.invoke(app, ["inspect", str(d)], env=env)
    assert r.exit_code == 0 and f"bundle         {tmp_path}/{SHOWN_HOSTILE}/model/marlin-pack" in r.stdout, r.output
    _shown_safely(r)
    manifest = d / "marlin-pack" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["source"]["architecture"] = f"LlamaForCausalLM{HOSTILE}\u202e\x9b"
    manifest.write_text(json.dumps(m))
    r = runner.invoke(app, ["inspect", str(d)], env=env)
    assert r.exit_code == 0 and f"awq-gemm LlamaForCausalLM{SHOWN_HOSTILE}\\u202e\\u009b, 1 file(s)" in r.stdout, r.output
    _shown_safely(r)
    r = runner.invoke(app, ["inspect", str(d), "--json"], env=env)  # JSON stays JSON, and reads back the same
    assert r.exit_code == 0 and json.loads(r.stdout)["manifest"]["source"]["architecture"] == m["source"]["architecture"]
    _shown_safely(r)
    r = runner.invoke(app, ["check", str(d)], env=env)
    _shown_safely(r, forged_ok=int(r.stdout.startswith("rank 0/1: load")))
    r = _run_wide("inspect", str(d / f"gone{HOSTILE}"))  # main()'s error line
    assert r.returncode == 1 and r.stderr.startswith(f"error: no bundle at {tmp_path}/{SHOWN_HOSTILE}/model/gone{SHOWN_HOSTILE}: ")
    _shown_safely(r)
    r = runner.invoke(app, ["check", str(d), "--revision", "main"], env=env)  # typer's own panel
    assert r.exit_code == 2 and SHOWN_HOSTILE in r.stderr.replace("│", "").replace("\n", ""), r.output
    _shown_safely(r)


def test_the_progress_bar_shows_hostile_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from marlin_pack.commands import console as cli

    buf = io.StringIO()
    console = type(cli.err)(file=buf, force_terminal=True, width=200, markup=False, color_system=None)  # the CLI's kind of console
    monkeypatch.setattr(cli, "err", console)
    with cli.progress(True, "converting") as update:
        assert update is not None
        update(1, 2, f"model.layers.0.{HOSTILE}")
    assert "model.layers.0.m\\x1b]0;tit" in buf.getvalue() and "\x1b]" not in buf.getvalue() and "\x1b[2J" not in buf.getvalue()


@pytest.mark.slow
def test_a_hostile_checkpoint_path_is_shown_through_convert_verify_check_and_inspect(make_checkpoint, tmp_path: Path) -> None:
    d = tmp_path / HOSTILE / "ckpt"
    shutil.copytree(make_checkpoint("awq", "tiny", group_size=32), d)
    for args, forged_ok in [
        (("convert", str(d)), 0), (("check", str(d)), 1), (("verify", str(d / "marlin-pack")), 0),
        (("inspect", str(d / "marlin-pack")), 0), (("convert", str(d), "--json"), 0), (("verify", str(d / f"gone{HOSTILE}")), 0),
    ]:
        r = _run_wide(*args)
        assert r.returncode == (1 if "gone" in args[-1] else 0) and "Traceback" not in r.stderr, (args, r.stderr)
        if "--json" in args:
            assert json.loads(r.stdout)["bundle"] == str(d / "marlin-pack")
        else:  # (rich wraps a long path or title)
            assert re.sub(r"\s+", "", SHOWN_HOSTILE) in re.sub(r"\s+", "", r.stdout + r.stderr), (args, r.stdout, r.stderr)
        _shown_safely(r, forged_ok)


# --- a file truncated while it is hashed or read: a one-line refusal, never SIGBUS (issue 68, item 5) ----

# Runs the CLI (argv[3:]) with a hook that cuts the file argv[1] to argv[2] bytes while it is in use: "hash" cuts it
# in the first BLAKE3 update of a hash of that file, before the buffer is hashed (through a memory map, before issue 68,
# that buffer was the file's pages); "read" at the second tensor convert reads (its file open by then); "verify" once
# verify's round trip compared its first shard (the bundle's rank files open by then).
_TRUNCATING_CLI = """
import os, sys, threading
target, keep, when, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]

def cut():
    if os.path.getsize(target) > keep:
        os.truncate(target, keep)

if when == "hash":
    import blake3
    from marlin_pack.io import hashing
    real, opened, here = blake3.blake3, hashing.open_regular, threading.local()

    def open_regular(path):
        here.path = os.path.realpath(path)
        return opened(path)

    class Truncating:
        AUTO = real.AUTO

        def __init__(self, *args, **kwargs):
            self.h = real(*args, **kwargs)

        def update(self, data):
            if getattr(here, "path", None) == os.path.realpath(target):
                cut()
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    hashing.open_regular, blake3.blake3 = open_regular, Truncating
elif when == "read":
    from marlin_pack.sources.checkpoint import Checkpoint
    get, calls = Checkpoint.get, []

    def reading(self, name):
        calls.append(name)
        if len(calls) == 2:
            cut()
        return get(self, name)

    Checkpoint.get = reading
else:
    import marlin_pack.verification as verification
    compare = verification._compare_weights

    def comparing(*args, **kwargs):
        cut()
        return compare(*args, **kwargs)

    verification._compare_weights = comparing
from marlin_pack.cli import main
sys.argv = ["marlin-pack", *argv]
main()
"""


def _run_truncating(target: Path, keep: int, when: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400"}
    cmd = [sys.executable, "-c", _TRUNCATING_CLI, str(target), str(keep), when, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _header_bytes(path: Path) -> int:
    import struct

    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.slow
def test_a_bundle_file_truncated_while_check_hashes_it_is_a_one_line_refusal(make_bundle, tmp_path: Path) -> None:
    d = tmp_path / "model"
    shutil.copytree(make_bundle("awq", "tiny"), d)
    rank = d / "marlin-pack" / "tp1" / "rank-0.safetensors"
    size = rank.stat().st_size
    r = _run_truncating(rank, 0, "hash", "check", str(d), "--verify", "full")
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])  # -7: killed by SIGBUS, nothing said
    assert r.stdout.startswith("rank 0/1: refuse ") and len(r.stdout.splitlines()) == 1 and "Traceback" not in r.stderr, r.stdout
    assert f"tp1/rank-0.safetensors changed while it was hashed (truncated to 0 of its {size} bytes)" in r.stdout


@pytest.mark.slow
def test_a_checkpoint_truncated_while_convert_reads_it_is_refused_and_leaves_nothing(make_checkpoint, tmp_path: Path) -> None:
    d = _ckpt(make_checkpoint, tmp_path)
    before = sorted(os.listdir(d))
    weights = d / "model.safetensors"
    keep = _header_bytes(weights)
    r = _run_truncating(weights, keep, "read", "convert", str(d))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])  # -7: killed by SIGBUS, lock and temp dir left
    assert r.stderr.startswith("error: model.safetensors changed while it was read (truncated to ") and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 2, r.stderr  # the error and the MARLIN_PACK_DEBUG hint
    assert sorted(os.listdir(d)) == before  # no bundle, no lock file, no temporary directory


@pytest.mark.slow
def test_a_bundle_file_truncated_while_verify_reads_it_fails_verify_in_one_line(make_bundle, tmp_path: Path) -> None:
    d = tmp_path / "model"
    shutil.copytree(make_bundle("awq", "tiny"), d)
    rank = d / "marlin-pack" / "tp1" / "rank-0.safetensors"
    r = _run_truncating(rank, _header_bytes(rank), "verify", "verify", str(d))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])  # -7: killed by SIGBUS, nothing said
    assert "Traceback" not in r.stderr and "FAILED" in r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("error: verify failed at round-trip: bundle file rank-0.safetensors changed while it was read"), errors


# --- small things a new user meets: --tp words, Ctrl-C, a daemon without a GPU, --version where the docs say ---


@pytest.mark.parametrize("value", ["1,,2", "1,", ",2", "", "1, ,2", "2,2", "0", "-1", "1.5", "two", "１"])
def test_tp_sizes_that_are_not_a_plain_list_are_refused(value: str) -> None:
    r = runner.invoke(app, ["convert", "/nonexistent", "--tp", value])
    assert r.exit_code == 2 and "Invalid value for --tp" in r.output and repr(value) in r.output, r.output


def test_tp_sizes_are_read_sorted() -> None:
    from marlin_pack.commands.params import parse_tp

    assert parse_tp("4,1,2") == [1, 2, 4] and parse_tp(" 1 , 2 ") == [1, 2] and parse_tp("8") == [8]


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_an_interrupted_conversion_names_its_signal(signame: str, make_checkpoint, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from marlin_pack import conversion
    from marlin_pack.bundle.writer import Interrupted

    signum = signal.Signals[signame]

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt() if signame == "SIGINT" else Interrupted(signum)  # Ctrl-C is a plain KeyboardInterrupt

    monkeypatch.setattr(conversion, "convert", interrupted)
    r = runner.invoke(app, ["convert", str(_ckpt(make_checkpoint, tmp_path))])
    assert r.exit_code == 128 + signum, r.output
    assert f"interrupted ({signame}): nothing was written" in r.output and "()" not in r.output, r.output


def test_daemon_without_a_gpu_says_so_before_vllm_starts(make_bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU: one line at once (vLLM would fail ~14 s later, in a traceback), without importing vLLM or torch."""
    code = (
        "import sys; from marlin_pack.cli import main; sys.argv = ['marlin-pack', 'daemon', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    print('RC', e.code)\n"
        "print('IMPORTED', sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code, str(make_bundle("awq")), "-tp", "2"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert "RC 1" in r.stdout and "IMPORTED []" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("error: marlin-pack daemon fills GPU memory, and CUDA_VISIBLE_DEVICES='' hides every GPU; "
                               "run it on a machine with the engines' GPUs"), r.stderr


def test_daemon_needs_the_gpus_its_tp_and_pp_take(make_bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    import marlin_pack.vllm_plugin.launcher as launcher

    calls: list[list[str]] = []
    monkeypatch.setattr(launcher, "run", calls.append)
    monkeypatch.setattr("marlin_pack.gpu.gpu_room.visible_gpus", lambda: (2, ""))
    r = runner.invoke(app, ["daemon", str(make_bundle("awq")), "--tensor-parallel-size=2", "-pp", "2"])
    assert r.exit_code == 1 and not calls, r.output
    assert "marlin-pack daemon with 4 GPUs (-tp x -pp), 2 visible here" in str(r.exception), r.exception
    r = runner.invoke(app, ["daemon", str(make_bundle("awq")), "-tp", "2"])
    assert r.exit_code == 0 and len(calls) == 1, r.output


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from marlin_pack.gpu import gpu_room

    class FakeNvml:
        def nvmlInit_v2(self) -> int:
            return 0

        def nvmlDeviceGetCount_v2(self, count) -> int:  # type: ignore[no-untyped-def]
            ctypes.cast(count, ctypes.POINTER(ctypes.c_uint)).contents.value = 2
            return 0

        def nvmlShutdown(self) -> int:
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml())
    assert gpu_room.visible_gpus({}) == (2, "")
    assert gpu_room.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == (1, "")
    assert gpu_room.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,5"}) == (2, "")  # CUDA stops at the first device not there
    assert gpu_room.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == (0, "CUDA_VISIBLE_DEVICES='-1' names no GPU of this machine")
    assert gpu_room.visible_gpus({"CUDA_VISIBLE_DEVICES": " "})[0] == 0

    def no_driver(name: str) -> None:
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert gpu_room.visible_gpus({}) == (0, "no NVIDIA driver here (libnvidia-ml.so.1 cannot be loaded)")


def test_version_is_where_the_options_page_says() -> None:
    """docs/options.md: -h/--help on every command, --version/-V on marlin-pack itself, and the version command."""
    from marlin_pack import __version__

    text = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    assert "`-h`/`--help` work on every command" in text and "`--version` (`-V`) on `marlin-pack` itself" in text
    for argv in (["--version"], ["-V"], ["version"]):
        r = runner.invoke(app, argv)
        assert r.exit_code == 0 and __version__ in r.stdout, (argv, r.output)
    for command in (["convert"], ["verify"], ["check"], ["inspect"], ["cache", "ls"], ["cache", "rm"], ["daemon"], ["env"],
                    ["schema"], ["version"]):
        for flag in ("-h", "--help"):
            assert runner.invoke(app, [*command, flag]).exit_code == 0, (command, flag)


def test_library_errors_name_arguments_the_cli_names_options(make_checkpoint, tmp_path: Path) -> None:
    """An error raised below the CLI names the library's argument (`device='cuda'`); the CLI prints its option."""
    import torch

    from marlin_pack import convert
    from marlin_pack.errors import MarlinPackError

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU")
    d = _ckpt(make_checkpoint, tmp_path)
    with pytest.raises(MarlinPackError, match=r"`device='cuda'` asked for, but no CUDA GPU is available; use `device='cpu'`"):
        convert(d, device="cuda")
    r = _run("convert", str(d), "--device", "cuda")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: `--device cuda` asked for, but no CUDA GPU is available; use `--device cpu`"), r.stderr


@pytest.mark.parametrize("api, cli", [
    ("pass `force=True` to replace it", "pass `--force` to replace it"),
    ("or `output=DIR` elsewhere", "or `-o DIR` elsewhere"),
    ("asked for `tp=[1, 2, 4]`", "asked for `--tp 1,2,4`"),
    ("`kernel='machete'` and `dtype='bfloat16'`", "`--kernel machete` and `--dtype bfloat16`"),
    ("`revision=COMMIT`, `source=MODEL_DIR`, `integrity_only=True`", "`--revision COMMIT`, `--source MODEL_DIR`, `--integrity-only`"),
    ("run `marlin-pack convert /m --tp 2`", "run `marlin-pack convert /m --tp 2`"),  # a command: as it is
    ("`unknown=1`, `force=False`, a path /x/force=True", "`unknown=1`, `force=False`, a path /x/force=True"),
])
def test_the_cli_shows_each_library_argument_as_its_option(api: str, cli: str) -> None:
    from marlin_pack.commands.api_words import as_cli

    assert as_cli(api) == cli


def test_verify_shows_the_reports_advice_in_the_cli_words(make_bundle, tmp_path: Path) -> None:
    """verify()'s report names its arguments (`source=MODEL_DIR`); verify's table shows the options."""
    moved = tmp_path / "moved"
    shutil.copytree(make_bundle("awq") / "marlin-pack", moved)
    r = runner.invoke(app, ["verify", str(moved)])
    assert r.exit_code == 1 and "pass `--source MODEL_DIR`, or `--integrity-only` to check the bundle alone" in r.stdout, r.stdout
    assert "source=" not in r.stdout and "integrity_only" not in r.stdout
    r = runner.invoke(app, ["verify", str(moved), "--integrity-only"])
    assert r.exit_code == 0 and "skipped (`--integrity-only`)" in r.stdout, r.stdout
