"""``gpu.reader``: byte ranges of a bundle file into tensors as an :class:`IoPlan` says (CPU destinations here), the
windows it cuts, the safetensors headers (``io.safetensors_io.read_header``) that locate the bytes, and
``gpu.host_map``'s file maps. The CUDA parts are marked ``gpu`` (skipped without one; the GPU suite is tests/on_gpu)."""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack.errors import BundleError
from marlin_pack.gpu import reader as reader_mod
from marlin_pack.gpu.host_map import FileMap, HostMap
from marlin_pack.gpu.plan import ENV, IoFacts, IoPlan, plan_io
from marlin_pack.gpu.reader import CopyItem, ParallelReader, Window, populate_read, windows_of
from marlin_pack.io.safetensors_io import SafetensorsFormatError, read_header

_PAGE = mmap.PAGESIZE


@pytest.fixture
def rank_file(make_bundle) -> Path:  # type: ignore[no-untyped-def]
    """The rank file of the tiny AWQ bundle (shared, read-only)."""
    return make_bundle("awq", "tiny", tp_sizes=(1, 2)) / "marlin-pack/tp1/rank-0.safetensors"


@pytest.fixture
def common_file(rank_file: Path) -> Path:
    return rank_file.parent.parent / "common.safetensors"


def _items(path: Path) -> tuple[dict[str, torch.Tensor], list[CopyItem]]:
    header = read_header(path)
    out = {n: torch.empty(i.shape, dtype=i.torch_dtype) for n, i in header.tensors.items()}
    return out, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()]


def _pool_workers(r: ParallelReader) -> int | None:
    return None if r._pool is None else r._pool._max_workers


