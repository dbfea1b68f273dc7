"""The writer's recycled buffers: given back only once written, reused after, never shared while out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from marlin_pack.io.buffers import BufferPool
from marlin_pack.io.safetensors_io import StreamWriter


def test_pool_reuses_a_buffer_only_after_it_is_given_back() -> None:
    pool = BufferPool(64)
    a = pool.take(torch.int32, (4, 4))
    b = pool.take(torch.float16, (8,))
    assert a.shape == (4, 4) and a.dtype == torch.int32 and b.dtype == torch.float16
    assert a.data_ptr() != b.data_ptr() and pool.owns(a) and pool.owns(b[2:])
    pool.give_back(a)
    assert not pool.owns(a)
    c = pool.take(torch.uint8, (64,))
    assert c.data_ptr() == a.data_ptr()  # recycled
    pool.give_back(torch.zeros(3))  # not from the pool: ignored
    with pytest.raises(ValueError, match="internal error"):
        pool.take(torch.int32, (17,))


def test_stream_writer_recycles_its_buffers_and_writes_each_tensor_once(tmp_path: Path) -> None:
    specs = [(f"w{i}", torch.int32, (64, 32)) for i in range(12)]
    path = tmp_path / "r.safetensors"
    w = StreamWriter(path, specs, {})
    seen = set()
    for i, (name, _, _) in enumerate(specs):
        t = w.empty(name)
        seen.add(t.data_ptr())
        t.fill_(i)
        w.write(name, t)
    w.close()
    assert len(seen) <= 3  # in flight (2) plus the one being filled: bounded, whatever the file's length
    with safe_open(str(path), framework="pt") as f:
        for i, (name, _, _) in enumerate(specs):
            assert torch.equal(f.get_tensor(name), torch.full((64, 32), i, dtype=torch.int32))


def test_stream_writer_empty_names_a_tensor_still_to_write(tmp_path: Path) -> None:
    w = StreamWriter(tmp_path / "e.safetensors", [("a", torch.int32, (2,))], {})
    try:
        with pytest.raises(RuntimeError, match="internal error: b is not a tensor"):
            w.empty("b")
    finally:
        w.abort()


def test_stream_writer_bounds_the_bytes_in_flight(tmp_path: Path) -> None:
    specs = [(f"t{i}", torch.uint8, (100,)) for i in range(10)] + [("big", torch.uint8, (1000,))]
    w = StreamWriter(tmp_path / "b.safetensors", specs, {}, max_in_flight=None, max_bytes_in_flight=250)
    most = 0
    for name, _, shape in specs:
        w.write(name, torch.ones(shape, dtype=torch.uint8))
        most = max(most, w._bytes_in_flight)
        assert w._bytes_in_flight <= 250 or len(w._pending) == 1  # a tensor over the limit goes alone
    w.close()
    assert most == 1000
