#!/usr/bin/env bash
# Map families on the real pair (issue 12): results/maps/. One calibration (the Wikipedia calibration of
# experiments/qwen25coder, 160 x 256 tokens, stride 2), one eval config (that experiment's: HellaSwag and
# ARC-C 100 items, WikiText-2 perplexity at prefixes 0/64/256, 16 windows), one row per map:
#   bash experiments/qwen25coder/run.sh      # first: calibration, baselines, the paper's map (sink 0 and 1)
#   bash experiments/maps/run.sh              # the families below; rerun to resume (every stage is cached)
#   FIDELITY=1 bash experiments/maps/run.sh   # cheaper rows: fit + held-out fidelity only (more ranks)
#   python experiments/maps/collect.py        # results/maps/{README tables, maps.csv|md, figures}
# Baselines (target/source/no_context) and the paper's k = 8 map come from the cache the first script
# filled, so each row below costs one map fit and its `transfer` evaluations only.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/maps/runs
mkdir -p "$OUT"

# fidelity-only rows (FIDELITY=1): fit + the held-out fidelity diagnostics (attention-output cosine,
# next-token KL, top-1 agreement on 4 held-out sequences), no benchmark: ~1 min each on 2 cores
FID=results/maps/fidelity_runs
fid() {  # fid NAME OVERRIDES...
  local name=$1; shift
  if [[ -f "$FID/$name/summary.json" ]]; then echo "[$name] done"; return; fi
  rm -rf "$FID/$name"; mkdir -p "$FID"
  echo "[$name] $(date -u +%H:%M:%S) start (fidelity only): $*"
  python run.py +experiment=qwen25coder_cpu progress=false out_dir="$FID/$name" stage=[fit,eval] \
    "eval.tasks=[]" eval.ppl.enabled=false "$@"
}
if [[ "${FIDELITY:-0}" == 1 ]]; then
  fid paper                 # the paper's map, sink 1
  for r in 16 32 64; do
    fid "rank$r"            mapper.rank=$r
    fid "rank${r}_attn"     mapper.rank=$r mapper.weighting=attention
  done
  fid head_local            mapper.support=head_local
  fid head_local_rank32_attn mapper.support=head_local mapper.rank=32 mapper.weighting=attention
  exit 0
fi

run() {  # run NAME OVERRIDES...
  local name=$1; shift
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then return; fi
  if [[ -f "$OUT/$name/summary.json" ]]; then echo "[$name] done"; return; fi
  rm -rf "$OUT/$name"
  echo "[$name] $(date -u +%H:%M:%S) start: $*"
  python run.py +experiment=qwen25coder_cpu progress=false out_dir="$OUT/$name" stage=[fit,eval] "$@"
  echo "[$name] $(date -u +%H:%M:%S) done"
}

run head_local_sink1    mapper.support=head_local
run rank64_sink1        mapper.rank=64
run rank64_attn_sink1   mapper.rank=64 mapper.weighting=attention
run rank32_attn_sink1   mapper.rank=32 mapper.weighting=attention
run rank32_sink1        mapper.rank=32
run head_local_rank32_attn_sink1 mapper.support=head_local mapper.rank=32 mapper.weighting=attention
run head_local_sink0    mapper.support=head_local mapper.native_sink=0