@pytest.mark.parametrize("mode", ["staged", "registered", "helpers", "direct"])
@pytest.mark.parametrize("threads", [1, 3])
def test_reader_reads_every_tensor_to_cpu(rank_file: Path, threads: int, mode: str) -> None:
    """CPU destinations are read into directly in every mode (a helpers plan starts no helper for them)."""
    want = load_file(str(rank_file))
    out, items = _items(rank_file)
    plan = IoPlan(mode, threads=threads, window=1 << 16, helpers=4 if mode == "helpers" else 0)  # small windows: tensors split
    with ParallelReader(plan) as r:
        n = r.copy(rank_file, items)
        assert r.copy(rank_file, []) == 0
        assert _pool_workers(r) == (None if threads == 1 else threads)  # the plan's threads
        assert r._helpers is None and r.modes_used == set()  # nothing on a GPU
    assert n == sum(it.nbytes for it in items) == r.bytes_read
    assert want.keys() == out.keys()
    for name, t in want.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_the_plan_picks_threads_and_window(rank_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests and benchmarks pick a variant: $MARLIN_PACK_IO overrides the plan the reader obeys."""
    monkeypatch.setenv(ENV, '{"threads": 2, "window_mib": 1}')
    plan = plan_io(IoFacts())
    assert (plan.threads, plan.window) == (2, 1 << 20)
    windows: list[int] = []
    real = reader_mod.windows_of
    monkeypatch.setattr(reader_mod, "windows_of", lambda items, size, file_size, **kw: windows.append(size) or real(
        items, size, file_size, **kw))
    want = load_file(str(rank_file))
    out, items = _items(rank_file)
    with ParallelReader(plan) as r:
        r.copy(rank_file, items)
        workers = _pool_workers(r)
    assert windows == [1 << 20]
    # the rank file is smaller than two windows of 1 MiB: one thread; with 64 KiB windows, the plan's two
    size = rank_file.stat().st_size
    assert workers == (2 if size > 1 << 20 else None)
    monkeypatch.setenv(ENV, '{"threads": 2, "window_mib": 1, "window": 65536}')  # window_mib wins over window
    assert plan_io(IoFacts()).window == 1 << 20
    with ParallelReader(IoPlan(threads=2, window=1 << 16)) as r:
        r.copy(rank_file, items)
        assert _pool_workers(r) == 2
    for name, t in want.items():
        assert torch.equal(out[name], t), name


def test_the_default_plan_is_registered() -> None:
    r = ParallelReader()
    assert r.plan == IoPlan() and r.plan.mode == "registered" and r.populate


def test_copy_files_reads_several_files_in_order(rank_file: Path, common_file: Path) -> None:
    want = {**load_file(str(rank_file)), **load_file(str(common_file))}
    out_rank, rank_items = _items(rank_file)
    out_common, common_items = _items(common_file)
    with ParallelReader(IoPlan(threads=3, window=1 << 16)) as r:
        n = r.copy_files([(rank_file, rank_items), (common_file, common_items), (common_file, [])])
    assert n == sum(it.nbytes for it in rank_items + common_items) == r.bytes_read
    for name, t in {**out_rank, **out_common}.items():
        assert torch.equal(t, want[name]), name


def test_reader_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10, dtype=torch.int32)}, str(path))
    info = read_header(path).tensors["a"]
    with pytest.raises(ValueError, match="destination holds 36 bytes"):
        ParallelReader().copy(path, [CopyItem(info.start, info.nbytes, torch.empty(9, dtype=torch.int32))])
    with pytest.raises(ValueError, match="destination tensors must be contiguous"):
        ParallelReader().copy(path, [CopyItem(info.start, info.nbytes, torch.empty(20, dtype=torch.int32)[::2])])
    with pytest.raises(BundleError, match="truncated"):
        ParallelReader().copy(path, [CopyItem(info.start + 8, info.nbytes, torch.empty(10, dtype=torch.int32))])
    with pytest.raises(BundleError, match="lie outside the file"):
        ParallelReader().copy(path, [CopyItem(-4, 4, torch.empty(1, dtype=torch.int32))])


def test_a_short_read_is_a_truncated_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file shrank after its size was taken (windows are cut from fstat): the read says so, it does not loop."""
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(4096))
    monkeypatch.setattr(reader_mod.os, "preadv", lambda fd, bufs, offset: 0)
    with pytest.raises(BundleError, match="unexpected end of file at offset 0: the bundle file is truncated"):
        ParallelReader(IoPlan(threads=1, window=1 << 16)).copy(path, [CopyItem(0, 4096, torch.empty(4096, dtype=torch.uint8))])


def test_a_failing_thread_stops_the_others_and_its_error_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(64 << 16))
    items = [CopyItem(i << 16, 1 << 16, torch.empty(1 << 16, dtype=torch.uint8)) for i in range(64)]
    reads: list[int] = []
    real = reader_mod._pread_into

    def pread(fd: int, buf: memoryview, offset: int) -> None:
        reads.append(offset)
        if offset == 0:
            raise OSError(5, "Input/output error")
        time.sleep(0.01)  # the failure's callback comes long before the others could take every window
        real(fd, buf, offset)

    monkeypatch.setattr(reader_mod, "_pread_into", pread)
    # A failed read is a refusal naming the file and what to do, not a bare OSError.
    with ParallelReader(IoPlan(threads=4, window=1 << 16)) as r, pytest.raises(
        BundleError, match=rf"reading {path} failed \(Input/output error\): .*check it \(dmesg\)"
    ):
        r.copy(path, items)
    assert len(reads) < 64  # the others took no new window once it failed (a few may have been under way)


def test_window_must_be_a_multiple_of_the_page_size() -> None:
    with pytest.raises(ValueError, match=rf"window of 5000 bytes: expected a multiple of the page size {_PAGE}"):
        ParallelReader(IoPlan(window=5000))
    ParallelReader(IoPlan(window=3 * _PAGE))


