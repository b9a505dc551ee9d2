#!/usr/bin/env bash
# Equal-cost baselines: is the map worth its cost against the target reading a truncated prompt? results/baselines/.
#   bash experiments/baselines/run.sh          # every run below; rerun to resume (each mode's result is cached)
#   python experiments/baselines/collect.py    # results/baselines/README.md, tables and the cost figure
# Each run writes results/baselines/runs/<name>/ and is skipped once its summary exists. The real-pair runs read the
# main configuration's calibration and map (conf/experiment/baselines_cpu.yaml pins every setting) from CACHE (any
# cache_dir works: it calibrates and fits on first use, ~20 min on 2 cores). STEPS="name ..." runs a subset.
# The selection / confirmation split of WikiText-2's articles is experiments/baselines/split.yaml (fixed before any
# run); collect.py chooses the repair on the selection half only and reports the confirmation half.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/baselines/runs
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

# 1. the check on the tiny trained pair (models/tiny): truncate_0.3 beside recompute_recent_0.3, measured seconds
#    of both and of target, the truncation curve and the map's worth in native tokens; a few minutes on 2 cores
run tiny_check stage=[calibrate,fit,eval] cache_dir=artifacts/baselines_tiny eval.tasks=[] eval.controls=[] \
  eval.coqa.enabled=false eval.fidelity.enabled=false "eval.modes=[target,transfer,no_context]" \
  "eval.ppl.prefixes=[0,128,256]" "eval.recompute_fraction=[0.3]" "eval.recompute_select=[recent]"

# 2. without a calibration (the target alone): the truncation curve on the windows of results/qwen25coder's
#    controls_ppl run (the same draw: 62 per-document windows of each set at P = 256, 64 scored tokens), whose
#    transfer / target / no_context NLLs collect.py reads beside it; then target and no_context again, timed
#    (m = 1 is no_context, which the committed run holds; the timed run computes it again as a check)
CURVE5="truncate_tokens_4,truncate_tokens_8,truncate_tokens_16,truncate_tokens_32,truncate_tokens_64"
TONLY="+experiment=baselines_cpu cache_dir=$CACHE stage=[eval] eval.recompute_fraction=[] eval.truncate.curve=[]"
run real_trunc_wikitext2 $TONLY "eval.ppl.sets=[wikitext2]" "eval.modes=[$CURVE5]"
run real_trunc_stdlib $TONLY "eval.ppl.sets=[python_stdlib]" "eval.modes=[$CURVE5]"
run real_trunc_timed $TONLY "eval.ppl.sets=[wikitext2]" "eval.modes=[$CURVE5,truncate_tokens_1,no_context,target]"

# 3. the real pair on WikiText-2 at P = 256: every article long enough (one window each, both halves of the split),
#    64 scored tokens per window. Three runs, each with the baselines (cached after the first), so each writes its
#    own summary and an interrupted one loses only its own modes: (a) map + recent recompute at r = 0.3 and its
#    truncation twin, (b) the truncation curve, (c) r = 0.15 and 0.05 with their twins
REAL="+experiment=baselines_cpu cache_dir=$CACHE stage=[calibrate,fit,eval]"
BASE="no_context,transfer,target"
CURVE="truncate_tokens_1,truncate_tokens_4,truncate_tokens_8,truncate_tokens_16,truncate_tokens_32,truncate_tokens_64,truncate_tokens_128"
NOCURVE="eval.truncate.curve=[]"
run real_wikitext2_a $REAL $NOCURVE "eval.recompute_fraction=[0.3]" "eval.modes=[$BASE,recompute_recent_0.3,truncate_0.3]"
run real_wikitext2_b $REAL "eval.recompute_fraction=[]" "eval.modes=[$BASE,$CURVE]"
run real_wikitext2_c $REAL $NOCURVE "eval.recompute_fraction=[0.15,0.05]" \
  "eval.modes=[$BASE,recompute_recent_0.15,truncate_0.15,recompute_recent_0.05,truncate_0.05]"
# 3b. the per-request gate as served (thresholds fitted on held-out calibration text for ~20 % recompute / ~10 % full):
#     its realised actions and gap closed on both halves, against the fixed rule at its realised cost (collect.py)
run real_wikitext2_gate $REAL $NOCURVE eval.gate.enabled=true "eval.recompute_fraction=[]" "eval.modes=[$BASE]"
# 4. the Python stdlib set at P = 256 (never used for selection): one window per module long enough
STDLIB="eval.ppl.sets=[python_stdlib]"
run real_stdlib_a $REAL $STDLIB $NOCURVE "eval.recompute_fraction=[0.3]" "eval.modes=[$BASE,recompute_recent_0.3,truncate_0.3]"
run real_stdlib_b $REAL $STDLIB "eval.recompute_fraction=[]" "eval.modes=[$BASE,$CURVE]"
# 5. P = 1,024 on WikiText-2 (does the map's worth grow with the prefix?), the curve extended to 512
LONG="eval.ppl.prefixes=[1024]"
run real_wikitext2_1024_b $REAL $LONG "eval.recompute_fraction=[]" \
  "eval.modes=[$BASE,$CURVE,truncate_tokens_256,truncate_tokens_512]"
