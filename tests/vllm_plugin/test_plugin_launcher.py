"""``launcher`` (``marlin-pack daemon``): argument handling, no vLLM import for ``--help``,
marlin-pack installed before vLLM's CLI runs, vLLM's errors in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from marlin_pack.errors import BundleError, MarlinPackError
from marlin_pack.vllm_plugin.launcher import preload_argv, run

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _bundle(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    (model / "marlin-pack").mkdir(parents=True)
    (model / "marlin-pack" / "manifest.json").write_text("{}")
    return model


def test_preload_argv_defaults_to_the_bundle(tmp_path: Path) -> None:
    model = _bundle(tmp_path)
    assert preload_argv(model) == ["preload", "--model", str(model), "--load-format", "marlin_prepacked"]
    extra = ["--tensor-parallel-size", "2", "--weight-cache-socket-dir", "/s", "--dtype=float16"]
    assert preload_argv(model, extra) == ["preload", "--model", str(model), "--load-format", "marlin_prepacked", *extra]


@pytest.mark.parametrize(
    "extra",
    [
        ["--load-format", "auto", "--linear-backend", "marlin"],
        ["--load_format=auto"],
        ["--load-format=AUTO", "--enforce-eager"],
    ],
)
def test_preload_argv_keeps_an_explicit_load_format(tmp_path: Path, extra: list[str]) -> None:
    model = tmp_path / "no-bundle"  # a checkpoint fill needs no bundle
    assert preload_argv(model, extra) == ["preload", "--model", str(model), *extra]


def test_preload_argv_bundle_options(tmp_path: Path) -> None:
    model = tmp_path / "model"
    other = _bundle(tmp_path / "elsewhere") / "marlin-pack"
    for extra in (
        ["--model-loader-extra-config", json.dumps({"bundle": str(other)})],
        [f"--model-loader-extra-config={json.dumps({'fallback': True})}"],
        ["--model-loader-extra-config", "{not json"],  # vLLM reports it
    ):
        assert preload_argv(model, extra)[-len(extra) :] == extra


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ([], BundleError, r"no marlin-pack bundle at .*model/marlin-pack .*run `marlin-pack convert"),
        (["--model-loader-extra-config", '{"bundle": "/nope"}'], BundleError, r"no marlin-pack bundle at /nope"),
        (["--model", "x"], MarlinPackError, r"--model is MODEL_DIR"),
        (["--model=x"], MarlinPackError, r"--model is MODEL_DIR"),
        (["--load-format", "ipc_cache"], MarlinPackError, r"--load-format ipc_cache is for engines"),
        (["--load-format"], MarlinPackError, r"--load-format needs a value"),
    ],
)
def test_preload_argv_refuses(tmp_path: Path, extra: list[str], error: type, match: str) -> None:
    (tmp_path / "model").mkdir()  # a checkpoint directory without a bundle
    with pytest.raises(error, match=match):
        preload_argv(tmp_path / "model", extra)


def test_preload_argv_names_a_model_that_is_nowhere(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"neither a checkpoint directory nor a Hugging Face model id"):
        preload_argv(tmp_path / "missing")


def test_cli_daemon_forwards_every_other_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import marlin_pack.vllm_plugin.launcher as launcher
    from marlin_pack.cli import app

    model = _bundle(tmp_path)
    calls: list[list[str]] = []
    monkeypatch.setattr(launcher, "run", calls.append)
    monkeypatch.setattr("marlin_pack.gpu.gpu_room.visible_gpus", lambda: (2, ""))  # the GPUs -tp 2 takes
    args = ["--tensor-parallel-size", "2", "--weight-cache-socket-dir", "/s", "--enforce-eager"]
    r = runner.invoke(app, ["daemon", str(model), *args])
    assert r.exit_code == 0, r.output
    assert calls == [["preload", "--model", str(model.resolve()), "--load-format", "marlin_prepacked", *args]]
    assert "marlin-pack: vllm preload --model" in r.output
    r = runner.invoke(app, ["daemon", str(tmp_path)])  # no bundle: one-line error before vLLM starts
    assert r.exit_code != 0 and isinstance(r.exception, BundleError)
    assert len(calls) == 1


def test_cli_daemon_help_does_not_import_vllm() -> None:
    code = (
        "import sys\nfrom marlin_pack.cli import main\nsys.argv = ['marlin-pack', 'daemon', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import marlin_pack.vllm_plugin.launcher, marlin_pack.vllm_plugin.patches.weight_cache\n"
        "print('VLLM', [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "VLLM []" in r.stdout, r.stderr
    assert "vllm preload" in r.stdout and "ipc_cache" in r.stdout


def test_run_installs_marlin_pack_before_vllm_cli(registered: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """run() registers marlin-pack and installs its patches (even where register() already ran),
    so vLLM's daemon module spawns marlin-pack's target before vLLM's CLI runs."""
    import vllm.entrypoints.cli.main as vllm_cli

    from marlin_pack.vllm_plugin import patches
    from marlin_pack.vllm_plugin.patches.weight_cache import run_daemon

    seen: dict[str, Any] = {}

    def fake_main() -> None:
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
        from vllm.model_executor.model_loader.weight_cache.daemon import _run_daemon

        seen.update(argv=list(sys.argv), spawn_target=_run_daemon, formats=set(_LOAD_FORMAT_TO_MODEL_LOADER))

    monkeypatch.setattr(vllm_cli, "main", fake_main)
    argv = ["preload", "--model", "/m", "--load-format", "marlin_prepacked"]
    before = list(sys.argv)
    run(argv)
    assert sys.argv == before
    assert seen["argv"] == ["vllm", *argv]
    assert seen["spawn_target"] is run_daemon  # what PreloadSubcommand.cmd hands to spawn
    assert "marlin_prepacked" in seen["formats"]
    # Deferred patches apply when vLLM first imports their module (the GPU worker's is not imported here).
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    imported = {p.target for p in patches.for_release(vllm_version()) if not p.deferred or p.module in sys.modules}
    assert imported == set(patches.installed())