def test_read_header_errors(tmp_path: Path) -> None:
    """The one header parser raises SafetensorsFormatError (a ValueError); the loader turns it
    into a BundleError (see test_plugin_loader)."""
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10, dtype=torch.int32)}, str(path), metadata={"k": "v"})
    header = read_header(path)
    assert header.metadata == {"k": "v"} and header.tensors["a"].shape == (10,) and header.tensors["a"].dtype == "I32"
    assert header.tensors["a"].end == path.stat().st_size and header.tensors["a"].torch_dtype == torch.int32
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(SafetensorsFormatError, match=r"tensor a spans bytes 0\.\.40 of 36"):
        read_header(path)
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]")
    with pytest.raises(SafetensorsFormatError, match="corrupt safetensors header"):
        read_header(path)
    assert issubclass(SafetensorsFormatError, ValueError)
    with pytest.raises(OSError):
        read_header(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("window", [1 << 16, 3 << 16, 1 << 30])
def test_windows_are_page_aligned_and_cover_every_byte(rank_file: Path, window: int) -> None:
    """Registered windows must never share a page (two threads would register it twice) and
    the pieces must cover each destination exactly once."""
    header = read_header(rank_file)
    dsts = {n: torch.zeros(i.nbytes, dtype=torch.uint8) for n, i in header.tensors.items()}
    wins = windows_of([CopyItem(i.start, i.nbytes, dsts[n]) for n, i in header.tensors.items()], window, rank_file.stat().st_size)
    assert all(isinstance(w, Window) for w in wins)
    pages = [(w.lo // _PAGE, -(-w.hi // _PAGE)) for w in wins]
    assert all(a[1] <= b[0] for a, b in zip(pages, pages[1:], strict=False)), "windows share a page"
    assert [w.lo for w in wins] == sorted(w.lo for w in wins)  # file order
    for w in wins:
        assert w.hi - w.lo <= window and w.lo // window == (w.hi - 1) // window  # inside one aligned window
        for off, n, dst in w.pieces:
            assert w.lo <= off and off + n <= w.hi and dst.numel() == n
            dst += 1
    assert all(bool((d == 1).all()) for d in dsts.values())
    assert len(wins) >= (1 if window > rank_file.stat().st_size else 2)


def test_windows_of_merges_and_splits() -> None:
    a, b, c = (torch.empty(n, dtype=torch.uint8) for n in (10, 20, 3 << 16))
    wins = windows_of([CopyItem(100, 10, a), CopyItem(200, 20, b), CopyItem(1 << 16, 3 << 16, c)], 1 << 16, 5 << 16)
    assert [(w.lo, w.hi, [(o, n) for o, n, _ in w.pieces]) for w in wins] == [
        (100, 220, [(100, 10), (200, 20)]),  # two tensors in one window
        *[(k << 16, (k + 1) << 16, [(k << 16, 1 << 16)]) for k in (1, 2, 3)],  # one tensor over three
    ]
    assert wins[2].pieces[0][2].data_ptr() == c.data_ptr() + (1 << 16)  # views of the destination
    assert windows_of([], 1 << 16, 0) == []
    with pytest.raises(ValueError, match="destination holds 10 bytes, the file range 11"):
        windows_of([CopyItem(0, 11, a)], 1 << 16, 100)
    with pytest.raises(BundleError, match=r"tensor bytes 95\.\.105 lie outside the file \(100 bytes\)"):
        windows_of([CopyItem(95, 10, a)], 1 << 16, 100)


@pytest.mark.parametrize(
    ("path", "policy", "base_pages"),
    [
        ("/dev/shm/b", "always within_size advise [never] deny force", True),  # a default tmpfs
        ("/mnt/hp/b", "always within_size advise [never] deny force", False),  # huge=always
        ("/mnt/ws/b", "always within_size advise [never] deny force", False),  # huge=within_size
        ("/mnt/adv/b", "always within_size advise [never] deny force", True),  # huge=advise: only on madvise
        ("/mnt/ram/b", "always within_size advise [never] deny force", True),  # ramfs: never huge
        ("/data/b", "always within_size advise [never] deny force", False),  # a disk
        ("/dev/shm/b", "always within_size advise never deny [force]", False),  # forced on every tmpfs
        ("/mnt/ram/b", "always within_size advise never deny [force]", True),  # ... not on ramfs
        ("/mnt/hp/b", "always within_size advise never [deny] force", True),  # denied on every tmpfs
        ("/mnt/hp/b", None, False),  # no policy file (older kernels, no THP): the mount decides
        ("/dev/shm/b", None, True),
    ],
)
def test_base_memory_pages_follow_the_mount_and_the_kernel_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, policy: str | None, base_pages: bool
) -> None:
    """Files on a tmpfs of 4 KiB pages are slow to page-lock in place; a huge-page tmpfs is not."""
    from types import SimpleNamespace

    from marlin_pack.gpu.plan import GpuRoom
    from marlin_pack.io.files import in_base_memory_pages
    from marlin_pack.vllm_plugin import io_facts

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda1 / ext4 rw,relatime 0 0\ntmpfs /dev/shm tmpfs rw,relatime,size=1024k 0 0\n"
        "tmpfs /mnt/hp tmpfs rw,relatime,size=41943040k,huge=always 0 0\n"
        "tmpfs /mnt/ws tmpfs rw,huge=within_size,size=4g 0 0\ntmpfs /mnt/adv tmpfs rw,huge=advise 0 0\n"
        "none /mnt/ram ramfs rw 0 0\n/dev/vdb /data xfs rw 0 0\n"
    )
    shmem = tmp_path / "shmem_enabled"
    if policy is not None:
        shmem.write_text(policy + "\n")
    assert in_base_memory_pages(path, mounts, shmem) is base_pages
    # the plan stages exactly those, and copies the rest with helpers where they may
    files = (tmp_path / "rank-0.safetensors", tmp_path / "common.safetensors")
    for f in files:
        f.write_bytes(bytes(100))
    monkeypatch.setattr(io_facts, "in_base_memory_pages", lambda p: in_base_memory_pages(path, mounts, shmem))
    monkeypatch.setattr(io_facts, "gpu_room", lambda device: GpuRoom(free=140 << 30, total=141 << 30))
    monkeypatch.setattr(io_facts, "usable_cores", lambda: 16)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv(ENV, raising=False)
    configs = (SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=1),
                               cache_config=SimpleNamespace(gpu_memory_utilization=0.9)), SimpleNamespace(enable_sleep_mode=False))
    plan = io_facts.plan_for(*configs, files, experts=False, role="engine", preload=True, device=0)
    assert plan.mode == ("staged" if base_pages else "helpers")