# 5b. worth as the context grows, on a fixed subsample that fits a session on 2 cores: P = 1,024 on WikiText-2, the
#     first 24 long-enough articles' windows, the map against truncation to 16-512 tokens (~1 h on 2 free cores)
run real_wikitext2_1024_w24 $REAL $LONG "eval.recompute_fraction=[]" "eval.ppl.windows=24" \
  "eval.modes=[$BASE,truncate_tokens_16,truncate_tokens_64,truncate_tokens_128,truncate_tokens_256,truncate_tokens_512]"
# 5c. the same at P = 512 on WikiText-2 and at P = 1,024 on Python source (24 windows each; the curve from m = 4)
run real_wikitext2_512_w24 $REAL "eval.ppl.prefixes=[512]" "eval.recompute_fraction=[]" "eval.ppl.windows=24" \
  "eval.modes=[$BASE,truncate_tokens_4,truncate_tokens_8,truncate_tokens_16,truncate_tokens_32,truncate_tokens_64,truncate_tokens_128,truncate_tokens_256]"
run real_stdlib_1024_w24 $REAL $LONG $STDLIB "eval.recompute_fraction=[]" "eval.ppl.windows=24" \
  "eval.modes=[$BASE,truncate_tokens_4,truncate_tokens_8,truncate_tokens_16,truncate_tokens_32,truncate_tokens_64,truncate_tokens_128,truncate_tokens_256,truncate_tokens_512]"
# 5d. the repair chosen on WikiText-2's selection half (recent, r = 0.05), run on Python source with its twin
run real_stdlib_c $REAL $STDLIB $NOCURVE "eval.recompute_fraction=[0.05]" \
  "eval.modes=[$BASE,recompute_recent_0.05,truncate_0.05]"
# 5e. the seconds of every table, by the timing protocol (timing.py: interleaved rounds on 8 contexts, one at a time,
#     on a quiet machine; each writes results/baselines/timing/<set>_P<P>.json once). Python source is priced with
#     WikiText-2's timing at the same P: a dense prefill's and the map's work depend on the token count, not the text
timed() {  # timed RUN P MODES [SUFFIX] [WINDOWS]   (SUFFIX _reverse: a large -> small run's file, step timing_<P>_reverse;
           # WINDOWS: the subsample's size, default 8)
  local f="results/baselines/timing/wikitext2_P$2${4:-}.json"
  if [[ -n "${STEPS:-}" && " $STEPS " != *" timing_$2${4:-} "* ]]; then return; fi
  if [[ -f "$f" ]]; then echo "[timing_$2${4:-}] done"; return; fi
  echo "[timing_$2${4:-}] $(date -u +%H:%M:%S) start"
  python experiments/baselines/timing.py --run "$OUT/$1" --set wikitext2 --prefix "$2" --modes "$3" --windows "${5:-8}"
}
CURVE_ALL="$CURVE,truncate_tokens_256,truncate_tokens_512"
timed real_wikitext2_1024_w24 1024 "$BASE,$CURVE_ALL"
timed real_wikitext2_1024_w24 256 "$BASE,$CURVE,recompute_recent_0.3,truncate_0.3,recompute_recent_0.15,truncate_0.15,recompute_recent_0.05,truncate_0.05"
timed real_wikitext2_1024_w24 512 "$BASE,$CURVE_ALL"
# 5f. large -> small (pair.direction=reverse: the 1.5B reads the context, the 0.5B answers): its own calibration and
#     map (the same pinned protocol), WikiText-2 at P = 256 with the truncation curve of the 0.5B
run real_reverse_wikitext2 $REAL pair.direction=reverse "eval.recompute_fraction=[]" "eval.modes=[$BASE,$CURVE]"
timed real_reverse_wikitext2 256 "$BASE,$CURVE" _reverse
run real_reverse_1024_w24 $REAL pair.direction=reverse $LONG "eval.recompute_fraction=[]" "eval.ppl.windows=24" \
  "eval.modes=[$BASE,$CURVE,truncate_tokens_256,truncate_tokens_512]"
