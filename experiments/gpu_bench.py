"""Shapes-only mapper-vs-re-prefill benchmark on one GPU (Table 5 layout), ~8 minutes.

Pairs qwen3_14b_32b and llama31_8b_70b, bf16, sdpa attention, tokens 1K-32K, as many target layers
as fit in memory (full depth for Qwen3-32B on an 80+ GB GPU; Llama-3.1-70B's 80 layers do not fit
in bf16 next to their activations, so a reduced depth is run and scaled, as the rows say).
bf16 GEMMs accumulate in fp32 (reduced-precision reductions off).

    python experiments/gpu_bench.py --out results/gpu_bench_<date>
    python experiments/gpu_bench.py --smoke --out /tmp/smoke      # CPU: 1 layer, tiny token counts
    python experiments/gpu_bench.py --mapper-dtypes float32,bfloat16 --out ...   # the map in both dtypes
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtransfer import bench  # noqa: E402
from kvtransfer.core.map_dtype import map_dtype  # noqa: E402
from kvtransfer.core.models import kv_shape  # noqa: E402

PAIRS = ("qwen3_14b_32b", "llama31_8b_70b")
TOKENS = (1024, 4096, 8192, 16384, 32768)


def layers_that_fit(pair: str, free_bytes: int, dtype_bytes: int, max_tokens: int, headroom: float = 0.75) -> int:
    """Target layers whose body weights + KV + prefill activations at max_tokens fit in headroom * free."""
    cfg = bench.real_config(bench.PAIRS[pair][1])
    per_layer = bench.body_params(cfg, 1) * dtype_bytes + 2 * max_tokens * kv_shape(cfg).width * dtype_bytes
    fixed = (cfg.vocab_size * cfg.hidden_size * dtype_bytes
             + max_tokens * (4 * cfg.intermediate_size + 8 * cfg.hidden_size) * dtype_bytes)
    return max(1, min(cfg.num_hidden_layers, int((headroom * free_bytes - fixed) // per_layer)))


def _with_prefill(row: dict, timed: dict) -> dict:
    """`row` (a map dtype timed without the prefill) with the prefill columns of `timed` (the same tokens) and its
    speedup; `timed` itself is returned as it is."""
    if row is timed or "prefill_ms" in row or "prefill_ms" not in timed or "mapper_ms" not in row:
        return row
    out = dict(row, **{k: v for k, v in timed.items() if k.startswith("prefill_")})
    out.update(speedup=out["prefill_ms"] / out["mapper_ms"], flop_ratio=out["prefill_flops"] / out["mapper_flops"],
               mapper_ms_full_est=out["mapper_ms"] * out["layers_full"] / out["layers_run"],
               prefill_ms_full_est=timed.get("prefill_ms_full_est"))
    out["speedup_vs_flop_ratio"] = out["speedup"] / out["flop_ratio"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="new output directory (existing files are never overwritten)")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized run: 1 layer, 16/32 tokens, 3 repeats")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new pairs after this many seconds")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated pairs of kvtransfer.bench.PAIRS")
    ap.add_argument("--mapper-dtypes", default="float32",
                    help="comma list of float32 | bfloat16: the dtypes the map is timed in (the prefill is timed once)")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = [16, 32] if a.smoke else [int(t) for t in a.tokens.split(",")]
    repeats, warmup = (3, 1) if a.smoke else (a.repeats, a.warmup)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    bench.output_paths(a.out)  # refuse an existing output before spending device time
    t0 = time.time()
    caps = bench.measure_device(device, dtype)
    print(f"{device} {dtype}: matmul {caps['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s, "
          f"copy {caps['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    rows, depth = [], {}
    for pair in a.pairs.split(","):
        if time.time() - t0 > a.budget_s:
            print(f"time budget spent; skipping {pair}")
            continue
        layers = 1 if a.smoke else layers_that_fit(pair, bench.available_bytes(device), 2, max(tokens))
        depth[pair] = layers
        print(f"{pair}: {layers} target layers", flush=True)
        first = None
        for mapper_dtype in a.mapper_dtypes.split(","):  # the prefill is the same for every map dtype: timed once
            got = bench.bench_pair(pair, tokens, layers=layers, device=device, dtype=dtype, warmup=warmup,
                                   mapper_dtype=map_dtype(mapper_dtype), repeats=repeats,
                                   n_inputs=2 if device == "cuda" else 3, caps=caps, run_prefill=first is None)
            first = first or {r["tokens"]: r for r in got}
            rows += [_with_prefill(r, first[r["tokens"]]) for r in got]
    extra = {"script": "experiments/gpu_bench.py", "smoke": a.smoke, "layers_run": depth,
             "wall_s": time.time() - t0, "assumptions": bench.ASSUMPTIONS,
             "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    paths = bench.write_outputs(rows, a.out, caps=caps, extra=extra)
    print(Path(paths["md"]).read_text())
    print(json.dumps({k: str(v) for k, v in paths.items()}))


if __name__ == "__main__":
    main()
