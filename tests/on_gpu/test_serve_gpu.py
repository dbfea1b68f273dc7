"""``vllm serve MODEL_DIR --load-format marlin_prepacked`` answers like the ordinary server.

The two servers run one after the other on 127.0.0.1 (two at once on one GPU make the
second one's memory profiling fail), each started in its own session and killed by
process group. Temperature 0: the completions must be identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from _harness import ATTN

READY_TIMEOUT_S = 300

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _start(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float16",
        "--enforce-eager",
        "--attention-backend",
        ATTN,
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server on {port} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"server on {port} not ready after {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _complete(port: int, prompt: str) -> dict:
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]


def test_serve_prepacked_matches_ordinary(tmp_path: Path) -> None:
    from marlin_pack import convert
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint

    model = write_awq_checkpoint(tmp_path / "tiny-awq", PRESETS["tiny"])
    convert(model, tp=(1,), dtype="float16", kernel="marlin")
    prompts = ("Hello, my name is", "The capital of France is")
    runs = {"ordinary": ("--linear-backend", "marlin"), "prepacked": ("--load-format", "marlin_prepacked")}
    answers: dict[str, list[dict]] = {}
    for i, (name, extra) in enumerate(runs.items()):
        port, log = 8011 + i, tmp_path / f"{name}.log"
        proc = _start(model, port, log, *extra)
        try:
            _wait_ready(port, proc, log)
            answers[name] = [_complete(port, p) for p in prompts]
        finally:
            _stop(proc)
        for line in log.read_text().splitlines():
            if "marlin-pack:" in line or "Model loading took" in line or "Using MarlinLinearKernel" in line:
                print(f"{name}: {line[-220:]}")
        if name == "prepacked":
            text = log.read_text()
            assert "marlin-pack: validate" in text and "Using MarlinLinearKernel" in text
    for p, a, b in zip(prompts, answers["ordinary"], answers["prepacked"], strict=True):
        print(f"{p!r}: ordinary {a['text']!r} | prepacked {b['text']!r}")
        assert a["text"] == b["text"]
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["top_logprobs"] == b["logprobs"]["top_logprobs"]


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
