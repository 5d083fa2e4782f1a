#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, in the order they were run (one phase per device call), and the GPU
# phases of the SmolLM2 mapper's training (docs/training.md: data, train, eval-mapper).
#   bash examples/gpu_benchmarks.sh tests|mapper|llama|qwen|long|eval|data|train|eval-mapper  OUT_DIR [ARGS]
# Random-weight models with the real shapes (speed does not depend on weight values), bfloat16, sdpa attention.
set -uo pipefail
phase=$1; out=${2:-runs/gpu}; mkdir -p "$out"
bench() { python3 -m proxykv_hf.cli bench --dtype bfloat16 --keep-ratio 0.3 "$@"; }
case $phase in
  tests)
    python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_kernels.py tests/test_graph_decode.py
    python3 examples/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536
    python3 examples/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536 --statistics sum max ;;
  mapper)  # the mapper's encoder: module vs encode_sdpa vs torch.compile, paper preset; ARGS: the shape (one per
           # device call: torch.compile's first calls take minutes), llama-3.1-8b or qwen2.5-7b
    python3 examples/bench_mapper_gpu.py --shape "${3:-llama-3.1-8b}" --lengths 8192 16384 32768 ;;
  llama)
    bench --shape llama-3.1-8b --methods full snapkv ${KVZIP-kvzip} proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/llama" ;;
  qwen)
    bench --shape qwen2.5-7b --methods full snapkv kvzip kvzip_iam proxykv --context-lengths 4096 8192 16384 32768 \
      --repeats 3 --decode-tokens 128 --out "$out/qwen" ;;
  long)  # expandable segments: the 128k prefill otherwise fails on fragmentation (12 GiB reserved, unused);
         # ARGS: the shape, llama-3.1-8b (default) or qwen2.5-7b
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench --shape "${3:-llama-3.1-8b}" --methods full proxykv \
      --context-lengths 65536 131072 --repeats 1 --warmup 0 --decode-tokens 32 --out "$out/long-${3:-llama-3.1-8b}" ;;
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
  data)  # mapper training data for the bundled SmolLM2: self features (sum + max) and the KVzip oracle, ~2k and ~4k
          # texts of the ten training generators (vt and qa held out), two builds side by side, then merged
    python3 -c "from proxykv_hf.models import bundled_model_dir; print(bundled_model_dir())"  # convert once
    T="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue
       niah_multiquery cwe fwe"
    B="python3 -m proxykv_hf.cli build-data --device cuda --proxy-kind self --proxy-statistics sum max --crop-len 2048
       --stride 1024 --shard-size 8 --target-model-id smollm2-135m-instruct --tasks $T"
    timeout "${BUILD_LIMIT_S:-240}" $B --n-per-task "${N2K:-16}" --tokens 2048 --seed 20000 --out "$out/data-2k" \
      > "$out/data-2k.log" 2>&1 &
    timeout "${BUILD_LIMIT_S:-240}" $B --n-per-task "${N4K:-8}" --tokens 4096 --seed 50000 --out "$out/data-4k" \
      > "$out/data-4k.log" 2>&1 &
    wait
    python3 -m proxykv_hf.cli merge-data "$out/data-2k" "$out/data-4k" --out "$out/data" ;;
  train)  # two mappers side by side on the merged data: the shipped one fine-tuned (ft), a wider one (wide)
    C="--data $out/data --preset small --batch-size 4 --layers-per-step 6 --no-progress --val-fraction 0.1
       --direct-path-lr-mult 50 --log-every 20 --epochs ${EPOCHS:-12}"
    W="crop_len=512 stride=256 direct_path=true input_transform=log1p,log"
    timeout "${TRAIN_LIMIT_S:-300}" python3 -m proxykv_hf.cli train $C --warmup-steps 20 --mapper-config $W \
      --init-from proxykv_hf/checkpoints/proxykv-smollm2-135m-instruct --out "$out/ft" > "$out/ft.log" 2>&1 &
    timeout "${TRAIN_LIMIT_S:-300}" python3 -m proxykv_hf.cli train $C --warmup-steps 100 --mapper-config $W \
      d_time=256 stem_hidden=128 num_encoder_layers=4 num_encoder_heads=8 d_head=32 --out "$out/wide" \
      > "$out/wide.log" 2>&1 &
    wait ;;
  eval-mapper)  # ProxyKV alone with mapper $3 on run 3's 72 samples (~2k) and run 4's 12 (~4k): one process per task
                # and length; run one mapper at a time (these 24 processes fit an 80 GB H100, 48 ran out of memory)
    M=$3
    for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 \
             niah_multivalue niah_multiquery vt cwe fwe qa; do
      for spec in 2048:6 4096:1; do
        OMP_NUM_THREADS=1 timeout "${EVAL_LIMIT_S:-3600}" python3 -m proxykv_hf.cli eval --device cuda --mapper "$M" \
          --methods proxykv --keep-ratios 0.1 0.2 0.3 0.5 0.7 0.9 --tasks $t --context-lengths "${spec%:*}" \
          --n-samples "${spec#*:}" --seed 100 --max-new-tokens 24 --out-dir "$out/$t-${spec%:*}" \
          > "$out/$t-${spec%:*}.log" 2>&1 &
      done
    done
    wait ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
