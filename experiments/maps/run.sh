#!/usr/bin/env bash
# Map families on the real pair (issue 12): results/maps/. One calibration (the Wikipedia calibration of
# experiments/qwen25coder, 160 x 256 tokens, stride 2), one eval config (that experiment's: HellaSwag and
# ARC-C 100 items, WikiText-2 perplexity at prefixes 0/64/256, 16 windows), one row per map:
#   bash experiments/qwen25coder/run.sh      # first: calibration, baselines, the paper's map (sink 0 and 1)
#   bash experiments/maps/run.sh              # the families below; rerun to resume (every stage is cached)
#   FIDELITY=1 bash experiments/maps/run.sh   # cheaper rows: fit + held-out fidelity only (more ranks)
#   HS200=1 bash experiments/maps/run.sh      # the issue's sizes: every family on HellaSwag n = 200, 32 windows
#   ARC100=1 bash experiments/maps/run.sh     # ... and on ARC-C n = 100
#   SCORED=1 bash experiments/maps/run.sh     # the goal-2 rows again, with per-item scores (paired SEs)
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
  # head_local over more source layers: at k = 16 it reads as many features per head as the paper's map at
  # k = 8 on this pair (16 x 64 = 1,024) and 1/4 of its apply FLOPs at Qwen3-14B -> 32B (8 -> 8 heads)
  fid head_local_k12        mapper.support=head_local pair.k=12
  fid head_local_k16        mapper.support=head_local pair.k=16
  exit 0
fi

run() {  # run NAME OVERRIDES...   (a section may set OUT and the array EVAL of base overrides)
  local name=$1; shift
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then return; fi
  if [[ -f "$OUT/$name/summary.json" ]]; then echo "[$name] done"; return; fi
  rm -rf "$OUT/$name"
  echo "[$name] $(date -u +%H:%M:%S) start: $*"
  python run.py +experiment=qwen25coder_cpu progress=false out_dir="$OUT/$name" stage=[fit,eval] ${EVAL[@]+"${EVAL[@]}"} "$@"
  echo "[$name] $(date -u +%H:%M:%S) done"
}

# the map rows of the issue's table, most informative first: families TASK_OVERRIDE runs each under the
# section's OUT and EVAL (the paper's map at sink 1 is the first row)
families() {
  run paper_sink1          "$1"
  run mass_sink1           "$1" mapper.weighting=attention_mass   # the paper's support and rank, tokens weighted
  run head_local_k16_sink1 "$1" mapper.support=head_local pair.k=16
  run head_local_sink1     "$1" mapper.support=head_local
  run rank64_sink1         "$1" mapper.rank=64
  run rank64_attn_sink1    "$1" mapper.rank=64 mapper.weighting=attention
  run paper_sink0          "$1" mapper.native_sink=0
  run rank32_sink1         "$1" mapper.rank=32
  run mass_sink0           "$1" mapper.weighting=attention_mass mapper.native_sink=0
  run head_local_k16_sink0 "$1" mapper.support=head_local pair.k=16 mapper.native_sink=0
  run rank32_attn_sink1    "$1" mapper.rank=32 mapper.weighting=attention
  run head_local_sink0     "$1" mapper.support=head_local mapper.native_sink=0
  run rank64_sink0         "$1" mapper.rank=64 mapper.native_sink=0
  run rank64_attn_sink0    "$1" mapper.rank=64 mapper.weighting=attention mapper.native_sink=0
}

# ARC100=1: ARC-C on the first 100 items (the issue's size) for every row of `families`, under the eval key of
# experiments/qwen25coder (n = 100, 16 windows), whose baselines that script computed: ~2.5 min per map
if [[ "${ARC100:-0}" == 1 ]]; then
  OUT=results/maps/runs_arc100
  mkdir -p "$OUT"
  EVAL=(eval.ppl.enabled=false "eval.modes=[target,source,transfer,no_context]")
  families "eval.tasks=[arc_challenge]"
  exit 0
fi

# SCORED=1: the two rows that decide goal 2 (the paper's map and head_local at k = 16, sink 1) rerun at the issue's
# sizes by a commit that writes scores.json (per-item HellaSwag and per-window NLLs), so their paired difference
# has an SE (kvtransfer.eval.metrics.gap_closed_difference). Same eval settings as HS200; its own folder, since
# results are never overwritten. Baselines ~30 min on 2 cores, then ~10 min per map.
if [[ "${SCORED:-0}" == 1 ]]; then
  OUT=results/maps/runs_hs200_scored
  mkdir -p "$OUT"
  EVAL=(eval.limit=200 eval.ppl.windows=32 "eval.modes=[target,source,transfer,no_context]")
  run paper_sink1          "eval.tasks=[hellaswag]"
  run head_local_k16_sink1 "eval.tasks=[hellaswag]" mapper.support=head_local pair.k=16
  exit 0
fi

# HS200=1: the issue's sizes, HellaSwag on 200 items and perplexity on 32 windows (per-window NLLs, so the
# perplexity gap closed has a bootstrap SE), for the maps that decide its two goals, and the native tail
# (eval.native_tail=m: the target re-prefills the last m context tokens on top of the mapped cache). Its own
# eval key, so its baselines are computed once here (~30 min on 2 cores), then ~10 min per map; the tail
# rows on perplexity only (~2 min each).
if [[ "${HS200:-0}" == 1 ]]; then
  OUT=results/maps/runs_hs200
  mkdir -p "$OUT"
  EVAL=(eval.limit=200 eval.ppl.windows=32 "eval.modes=[target,source,transfer,no_context]")
  run paper_sink1          "eval.tasks=[hellaswag]"
  for m in 4 16 64; do
    run "paper_sink1_tail$m" "eval.tasks=[]" eval.native_tail=$m
  done
  # what the tail costs: the target's forward over the last m tokens on the mapped rest, against re-prefill
  if [[ ! -f "$OUT/speed_tail/summary.json" ]]; then
    python run.py +experiment=qwen25coder_cpu progress=false out_dir="$OUT/speed_tail" stage=[bench] \
      "bench.tokens=[256,1024]" "bench.native_tails=[4,16,64]"
  fi
  # the floor a tail must beat: the target reading only the start token and the last m tokens, i.e. its own
  # perplexity at P = m on the same windows (drawn at max P = 256, so they are the rows' windows)
  if [[ ! -f "$OUT/truncation_floor/summary.json" ]]; then
    python run.py +experiment=qwen25coder_cpu progress=false out_dir="$OUT/truncation_floor" stage=[eval] \
      eval.ppl.windows=32 "eval.tasks=[]" "eval.ppl.prefixes=[0,4,16,64,256]" "eval.modes=[target]" \
      eval.fidelity.enabled=false
  fi
  # every family at the issue's sizes, with and without the native sink, most informative first (~11 min each)
  families "eval.tasks=[hellaswag]"
  run paper_sink1_tail16_hs "eval.tasks=[hellaswag]" eval.native_tail=16
  exit 0
fi

run head_local_sink1    mapper.support=head_local
run rank64_sink1        mapper.rank=64
run rank64_attn_sink1   mapper.rank=64 mapper.weighting=attention
run rank32_attn_sink1   mapper.rank=32 mapper.weighting=attention
run rank32_sink1        mapper.rank=32
run head_local_rank32_attn_sink1 mapper.support=head_local mapper.rank=32 mapper.weighting=attention
run head_local_sink0    mapper.support=head_local mapper.native_sink=0
