"""GPU (H200, SM90): ``convert --kernel machete`` bundles against vLLM's default engine, which picks Machete itself.

Engine (a) loads the checkpoint the ordinary way with vLLM's own kernel choice (no ``--linear-backend``);
engine (b) serves it with ``--load-format marlin_prepacked`` from a ``--kernel machete`` bundle. Every
parameter of (b) is bit-identical to (a) (sha256 of each), the named layer ran on the same kernel in both
(Machete where vLLM takes it, Marlin for group size 32 and untiled shapes), and tokens and logprobs are
equal: AWQ, GPTQ 4- and 8-bit, compressed-tensors symmetric and asymmetric, group sizes -1/64/128, one
group-32 model and one padded shape. (The weight-cache daemon with a Machete bundle is not covered yet.)

Run on the device (``tests/on_gpu/device.sh tests/on_gpu/test_machete_gpu.py``); first run
``test_machete_golden_gpu.py``, which checks the layout itself against ``machete_prepack_B``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch  # noqa: F401  (the skip condition evaluates it)
from _harness import assert_engines_identical, ordinary_and_prepacked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

LAYER = "model.layers.0.self_attn.qkv_proj"
MACHETE, MARLIN = "MacheteLinearKernel", "MarlinLinearKernel"
# case -> (format, bits, group size, preset, the kernel vLLM picks for LAYER on SM90)
CASES = {
    "awq4-g128": ("awq", 4, 128, "tiny", MACHETE),
    "awq4-g64": ("awq", 4, 64, "tiny", MACHETE),
    "gptq4-g128": ("gptq", 4, 128, "tiny", MACHETE),
    "gptq4-channel": ("gptq", 4, -1, "tiny", MACHETE),
    "gptq8-g128": ("gptq", 8, 128, "tiny", MACHETE),
    "ct4-sym-g128": ("ct", 4, 128, "tiny", MACHETE),
    "ct4-asym-g64": ("ct-asym", 4, 64, "tiny", MACHETE),
    "gptq4-g32": ("gptq", 4, 32, "tiny", MARLIN),  # Machete takes group sizes -1/64/128 only
    "gptq4-padded": ("gptq", 4, -1, "tiny-padded", MARLIN),  # qkv N = 320 + 2*64 = 448: not a multiple of 128
}


def _checkpoint(workdir: Path, case: str) -> Path:
    from marlin_pack.testing.synthetic import (
        PRESETS,
        write_awq_checkpoint,
        write_compressed_tensors_checkpoint,
        write_gptq_checkpoint,
    )

    fmt, bits, group, preset, _ = CASES[case]
    out = workdir / case
    if fmt == "awq":
        return write_awq_checkpoint(out, PRESETS[preset], group_size=group)
    if fmt.startswith("ct"):
        return write_compressed_tensors_checkpoint(out, PRESETS[preset], bits=bits, group_size=group, symmetric=fmt == "ct")
    return write_gptq_checkpoint(out, PRESETS[preset], bits=bits, group_size=group)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("machete-gpu")


@pytest.mark.parametrize("case", list(CASES))
def test_machete_bundle_equals_vllms_default_engine(workdir: Path, case: str) -> None:
    import marlin_pack

    model = _checkpoint(workdir, case)
    manifest = marlin_pack.convert(model, tp=(1,), kernel="machete").manifest
    kernel = CASES[case][-1]
    assert {e.name: e.kernel.value for e in manifest.tensor_parallel[0].layers}[LAYER] == kernel[: -len("LinearKernel")].lower()
    a, b = ordinary_and_prepacked(workdir, case, model, LAYER, vllm_default=True, dtype=manifest.serving_dtype.value)
    n = assert_engines_identical(a, b, LAYER, kernel)
    print(f"{case}: {n} parameters bit-identical, {LAYER} on {kernel}, tokens and logprobs equal; "
          f"start {a['start_s']:.1f} s ordinary (vLLM's default) vs {b['start_s']:.1f} s prepacked")


def test_a_marlin_bundle_on_sm90_loads_with_marlin_forced_and_one_warning(workdir: Path) -> None:
    import marlin_pack
    from marlin_pack.testing.engine_harness import Cluster

    model = _checkpoint(workdir, "gptq4-g128")
    marlin_pack.convert(model, workdir / "gptq4-g128-marlin", tp=(1,), kernel="marlin")
    cluster = Cluster(workdir / "warn-engines", logs="gpu-logs-machete-warn")
    try:
        proc = cluster.engine(
            "marlin-on-hopper", model, load_format="marlin_prepacked",
            model_loader_extra_config={"bundle": str(workdir / "gptq4-g128-marlin")}, layers=[LAYER],
        )
        result = proc.result()
        assert result is not None, proc.tail()
        log = proc.log()
    finally:
        cluster.stop()
    assert result["layers"]["kernels"][LAYER]["kernel"] == MARLIN
    assert log.count("holds Marlin's layout; on this SM90 GPU vLLM's default serves") == 1, log[-4000:]
    assert "--kernel machete --force" in log
