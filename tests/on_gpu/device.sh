#!/usr/bin/env bash
# On the device machine, after stage b of ../shared/device/README.md has unpacked vLLM into /tmp/site:
#   bash tests/on_gpu/device.sh PYTEST_ARGS...      (logs and results go to $OUT)
set -o pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export MARLIN_PACK_TEST_ATTN=${MARLIN_PACK_TEST_ATTN:-TRITON_ATTN}
# MLA models (DeepSeek): no flash-attn binaries there, so no FLASH_ATTN MLA prefill (see tests/on_gpu/_harness.py)
export MARLIN_PACK_TEST_MLA_ATTN=${MARLIN_PACK_TEST_MLA_ATTN:-TRITON_MLA} MARLIN_PACK_TEST_MLA_PREFILL=${MARLIN_PACK_TEST_MLA_PREFILL:-CPU}
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation --no-index .
mkdir -p "${OUT:-/tmp/out}"
# vLLM's model-info cache written on the CPU machine (tests/on_gpu/modelinfo_cache.py), when this call carries it:
# no ~25 s model-class inspection before the first engine of each architecture
if [ -d .device-carry/mi/modelinfos ]; then
  # keep files already there; coreutils 9.5 warns about -n, older ones lack --update=none
  cache="${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
  mkdir -p "$cache" && { cp -r --update=none .device-carry/mi/modelinfos "$cache/" 2>/dev/null || cp -rn .device-carry/mi/modelinfos "$cache/"; }
fi
python3 -m pytest -m gpu -v -rA -s -p no:cacheprovider --basetemp=/tmp/pt --durations=0 --durations-min=5 "$@" 2>&1 | tee -a "${OUT:-/tmp/out}/pytest.log" | grep -E "PASSED|FAILED|ERROR|bit-identical|marlin-pack:|Model loading took|ordinary|prepacked|passed|failed|Error|error|^[0-9.]+s (setup|call) " | cut -c1-400
