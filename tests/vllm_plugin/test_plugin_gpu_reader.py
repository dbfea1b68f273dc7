"""``gpu_reader``: byte ranges of a bundle file into tensors (CPU destinations here), and the
safetensors headers (``io.safetensors_io.read_header``) that locate them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack.errors import BundleError
from marlin_pack.io.safetensors_io import SafetensorsFormatError, read_header
from marlin_pack.vllm_plugin.gpu_reader import CopyItem, ParallelReader


@pytest.mark.parametrize("threads", [1, 3])
def test_reader_reads_every_tensor_to_cpu(awq_bundle: Path, threads: int) -> None:
    path = awq_bundle / "marlin-pack/tp1/rank-0.safetensors"
    header = read_header(path)
    want = load_file(str(path))
    out = {n: torch.empty(i.shape, dtype=i.torch_dtype) for n, i in header.tensors.items()}
    with ParallelReader(threads=threads, chunk_bytes=1 << 16) as r:  # small chunks: tensors split
        n = r.copy(path, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
        assert r.copy(path, []) == 0
    assert n == sum(i.nbytes for i in header.tensors.values()) == r.bytes_read
    assert want.keys() == out.keys()
    for name, t in want.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


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


@pytest.mark.parametrize("chunk", [1 << 16, 3 << 16, 1 << 30])
def test_windows_are_page_aligned_and_cover_every_byte(awq_bundle: Path, chunk: int) -> None:
    """Registered windows must never share a page (two threads would register it twice) and
    the pieces must cover each destination exactly once."""
    from marlin_pack.vllm_plugin.gpu_reader import _PAGE, _windows

    path = awq_bundle / "marlin-pack/tp1/rank-0.safetensors"
    header = read_header(path)
    dsts = {n: torch.zeros(i.nbytes, dtype=torch.uint8) for n, i in header.tensors.items()}
    reader = ParallelReader(chunk_bytes=chunk)
    assert reader.chunk % _PAGE == 0
    wins = _windows([CopyItem(i.start, i.nbytes, dsts[n]) for n, i in header.tensors.items()], reader.chunk,
                    path.stat().st_size)
    pages = [(w.lo // _PAGE, -(-w.hi // _PAGE)) for w in wins]
    assert all(a[1] <= b[0] for a, b in zip(pages, pages[1:], strict=False)), "windows share a page"
    for w in wins:
        assert w.hi - w.lo <= reader.chunk
        for off, n, dst in w.pieces:
            assert w.lo <= off and off + n <= w.hi and dst.numel() == n
            dst += 1
    assert all(bool((d == 1).all()) for d in dsts.values())
    assert len(wins) >= (1 if chunk > path.stat().st_size else 2)


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
    from marlin_pack.io.files import in_base_memory_pages
    from marlin_pack.vllm_plugin import gpu_reader

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
    # auto stages exactly those, and copies the rest with helpers where it may
    monkeypatch.setattr(gpu_reader, "in_base_memory_pages", lambda p: in_base_memory_pages(p, mounts, shmem))
    assert gpu_reader.resolve_mode("auto", path, helpers=True) == ("staged" if base_pages else "processes")


def test_unknown_io_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="io mode 'fast': expected one of auto, staged, registered, hybrid"):
        ParallelReader(mode="fast")  # type: ignore[arg-type]


def test_auto_mode_stages_files_in_memory_and_registers_the_rest(tmp_path: Path) -> None:
    from marlin_pack.io.files import filesystem_type, in_base_memory_pages
    from marlin_pack.vllm_plugin.gpu_reader import MODE_DEFAULTS, resolve_mode

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
    assert resolve_mode("staged", "/dev/shm/x") == "staged"
    here = resolve_mode("auto", tmp_path / "f")
    assert here == ("staged" if in_base_memory_pages(tmp_path) else "registered")
    with_helpers = resolve_mode("auto", tmp_path / "f", helpers=True)
    assert with_helpers == ("staged" if in_base_memory_pages(tmp_path) else "processes")
    assert resolve_mode("registered", tmp_path / "f", helpers=True) == "registered"
    plan = ParallelReader(mode="auto").plan(tmp_path / "f")
    assert (plan.threads, plan.chunk) == MODE_DEFAULTS[plan.mode]
    assert ParallelReader(threads=3, chunk_bytes=5000, mode="staged").plan(tmp_path / "f").chunk == 1 << 16


def test_host_map_views_every_tensor(awq_bundle: Path) -> None:
    """Common tensors are fed to vLLM as views of the file map (CPU: nothing is registered)."""
    path = awq_bundle / "marlin-pack/common.safetensors"
    header = read_header(path)
    want = load_file(str(path))
    from marlin_pack.vllm_plugin.gpu_reader import HostMap

    with HostMap(path) as host:
        got = {n: host.tensor(i.start, i.nbytes, i.torch_dtype, i.shape) for n, i in header.tensors.items()}
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for name, t in want.items():  # views outlive the map's close: the pages stay mapped
        assert torch.equal(got[name], t), name


def test_host_map_unaligned_and_truncated(tmp_path: Path) -> None:
    from marlin_pack.vllm_plugin.gpu_reader import HostMap

    path = tmp_path / "raw.bin"
    data = torch.arange(16, dtype=torch.int16)
    path.write_bytes(b"\x00" + data.numpy().tobytes())
    with HostMap(path) as host:
        assert torch.equal(host.tensor(1, 32, torch.int16, (4, 4)), data.view(4, 4))  # odd offset: copied
        with pytest.raises(BundleError, match=r"lie outside raw\.bin \(33 bytes\).*truncated"):
            host.tensor(1, 34, torch.int16, (17,))


def test_populate_read_faults_a_file_map_in(tmp_path: Path) -> None:
    """``populate_read`` (libc madvise through ctypes, without the GIL) on a read-only file map, as the
    registered reader uses it; an unmapped range is an OSError (the reader then pins without populating)."""
    import mmap
    import warnings

    from marlin_pack.vllm_plugin.gpu_reader import populate_read

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


class _RecordingPool:
    """A stand-in HelperPool: the helpers 'copy' every window but the first (left to the caller)
    and the last (the caller's own share, handed to ``own`` as HelperPool.copy does)."""

    def __init__(self) -> None:
        self.own_passed: bool | None = None

    def copy(self, path: Any, windows: list[Any], threads: int, own: Any = None) -> list[Any]:
        self.own_passed = own is not None
        if own is not None:
            own(windows[-1:])
        return windows[:1]


@pytest.mark.parametrize("own_share", ["gated", "from the start", "none"])
def test_processes_mode_own_copying_waits_for_own_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_share: str) -> None:
    """``processes`` mode: with ``own_after``, this process copies nothing (its share, what the helpers
    left) until the event is set, while the helpers go on; without it at once; ``own_share=False``
    hands the helpers everything. (Meta destinations stand in for a GPU: nothing is really copied.)"""
    import threading

    path = tmp_path / "f"
    path.write_bytes(bytes(4 << 16))
    items = [CopyItem(i << 16, 1 << 16, torch.empty(1 << 16, dtype=torch.uint8, device="meta")) for i in range(4)]
    pool, gate, reads = _RecordingPool(), threading.Event(), []
    monkeypatch.setattr(ParallelReader, "_read", lambda self, plan, fd, size, windows, device, record=True: reads.append(
        (plan.mode, [w.lo for w in windows])))
    reader = ParallelReader(chunk_bytes=1 << 16, mode="processes", helpers=pool,  # type: ignore[arg-type]
                            own_share=own_share != "none", own_after=gate if own_share == "gated" else None)
    copier = threading.Thread(target=reader.copy, args=(path, items))
    copier.start()
    if own_share == "gated":
        copier.join(timeout=0.3)
        assert copier.is_alive() and reads == [] and pool.own_passed is True
        gate.set()
    copier.join(timeout=30)
    assert not copier.is_alive()
    share = [("registered", [3 << 16])] if own_share != "none" else []
    assert reads == [*share, ("registered", [0])] and pool.own_passed is (own_share != "none")
