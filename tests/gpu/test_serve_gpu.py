"""``vllm serve MODEL_DIR --load-format marlin_prepacked`` answers like the ordinary server.

Both servers run at once on 127.0.0.1 (one GPU, a small memory share each), started with
``setsid`` and killed by process group. Temperature 0: the completions must be identical.
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

ATTN = os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN")
READY_TIMEOUT_S = 300

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _start(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float16", "--enforce-eager",
        "--attention-backend", ATTN, "--gpu-memory-utilization", "0.2", "--max-model-len", "512",
        "--served-model-name", "tiny", *extra,
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
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]


def test_serve_prepacked_matches_ordinary(tmp_path: Path) -> None:
    from marlin_pack import convert
    from marlin_pack.synthetic import PRESETS, write_awq_checkpoint

    model = write_awq_checkpoint(tmp_path / "tiny-awq", PRESETS["tiny"])
    convert(model, tp_sizes=(1,), dtype="float16")
    logs = {name: tmp_path / f"{name}.log" for name in ("ordinary", "prepacked")}
    servers = {
        "ordinary": (8011, _start(model, 8011, logs["ordinary"], "--linear-backend", "marlin")),
        "prepacked": (8012, _start(model, 8012, logs["prepacked"], "--load-format", "marlin_prepacked")),
    }
    try:
        for name, (port, proc) in servers.items():
            _wait_ready(port, proc, logs[name])
        for prompt in ("Hello, my name is", "The capital of France is"):
            a, b = _complete(8011, prompt), _complete(8012, prompt)
            print(f"{prompt!r}: ordinary {a['text']!r} | prepacked {b['text']!r}")
            assert a["text"] == b["text"]
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        log = logs["prepacked"].read_text()
        assert "marlin-pack: validate" in log and "Using MarlinLinearKernel" in log
        for line in log.splitlines():
            if "marlin-pack:" in line or "Model loading took" in line:
                print("prepacked:", line[-200:])
        for line in logs["ordinary"].read_text().splitlines():
            if "Model loading took" in line:
                print("ordinary:", line[-200:])
    finally:
        for _, proc in servers.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for _, proc in servers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
