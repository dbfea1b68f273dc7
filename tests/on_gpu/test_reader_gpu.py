"""``ParallelReader`` to CUDA destinations under each I/O plan, and the copy helpers on a real GPU: every
byte lands where the safetensors header says, with windows smaller than the tensors (split) and larger
(merged)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack.gpu.helpers import HelperPool
from marlin_pack.gpu.plan import IoFacts, IoPlan, plan_io
from marlin_pack.gpu.reader import CopyItem, ParallelReader
from marlin_pack.io.safetensors_io import read_header

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


def _outputs(path: Path) -> tuple[dict, dict, list[CopyItem]]:
    header = read_header(path)
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    items = [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()]
    return load_file(str(path)), out, items


def _same(want: dict, out: dict) -> None:
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


@pytest.mark.parametrize("mode", ["staged", "registered"])
@pytest.mark.parametrize("populate", [True, False])
@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 16), (4, 1 << 16), (3, 1 << 30)])
def test_in_process_plans_copy_every_byte_to_the_gpu(tensor_file: Path, mode: str, populate: bool, threads: int, window: int) -> None:
    want, out, items = _outputs(tensor_file)
    header = read_header(tensor_file)
    with ParallelReader(IoPlan(mode, threads, window), populate=populate) as r:  # type: ignore[arg-type]
        n = r.copy(tensor_file, items)
        n += r.copy(tensor_file, [CopyItem(header.tensors["t1"].start, 28, out["t1"])])  # the file again
        assert r.modes_used == {mode}
    assert n == sum(i.nbytes for i in header.tensors.values()) + 28
    _same(want, out)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 16), (4, 1 << 16), (3, 1 << 30)])
def test_helpers_copy_every_byte(tensor_file: Path, threads: int, window: int, defer: bool) -> None:
    """The helpers themselves copy (none fails, nothing is left to this process), into allocations of several
    sizes at offsets inside them; three jobs in a row (``defer``: the second maps the file again)."""
    want, out, items = _outputs(tensor_file)
    header = read_header(tensor_file)
    with HelperPool(3, torch.cuda.current_device(), defer_unregister=defer) as pool:
        with ParallelReader(IoPlan("helpers", threads, window, 3), helpers=pool) as r:
            n = r.copy(tensor_file, items)
            n += r.copy(tensor_file, [CopyItem(header.tensors["t1"].start, 28, out["t1"])])
            n += r.copy(tensor_file, items)
        assert pool.failures == []
        assert r.modes_used == {"helpers"}
    assert n == 2 * sum(i.nbytes for i in header.tensors.values()) + 28
    _same(want, out)


@pytest.mark.parametrize("helpers", [1, 3])
def test_helpers_copy_several_files_in_one_job_each(tensor_file: Path, tmp_path: Path, helpers: int) -> None:
    """``copy_files`` (the rank file and the common tensors): every byte of both lands, copied by the helpers,
    whose shares cut across the two files; then a job of one of them alone."""
    g = torch.Generator().manual_seed(1)
    other = tmp_path / "common.safetensors"
    save_file({"embed": torch.randn(1000, 257, generator=g).half(), "norm": torch.randn(99, generator=g)}, str(other))
    (want_a, out_a, items_a), (want_b, out_b, items_b) = _outputs(tensor_file), _outputs(other)
    with HelperPool(helpers, torch.cuda.current_device()) as pool:
        with ParallelReader(IoPlan("helpers", 2, 1 << 16, helpers), helpers=pool) as r:
            n = r.copy_files([(tensor_file, items_a), (other, items_b)])
            n += r.copy_files([(other, items_b)])
        assert pool.failures == []
        assert r.modes_used == {"helpers"}
    assert n == sum(it.nbytes for it in items_a) + 2 * sum(it.nbytes for it in items_b)
    _same(want_a, out_a)
    _same(want_b, out_b)


def test_retained_then_copied_then_let_go_then_rewritten(tensor_file: Path, tmp_path: Path) -> None:
    """As ``preload`` drives them: the helpers page-lock the file first (``retain``), the copy takes every window
    from the helper holding it, ``let_go`` leaves them alive, and a rewritten file under the same name gets its
    new bytes in the next job."""
    file = tmp_path / "rank.safetensors"
    shutil.copyfile(tensor_file, file)
    with HelperPool(2, torch.cuda.current_device()) as pool:
        assert pool.retain([file], 1 << 16) >= file.stat().st_size
        want, out, items = _outputs(file)
        with ParallelReader(IoPlan("helpers", 2, 1 << 16, 2), helpers=pool) as r:
            r.copy(file, items)
        _same(want, out)
        pool.let_go()
        new = tmp_path / "new.safetensors"
        save_file({n: (t + 1 if t.is_floating_point() else t ^ 0x5A5A) for n, t in load_file(str(file)).items()}, str(new))
        os.replace(new, file)
        want, out, items = _outputs(file)
        with ParallelReader(IoPlan("helpers", 2, 1 << 16, 2), helpers=pool) as r:
            r.copy(file, items)
        assert pool.failures == []
        _same(want, out)


def test_windows_a_helper_leaves_are_read_here(tensor_file: Path) -> None:
    """A helper that fails (a script that answers ready, then errors) costs speed, not bytes."""
    script = tensor_file.parent / "failing_helper.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True, "protocol": 2}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"error": "RuntimeError: injected"}), flush=True)
    """))
    want, out, items = _outputs(tensor_file)
    with HelperPool(2, torch.cuda.current_device(), script=script) as pool:
        with ParallelReader(IoPlan("helpers", 2, 1 << 16, 2), helpers=pool) as r:
            r.copy(tensor_file, items)
        assert pool.failures and "injected" in pool.failures[0]
    _same(want, out)


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
def test_the_plan_of_a_file_on_a_tmpfs_copies_it(tensor_file: Path, request: pytest.FixtureRequest, place: str) -> None:
    """A file on a huge-page tmpfs is copied by helpers as a file on disk is (as fast to pin), one on a tmpfs of
    4 KiB pages is staged; every byte lands either way."""
    from marlin_pack.io.files import in_base_memory_pages

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
        base = in_base_memory_pages(path)
        assert place == "/dev/shm" or not base
        free, total = torch.cuda.mem_get_info()
        plan = plan_io(IoFacts(cores=16, base_pages=base, bundle_bytes=path.stat().st_size, gpu=_room(free, total)), environ={})
        expected = "staged" if base else "helpers"
        assert plan.mode == expected, plan.why
        want, out, items = _outputs(path)
        with ParallelReader(plan) as r:
            r.copy(path, items)
            assert r.modes_used == {expected}
        _same(want, out)
    finally:
        path.unlink()
        if place == "/dev/shm":
            directory.rmdir()


