#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, in the order they were run (one phase per device call).
#   bash examples/gpu_benchmarks.sh tests|llama|qwen|long|eval  OUT_DIR [CONTEXT_LENGTH]
# Random-weight models with the real shapes (speed does not depend on weight values), bfloat16, sdpa attention.
set -uo pipefail
phase=$1; out=${2:-runs/gpu}; mkdir -p "$out"
bench() { python3 -m proxykv_hf.cli bench --dtype bfloat16 --keep-ratio 0.3 "$@"; }
case $phase in
  tests)
    python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py tests/test_graph_decode.py
    python3 examples/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536
    python3 examples/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536 --statistics sum max ;;
  llama)
    bench --shape llama-3.1-8b --methods full snapkv ${KVZIP-kvzip} proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/llama" ;;
  qwen)
    bench --shape qwen2.5-7b --methods full snapkv kvzip kvzip_iam proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/qwen" ;;
  long)  # expandable segments: the 128k prefill otherwise fails on fragmentation (12 GiB reserved, unused)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --shape llama-3.1-8b --methods full proxykv --context-lengths 65536 131072 --repeats 1 --warmup 0 \
      --decode-tokens 32 --out "$out/long" ;;
  eval)  # the accuracy grid of docs/results.md on the bundled SmolLM2 (float32), one process per task, all at once:
         # generation is host-bound, so 12 processes share the GPU; records are resumable, shards merge afterwards
    len=${3:-2048}; M=proxykv_hf/checkpoints/proxykv-smollm2-135m-instruct
    python3 -c "from proxykv_hf.models import bundled_model_dir; print(bundled_model_dir())"  # convert once
    for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 \
             niah_multivalue niah_multiquery vt cwe fwe qa; do
      OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT_S:-3600}" python3 -m proxykv_hf.cli eval --device cuda --mapper $M \
        --methods full kvzip snapkv streaming random kvzip_iam proxykv --keep-ratios 0.1 0.2 0.3 0.5 0.7 0.9 \
        --tasks $t --context-lengths "$len" --n-samples 20 --seed 100 --max-new-tokens 24 \
        --out-dir "$out/$t-$len" > "$out/$t-$len.log" 2>&1 &
    done
    wait ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
