#!/usr/bin/env bash
# Issue 30 measurements: selective recompute curve and the per-request gate, results/gate/.
#   bash experiments/gate/run.sh            # every run below; rerun to resume (each mode's result is cached)
#   python experiments/gate/collect.py      # results/gate/README.md tables from the runs
# Each run writes results/gate/runs/<name>/ and is skipped once its summary exists. The real-pair runs read
# the main configuration's calibration and map from CACHE (default /work/artifacts/qwen25coder, the coordinator's;
# any cache_dir works, it calibrates and fits on first use). Later runs add modes: what an earlier one computed
# comes from the cache. STEPS="name ..." runs a subset.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/gate/runs
CACHE=${KVT_GATE_CACHE:-/work/artifacts/qwen25coder}
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

TINY="eval.tasks=[] eval.controls=[] eval.coqa.enabled=false eval.modes=[target,transfer,no_context]"
# 1. the tiny trained pair (models/tiny 1m -> 7m): the whole curve and the gate, minutes on 2 cores
run tiny_curve stage=[calibrate,fit,eval] cache_dir=artifacts/gate_tiny $TINY "eval.ppl.prefixes=[0,128]" \
  "eval.recompute_fraction=[0,0.15,0.3,1]" "eval.recompute_select=[deviation,random]" eval.gate.enabled=true

# 2. the real pair, main configuration (Qwen2.5-Coder 0.5B -> 1.5B, k = 8, native sink 1): WikiText-2 at P = 256,
#    24 per-document windows (64 scored tokens each); CPU-affordable subset first, then the rest of the curve
REAL="+experiment=qwen25coder_cpu cache_dir=$CACHE stage=[fit,eval] eval.tasks=[] eval.controls=[]
  eval.fidelity.enabled=false eval.ppl.sets=[wikitext2] eval.ppl.draw=per_document eval.ppl.prefixes=[256]
  eval.ppl.windows=24"
# modes named in eval.modes run in that order (the repair modes before the dear target)
run real_ppl_a $REAL "eval.modes=[no_context,transfer,recompute_0.15,recompute_random_0.15,gated,target]" \
  "eval.recompute_fraction=[0.15]" "eval.recompute_select=[deviation,random]" eval.gate.enabled=true
run real_ppl_b $REAL "eval.modes=[target,transfer,no_context]" "eval.recompute_fraction=[0,0.15,0.3]" "eval.recompute_select=[deviation,random]" \
  eval.gate.enabled=true
run real_ppl_c $REAL "eval.modes=[target,transfer,no_context]" "eval.recompute_fraction=[0,0.05,0.15,0.3,0.5]" "eval.recompute_select=[deviation,random,recent]" \
  eval.gate.enabled=true
