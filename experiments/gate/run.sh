#!/usr/bin/env bash
# Selective recompute curve and the per-request gate, results/gate/.
#   bash experiments/gate/run.sh            # every run below; rerun to resume (each mode's result is cached)
#   python experiments/gate/collect.py      # results/gate/README.md tables from the runs
# Each run writes results/gate/runs/<name>/ and is skipped once its summary exists. The real-pair runs read
# the main configuration's calibration and map from CACHE (default artifacts/qwen25coder, where
# experiments/qwen25coder/run.sh leaves them; any cache_dir works, it calibrates and fits on first use). Later runs add modes: what an earlier one computed
# comes from the cache. STEPS="name ..." runs a subset.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/gate/runs
CACHE=${KVT_GATE_CACHE:-artifacts/qwen25coder}
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
# 3. the tasks (issue 30 item 1-2): per item the gate's score and action (gated) and each mode's correctness and
#    gold margin (kvtransfer.eval.items), so collect.py computes the score's ROC AUC for "transfer below the
#    no-context floor / the target"; gated rows beside transfer, no_context, target. Sized for a 2-core CPU
#    (~10 s per HellaSwag item over the four modes, ~30 s per MMLU 5-shot item): one run per task, the cheap first
TASKS="+experiment=qwen25coder_cpu cache_dir=$CACHE stage=[fit,eval] eval.ppl.enabled=false eval.controls=[]
  eval.fidelity.enabled=false eval.modes=[no_context,transfer,target] eval.gate.enabled=true"
run real_arc $TASKS "eval.tasks=[arc_challenge]" eval.limit=60
run real_hellaswag $TASKS "eval.tasks=[hellaswag]" eval.limit=50
run real_mmlu $TASKS "eval.tasks=[mmlu]" "eval.limits={mmlu:3}"
# 4. the recompute curve on WikiText-2 (the windows of real_ppl_a), r x {deviation, random, recent}; r = 0 is the
#    transfer row by construction (tests/test_gate_run.py), r = 0.15 deviation / random and the gated row are
#    real_ppl_a's. Three runs, so the points the goal turns on (r = 0.3, the cost bound) finish first
run real_curve_a $REAL "eval.modes=[no_context,transfer,target]" "eval.recompute_fraction=[0.3]" \
  "eval.recompute_select=[random,recent,deviation]"
run real_curve_b $REAL "eval.modes=[no_context,transfer,target]" "eval.recompute_fraction=[0.05,0.5]" \
  "eval.recompute_select=[random,recent,deviation]"
run real_curve_c $REAL "eval.modes=[no_context,transfer,target]" "eval.recompute_fraction=[0.15]" \
  "eval.recompute_select=[recent]"
# 5. the recompute curve on the tasks (issue 30 item 3): ARC-C and HellaSwag accuracy at r x {deviation, random,
#    recent}, the items of real_arc / real_hellaswag (baselines reproduced from the same cache); r = 0.15 and 0.3
#    first (the cost bound), then 0.05 and 0.5
CURVE_T="+experiment=qwen25coder_cpu cache_dir=$CACHE stage=[fit,eval] eval.ppl.enabled=false eval.controls=[]
  eval.fidelity.enabled=false eval.modes=[no_context,transfer,target] eval.recompute_select=[recent,deviation,random]"
run real_arc_curve_a $CURVE_T "eval.tasks=[arc_challenge]" eval.limit=60 "eval.recompute_fraction=[0.15,0.3]"
run real_hellaswag_curve_a $CURVE_T "eval.tasks=[hellaswag]" eval.limit=50 "eval.recompute_fraction=[0.15,0.3]"
run real_arc_curve_b $CURVE_T "eval.tasks=[arc_challenge]" eval.limit=60 "eval.recompute_fraction=[0.05,0.5]"
run real_hellaswag_curve_b $CURVE_T "eval.tasks=[hellaswag]" eval.limit=50 "eval.recompute_fraction=[0.05,0.5]"
# 6. the per-request signals beside the gate's score (issue 30 §1, kvtransfer.core.signals: tail_kv, first_layer,
#    tail_kl, tail_nll_gain), one measurement each: the gated mode with eval.gate.signals (default: all four) on
#    the items of real_arc / real_hellaswag and the windows of real_ppl_a (baselines from the cache); the gate is
#    the same artifact (score tail_kv), so actions reproduce real_arc / real_hellaswag / real_ppl_a
run real_arc_signals $TASKS "eval.tasks=[arc_challenge]" eval.limit=60
run real_hellaswag_signals $TASKS "eval.tasks=[hellaswag]" eval.limit=50
run real_ppl_signals $REAL "eval.modes=[no_context,transfer,recompute_0.15,gated,target]" \
  "eval.recompute_fraction=[0.15]" eval.gate.enabled=true
