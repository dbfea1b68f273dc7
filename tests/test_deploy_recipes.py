"""The deployment recipes (docs/deployment.md, examples/deploy/): their commands parse, each bundle is for a GPU the
recipe names, and the pod's roles work.

Every conversion names the GPU its bundle is for (``--compute-capability``; or it runs in a container given a GPU),
and every ``check``, node selector and server of the recipe agrees with it; each recipe's conversions and checks,
played on a small checkpoint, give every layer the kernel vLLM runs it with on that GPU. The pod plays out with
real processes on a temporary "volume": several init containers start ``marlin-pack convert`` at once, then
``marlin-pack check`` decides as the engine would, also on a read-only volume.
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
from typer.testing import CliRunner

from marlin_pack import read_manifest
from marlin_pack.cli import app
from marlin_pack.machete.supports import machete_supports
from marlin_pack.schemas import Manifest, TensorParallelSet, torch_dtype

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


def _spec_containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _containers(path: Path) -> list[dict]:
    return [c for doc in _yaml_docs(path) for spec in _pod_specs(doc) for c in _spec_containers(spec)]


def _arg(match: re.Match, args: dict[str, str]) -> str:
    """``${NAME}``, or ``${NAME%%,*}`` (the shell's: up to the first comma), from the ARG defaults."""
    if match.group(1) not in args:
        return match.group(0)
    value = args[match.group(1)]
    return value.split(",")[0] if match.group(2) else value


def _dockerfile_argvs(path: Path) -> list[list[str]]:
    """The commands of the Dockerfile's RUN lines, and ENTRYPOINT + CMD, with the ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    out, entrypoint, cmd = [], [], []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        rest = re.sub(r"\$\{(\w+)(%%,\*)?\}", lambda m: _arg(m, args), rest)
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


def _mounts(container: dict) -> set[str]:
    return {m["mountPath"] for m in container.get("volumeMounts", [])}


def _assert_on_a_volume(path: Path, container: dict) -> None:
    """Where a model id's checkpoint and bundle go (HF_HOME, MARLIN_PACK_CACHE) is on a volume of the container."""
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    mounts = _mounts(container)
    places = [env[n] for n in ("HF_HOME", "MARLIN_PACK_CACHE") if n in env]
    assert places and all(any(v.startswith(m + "/") for m in mounts) for v in places), f"{path.name}: {places} off {mounts}"


# --- which GPU each bundle is for --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Step:
    """One command of a recipe, with the container it runs in and the GPU its pod's node selector names."""

    where: str
    argv: list[str]
    container: dict
    node: str | None  # "9.0" from nvidia.com/gpu.compute.major/minor; None: no such selector (or the Dockerfile)


RECIPES = [*(p.name for p in sorted(DEPLOY.glob("*.yaml"))), "Dockerfile"]


def _node_capability(spec: dict) -> str | None:
    selector = spec.get("nodeSelector") or {}
    major = selector.get("nvidia.com/gpu.compute.major")
    return None if major is None else f"{major}.{selector.get('nvidia.com/gpu.compute.minor', '0')}"


def _steps(recipe: str) -> list[_Step]:
    if recipe == "Dockerfile":
        return [_Step(recipe, argv, {}, None) for argv in _dockerfile_argvs(DEPLOY / recipe)]
    return [
        _Step(f"{recipe} {doc['metadata']['name']}/{c['name']}", argv, c, _node_capability(spec))
        for doc in _yaml_docs(DEPLOY / recipe) for spec in _pod_specs(doc) for c in _spec_containers(spec) for argv in _argvs(c)
    ]


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``argv`` (``--name value`` or ``--name=value``)."""
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(name + "="):
                return word.partition("=")[2]
    return None


def _given_a_gpu(container: dict) -> bool:
    resources = container.get("resources") or {}
    return any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))


def _bundle_key(argv: list[str]) -> tuple[str, str | None]:
    """(MODEL, bundle directory; None: the default place) of a convert, check or vllm serve."""
    if argv[:2] == ["marlin-pack", "convert"]:
        return argv[2], _flag(argv, "-o", "--output")
    if argv[:2] == ["marlin-pack", "check"]:
        return argv[2], _flag(argv, "--bundle")
    assert argv[:2] == ["vllm", "serve"], argv
    extra = _vllm_serve_flags(argv).get("--model-loader-extra-config")
    return argv[2], json.loads(extra).get("bundle") if extra else None


def _gpu_of_each_bundle(steps: list[_Step]) -> dict[tuple[str, str | None], str | None]:
    """{bundle: the compute capability its conversion names}, asserting that every conversion names the GPU (or runs
    in a container given one: None), that its pod's node selector agrees, and that every check and server of the
    recipe is for a bundle the recipe writes, on the GPU it was written for."""
    gpu: dict[tuple[str, str | None], str | None] = {}
    for st in steps:
        if st.argv[:2] != ["marlin-pack", "convert"]:
            continue
        cc = _flag(st.argv, "--compute-capability")
        assert cc is not None or _given_a_gpu(st.container), (
            f"{st.where}: `{shlex.join(st.argv)}` converts without naming the GPU the bundle is for (a machine without "
            "a GPU writes Marlin's layout, slower on H100/H200): pass --compute-capability (9.0 H100/H200, 8.0 A100) "
            "or run it in a container given the GPU")
        assert cc is None or st.node is None or cc == st.node, f"{st.where}: converts for {cc}, on a node of {st.node}"
        gpu[_bundle_key(st.argv)] = cc if cc is not None else st.node
    for st in steps:
        if st.argv[:2] not in (["marlin-pack", "check"], ["vllm", "serve"]):
            continue
        key = _bundle_key(st.argv)
        assert key in gpu, f"{st.where}: `{shlex.join(st.argv)}` uses a bundle no conversion of the recipe writes: {key}"
        if st.argv[0] == "marlin-pack":
            cc = _flag(st.argv, "--compute-capability")
            assert cc == gpu[key], f"{st.where}: `{shlex.join(st.argv)}` checks for {cc}, the bundle is for {gpu[key]}"
        if st.node is not None:
            assert gpu[key] == st.node, f"{st.where}: a node of {st.node} uses the bundle for {gpu[key]}: {key}"
    return gpu


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_bundle_is_for_a_gpu_the_recipe_names(recipe: str) -> None:
    """Each conversion names the GPU (or sees it); checks, node selectors and servers agree with it."""
    gpu = _gpu_of_each_bundle(_steps(recipe))
    assert gpu and all(cc is not None for cc in gpu.values()), gpu


def test_a_conversion_without_a_gpu_named_is_caught() -> None:
    convert = ["marlin-pack", "convert", "M", "--tp", "2"]
    with pytest.raises(AssertionError, match="without naming the GPU"):
        _gpu_of_each_bundle([_Step("x", convert, {}, None)])
    on_the_gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert _gpu_of_each_bundle([_Step("x", convert, on_the_gpu, "9.0")]) == {("M", None): "9.0"}
    named = _Step("x", [*convert, "--compute-capability", "9.0"], {}, None)
    with pytest.raises(AssertionError, match="converts for 9.0, on a node of 8.0"):
        _gpu_of_each_bundle([dataclasses.replace(named, node="8.0")])
    with pytest.raises(AssertionError, match="checks for 8.0, the bundle is for 9.0"):
        _gpu_of_each_bundle([named, _Step("x", ["marlin-pack", "check", "M", "--compute-capability", "8.0"], {}, None)])
    with pytest.raises(AssertionError, match="checks for None"):
        _gpu_of_each_bundle([named, _Step("x", ["marlin-pack", "check", "M"], {}, None)])
    with pytest.raises(AssertionError, match="a node of 8.0 uses the bundle for 9.0"):
        _gpu_of_each_bundle([named, _Step("x", ["vllm", "serve", "M"], {}, "8.0")])
    with pytest.raises(AssertionError, match="no conversion of the recipe writes"):
        _gpu_of_each_bundle([named, _Step("x", ["marlin-pack", "check", "M", "--bundle", "/b"], {}, None)])


def _expected_kernels(manifest: Manifest, tp_set: TensorParallelSet, capability: str | None) -> list[str]:
    """What vLLM runs each layer of ``tp_set`` with on a GPU of ``capability`` by default: Machete where it implements
    the layer on SM90, else Marlin."""
    major, _, minor = (capability or "").partition(".")
    cc = int(major) * 10 + int(minor or 0) if major else None
    q = manifest.quant
    return ["machete" if machete_supports(
        capability=cc, weight_type=q.weight_type.value, zero_points=q.zero_points, group_size=q.group_size,
        act_dtype=torch_dtype(manifest.serving_dtype), in_features=e.size_k, out_features=e.size_n)[0] else "marlin"
        for e in tp_set.layers]


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_bundle_holds_the_kernels_of_the_gpu_its_recipe_names(recipe: str, make_checkpoint, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's conversions and checks, played in order on a small AWQ checkpoint (each model id or directory a copy
    of it, each bundle directory moved under tmp_path): every layer of every TP size holds the layout of the kernel vLLM
    runs it with on the GPU the conversion names, and every check loads, naming those kernels."""
    steps = [st for st in _steps(recipe) if st.argv[:2] in (["marlin-pack", "convert"], ["marlin-pack", "check"])]
    gpu = _gpu_of_each_bundle(_steps(recipe))
    source, models, bundles = make_checkpoint("awq", "wide"), {}, {}
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))

    def local(argv: list[str]) -> list[str]:
        argv = list(argv)
        if argv[2] not in models:
            models[argv[2]] = tmp_path / f"model-{len(models)}"
            shutil.copytree(source, models[argv[2]])
        argv[2] = str(models[argv[2]])
        for i, word in enumerate(argv[:-1]):
            if word in ("-o", "--output", "--bundle"):
                argv[i + 1] = str(tmp_path / "volume" / argv[i + 1].lstrip("/"))
        return [*argv[1:], "--json"]

    runner = CliRunner()
    for st in steps:
        r = runner.invoke(app, local(st.argv))
        assert r.exit_code == 0, f"{st.where}: `{shlex.join(st.argv)}` exited {r.exit_code}: {r.output}"
        cc = gpu[_bundle_key(st.argv)]
        if st.argv[1] == "convert":
            manifest = read_manifest(json.loads(r.stdout)["bundle"])
            bundles[_bundle_key(st.argv)] = manifest
            for s in manifest.tensor_parallel:
                got = [e.kernel.value for e in s.layers]
                assert got == _expected_kernels(manifest, s, cc), f"{st.where}: tp {s.tp_size} for {cc}: {got}"
                assert ("machete" in got) == (cc == "9.0"), f"{st.where}: tp {s.tp_size} for {cc}: {got}"
        else:
            report = json.loads(r.stdout)
            assert report["decision"] == "load", report
            machete = bundles[_bundle_key(st.argv)].has_machete_layers
            for rank in report["ranks"]:
                assert ("on MacheteLinearKernel" in rank["message"]) == machete and "forced" not in rank["message"], rank
    assert {st.argv[1] for st in steps} == {"convert", "check"}


