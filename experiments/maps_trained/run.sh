#!/usr/bin/env bash
# The paper's map trained for the target's attention output, layer-local (issue 23 §1; mapper=trained,
# kvtransfer/maps/train_map.py) on the real pair, against the paper's map: results/maps_trained/.
# Same calibration as experiments/qwen25coder and experiments/maps (Wikipedia, 160 x 256 tokens, stride 2, 20 %
# held out); the trained map collects its inputs on 64 + 16 (stop split) of the 128 train sequences. Every stage
# is cached under artifacts/qwen25coder, so a rerun resumes and the paper-map rows reuse experiments/maps' results.
#   bash experiments/qwen25coder/run.sh          # first: calibration, baselines, the paper's map
#   FIDELITY=1 bash experiments/maps_trained/run.sh   # fit + held-out fidelity only (K/V R², attention cosine, KL,
#                                                     # top-1 on 4 held-out sequences), one row per learning rate
#   HS200=1 bash experiments/maps_trained/run.sh      # HellaSwag n = 200 + perplexity on 32 windows (as experiments/maps HS200)
#   ARC100=1 bash experiments/maps_trained/run.sh     # ARC-C n = 100
#   MMLU100=1 bash experiments/maps_trained/run.sh    # MMLU, 10 items x 10 subjects (the experiment's eval.limits)
#   HIDDEN=1 bash experiments/maps_trained/run.sh     # the hidden-state map (issue 23 §2): calibration, fidelity, perplexity
#   HIDDEN=1 HS200=1 bash ...                         # ... and its benchmark rows (ARC100=1, MMLU100=1 likewise)
#   LR=3e-4 HS200=1 bash experiments/maps_trained/run.sh   # the benchmark rows at another learning rate
#   SHORT=1 LR=3e-4 HS200=1 bash ...   # half the sequences and steps (what one 2-core session affords)
#   E2E=1 PPL32=1 bash ...             # the end-to-end objective at a CPU budget: fidelity + perplexity (32 windows)
#   E2E=1 HS200=1 bash ...             # ... and its benchmark rows (ARC100=1, MMLU100=1 likewise)
#   E2E=1 E2E_MORE=1 PPL32=1 bash ...  # ... on 48 + 8 sequences, at most 60 steps
# Choose the learning rate on calibration text only: by the stop-split losses each artifact records
# (summary.json: mapper.training.layers[*].stop_loss_final vs stop_loss_ridge), never by the fidelity numbers
# (their held-out split is the one reported) or the benchmark rows.
set -euo pipefail
cd "$(dirname "$0")/../.."
LR=${LR:-1e-4}
# SHORT=1: the CPU budget of one 2-core session -- half the sequences (32 + 8 stop) and half the steps (150) per layer
# E2E=1: the end-to-end objective (mapper.objective=end_to_end, kvtransfer.maps.train_e2e) at what one 2-core session
# affords -- 16 + 4 stop sequences, 2 per step, at most 40 joint steps (the config's 300 steps on 64 + 16 are ~5 h
# on this CPU: a GPU job); the learning rate is the config's default 1e-4, set before the run
# HIDDEN=1: the hidden-state map (issue 23 §2, mapper=hidden, k = 2); it needs its own calibration (the source's
# normed layer inputs, ~21 GiB of host memory by the plan at float32 moments: run it alone on a 24 GiB machine)
MAP_STAGE="[fit,eval]"
# E2E=1 E2E_MORE=1: 48 + 8 sequences and at most 60 steps, because the first run's record shows the 16 fit
# sequences overfit within 3 epochs (stop KL up at step 40 while the fit KL halved): more text, same rate
if [[ "${E2E:-0}" == 1 && "${E2E_MORE:-0}" == 1 ]]; then
  MAP=(mapper=trained mapper.objective=end_to_end mapper.native_sink=1 "mapper.lr=$LR" mapper.train_sequences=48
       mapper.stop_sequences=8 mapper.batch_sequences=2 mapper.steps=60 mapper.eval_every=10)
  NAME="e2e_lr${LR}_cpu48_sink1"