def test_run_reports_vllm_errors_in_one_line(registered: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.entrypoints.cli.main as vllm_cli

    def fake_main() -> None:
        raise ValueError("--weight-cache-master-port is required when the daemons span nodes")

    monkeypatch.setattr(vllm_cli, "main", fake_main)
    before = list(sys.argv)
    with pytest.raises(MarlinPackError, match=r"^vllm preload failed: ValueError: --weight-cache-master-port"):
        run(["preload", "--model", "/m"])
    assert sys.argv == before


def test_run_refuses_when_marlin_pack_cannot_register(monkeypatch: pytest.MonkeyPatch) -> None:
    import marlin_pack.vllm_plugin as plugin

    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.setattr(plugin, "is_registered", lambda: False)
    expected = (r"could not register the marlin_prepacked load format .* is one of vLLM "
                r"0\.34\.0, 0\.33\.0, 0\.32\.0, 0\.31\.0, 0\.30\.0 installed")
    with pytest.raises(MarlinPackError, match=expected):
        run(["preload", "--model", "/m"])


def test_run_refuses_a_release_whose_daemon_has_no_vllm_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.30.0 starts its weight-cache daemon with python -m (no `vllm preload`, no get_model hook): one line."""
    import marlin_pack.vllm_plugin as plugin
    import marlin_pack.vllm_plugin.version_guard as guard

    monkeypatch.setattr(plugin, "ensure_registered", lambda: True)
    monkeypatch.setattr(guard, "vllm_version", lambda: "0.30.0")
    with pytest.raises(MarlinPackError) as e:
        run(["preload", "--model", "/m"])
    text = str(e.value)
    assert "\n" not in text and "vLLM 0.30.0 starts its weight-cache daemon without `vllm preload`" in text
    assert "use vLLM 0.34.0, 0.33.0, 0.32.0, 0.31.0 for the daemon" in text and "--load-format marlin_prepacked" in text
