#!/usr/bin/env bash
# The map's dtype on the real pair (Qwen2.5-Coder 0.5B -> 1.5B, conf/experiment/baselines_cpu.yaml): the same map applied
# in float32 and in bfloat16 (eval.map_dtype), scored on the same perplexity windows at P = 256 -- WikiText-2 (every
# article long enough; collect.py reports its confirmation half) and the Python stdlib set -- on float32 engines and
# on bfloat16 engines (pair.dtype=bfloat16). The margin and the rule are experiments/map_dtype/margin.yaml, fixed before
# any run.
#   bash experiments/map_dtype/run.sh          # every run below; rerun to resume (each mode's result is cached)
#   python experiments/map_dtype/collect.py    # results/map_dtype/README.md and map_dtype.json
# Each run writes results/map_dtype/runs/<name>/ and is skipped once its summary exists. The float32-engine runs read
# the main configuration's calibration and map from CACHE (as experiments/baselines/run.sh: ~20 min on 2 cores to
# calibrate and fit on first use); their target and no_context are shared by both map dtypes through the cache.
# STEPS="name ..." runs a subset.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/map_dtype/runs
CACHE=${KVT_BASELINES_CACHE:-artifacts/qwen25coder}
mkdir -p "$OUT"

run() {  # run NAME OVERRIDES...
  local name=$1; shift
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then return; fi
  if [[ -f "$OUT/$name/summary.json" ]]; then echo "[$name] done"; return; fi
  rm -rf "$OUT/$name"
  echo "[$name] $(date -u +%H:%M:%S) start: $*"
  python run.py progress=false out_dir="$OUT/$name" "$@"
  echo "[$name] $(date -u +%H:%M:%S) done"
}

COMMON="+experiment=baselines_cpu cache_dir=$CACHE stage=[calibrate,fit,eval] eval.recompute_fraction=[]"
COMMON="$COMMON eval.truncate.curve=[] eval.modes=[no_context,transfer,target]"
REAL="$COMMON eval.ppl.sets=[wikitext2,python_stdlib]"
# 1. float32 engines (the pinned pair.dtype): the map in float32, then in bfloat16
run f32_engines_f32_map $REAL eval.map_dtype=float32
run f32_engines_bf16_map $REAL eval.map_dtype=bfloat16
# 2. bfloat16 engines (models in bfloat16: their own calibration and map, the long-context setting)
run bf16_engines_f32_map $REAL pair.dtype=bfloat16 eval.map_dtype=float32
run bf16_engines_bf16_map $REAL pair.dtype=bfloat16 eval.map_dtype=bfloat16
# 3. HellaSwag (the first 100 items, lm-eval's acc_norm) with each map dtype on each engine dtype: the same
#    calibrations and maps as above (cached), paired item by item in collect.py
HS="$COMMON eval.tasks=[hellaswag] eval.limit=100 eval.ppl.enabled=false"
run f32_engines_f32_map_hellaswag $HS eval.map_dtype=float32
run f32_engines_bf16_map_hellaswag $HS eval.map_dtype=bfloat16
run bf16_engines_f32_map_hellaswag $HS pair.dtype=bfloat16 eval.map_dtype=float32
run bf16_engines_bf16_map_hellaswag $HS pair.dtype=bfloat16 eval.map_dtype=bfloat16
# 4. the mapped caches' relative difference, bfloat16 map against float32 map, per engine dtype
#    (cache_diff.py: 16 WikiText-2 contexts at P = 256; writes results/map_dtype/cache_diff_<engine dtype>.json once)
cache_diff() {  # cache_diff ENGINE_DTYPE RUN
  local f="results/map_dtype/cache_diff_$1.json"
  if [[ -n "${STEPS:-}" && " $STEPS " != *" cache_diff_$1 "* ]]; then return; fi
  if [[ -f "$f" ]]; then echo "[cache_diff_$1] done"; return; fi
  echo "[cache_diff_$1] $(date -u +%H:%M:%S) start"
  python experiments/map_dtype/cache_diff.py --run "$OUT/$2"
}
cache_diff float32 f32_engines_f32_map
cache_diff bfloat16 bf16_engines_f32_map