def _room(free: int, total: int):  # noqa: ANN202 - a GpuRoom
    from marlin_pack.gpu.plan import GpuRoom

    return GpuRoom(free, total)


@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 16), (4, 1 << 16), (8, 32 << 20)])
@pytest.mark.parametrize("memory_keeps_it", [False, True])
def test_a_cold_file_is_read_once_to_the_gpu(tensor_file: Path, tmp_path: Path, threads: int, window: int,
                                             memory_keeps_it: bool) -> None:
    """The cold path: the file's pages dropped from the page cache. Where the host's memory would not keep it, the plan
    reads it directly (``O_DIRECT``, windows widened to whole blocks) and the page cache stays as it was; where it
    would, ``staged`` (``pread`` through the page cache, the same threads and windows) and the file is left cached for
    the next start. Every byte lands either way."""
    from marlin_pack.io.residency import cached_fraction

    cold = _cold_copy(tensor_file, tmp_path)  # on the disk under the test's temporary folder, not a tmpfs
    facts = IoFacts(cores=16, bundle_bytes=cold.stat().st_size, cached=cached_fraction(cold), direct_reads=True,
                    cache_room=memory_keeps_it)
    mode = plan_io(facts, environ={}).mode
    assert mode == ("staged" if memory_keeps_it else "direct")
    header = read_header(cold)  # reads the header's first pages only
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    items = [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()]
    with ParallelReader(IoPlan(mode, threads, window)) as r:
        assert r.copy(cold, items) == sum(it.nbytes for it in items)
        assert r.modes_used == {mode}
    torch.cuda.synchronize()
    cached = cached_fraction(cold) or 0.0
    assert cached > 0.9 if memory_keeps_it else cached < 0.5, cached  # left in the page cache / read past it
    _same(load_file(str(cold)), out)