def test_every_engine_uses_the_converted_model_and_tp() -> None:
    """Each check and vllm serve: the model, bundle and TP a conversion of the same recipe wrote, with marlin_prepacked;
    bundles and caches on the containers' volumes; the env agrees."""
    checked = 0
    for path in sorted(DEPLOY.glob("*.yaml")):
        steps = _steps(path.name)
        converts = {_bundle_key(st.argv): st for st in steps if st.argv[:2] == ["marlin-pack", "convert"]}
        assert converts, f"{path.name}: no conversion"
        pod_env = {e["name"]: e["value"] for st in converts.values() for e in st.container.get("env", [])}
        for key, st in converts.items():
            _assert_on_a_volume(path, st.container)
            assert key[1] is None or any(key[1].startswith(m + "/") for m in _mounts(st.container)), f"{st.where}: {key[1]}"
        for st in steps:
            if st.argv[:2] == ["marlin-pack", "check"]:
                assert _marlin_pack_context(st.argv).params["tp"] in _tp_sizes(converts[_bundle_key(st.argv)].argv)
            if st.argv[:2] != ["vllm", "serve"]:
                continue
            flags = _vllm_serve_flags(st.argv)
            assert flags["--load-format"] == "marlin_prepacked"
            key = _bundle_key(st.argv)
            assert int(flags.get("--tensor-parallel-size") or 1) in _tp_sizes(converts[key].argv)
            env = {e["name"]: e["value"] for e in st.container.get("env", [])}
            for name in ("HF_HOME", "MARLIN_PACK_CACHE"):
                assert env.get(name) == pod_env.get(name), f"{st.where}: {name} differs between convert and vllm"
            _assert_on_a_volume(path, st.container)
            assert key[1] is None or any(key[1].startswith(m + "/") for m in _mounts(st.container)), f"{st.where}: {key[1]}"
            checked += 1
    dockerfile = _dockerfile_argvs(DEPLOY / "Dockerfile")
    convert = next(a for a in dockerfile if a[:2] == ["marlin-pack", "convert"])
    flags = _vllm_serve_flags(dockerfile[-1])
    assert dockerfile[-1][2] == convert[2] and flags["--load-format"] == "marlin_prepacked"
    assert int(flags.get("--tensor-parallel-size") or 1) in _tp_sizes(convert)
    assert checked >= 3


@pytest.mark.slow
def test_every_vllm_flag_is_one_vllm_takes() -> None:
    """The flags of each `vllm serve` are the installed vLLM's engine or server arguments (their dataclass fields)."""
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
