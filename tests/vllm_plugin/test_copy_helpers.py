"""``copy_helpers`` / ``copy_helper_main`` (the ``processes`` io mode) without a GPU: how windows are
shared out, and that a helper that cannot start or fails leaves every window to the caller.
The copies themselves are checked on a GPU (tests/gpu/test_gpu_reader_gpu.py)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from marlin_pack.vllm_plugin import copy_helper_main
from marlin_pack.vllm_plugin.copy_helpers import HelperPool, split_by_bytes
from marlin_pack.vllm_plugin.gpu_reader import CopyItem, ParallelReader
from marlin_pack.vllm_plugin.options import parse_extra_config


@dataclass
class _W:
    lo: int
    hi: int
    pieces: list = field(default_factory=list)


def _windows(sizes: list[int]) -> list[_W]:
    out, pos = [], 0
    for n in sizes:
        out.append(_W(pos, pos + n, [(pos, n, torch.empty(0))]))
        pos += n
    return out


@pytest.mark.parametrize("sizes", [[10] * 16, [1, 100, 1, 1, 50, 50, 3], [7], [5, 5], list(range(1, 40))])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_split_by_bytes_is_contiguous_complete_and_balanced(sizes: list[int], parts: int) -> None:
    windows = _windows(sizes)
    runs = split_by_bytes(windows, parts)
    assert [w for r in runs for w in r] == windows  # every window once, in file order
    assert 1 <= len(runs) <= min(parts, len(windows)) and all(runs)
    total, biggest = sum(sizes), max(sizes)
    for r in runs:  # no run holds more than its share plus one window
        assert sum(w.hi - w.lo for w in r) <= total / parts + biggest
    if parts <= len(sizes) and len(set(sizes)) == 1:
        assert len(runs) == parts


def test_helper_script_uses_the_standard_library_only() -> None:
    """It runs as ``python -S`` (no site packages): importing torch or marlin_pack would fail there."""
    tree = ast.parse(Path(copy_helper_main.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_helper_without_a_cuda_driver_says_so_in_one_line(tmp_path: Path) -> None:
    if Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() or torch.cuda.is_available():
        pytest.skip("a CUDA driver is installed here")
    r = subprocess.run([sys.executable, "-S", copy_helper_main.__file__, "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "libcuda" in json.loads(lines[0])["error"]


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "helper.py"
    p.write_text(textwrap.dedent(body))
    return p


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('import json; print(json.dumps({"error": "OSError: no libcuda"}), flush=True)', "no libcuda"),
        ("import sys; sys.exit(3)", "exited with status 3"),
        ('print("garbage", flush=True)', "unreadable answer"),
    ],
)
def test_helpers_that_do_not_start_leave_every_window(tmp_path: Path, body: str, why: str) -> None:
    windows = _windows([4096, 8192])
    with HelperPool(2, 0, script=_script(tmp_path, body)) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert len(pool.failures) == 2 and all(why in f for f in pool.failures), pool.failures


def test_ready_helpers_that_cannot_prepare_the_job_leave_every_window(tmp_path: Path) -> None:
    """No CUDA here: the destinations' IPC handles cannot be made, so nothing is sent."""
    ready = 'import json, sys; print(json.dumps({"ready": True}), flush=True); sys.stdin.read()'
    windows = _windows([4096])
    with HelperPool(1, 0, script=_script(tmp_path, ready)) as pool:
        assert pool.copy(tmp_path / "f", windows, threads=1) == windows
        assert len(pool.failures) == 1
    assert pool._procs == []  # closed: each helper ended when its input did


def test_reader_in_processes_mode_reads_cpu_destinations_itself(tmp_path: Path) -> None:
    data = torch.arange(50_000, dtype=torch.int32)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    out = torch.zeros_like(data)
    with ParallelReader(threads=2, chunk_bytes=1 << 16, mode="processes") as r:
        assert r.copy(path, [CopyItem(0, data.numel() * 4, out)]) == data.numel() * 4
        assert r._helpers is None  # no GPU destination: no helper started
    assert torch.equal(out, data)


def test_io_processes_option() -> None:
    o = parse_extra_config({"io_mode": "processes", "io_processes": 2, "io_threads": 8})
    assert (o.io_mode, o.io_processes, o.io_threads) == ("processes", 2, 8)
    assert parse_extra_config({}).io_processes is None
    with pytest.raises(ValueError, match=r"\['io_processes'\] must be an integer in 1\.\.32"):
        parse_extra_config({"io_processes": 0})
