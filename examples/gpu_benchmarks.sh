#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, in the order they were run (one phase per device call).
#   bash examples/gpu_benchmarks.sh tests|llama|qwen|long  OUT_DIR
# Random-weight models with the real shapes (speed does not depend on weight values), bfloat16, sdpa attention.
set -uo pipefail
phase=$1; out=${2:-runs/gpu}; mkdir -p "$out"
bench() { python3 -m proxykv_hf.cli bench --dtype bfloat16 --keep-ratio 0.3 "$@"; }
case $phase in
  tests)
    python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py
    python3 examples/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536 ;;
  llama)
    bench --shape llama-3.1-8b --methods full snapkv ${KVZIP-kvzip} proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/llama" ;;
  qwen)
    bench --shape qwen2.5-7b --methods full snapkv kvzip proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/qwen" ;;
  long)  # expandable segments: the 128k prefill otherwise fails on fragmentation (12 GiB reserved, unused)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --shape llama-3.1-8b --methods full proxykv --context-lengths 65536 131072 --repeats 1 --warmup 0 \
      --decode-tokens 32 --out "$out/long" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