def test_filesystem_type_of_a_path(tmp_path: Path) -> None:
    from marlin_pack.io.files import filesystem_type

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda1 / ext4 rw 0 0\nproc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
        "/dev/vdb /data xfs rw 0 0\nnone /data/shm\\040x tmpfs rw 0 0\n"
    )
    assert filesystem_type("/dev/shm/b/rank-0.safetensors", mounts) == "tmpfs"
    assert filesystem_type("/data/b", mounts) == "xfs"
    assert filesystem_type("/data/shm x/b", mounts) == "tmpfs"  # octal escapes in mount points
    assert filesystem_type("/database/b", mounts) == "ext4"  # a prefix of a name is not a parent
    assert filesystem_type("/x", tmp_path / "missing") is None


def test_host_map_views_every_tensor(common_file: Path) -> None:
    """Common tensors are fed to vLLM as views of the file map (CPU: nothing is registered)."""
    header = read_header(common_file)
    want = load_file(str(common_file))
    with HostMap(common_file) as host:
        got = {n: host.tensor(i.start, i.nbytes, i.torch_dtype, i.shape) for n, i in header.tensors.items()}
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for name, t in want.items():  # views outlive the map's close: the pages stay mapped
        assert torch.equal(got[name], t), name


def test_host_map_unaligned_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "raw.bin"
    data = torch.arange(16, dtype=torch.int16)
    path.write_bytes(b"\x00" + data.numpy().tobytes())
    with HostMap(path) as host:
        assert torch.equal(host.tensor(1, 32, torch.int16, (4, 4)), data.view(4, 4))  # odd offset: copied
        with pytest.raises(BundleError, match=r"lie outside raw\.bin \(33 bytes\).*truncated"):
            host.tensor(1, 34, torch.int16, (17,))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with HostMap(empty) as host, pytest.raises(BundleError, match=r"lie outside empty\.bin \(0 bytes\)"):
        host.tensor(0, 1, torch.uint8, (1,))


