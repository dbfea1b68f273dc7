#!/usr/bin/env bash
# One device sitting (not committed): bash gpu_sitting.sh tests|awq1|awq2|gptq|cold1|cold2
set -o pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 MARLIN_PACK_TEST_ATTN=TRITON_ATTN
out="${OUT:-/tmp/out}"; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 benchmarks/bench_load.py --ordinary default --kernel machete --serve --workdir /dev/shm/bench --bundle-root /tmp/bench"
case "$1" in
tests)
  MARLIN_PACK_TEST_DAEMON_MODELS=awq4,awq4-machete timeout 480 bash tests/on_gpu/device.sh --parallel \
    'daemon:tests/on_gpu/test_daemon_gpu.py' 'reader:tests/on_gpu/test_reader_gpu.py' ;;
awq1)
  timeout 590 $B --formats awq --keep > "$out/awq1.log" 2>&1; echo "exit $?"; tail -16 "$out/awq1.log" | cut -c1-500 ;;
awq2)
  timeout 590 $B --formats awq --reuse --no-ordinary --daemon awq --attaches 1 > "$out/awq2.log" 2>&1; echo "exit $?"
  tail -16 "$out/awq2.log" | cut -c1-500; rm -rf /dev/shm/bench /tmp/bench ;;
gptq)
  timeout 590 $B --formats gptq > "$out/gptq.log" 2>&1; echo "exit $?"; tail -16 "$out/gptq.log" | cut -c1-500
  rm -rf /dev/shm/bench /tmp/bench ;;
cold1)
  rm -rf /tmp/cold
  timeout 590 python3 benchmarks/bench_cold.py --preset llama-70b --layers 40 --format awq --kernel machete --workdir /tmp/cold \
    --disk-reads 4x32,8x32 --skip ordinary,daemon,verify --keep > "$out/cold1.log" 2>&1
  echo "exit $?"; grep -E "failed|Error" "$out/cold1.log" | head -8 | cut -c1-300; tail -14 "$out/cold1.log" | cut -c1-600 ;;
cold2)
  timeout 590 python3 benchmarks/bench_cold.py --preset llama-70b --layers 40 --format awq --kernel machete --workdir /tmp/cold \
    --disk-reads 4x32 --skip prepacked --reuse > "$out/cold2.log" 2>&1
  echo "exit $?"; grep -E "failed|Error" "$out/cold2.log" | head -8 | cut -c1-300; tail -14 "$out/cold2.log" | cut -c1-600
  rm -rf /tmp/cold ;;
esac
case "$1" in
letgo)
  for f in gptq awq; do
    timeout 560 python3 benchmarks/bench_load.py --formats $f --ordinary default --kernel machete --workdir /dev/shm/bench \
      --bundle-root /tmp/bench --rounds 2 --io '{};{"env:MARLIN_PACK_LET_GO":"wait"}' > "$out/letgo-$f.log" 2>&1
    echo "$f exit $?"; grep -E "engine: Model loading|^$f " "$out/letgo-$f.log" | cut -c1-300; rm -rf /dev/shm/bench /tmp/bench
  done ;;
esac
