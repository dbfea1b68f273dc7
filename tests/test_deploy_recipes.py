"""The deployment recipes (docs/deployment.md, examples/deploy/): their commands parse, and the pod's roles work.

The pod plays out with real processes on a temporary "volume": several init containers start
``marlin-pack convert`` at once, then ``marlin-pack check`` decides as the engine would, also on a
read-only volume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.main import get_command

from marlin_pack.cli import app

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "examples" / "deploy"
DOC = ROOT / "docs" / "deployment.md"
# click's, whichever click typer uses (newer typers carry their own)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

# --- the commands in the recipes -------------------------------------------------------------------------------


def _split_script(script: str) -> list[list[str]]:
    """The simple commands of a shell line (``a && b; c``), leading ``VAR=value`` assignments dropped."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    commands, current = [], []
    for token in lex:
        if set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for argv in commands:
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def _argvs(container: dict) -> list[list[str]]:
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] == ["sh", "-c"]:
        return _split_script(" ".join(argv[2:]))
    return [argv]


def _yaml_docs(path: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_specs(doc: dict) -> Iterator[dict]:
    spec = doc["spec"]
    yield spec.get("template", {}).get("spec", spec)


def _containers(path: Path) -> list[dict]:
    return [c for doc in _yaml_docs(path) for spec in _pod_specs(doc) for c in spec.get("initContainers", []) + spec["containers"]]


def _dockerfile_argvs(path: Path) -> list[list[str]]:
    """The commands of the Dockerfile's RUN lines, and ENTRYPOINT + CMD, with the ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    out, entrypoint, cmd = [], [], []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        elif word == "RUN":
            out.extend(_split_script(rest))
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
    return [*out, [*entrypoint, *cmd]]


def _marlin_pack_context(argv: list[str]) -> typer.Context:
    """``marlin-pack ARGS`` parsed by the CLI's own parser (nothing runs): a wrong command, flag or value raises."""
    assert argv[0] == "marlin-pack", argv
    group = get_command(app)
    name, *rest = argv[1:]
    command = group.get_command(typer.Context(group), name)
    assert command is not None, f"marlin-pack has no command {name!r}: {shlex.join(argv)}"
    return command.make_context(name, rest)


def _vllm_serve_flags(argv: list[str]) -> dict[str, str | None]:
    """``vllm serve MODEL --flag [value] ...`` as {flag: value}: the model first, every other word a flag's value."""
    assert argv[:2] == ["vllm", "serve"], argv
    assert len(argv) > 2 and not argv[2].startswith("-"), f"vllm serve takes the model first: {shlex.join(argv)}"
    flags: dict[str, str | None] = {}
    last = None
    for a in argv[3:]:
        if a.startswith("--"):
            last, _, value = a.partition("=")
            flags[last] = value or None
        else:
            assert last is not None and flags[last] is None, f"vllm serve: a second positional {a!r}: {shlex.join(argv)}"
            flags[last] = a
    return flags


def _recipe_argvs() -> list[tuple[str, list[str]]]:
    out = [(p.name, a) for p in sorted(DEPLOY.glob("*.yaml")) for c in _containers(p) for a in _argvs(c)]
    return out + [("Dockerfile", a) for a in _dockerfile_argvs(DEPLOY / "Dockerfile")]


def test_the_recipes_are_there_and_documented() -> None:
    text = DOC.read_text()
    for name in ("pod.yaml", "job.yaml", "Dockerfile"):
        assert (DEPLOY / name).is_file() and f"examples/deploy/{name}" in text
    doc_yaml = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    yaml = pytest.importorskip("yaml")
    assert [yaml.safe_load(doc_yaml[0])] == _yaml_docs(DEPLOY / "pod.yaml"), "docs/deployment.md's pod differs from pod.yaml"


def test_every_marlin_pack_command_parses() -> None:
    commands = [(where, argv) for where, argv in _recipe_argvs() if argv[0] == "marlin-pack"]
    assert {argv[1] for _, argv in commands} >= {"convert", "check", "verify"}
    for where, argv in commands:
        try:
            _marlin_pack_context(argv)
        except UsageError as e:
            pytest.fail(f"{where}: {shlex.join(argv)}: {e.format_message()}")


def test_a_wrong_flag_or_value_is_caught() -> None:
    with pytest.raises(UsageError, match="No such option"):
        _marlin_pack_context(["marlin-pack", "convert", "M", "--tensor-paralel", "2"])
    with pytest.raises(typer.BadParameter):
        _marlin_pack_context(["marlin-pack", "check", "M", "--tp", "two"])
    with pytest.raises(AssertionError, match="no command"):
        _marlin_pack_context(["marlin-pack", "converts", "M"])
    with pytest.raises(AssertionError, match="model first"):
        _vllm_serve_flags(["vllm", "serve", "--tensor-parallel-size", "2"])


def _tp_sizes(argv: list[str]) -> tuple[int, ...]:
    ctx = _marlin_pack_context(argv)
    return tuple(int(t) for t in str(ctx.params["tp"]).split(","))


def _assert_on_a_volume(path: Path, container: dict) -> None:
    """Where a model id's checkpoint and bundle go (HF_HOME, MARLIN_PACK_CACHE) is on a volume of the container."""
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    places = [env[n] for n in ("HF_HOME", "MARLIN_PACK_CACHE") if n in env]
    assert places and all(any(v.startswith(m + "/") for m in mounts) for v in places), f"{path.name}: {places} off {mounts}"


def test_every_engine_uses_the_converted_model_and_tp() -> None:
    """Each vllm serve: the model and TP a conversion in the same recipe wrote, with marlin_prepacked; the env agrees."""
    checked = 0
    for path in sorted(DEPLOY.glob("*.yaml")):
        containers = _containers(path)
        converts = [(c, a) for c in containers for a in _argvs(c) if a[:2] == ["marlin-pack", "convert"]]
        assert converts, f"{path.name}: no conversion"
        for c, argv in converts:
            for check in [a for a in _argvs(c) if a[:2] == ["marlin-pack", "check"]]:
                assert check[2] == argv[2] and _marlin_pack_context(check).params["tp"] in _tp_sizes(argv)
        pod_env = {e["name"]: e["value"] for c, _ in converts for e in c.get("env", [])}
        for c, _ in converts:
            _assert_on_a_volume(path, c)
        for c in containers:
            for argv in (a for a in _argvs(c) if a[:2] == ["vllm", "serve"]):
                flags = _vllm_serve_flags(argv)
                assert flags["--load-format"] == "marlin_prepacked"
                convert = next(a for _, a in converts if a[2] == argv[2])
                assert int(flags.get("--tensor-parallel-size") or 1) in _tp_sizes(convert)
                env = {e["name"]: e["value"] for e in c.get("env", [])}
                for name in ("HF_HOME", "MARLIN_PACK_CACHE"):
                    assert env.get(name) == pod_env.get(name), f"{path.name}: {name} differs between convert and vllm"
                _assert_on_a_volume(path, c)
                checked += 1
    dockerfile = _dockerfile_argvs(DEPLOY / "Dockerfile")
    convert = next(a for a in dockerfile if a[:2] == ["marlin-pack", "convert"])
    flags = _vllm_serve_flags(dockerfile[-1])
    assert dockerfile[-1][2] == convert[2] and flags["--load-format"] == "marlin_prepacked"
    assert int(flags.get("--tensor-parallel-size") or 1) in _tp_sizes(convert)
    assert checked >= 1


@pytest.mark.slow
def test_every_vllm_flag_is_one_vllm_takes() -> None:
    """The flags of each `vllm serve` are vLLM 0.33.0's engine or server arguments (their dataclass fields)."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    cli_args = pytest.importorskip("vllm.entrypoints.common.cli_args")
    known = {f"--{f.name.replace('_', '-')}" for cls in (arg_utils.AsyncEngineArgs, cli_args.FrontendArgs) for f in dataclasses.fields(cls)}
    assert "--tensor-parallel-size" in known and "--no-such-flag" not in known
    serves = [(where, argv) for where, argv in _recipe_argvs() if argv[:2] == ["vllm", "serve"]]
    assert len(serves) >= 2
    for where, argv in serves:
        unknown = set(_vllm_serve_flags(argv)) - known
        assert not unknown, f"{where}: vllm serve takes no {sorted(unknown)}"


# --- the pod's roles, with real processes ----------------------------------------------------------------------


def _marlin_pack(*args: str, wrap: list[str] | None = None) -> list[str]:
    return [*(wrap or []), sys.executable, "-m", "marlin_pack.cli", *args]


def _check(model: Path, tp: int, stamps: Path, wrap: list[str] | None = None) -> dict:
    env = {**os.environ, "MARLIN_PACK_STAMPS": str(stamps)}
    r = subprocess.run(_marlin_pack("check", str(model), "--tp", str(tp), "--json", wrap=wrap),
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"check exited {r.returncode}: {r.stdout}{r.stderr}"
    report = json.loads(r.stdout)
    assert report["decision"] == "load" and [x["decision"] for x in report["ranks"]] == ["load"] * tp, report
    return report


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode) for p in root.rglob("*")}


def _read_only_wrapper(volume: Path) -> list[str]:
    """How to run a process that sees ``volume`` read-only: file modes, or as root a read-only bind mount."""
    if os.geteuid() != 0:
        for p in [volume, *volume.rglob("*")]:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        return []
    # root ignores file modes: a private mount namespace with the volume bind-mounted read-only
    wrap = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(volume)]
    if shutil.which("unshare") is None:
        pytest.skip("running as root, which ignores file modes, and no unshare(1) for a read-only bind mount")
    probe = subprocess.run([*wrap, "touch", str(volume / "probe")], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0 or (volume / "probe").exists():
        pytest.skip(f"running as root, which ignores file modes, and no read-only bind mount here: {probe.stderr.strip()}")
    return wrap


@pytest.mark.slow
def test_pods_starting_together_convert_once_then_the_engine_loads(make_checkpoint, tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    model = volume / "model"
    shutil.copytree(make_checkpoint("awq", "wide"), model)
    before = set(os.listdir(model))

    # The init containers of four pods that start together, each converting onto the shared volume.
    procs = [subprocess.Popen(_marlin_pack("convert", str(model), "--tp", "1,2"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    for rc, out, err in results:
        assert rc == 0, f"an init container's convert exited {rc}: {out}{err}"

    # Exactly one bundle, and no temporary directory or lock left beside it.
    assert set(os.listdir(model)) - before == {"marlin-pack"}
    assert [p.parent for p in volume.rglob("manifest.json")] == [model / "marlin-pack"]
    leftovers = [p for p in volume.rglob("*") if re.search(r"\.tmp|\.lock$|^\.marlin-pack", p.name)]
    assert not leftovers, leftovers
    r = subprocess.run(_marlin_pack("verify", str(model / "marlin-pack")), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    # The engine's pre-GPU decision, as a new serving user would take it.
    report = _check(model, 2, tmp_path / "engine-stamps")
    assert report["hashed"]["files"] > 0 and report["hashed"]["unavailable"] is None

    # The same volume read-only: the check still loads, writes nothing there, and its stamps spare the next start.
    tree = _tree(volume)
    stamps = tmp_path / "ro-stamps"
    try:
        wrap = _read_only_wrapper(volume)
        first = _check(model, 2, stamps, wrap)
        assert first["hashed"]["files"] > 0
        again = _check(model, 2, stamps, wrap)
        assert again["hashed"]["files"] == first["hashed"]["files"] - first["hashed"]["stamped"]
        # no writable stamp store at all (a read-only home): it still loads, hashing every time, and says so
        unwritable = _check(model, 2, model / "stamps", wrap)
        assert unwritable["hashed"]["files"] > 0 and unwritable["hashed"]["unavailable"]
        assert not (model / "stamps").exists()
    finally:
        for p in [volume, *volume.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert {k: v[:2] for k, v in _tree(volume).items()} == {k: v[:2] for k, v in tree.items()}