def test_file_map_is_a_read_only_byte_tensor(tmp_path: Path) -> None:
    import os

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 32)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = FileMap(fd, 8192)
        assert m.bytes.dtype == torch.uint8 and m.bytes.numel() == 8192 and m.base == m.bytes.data_ptr()
        assert m.bytes[:3].tolist() == [0, 1, 2] and int(m.bytes[8191]) == 255
        m.close()
        assert m.mm.closed
    finally:
        os.close(fd)


def test_populate_read_faults_a_file_map_in(tmp_path: Path) -> None:
    """``populate_read`` (libc madvise through ctypes, without the GIL) on a read-only file map, as the
    registered reader uses it; an unmapped range is an OSError (the reader then pins without populating)."""
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(256)) * 4096 * 4)  # 4 MiB
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # a read-only buffer, only read here
        warnings.simplefilter("ignore")
        data = torch.frombuffer(mm, dtype=torch.uint8)
    addr = data.data_ptr()
    try:
        populate_read(addr, 4 << 20)
    except OSError as e:  # a kernel older than 5.14 has no MADV_POPULATE_READ
        pytest.skip(f"no MADV_POPULATE_READ here: {e}")
    assert int(data[4095]) == 255 and data[:4].tolist() == [0, 1, 2, 3]
    del data
    mm.close()
    with pytest.raises(OSError, match="MADV_POPULATE_READ"):
        populate_read(addr, 4 << 20)  # unmapped now


# -- helpers plans (meta destinations stand in for a GPU: nothing is really copied) ----------------------------------


class _FakePool:
    """A stand-in HelperPool: the helpers 'copy' every window of a part but its first (left to the caller)."""

    made: list[_FakePool] = []

    def __init__(self, count: int = 4, device_index: int = 0, *, defer_unregister: bool = False) -> None:
        self.args = (count, device_index, defer_unregister)
        self.calls: list[tuple[list[str], int]] = []
        self.closed: list[bool] = []
        _FakePool.made.append(self)

    def copy_files(self, parts: list[tuple[Any, list[Window]]], threads: int) -> list[list[Window]]:
        self.calls.append(([Path(p).name for p, _ in parts], threads))
        return [windows[:1] for _, windows in parts]

    def close(self, wait: bool = True) -> None:
        self.closed.append(wait)


def _meta_items(n: int, offset: int = 0) -> list[CopyItem]:
    return [CopyItem(offset + (i << 16), 1 << 16, torch.empty(1 << 16, dtype=torch.uint8, device="meta")) for i in range(n)]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int, int, list[int]]]:
    """What this process reads itself: (file, plan mode, threads, window, window starts)."""
    seen: list[tuple[str, str, int, int, list[int]]] = []
    monkeypatch.setattr(ParallelReader, "_read", lambda self, plan, f, windows: seen.append(
        (Path(f.path).name, plan.mode, plan.threads, plan.window, [w.lo for w in windows])))
    _FakePool.made = []
    return seen