timed real_reverse_1024_w24 1024 "$BASE,$CURVE_ALL" _reverse
# 5f'. large -> small's content share: the 0.5B reading another article's context natively and through the map (the
#      same length; kvtransfer.maps.controls), at P = 256 and on the 24 windows at P = 1,024
CONTROLS="eval.controls=[target_wrong,transfer_wrong]"
run real_reverse_controls $REAL pair.direction=reverse $NOCURVE "eval.recompute_fraction=[]" "$CONTROLS" "eval.modes=[$BASE]"
run real_reverse_1024_controls $REAL pair.direction=reverse $LONG $NOCURVE "eval.recompute_fraction=[]" "eval.ppl.windows=24" \
  "$CONTROLS" "eval.modes=[$BASE]"
# 5g. P = 2,048 on WikiText-2 (the first 16 long-enough articles' windows; ~25 min on 2 cores), the curve from m = 16
#     to 512; its timing on 2 of those windows (a round of every mode takes ~2 min there)
P2K="$BASE,truncate_tokens_16,truncate_tokens_64,truncate_tokens_256,truncate_tokens_512"
run real_wikitext2_2048_w16 $REAL "eval.ppl.prefixes=[2048]" "eval.recompute_fraction=[]" "eval.ppl.windows=16" "eval.modes=[$P2K]"
timed real_wikitext2_2048_w16 2048 "$P2K,truncate_tokens_1" "" 2
# 6. calibration in the evaluated code domain: the map calibrated (as the main one, 160 x 256 tokens) on Python source
#    -- the modules inside the standard library's packages, disjoint from the evaluated top-level modules -- and
#    scored on both perplexity sets beside the main map (collect.py names its mode transfer_code_calib)
CODE_TEXT="$CACHE/text/python_stdlib_packages.jsonl"
wants() { [[ -z "${STEPS:-}" ]] || for s in "$@"; do [[ " $STEPS " == *" $s "* ]] && return 0; done; return 1; }
if wants real_calib_code real_calib_mixed && [[ ! -f "$CODE_TEXT" ]]; then
  mkdir -p "$(dirname "$CODE_TEXT")"
  python experiments/data/python_stdlib.py --packages "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" "$CODE_TEXT"
fi
run real_calib_code $REAL $NOCURVE "calib.files=[$CODE_TEXT]" "calib.domain=python_packages" "eval.recompute_fraction=[]" \
  "eval.modes=[$BASE]" "eval.ppl.sets=[wikitext2,python_stdlib]"
# 7. CoQA's twins on the real pair: the 5 shipped conversations x 10 turns, target / transfer / the target reading only
#    the last 32 or 128 tokens (every turn: of the prompt; once: of the story), greedy answers up to 32 tokens
run real_coqa $REAL "eval.ppl.enabled=false" "eval.recompute_fraction=[]" "eval.coqa.enabled=true" \
  "eval.coqa.conversations=5" "eval.coqa.turns=10" "eval.coqa.protocols=[every_turn,once]" "eval.coqa.max_gen_toks=32" \
  "eval.coqa.truncate=[32,128]" "eval.modes=[target,transfer]"
# 8. calibration size and domain, at the main protocol (160 x 256 tokens per part, stride 2): calib.draw d reads the
#    text's sequences 160d .. 160d + 159 (disjoint draws); calib.merge folds other parts' moments in exactly, so the
#    80K- and 160K-token maps reuse the draws' calibrations. Draws 1 and 2 alone give the spread between draws at 40K;
#    the mixed map is the main draw plus the code calibration of step 6 (80K tokens, half each); collect.py reads
#    each run's map as transfer_<run>
CURVE_SETS="eval.ppl.sets=[wikitext2,python_stdlib]"
run real_calib_draw1 $REAL $NOCURVE calib.draw=1 "eval.recompute_fraction=[]" "eval.modes=[$BASE]"
run real_calib_80k $REAL $NOCURVE "calib.merge=[{draw:1}]" "eval.recompute_fraction=[]" "eval.modes=[$BASE]" "$CURVE_SETS"
run real_calib_draw2 $REAL $NOCURVE calib.draw=2 "eval.recompute_fraction=[]" "eval.modes=[$BASE]"
run real_calib_mixed $REAL $NOCURVE "calib.merge=[{files:[$CODE_TEXT],domain:python_packages}]" \
  "eval.recompute_fraction=[]" "eval.modes=[$BASE]" "$CURVE_SETS"
run real_calib_160k $REAL $NOCURVE "calib.merge=[{draw:1},{draw:2},{draw:3}]" "eval.recompute_fraction=[]" \
  "eval.modes=[$BASE]" "$CURVE_SETS"
