"""GPU: a vLLM process that does not use marlin-pack behaves exactly as without the plugin.

Two ordinary engines (vLLM's default load format and kernel choice: Machete on an H200) of the same
checkpoint, one with the plugin installed (the ``vllm.general_plugins`` entry point: every patch is
installed in its processes) and one with ``VLLM_PLUGINS=""`` (vLLM loads no plugin): the same kernel
for every reported layer, bit-identical parameters (sha256 of each) and exactly the same tokens and
logprobs. The speed patches are inert outside marlin-pack's paths (``patches/scope.py``); the
correctness and weight-cache patches act only on what the loader or the weight cache marks.

Run on the GPU machine: ``bash tests/on_gpu/device.sh tests/on_gpu/test_plugin_inert_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import FUSED, Cluster, plugin_installed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")]

# name -> (format, preset, bits, group size)
CASES = {"awq4": ("awq", "tiny", 4, 128), "gptq4": ("gptq", "tiny-padded", 4, 32), "gptq8": ("gptq", "tiny-qwen2", 8, 128)}


def _write(fmt: str, preset: str, bits: int, group: int, out: Path) -> Path:
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    if fmt == "awq":
        return write_awq_checkpoint(out, PRESETS[preset], group_size=group, dtype=torch.float16)
    return write_gptq_checkpoint(out, PRESETS[preset], bits=bits, group_size=group, dtype=torch.float16)


@pytest.mark.parametrize("name", list(CASES))
def test_an_ordinary_engine_is_the_same_with_and_without_the_plugin(tmp_path: Path, name: str) -> None:
    if not plugin_installed():
        pytest.skip("marlin-pack's entry point is not installed (pip install .): VLLM_PLUGINS would change nothing")
    model = _write(*CASES[name], tmp_path / name)
    cluster = Cluster(tmp_path / "engines", logs=f"gpu-logs-inert-{name}")
    try:
        with_proc = cluster.engine(f"{name}-plugin", model, digests=True, layers=FUSED)
        with_plugin = with_proc.result()
        assert with_plugin is not None, with_proc.tail()
        without_proc = cluster.engine(f"{name}-no-plugin", model, digests=True, layers=FUSED, env={"VLLM_PLUGINS": ""})
        without = without_proc.result()
        assert without is not None, without_proc.tail()
    finally:
        cluster.stop()
    assert with_plugin["patched"], "the plugin's patches were not installed in the engine with the plugin"
    assert without["patched"] == [], without["patched"]
    assert with_plugin["layers"]["kernels"] == without["layers"]["kernels"]
    da, db = with_plugin["layers"]["digests"], without["layers"]["digests"]
    assert da.keys() == db.keys() and da, sorted(da.keys() ^ db.keys())[:5]
    assert [n for n in da if da[n] != db[n]] == []
    for oa, ob in zip(with_plugin["outputs"], without["outputs"], strict=True):
        assert oa["token_ids"] == ob["token_ids"] and oa["prompt_token_ids"] == ob["prompt_token_ids"]
        assert oa["logprobs"] == ob["logprobs"] and oa["prompt_logprobs"] == ob["prompt_logprobs"]
