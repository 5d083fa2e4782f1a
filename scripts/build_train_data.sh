#!/usr/bin/env bash
# Build mapper training data (proxy features + KVzip oracle scores) over the train split's tasks at several
# lengths, as parallel `proxykv build-data` jobs on one device, then merge them.
#
#   bash scripts/build_train_data.sh OUT [--workers N] [--rounds R] [--stop-after S] [--tokens "1024 2048 ..."]
#                                        [--n-per-task K] [--tasks "T1 T2 ..."] [-- EXTRA build-data ARGS]
#
# One job per (round, task): `--n-per-task` texts at each of `--tokens`, generator seed
# 800000 + 10000 * round + 100 * (the task's index in the list below, or in `--tasks`). Jobs run `--workers` at a
# time, every task's first round before any second one. `--stop-after S` ends the build S seconds after the script
# started: running jobs are interrupted (each keeps the shards it finished; the same command again resumes them)
# and no new job starts. The jobs land in OUT/jobs/, the merged dataset in OUT/data. Arguments after `--` go to
# every build-data call (e.g. `--device cuda --dtype float32`, or `--tiny --device cpu` for a smoke run).
set -euo pipefail
usage() { sed -n 2,13p "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[ $# -ge 1 ] || usage 2
case "$1" in -h|--help) usage 0 ;; esac
OUT=$1; shift
WORKERS=4 ROUNDS=1 STOP_AFTER=0 TOKENS="1024 2048 4096 8192" NPT=2 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --stop-after) STOP_AFTER=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --n-per-task) NPT=$2; shift 2 ;;
    --tasks) read -ra TASK_ARG <<< "$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done
# the train split's tasks (proxykv_hf.eval.splits) and the repeated-sentence train corpus; needles first
TASKS=(needle:filler-train needle:pydocs needle:pycode needle:repeats-train multikey:filler-train
       multivalue:filler-train multikey:pydocs multivalue:pydocs multikey:pycode multivalue:pycode niah_single_1
       niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue cwe fwe
       multikey:repeats-train)
[ -z "${TASK_ARG+x}" ] || TASKS=("${TASK_ARG[@]}")
PY=${PYTHON:-python3}
T0=$(date +%s)
mkdir -p "$OUT/jobs" "$OUT/logs"
jobs_file="$OUT/logs/jobs.txt"
: > "$jobs_file"
for ((r = 0; r < ROUNDS; r++)); do
  for i in "${!TASKS[@]}"; do
    echo "${TASKS[$i]} $((800000 + 10000 * r + 100 * i)) $r" >> "$jobs_file"
  done
done

job() {  # TASK SEED ROUND
  local name limit=()
  name="$(echo "$1" | tr ':' '_')-$3"
  if [ "$STOP_AFTER" -gt 0 ]; then
    local left=$((STOP_AFTER - ($(date +%s) - T0)))
    [ "$left" -gt 0 ] || { echo "skipped $name (past --stop-after)"; return 0; }
    limit=(timeout --signal=INT "$left")
  fi
  local rc=0
  "${limit[@]}" $PY -m proxykv_hf.cli build-data --proxy-kind self --proxy-statistics sum max lookback \
      --crop-len 2048 --stride 1024 --shard-size 8 --tokens $TOKENS --n-per-task "$NPT" --seed "$2" --tasks "$1" \
      --out "$OUT/jobs/$name" "${EXTRA[@]}" > "$OUT/logs/$name.log" 2>&1 || rc=$?
  case $rc in
    0) echo "done $name" ;;
    124|130) echo "stopped $name (--stop-after)" ;;
    *) echo "FAILED $name (exit $rc; see $OUT/logs/$name.log)"; return 1 ;;
  esac
}
export -f job
export OUT T0 STOP_AFTER TOKENS NPT PY
# bash cannot export arrays: each job rebuilds EXTRA from its declaration (arguments with spaces stay whole)
EXTRA_DECL=$(declare -p EXTRA)
export EXTRA_DECL
xargs -P "$WORKERS" -L 1 bash -c 'eval "$EXTRA_DECL"; job "$0" "$1" "$2"' < "$jobs_file"

built=()
for d in "$OUT"/jobs/*; do
  [ -f "$d/manifest.json" ] || continue
  $PY -c "import json, sys; sys.exit(json.load(open(sys.argv[1]))['crops'] == 0)" "$d/manifest.json" && built+=("$d")
done
[ ${#built[@]} -gt 0 ] || { echo "no job finished a shard" >&2; exit 1; }
rm -rf "$OUT/data"
if [ ${#built[@]} -eq 1 ]; then  # merge-data joins two or more
  cp -r "${built[0]}" "$OUT/data"
else
  $PY -m proxykv_hf.cli merge-data "${built[@]}" --out "$OUT/data"
fi
