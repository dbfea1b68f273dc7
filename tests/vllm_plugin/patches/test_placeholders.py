"""``patches.placeholders``: memory-less placeholders while the loader builds a model it fills from a bundle;
compressed-tensors' method records its layer inside marlin-pack's scope only."""

from __future__ import annotations

import pytest
import torch

from marlin_pack.vllm_plugin.patches import scope
from marlin_pack.vllm_plugin.patches.placeholders import EMBEDDING_METHOD, PATCHES, _StubFactories, stub_quantized_placeholders
from marlin_pack.vllm_plugin.patches.post_processing import LAYER_REF, QUANT_METHODS
from marlin_pack.vllm_plugin.stubs import is_stub, materialize_stubs


def test_stub_factories_keep_shape_dtype_device_and_value_without_memory() -> None:
    out = torch.empty(4)
    with _StubFactories():
        empty = torch.empty(64, 32, dtype=torch.int32)
        zeros = torch.zeros(8, 16, dtype=torch.float16)
        ones = torch.ones((3, 5))
        scalar = torch.zeros(())  # nothing to save: made as asked
        single = torch.empty(1, dtype=torch.int64)
        into = torch.zeros(4, out=out)
        other = torch.arange(6)  # not a placeholder factory
    for t, shape, dtype in [(empty, (64, 32), torch.int32), (zeros, (8, 16), torch.float16), (ones, (3, 5), torch.float32)]:
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
        assert is_stub(t) and t.untyped_storage().nbytes() == dtype.itemsize
    assert torch.equal(zeros, torch.zeros(8, 16, dtype=torch.float16)) and torch.equal(ones, torch.ones(3, 5))
    for t in (scalar, single, out, into, other):
        assert not is_stub(t)
    assert into is out and torch.equal(other, torch.arange(6))
    with torch.device("meta"), _StubFactories():
        assert torch.empty(4, 4).device.type == "meta"  # the default device applies


def test_materialize_stubs_gives_memory_with_the_same_contents() -> None:
    layer = torch.nn.Module()
    with _StubFactories():
        layer.qzeros = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.int32), requires_grad=False)
        layer.register_buffer("scale", torch.ones(6))
    layer.bias = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    qzeros = layer.qzeros
    assert is_stub(layer.qzeros) and is_stub(layer.scale)
    assert materialize_stubs(layer) == 2
    assert layer.qzeros is qzeros  # the Parameter object stays (vLLM's attributes on it)
    assert not is_stub(layer.qzeros) and layer.qzeros.is_contiguous() and torch.equal(layer.qzeros, torch.zeros(4, 8, dtype=torch.int32))
    assert torch.equal(layer.scale, torch.ones(6)) and torch.equal(layer.bias, torch.arange(4.0))
    assert materialize_stubs(layer) == 0


class _Method:
    """Stands in for a quant method object (the wrappers keep state in its __dict__)."""


def _create_weights(self: object, layer: torch.nn.Module, *args: object, **kwargs: object) -> None:
    """Stands in for vLLM's create_weights (vLLM's own run in test_plugin_loader's and test_construct's construction tests)."""
    layer.register_parameter("qweight", torch.nn.Parameter(torch.empty(64, 128, dtype=torch.int32), requires_grad=False))


@pytest.mark.parametrize("index", range(len(PATCHES)))
def test_create_weights_makes_stubs_only_inside_the_context(index: int) -> None:
    """The quant methods make stubs inside the context; vLLM's embedding method only when it asks for
    embeddings too (the loader copies the common tensors beside the construction)."""
    patch = PATCHES[index]
    embedding = patch.target.startswith(EMBEDDING_METHOD)
    wrapped = patch.make(_create_weights)
    inside, with_embeddings, disabled, outside = (torch.nn.Module() for _ in range(4))
    method = _Method()
    with stub_quantized_placeholders():
        wrapped(method, inside)
        with stub_quantized_placeholders(False, embeddings=True):
            wrapped(method, disabled)
    with stub_quantized_placeholders(embeddings=True):
        wrapped(method, with_embeddings)
    assert LAYER_REF not in method.__dict__  # outside marlin-pack's scope: nothing recorded
    with scope.in_use():  # a daemon's fill, an ipc_cache engine's build
        wrapped(method, outside)
    assert is_stub(inside.qweight) is not embedding and inside.qweight.shape == (64, 128)
    assert is_stub(with_embeddings.qweight)
    assert not is_stub(disabled.qweight) and not is_stub(outside.qweight)
    # compressed-tensors' method also records its layer (for supports_pre_processed), in the scope
    recorded = method.__dict__.get(LAYER_REF)
    assert (recorded is not None and recorded() is outside) == patch.target.startswith(QUANT_METHODS[2])


def test_the_embedding_method_is_patched() -> None:
    assert [p.target for p in PATCHES if p.target.startswith(EMBEDDING_METHOD)] == [f"{EMBEDDING_METHOD}.create_weights"]
