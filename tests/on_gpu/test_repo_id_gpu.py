"""GPU: a Hugging Face model id served from a local hub cache with ``--load-format marlin_prepacked``.

The checkpoint sits in a hand-made hub cache (refs/main, snapshots with symlinked blobs), is
converted by repo id (bundle in ``MARLIN_PACK_CACHE``), and an offline engine given the same
repo id loads it from the bundle: the loader's own timing line shows the prepacked path ran.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import ATTN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

REPO = "acme/tiny-awq"
ENGINE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format="marlin_prepacked", dtype="float16", enforce_eager=True,
          attention_backend=sys.argv[2], gpu_memory_utilization=0.25, max_model_len=256, max_num_seqs=2)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
print("TOKENS", len(out[0].outputs[0].token_ids))
"""


def _cache_repo(hub: Path, source: Path, commit: str) -> None:
    root = hub / f"models--{REPO.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_repo_id_served_from_the_hub_cache(tmp_path: Path) -> None:
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint

    src = write_awq_checkpoint(tmp_path / "src", PRESETS["tiny"], group_size=128)
    _cache_repo(tmp_path / "hf" / "hub", src, "c" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "MARLIN_PACK_CACHE": str(tmp_path / "mp"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cli = [sys.executable, "-m", "marlin_pack.cli"]
    r = subprocess.run([*cli, "convert", REPO, "--kernel", "marlin"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mp" / "models--acme--tiny-awq" / ("c" * 40) / "manifest.json").is_file()
    r = subprocess.run([*cli, "check", REPO], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "load" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-c", ENGINE, REPO, ATTN], env=env, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "TOKENS 8" in r.stdout and "marlin-pack: validate" in log and "models--acme--tiny-awq" in log, log[-4000:]
    print("repo id served from the bundle:", next(line for line in log.splitlines() if "marlin-pack: validate" in line)[-200:])
