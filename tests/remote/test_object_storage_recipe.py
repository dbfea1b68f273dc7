"""docs/deployment.md's object-storage recipe: its marlin-pack commands parse, the pods' check and loader name the same
bucket prefix push published, and played on a small checkpoint against the S3 server (convert once, push), the prefix
is a bundle `marlin-pack check` loads from the bucket, and its local copy (`aws s3 sync --exclude`, to serve from a local
copy instead) one it loads too."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import typer
from typer.main import get_command

from marlin_pack.cli import app
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


def _recipe() -> list[list[str]]:
    section = DOC.read_text().split("## Bundles in object storage", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_recipes_marlin_pack_commands_parse() -> None:
    argvs = [a for a in _recipe() if a[0] == "marlin-pack"]
    assert [a[1] for a in argvs] == ["convert", "push", "check"]
    group = get_command(app)
    for argv in argvs:
        command = group.get_command(typer.Context(group), argv[1])
        assert command is not None, argv
        command.make_context(argv[1], argv[2:])  # a wrong flag or value raises
    push_, check = argvs[1], argvs[2]
    serve = next(a for a in _recipe() if a[:2] == ["vllm", "serve"])
    extra = json.loads(serve[serve.index("--model-loader-extra-config") + 1])
    assert push_[3] == check[check.index("--bundle") + 1] == extra["bundle"]  # the pods stream what push published
    assert f"--exclude {RECORD_NAME}" in DOC.read_text()  # the local copy, to serve from a disk instead


def test_pushed_then_copied_down_the_bundle_loads(make_bundle, s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from marlin_pack.vllm_plugin.preflight import preflight

    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("llama/sm80"))
    local = tmp_path / "bundles" / "llama"
    client = s3.client()
    for key in s3.keys("llama/sm80/"):
        rel = key.removeprefix("llama/sm80/")
        if rel == RECORD_NAME:  # --exclude
            continue
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(s3.bucket, key, str(local / rel))
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == sorted(
        p.relative_to(model / "marlin-pack").as_posix() for p in (model / "marlin-pack").rglob("*") if p.is_file())
    report = preflight(str(model), bundle=local, tp_size=2, rank=None, dtype="float16", verify="full", fallback=False,
                       revision=None, capability=80)
    assert report.decision == "load", report.to_dict()
    streamed = preflight(str(model), bundle=s3.url("llama/sm80"), tp_size=2, rank=None, dtype="float16", verify="full",
                         fallback=False, revision=None, capability=80)
    assert streamed.decision == "load", streamed.to_dict()
    shutil.rmtree(local)
