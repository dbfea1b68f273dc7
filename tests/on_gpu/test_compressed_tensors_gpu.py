"""GPU: compressed-tensors WNA16 (llm-compressor's pack-quantized format) served from its bundle.

For a symmetric 4-bit (group 128) and an asymmetric 4-bit (zero points, group 128) checkpoint
written by ``write_compressed_tensors_checkpoint`` (bf16, tiny Llama, with a tokenizer): engine (a)
loads it the ordinary way with Marlin forced, engine (b) with ``--load-format marlin_prepacked``.
Every parameter of (b) is bit-identical to (a) (sha256 of each, ``weight_shape`` and the empty
``weight_zero_point`` of the symmetric scheme included), and tokens and logprobs are equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import assert_engines_identical, ordinary_and_prepacked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

CASES = {"ct-w4a16-sym": True, "ct-w4a16-asym": False}
LAYER = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ct-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_prepacked_equals_ordinary(workdir: Path, case: str) -> None:
    import marlin_pack
    from marlin_pack.testing.synthetic import PRESETS, write_compressed_tensors_checkpoint

    model = write_compressed_tensors_checkpoint(workdir / case, PRESETS["tiny"], group_size=128, symmetric=CASES[case])
    manifest = marlin_pack.convert(model, tp=(1,), kernel="marlin").manifest
    assert manifest.serving_dtype.value == "bfloat16"
    a, b = ordinary_and_prepacked(workdir, case, model, LAYER, dtype="bfloat16")
    n = assert_engines_identical(a, b, LAYER)
    packed = {name.rsplit(".", 1)[0] for name in a["layers"]["digests"] if name.endswith(".weight_packed")}
    assert packed == {e.name for e in manifest.tensor_parallel[0].layers}
    print(f"{case}: {n} parameters bit-identical, {len(packed)} prepacked layers, tokens and logprobs equal; "
          f"start {a['start_s']:.1f} s ordinary vs {b['start_s']:.1f} s prepacked")