def test_a_helpers_plan_gives_the_windows_to_the_pool_and_reads_what_it_left(tmp_path: Path, reads: list) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(4 << 16))
    b.write_bytes(bytes(3 << 16))
    pool = _FakePool()
    plan = IoPlan("helpers", threads=3, window=1 << 16, helpers=2)
    with ParallelReader(plan, helpers=pool) as r:  # type: ignore[arg-type]
        n = r.copy_files([(a, _meta_items(4)), (b, _meta_items(2, 1 << 16))])
    assert n == 6 << 16 == r.bytes_read
    assert pool.calls == [(["a", "b"], 3)]  # one job for both files, each helper with the plan's threads
    local = plan.local()
    assert reads == [("a", "registered", local.threads, local.window, [0]), ("b", "registered", local.threads, local.window, [1 << 16])]
    assert r.modes_used == {"helpers"}  # _read (which adds its own mode) is stood in for
    assert pool.closed == []  # the caller's pool stays the caller's
    assert _FakePool.made == [pool]


def test_a_helpers_plan_without_a_pool_starts_and_closes_its_own(
    tmp_path: Path, reads: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(4 << 16))
    monkeypatch.setattr(reader_mod, "HelperPool", _FakePool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)  # meta tensors have no device index
    plan = IoPlan("helpers", threads=4, window=1 << 16, helpers=3, defer_unregister=True)
    r = ParallelReader(plan)
    r.copy(path, _meta_items(4))
    r.copy(path, _meta_items(2))
    (pool,) = _FakePool.made  # one pool for every copy of the reader
    assert pool.args == (3, 5, True) and len(pool.calls) == 2 and pool.closed == []
    r.close()
    assert pool.closed == [True]
    r.close()
    assert pool.closed == [True]


def test_a_helpers_plan_reads_cpu_destinations_itself(tmp_path: Path, reads: list) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(4 << 16))
    pool = _FakePool()
    plan = IoPlan("helpers", threads=2, window=1 << 16, helpers=4)
    cpu = [CopyItem(0, 1 << 16, torch.empty(1 << 16, dtype=torch.uint8))]
    with ParallelReader(plan, helpers=pool) as r:  # type: ignore[arg-type]
        r.copy_files([(path, cpu), (path, _meta_items(2, 2 << 16))])
    assert pool.calls == [(["f"], 2)]  # only the part on the "GPU"
    assert reads == [("f", "registered", 16, 256 << 20, [2 << 16]), ("f", "helpers", 2, 1 << 16, [0])]


def test_other_plans_never_use_helpers(tmp_path: Path, reads: list) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(2 << 16))
    pool = _FakePool()
    for mode in ("staged", "registered"):
        with ParallelReader(IoPlan(mode, threads=2, window=1 << 16), helpers=pool) as r:  # type: ignore[arg-type]
            r.copy(path, _meta_items(2))
    assert pool.calls == [] and [(m, t, lo) for _, m, t, _, lo in reads] == [("staged", 2, [0, 1 << 16]), ("registered", 2, [0, 1 << 16])]


def test_destinations_on_several_devices_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(2 << 16))

    class Dst:  # two "devices" without a GPU: only their device is looked at
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    w = [Window(0, 1, [(0, 1, Dst("cuda:0"))]), Window(1, 2, [(1, 1, Dst("cuda:1"))])]  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"destinations span several devices: \['cuda:0', 'cuda:1'\]"):
        reader_mod._device_of(w)
    assert reader_mod._device_of([Window(0, 1, [(0, 1, torch.empty(1))])]) is None


