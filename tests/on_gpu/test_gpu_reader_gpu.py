"""``ParallelReader`` to CUDA destinations in each ``io_mode``: every byte lands where the
safetensors header says, with windows smaller than the tensors (split) and larger (merged)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack.io.safetensors_io import read_header
from marlin_pack.vllm_plugin.gpu_reader import CopyItem, ParallelReader

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tensor_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {  # odd sizes: pieces start and end inside pages
        f"t{i}": torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
        for i, n in enumerate([1, 7, 4095, 70_001, 300_000, 5, 1 << 20])
    }
    tensors["h"] = torch.randn(333, 77, generator=g).half()
    path = tmp_path_factory.mktemp("reader") / "f.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("mode", ["auto", "staged", "registered", "hybrid", "processes"])
@pytest.mark.parametrize(("threads", "chunk"), [(1, 1 << 16), (4, 1 << 16), (3, 1 << 30)])
def test_reader_modes_copy_every_byte_to_the_gpu(tensor_file: Path, mode: str, threads: int, chunk: int) -> None:
    header = read_header(tensor_file)
    want = load_file(str(tensor_file))
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    with ParallelReader(threads=threads, chunk_bytes=chunk, mode=mode) as r:  # type: ignore[arg-type]
        n = r.copy(tensor_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
        n += r.copy(tensor_file, [CopyItem(header.tensors["t1"].start, 28, out["t1"])])  # the file again
    assert n == sum(i.nbytes for i in header.tensors.values()) + 28
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


def test_registered_with_populated_windows(tensor_file: Path) -> None:
    header = read_header(tensor_file)
    want = load_file(str(tensor_file))
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    with ParallelReader(threads=3, chunk_bytes=1 << 16, mode="registered", populate=True) as r:
        r.copy(tensor_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


@pytest.mark.parametrize("settings", ["plain", "staged", "deferred"])
@pytest.mark.parametrize("own_share", [True, False])
@pytest.mark.parametrize(("threads", "chunk"), [(1, 1 << 16), (4, 1 << 16), (3, 1 << 30), (0, 1 << 16)])
def test_processes_mode_copies_every_byte_in_the_helpers(
    tensor_file: Path, threads: int, chunk: int, own_share: bool, settings: str
) -> None:
    """The helpers themselves copy (none fails, nothing is left to this process), into allocations of
    several sizes (the caching allocator's segments), at offsets inside them; with ``own_share`` this
    process copies the file's tail beside them. ``staged``: two staging threads per helper with 1 MiB
    buffers (windows cut into several stages) beside the registered ones; ``deferred``: windows
    unregistered after each job's answer (two jobs, so the second maps the file again). ``threads`` 0:
    with ``staged`` the staging threads copy everything, else each helper still gets one thread."""
    from marlin_pack.vllm_plugin.copy_helpers import HelperPool

    header = read_header(tensor_file)
    want = load_file(str(tensor_file))
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    extra = {"staged": {"staged": 2, "stage_mib": 1}, "deferred": {"defer_unregister": True}}.get(settings, {})
    with HelperPool(3, torch.cuda.current_device(), **extra) as pool:  # type: ignore[arg-type]
        with ParallelReader(threads=threads, chunk_bytes=chunk, mode="processes", helpers=pool, own_share=own_share) as r:
            n = r.copy(tensor_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
            n += r.copy(tensor_file, [CopyItem(header.tensors["t1"].start, 28, out["t1"])])  # a second job
            n += r.copy(tensor_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])  # a third
        assert pool.failures == []
        assert r.modes_used == {"processes"}
    assert n == 2 * sum(i.nbytes for i in header.tensors.values()) + 28
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


@pytest.mark.parametrize("settings", ["plain", "staged", "deferred"])
@pytest.mark.parametrize("helpers", [1, 3])
def test_processes_mode_copies_several_files_in_one_job_per_helper(
    tensor_file: Path, tmp_path: Path, settings: str, helpers: int
) -> None:
    """``copy_files`` (the rank file and the common tensors): every byte of both files lands, copied by the
    helpers, whose shares cut across the two files; then a job of one of the same files (``deferred``: it
    waits for the first job's pages to be unregistered)."""
    from marlin_pack.vllm_plugin.copy_helpers import HelperPool

    g = torch.Generator().manual_seed(1)
    other = tmp_path / "common.safetensors"
    save_file({"embed": torch.randn(1000, 257, generator=g).half(), "norm": torch.randn(99, generator=g)}, str(other))
    files = [tensor_file, other]
    headers = [read_header(f) for f in files]
    wants = [load_file(str(f)) for f in files]
    outs = [{n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in h.tensors.items()} for h in headers]
    extra = {"staged": {"staged": 2, "stage_mib": 1}, "deferred": {"defer_unregister": True}}.get(settings, {})
    with HelperPool(helpers, torch.cuda.current_device(), **extra) as pool:  # type: ignore[arg-type]
        with ParallelReader(threads=2, chunk_bytes=1 << 16, mode="processes", helpers=pool, own_share=False) as r:
            jobs = [
                (f, [CopyItem(i.start, i.nbytes, out[n]) for n, i in h.tensors.items()])
                for f, h, out in zip(files, headers, outs, strict=True)
            ]
            n = r.copy_files(jobs)
            n += r.copy_files(jobs[1:])  # the common file again, alone
        assert pool.failures == []
        assert r.modes_used == {"processes"}
    assert n == sum(i.nbytes for h in headers for i in h.tensors.values()) + sum(i.nbytes for i in headers[1].tensors.values())
    for want, out in zip(wants, outs, strict=True):
        for name, t in want.items():
            assert torch.equal(out[name].cpu(), t), name


@pytest.mark.parametrize(("retain_mib", "preload"), [(0, False), (64, False), (64, True)], ids=["plain", "retain", "preload"])
def test_service_helpers_copy_every_byte_engine_after_engine(
    tensor_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retain_mib: int, preload: bool
) -> None:
    """``marlin-pack helpers``: pools in a row (engines' loads) take the service's helpers, which copy every
    byte (nothing left to this process), are ready at once and go on serving; stopping the service removes
    its sockets. ``retain_mib``: the second pool finds the file's pages still registered (its helpers
    say so); then the file is rewritten (renamed over) and the third pool gets the new bytes. ``preload``:
    the file is page-locked before the first pool, whose windows (cut inside the preloaded blocks) are then
    all held: no helper retains more after it."""
    import tempfile

    from marlin_pack.vllm_plugin.copy_helpers import HelperPool
    from marlin_pack.vllm_plugin.helper_service import HelperService

    d = Path(tempfile.mkdtemp(prefix="mph-", dir="/tmp"))
    monkeypatch.setenv("MARLIN_PACK_HELPERS_DIR", str(d))
    file = tmp_path / "rank.safetensors"
    shutil.copyfile(tensor_file, file)
    service = HelperService([torch.cuda.current_device()], processes=2, directory=d, retain_mib=retain_mib)
    service.start()
    try:
        assert all(h.uuid is not None for h in service.helpers)
        if preload:
            assert sum(service.preload([file]).values()) >= file.stat().st_size
        before = None
        for round_ in range(3):
            if round_ == 2:  # a rewritten bundle: other bytes under the same name
                new = tmp_path / "new.safetensors"
                save_file({n: (t + 1 if t.is_floating_point() else t ^ 0x5A5A) for n, t in load_file(str(file)).items()}, str(new))
                os.replace(new, file)
            header, want = read_header(file), load_file(str(file))
            out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
            with HelperPool(4, torch.cuda.current_device()) as pool:
                with ParallelReader(threads=2, chunk_bytes=1 << 16, mode="processes", helpers=pool, own_share=False) as r:
                    n = r.copy(file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
                assert (pool.source, pool.ready(), pool.failures) == ("service", 2, [])
                assert pool.ready_after is not None and pool.ready_after < 0.2
                assert r.modes_used == {"processes"}
                if retain_mib:
                    assert (pool.retained_bytes or 0) > 0 if round_ > 0 or preload else pool.retained_bytes == 0
                    if preload and round_ == 1:
                        assert pool.retained_bytes == before  # the first pool's windows were all held already
                    before = pool.retained_bytes
                else:
                    assert pool.retained_bytes is None
            assert n == sum(i.nbytes for i in header.tensors.values())
            for name, t in want.items():
                assert torch.equal(out[name].cpu(), t), name
            assert all(h.proc.poll() is None for h in service.helpers)
    finally:
        service.stop()
    assert list(d.iterdir()) == []


def test_processes_mode_left_windows_are_read_here(tensor_file: Path) -> None:
    """A helper that fails (here: a helper script that answers ready, then errors) costs speed, not bytes."""
    import textwrap

    from marlin_pack.vllm_plugin.copy_helpers import HelperPool

    script = tensor_file.parent / "failing_helper.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"error": "RuntimeError: injected"}), flush=True)
    """))
    header = read_header(tensor_file)
    want = load_file(str(tensor_file))
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    with HelperPool(2, torch.cuda.current_device(), script=script) as pool:
        with ParallelReader(threads=2, chunk_bytes=1 << 16, mode="processes", helpers=pool) as r:
            r.copy(tensor_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
        assert pool.failures and "injected" in pool.failures[0]
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


@pytest.fixture(scope="module")
def huge_tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tmpfs of 2 MiB pages (``huge=always``), where root may mount one."""
    mount = tmp_path_factory.mktemp("huge-tmpfs")
    if os.geteuid() != 0:
        pytest.skip("mounting a huge-page tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=64m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a huge-page tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("place", ["huge tmpfs", "/dev/shm"])
def test_auto_mode_copies_with_helpers_from_a_huge_page_tmpfs(
    tensor_file: Path, request: pytest.FixtureRequest, place: str
) -> None:
    """``auto`` with helpers: a file on a huge-page tmpfs is page-locked in place by the helpers as a file on
    disk is (measured as fast to pin), one on a tmpfs of 4 KiB pages is staged; every byte lands either way."""
    from marlin_pack.io.files import in_base_memory_pages
    from marlin_pack.vllm_plugin.copy_helpers import HelperPool
    from marlin_pack.vllm_plugin.gpu_reader import resolve_mode

    if place == "/dev/shm":
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm")
        directory = Path("/dev/shm") / f"marlin-pack-test-{os.getpid()}"
        directory.mkdir(exist_ok=True)
    else:
        directory = request.getfixturevalue("huge_tmpfs")
    path = directory / tensor_file.name
    shutil.copyfile(tensor_file, path)
    try:
        expected = "staged" if place == "/dev/shm" and in_base_memory_pages(path) else "processes"
        assert place == "/dev/shm" or not in_base_memory_pages(path)
        assert resolve_mode("auto", path, helpers=True) == expected
        header = read_header(path)
        want = load_file(str(path))
        out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
        with HelperPool(2, torch.cuda.current_device()) as pool:
            with ParallelReader(threads=2, chunk_bytes=1 << 20, mode="auto", helpers=pool) as r:
                r.copy(path, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
            assert r.modes_used == {expected}
            assert pool.failures == []
        for name, t in want.items():
            assert torch.equal(out[name].cpu(), t), name
    finally:
        path.unlink()
        if place == "/dev/shm":
            directory.rmdir()
