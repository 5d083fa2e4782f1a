#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, one phase per call.
#
# How to run me (one CUDA GPU, the package installed with a CUDA build of torch):
#   bash scripts/gpu_benchmarks.sh quick OUT_DIR    # GPU tests, then 32k only, compiled mapper: Llama full / KVzip /
#                                                   # ProxyKV and Qwen full / ProxyKV with the mapper's windows side
#                                                   # by side (the speed targets), both again with the paper's
#                                                   # overlapping windows, and Llama with the flash kernel for the
#                                                   # proxy (~9 minutes)
#   bash scripts/gpu_benchmarks.sh tests OUT_DIR    # GPU tests, then the kernel and mapper tables
#                                                   # (bench_kernel_tiles, bench_gpu_mapper, bench_attention_lse)
#   bash scripts/gpu_benchmarks.sh llama OUT_DIR    # Llama-3.1-8B / 3.2-1B shapes, 4k-32k  -> OUT_DIR/llama/bench.json
#   KVZIP= bash scripts/gpu_benchmarks.sh llama OUT_DIR          # the same without KVzip (its rows take longest)
#   bash scripts/gpu_benchmarks.sh qwen OUT_DIR     # Qwen2.5-7B / 1.5B shapes, all five methods -> OUT_DIR/qwen/
#   bash scripts/gpu_benchmarks.sh long OUT_DIR [SHAPE]   # 64k and 128k, full vs ProxyKV -> OUT_DIR/long-SHAPE/
#
# Random-weight models with the published shapes (speed does not depend on the weight values), bfloat16, sdpa
# attention, keep ratio 0.3. Each bench directory holds bench.json (rows, config, environment), bench.md and
# bench.png; docs/data/gpu_*.json are such files.
set -uo pipefail
phase=${1:?give a phase: quick, tests, llama, qwen or long}; out=${2:-bench-out/gpu}; mkdir -p "$out"
here=$(dirname "$0")
bench() { python3 -m proxykv_hf.cli bench --dtype bfloat16 --keep-ratio 0.3 "$@"; }
gpu_tests() { python3 -m pytest -q -m gpu tests; }  # every test marked gpu
case $phase in
  quick)
    gpu_tests
    # the mapper's encoder windows side by side (stride = crop_len), as the bundled SmolLM2 mapper runs its own
    bench --shape llama-3.1-8b --methods full kvzip proxykv --context-lengths 32768 --repeats 3 --decode-tokens 32 \
      --compile-mapper --mapper-config stride=2048 --out "$out/llama-32k-sbs"   # -> docs/data/gpu_h200_llama_32k_sbs.json
    bench --shape qwen2.5-7b --methods full proxykv --context-lengths 32768 --repeats 3 --decode-tokens 32 \
      --compile-mapper --mapper-config stride=2048 --out "$out/qwen-32k-sbs"   # -> docs/data/gpu_h200_qwen_32k_sbs.json
    # the paper preset's overlapping windows (stride crop_len / 2)
    bench --shape llama-3.1-8b --methods full proxykv --context-lengths 32768 --repeats 3 --decode-tokens 32 \
      --compile-mapper --out "$out/llama-32k"   # -> docs/data/gpu_h200_llama_32k.json
    bench --shape qwen2.5-7b --methods full proxykv --context-lengths 32768 --repeats 3 --decode-tokens 32 \
      --compile-mapper --out "$out/qwen-32k"   # -> docs/data/gpu_h200_qwen_32k.json
    # the proxy's attention through PyTorch's flash kernel instead of cuDNN's -> docs/data/gpu_h200_llama_32k_flash.json
    python3 -c 'import sys; from proxykv_hf import kernels, cli; kernels.LSE_KERNEL = "flash"; cli.main(sys.argv[1:])' \
      bench --dtype bfloat16 --keep-ratio 0.3 --shape llama-3.1-8b --methods full proxykv --context-lengths 32768 \
      --repeats 3 --decode-tokens 32 --compile-mapper --out "$out/llama-32k-flash" ;;
  tests)
    gpu_tests
    python3 "$here/bench_kernel_tiles.py" --length 32768 --heads 32 --kv-heads 8 --head-dim 64
    python3 "$here/bench_kernel_tiles.py" --length 32768 --heads 12 --kv-heads 2 --head-dim 128
    python3 "$here/bench_kernel_tiles.py" --length 4130 --queries 2078 --heads 32 --kv-heads 8 --head-dim 128 --max
    python3 "$here/bench_gpu_mapper.py" --shape llama-3.1-8b --lengths 32768
    python3 "$here/bench_gpu_mapper.py" --shape qwen2.5-7b --lengths 32768
    python3 "$here/bench_attention_lse.py" --lengths 8192 32768
    python3 "$here/bench_attention_lse.py" --lengths 8192 32768 --heads 12 --kv-heads 2 --head-dim 128 ;;
  llama)
    bench --shape llama-3.1-8b --methods full snapkv ${KVZIP-kvzip} proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/llama" ;;
  qwen)
    bench --shape qwen2.5-7b --methods full snapkv kvzip kvzip_iam proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/qwen" ;;
  long)  # expandable segments: without them the 128k prefill fails on fragmentation (12 GiB reserved, unused)
    shape=${3:-llama-3.1-8b}
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --shape "$shape" --methods full proxykv \
      --context-lengths 65536 131072 --repeats 1 --warmup 0 --decode-tokens 32 --out "$out/long-$shape" ;;
  *) echo "unknown phase $phase: give quick, tests, llama, qwen or long"; exit 2 ;;
esac