# -- CUDA destinations (skipped without a GPU) -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["staged", "registered"])
@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 16), (4, 1 << 16), (3, 1 << 30)])
def test_reader_copies_every_byte_to_the_gpu(rank_file: Path, mode: str, threads: int, window: int) -> None:
    header = read_header(rank_file)
    want = load_file(str(rank_file))
    out = {n: torch.full(i.shape, 7, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    with ParallelReader(IoPlan(mode, threads=threads, window=window)) as r:  # type: ignore[arg-type]
        n = r.copy(rank_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
        assert r.modes_used == {mode}
    assert n == sum(i.nbytes for i in header.tensors.values())
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


@pytest.mark.gpu
def test_a_copy_on_another_thread_orders_after_the_callers_stream(rank_file: Path) -> None:
    """Destinations allocated (and written) on the caller's stream: the reader's streams wait for it."""
    header = read_header(rank_file)
    want = load_file(str(rank_file))
    out = {n: torch.empty(i.shape, dtype=i.torch_dtype, device="cuda") for n, i in header.tensors.items()}
    for t in out.values():
        t.fill_(7)
    done = threading.Event()

    def copy() -> None:
        with ParallelReader(IoPlan("registered", threads=2, window=1 << 16)) as r:
            r.copy(rank_file, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
        done.set()

    worker = threading.Thread(target=copy)
    worker.start()
    worker.join(60)
    assert done.is_set()
    for name, t in want.items():
        assert torch.equal(out[name].cpu(), t), name


# --- direct reads (the cold path): aligned O_DIRECT reads widened to whole blocks ---------------------------------


def _direct_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    from marlin_pack.io.residency import takes_direct_reads

    path = tmp_path / "rank.bin"
    data = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    if not takes_direct_reads(path):
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT reads")
    return path, data


@pytest.mark.parametrize(
    "lo, hi", [(0, 4096), (1, 4095), (4095, 4097), (5000, 70_000), (12_288, 3 * 4096 + 1), (70_000, 3 * 4096 * 8 + 123)]
)
def test_pread_direct_reads_any_range_from_whole_blocks(tmp_path: Path, lo: int, hi: int) -> None:
    """Unaligned ends, ranges ending at the file's unaligned end (the last direct read comes back short)."""
    path, data = _direct_file(tmp_path, 3 * 4096 * 8 + 123)
    buf = mmap.mmap(-1, hi - lo + 2 * 4096)  # page-aligned, as pinned buffers are
    fd, direct = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        skip = reader_mod.pread_direct(direct, fd, memoryview(buf), lo, hi)
        assert skip == lo % 4096
        assert bytes(buf[skip : skip + hi - lo]) == data[lo:hi]
    finally:
        os.close(fd)
        os.close(direct)
        buf.close()


def test_pread_direct_finishes_a_short_read_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct read the kernel cut off a block boundary: the rest comes from the buffered descriptor."""
    path, data = _direct_file(tmp_path, 64 << 10)
    real = os.preadv
    calls: list[int] = []

    def preadv(fd: int, bufs: list, offset: int) -> int:
        calls.append(fd)
        if len(calls) == 1:  # the first direct read: 1000 bytes only
            return real(fd, [bufs[0][:4096]], offset) and 1000
        return real(fd, bufs, offset)

    monkeypatch.setattr(reader_mod.os, "preadv", preadv)
    buf = mmap.mmap(-1, (64 << 10) + 2 * 4096)
    fd, direct = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        skip = reader_mod.pread_direct(direct, fd, memoryview(buf), 10, 60_000)
        assert bytes(buf[skip : skip + 59_990]) == data[10:60_000]
        assert calls[0] == direct and set(calls[1:]) == {fd}
    finally:
        os.close(fd)
        os.close(direct)
        buf.close()


def test_pread_direct_of_a_truncated_file_says_so(tmp_path: Path) -> None:
    path, _ = _direct_file(tmp_path, 8192)
    buf = mmap.mmap(-1, 4 * 4096)
    fd, direct = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(BundleError, match="unexpected end of file at offset 8192: the bundle file is truncated"):
            reader_mod.pread_direct(direct, fd, memoryview(buf), 100, 9000)  # the file shrank after its windows were cut
    finally:
        os.close(fd)
        os.close(direct)
        buf.close()
