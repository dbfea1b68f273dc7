"""Write vLLM's model-info cache for the architectures the GPU tests and benchmarks build (run on the CPU machine).

On a fresh GPU machine every engine's configuration first has vLLM inspect the model class in a
subprocess (``_LazyRegisteredModel.inspect_model_cls``: about 25 s there), unless its cache file
``$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`` holds an entry for the same source files
(vLLM keys it by a hash of the model's module files, so an entry written here from the same vLLM
0.33.0 wheel is valid on the device, and a stale one is only recomputed). So the device's time
goes to the runs, not to the inspection:

    python tests/on_gpu/modelinfo_cache.py .device-carry/mi          # here, once per checkout
    # in the device call that installs vLLM, carry .device-carry/mi; tests/on_gpu/device.sh then
    # copies it into vLLM's cache (or: cp -r .device-carry/mi/modelinfos ~/.cache/vllm/)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# What marlin_pack.testing writes (dense presets, Mixtral, Qwen3-MoE, DeepSeek-V2/V3) and what
# the benchmarks load.
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)


def main(out: Path) -> None:
    os.environ["VLLM_CACHE_ROOT"] = str(out)  # before vLLM reads its environment
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.models[arch].inspect_model_cls()  # computes (in a subprocess) and writes the entry
    written = sorted(p.name for p in (out / "modelinfos").glob("*.json"))
    print(f"{len(written)} model-info entries in {out / 'modelinfos'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    main(Path(sys.argv[1]).resolve())