def _cold_copy(tensor_file: Path, tmp_path: Path) -> Path:
    from marlin_pack.io.residency import cached_fraction, drop_cached, takes_direct_reads

    cold = tmp_path / "cold.safetensors"
    shutil.copyfile(tensor_file, cold)
    drop_cached(cold)
    if not takes_direct_reads(cold) or cached_fraction(cold) != 0.0:
        pytest.skip(f"{tmp_path} takes no direct reads or keeps its pages")
    return cold


def test_a_cold_file_cut_short_is_a_clean_refusal(tensor_file: Path, tmp_path: Path) -> None:
    """The file shrank after its header was read (another process rewrote it): the direct read past its new end
    is a BundleError naming the file, not a hang and not a partial copy passed off as whole."""
    from marlin_pack.errors import BundleError

    cold = _cold_copy(tensor_file, tmp_path)
    header = read_header(cold)
    out = {n: torch.empty(i.shape, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    items = [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()]
    os.truncate(cold, cold.stat().st_size - 100_000)
    with ParallelReader(IoPlan("direct", 4, 1 << 16)) as r, pytest.raises(BundleError, match=f"{cold}.*truncated"):
        r.copy(cold, items)


def test_an_io_error_mid_file_is_a_clean_refusal(tensor_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO from the disk on the fourth direct read: every thread stops, the error names the file and the cause."""
    import errno

    from marlin_pack.errors import BundleError
    from marlin_pack.gpu import reader as reader_mod

    cold = _cold_copy(tensor_file, tmp_path)
    _, out, items = _outputs(cold)
    real, calls = os.preadv, [0]

    def preadv(fd: int, bufs: list, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 4:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(reader_mod.os, "preadv", preadv)
    with ParallelReader(IoPlan("direct", 4, 1 << 16)) as r, pytest.raises(BundleError, match=f"{cold}.*Input/output error"):
        r.copy(cold, items)


@pytest.mark.parametrize("mode", ["direct", "staged", "registered", "helpers"])
@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 16), (4, 1 << 16), (8, 32 << 20)])
def test_a_cold_file_hashed_as_it_is_copied_to_the_gpu(tensor_file: Path, tmp_path: Path, mode: str, threads: int,
                                                       window: int) -> None:
    """Issue 72: the staged windows (pinned buffers, O_DIRECT where the plan is direct) feed the file's BLAKE3 before the
    buffer is reused: every byte lands, the digest is the file's, and no plan hands a hashed file to the helpers."""
    from marlin_pack.io.hashing import file_digest

    cold = _cold_copy(tensor_file, tmp_path)
    header = read_header(cold)  # the header's pages only: the file stays cold
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    items = [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()]
    plan = IoPlan(mode, threads, window, helpers=4 if mode == "helpers" else 0)  # type: ignore[arg-type]
    with ParallelReader(plan) as r:
        assert r.copy_files([(cold, items)], hashed=[cold]) == sum(it.nbytes for it in items)
        assert r.modes_used == {plan.hashing().mode} and r._helpers is None
        hashed = r.digests[str(cold)]
    torch.cuda.synchronize()
    _same(load_file(str(cold)), out)
    assert hashed.digest == file_digest(cold)