elif [[ "${E2E:-0}" == 1 ]]; then
  MAP=(mapper=trained mapper.objective=end_to_end mapper.native_sink=1 "mapper.lr=$LR" mapper.train_sequences=16
       mapper.stop_sequences=4 mapper.batch_sequences=2 mapper.steps=40 mapper.eval_every=10)
  NAME="e2e_lr${LR}_cpu_sink1"
elif [[ "${HIDDEN:-0}" == 1 ]]; then
  MAP=(mapper=hidden mapper.native_sink=1)
  NAME=hidden_k2_sink1
  MAP_STAGE="[calibrate,fit,eval]"
elif [[ "${SHORT:-0}" == 1 ]]; then
  MAP=(mapper=trained mapper.native_sink=1 "mapper.lr=$LR" mapper.train_sequences=32 mapper.stop_sequences=8 mapper.steps=150)
  NAME="trained_lr${LR}_short_sink1"
else
  MAP=(mapper=trained mapper.native_sink=1 "mapper.lr=$LR")
  NAME="trained_lr${LR}_sink1"
fi

run() {  # run OUT NAME OVERRIDES...
  local out=$1 name=$2; shift 2
  if [[ -f "$out/$name/summary.json" ]]; then echo "[$name] done"; return; fi
  rm -rf "${out:?}/$name"; mkdir -p "$out"
  echo "[$name] $(date -u +%H:%M:%S) start: $*"
  nice -n 10 python run.py +experiment=qwen25coder_cpu progress=false out_dir="$out/$name" "stage=${STAGE:-[fit,eval]}" "$@"
  echo "[$name] $(date -u +%H:%M:%S) done"
}

if [[ "${FIDELITY:-0}" == 1 ]]; then
  OUT=results/maps_trained/fidelity_runs
  FID=("eval.tasks=[]" eval.ppl.enabled=false)
  run "$OUT" paper_sink1 "${FID[@]}"
  for lr in 3e-5 1e-4 3e-4 1e-3; do
    run "$OUT" "trained_lr${lr}_sink1" "${FID[@]}" mapper=trained mapper.native_sink=1 "mapper.lr=$lr"
  done
  exit 0
fi

rows() {  # rows OUT EVAL...: the paper's map and the chosen map ($NAME) under one eval setting
  local out=$1; shift
  run "$out" paper_sink1 "$@"
  STAGE="$MAP_STAGE" run "$out" "$NAME" "$@" "${MAP[@]}"
  exit 0
}
MODES="eval.modes=[target,source,transfer,no_context]"
# HIDDEN=1 alone: fidelity + perplexity (what was first measured for it)
if [[ "${HIDDEN:-0}" == 1 && "${PPL32:-0}${HS200:-0}${ARC100:-0}${MMLU100:-0}" == 0000 ]]; then PPL32=1; fi
# fidelity + perplexity on 32 windows only (the issue's sizes), for a map whose benchmark rows are not yet run
[[ "${PPL32:-0}" == 1 ]] && rows results/maps_trained/runs_ppl32 "eval.tasks=[]" eval.ppl.windows=32 "$MODES"
[[ "${HS200:-0}" == 1 ]] && rows results/maps_trained/runs_hs200 eval.limit=200 eval.ppl.windows=32 "$MODES" "eval.tasks=[hellaswag]"
[[ "${ARC100:-0}" == 1 ]] && rows results/maps_trained/runs_arc100 eval.ppl.enabled=false "$MODES" "eval.tasks=[arc_challenge]"
[[ "${MMLU100:-0}" == 1 ]] && rows results/maps_trained/runs_mmlu100 eval.ppl.enabled=false "$MODES" "eval.tasks=[mmlu]"

echo "set one of FIDELITY=1, PPL32=1, HS200=1, ARC100=1, MMLU100=1, HIDDEN=1 (see the header)" >&2
exit 2
