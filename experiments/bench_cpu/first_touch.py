"""Fresh pages an apply touches per call: the process's minor page faults around `map_layers` at the bench's
shapes, with glibc's defaults or with whatever MALLOC_* settings the environment holds.

    python experiments/bench_cpu/first_touch.py results/bench_cpu/first_touch.json
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 python experiments/bench_cpu/first_touch.py OUT.json

A minor fault is the kernel mapping (and zeroing) one page the process touches for the first time: with glibc's
defaults each large buffer a call allocates is a fresh mmap, so the faults times the page size are the bytes zeroed
for nothing. Counts, not times: the machine's load does not change them. Per row: the pair, tokens, dtype and the
faults of 3 calls after one warm-up. Written once (never overwritten).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvtransfer.bench.breakdown import machine  # noqa: E402
from kvtransfer.bench.shapes import PAIRS, random_mapper, real_config, rope_only  # noqa: E402
from kvtransfer.config.provenance import json_provenance  # noqa: E402
from kvtransfer.core.io import atomic_write_json  # noqa: E402
from kvtransfer.core.models import kv_shape  # noqa: E402
from kvtransfer.core.rope import RopeCodec  # noqa: E402
from kvtransfer.core.transfer import map_layers  # noqa: E402


def faults_per_call(pair: str, tokens: int, dtype: torch.dtype, *, layers: int = 2, calls: int = 3) -> list[int]:
    """Minor page faults of each of `calls` map_layers calls (after one warm-up) at the bench's random selection."""
    src_name, tgt_name, k = PAIRS[pair]
    s_cfg, t_cfg = real_config(src_name), real_config(tgt_name, layers)
    s = kv_shape(s_cfg)
    mapper = random_mapper(s_cfg, t_cfg, k, n_target_layers=layers, selection="random", dtype=dtype, seed=0)
    used = sorted({x for row in mapper.selected_layers.tolist() for x in row})
    g = torch.Generator(device="cpu").manual_seed(0)
    real = {x: tuple(torch.randn(1, s.n_kv, tokens, s.head_dim, generator=g, device="cpu").to(dtype)
                     for _ in range(2)) for x in used}
    src = [real.get(x, real[used[0]]) for x in range(s.n_layers)]
    sc, tc = (RopeCodec(rope_only(c), initial_positions=tokens) for c in (s_cfg, t_cfg))
    kw = dict(source_codec=sc, target_codec=tc, target_n_kv=kv_shape(t_cfg).n_kv, out_dtype=dtype)
    pos = torch.arange(tokens, device="cpu")
    map_layers(src, mapper, pos, **kw)
    out = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        mapped = map_layers(src, mapper, pos, **kw)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del mapped
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--pair", default="qwen3_14b_32b")
    ap.add_argument("--tokens", default="1024,4096")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: write a new file")
    page = os.sysconf("SC_PAGE_SIZE")
    rows = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            faults = faults_per_call(args.pair, tokens, dtype)
            rows.append({"pair": args.pair, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                         "faults": faults, "page_bytes": page, "mb_per_call": [f * page / 1e6 for f in faults]})
            print(json.dumps(rows[-1]), flush=True)
    atomic_write_json(args.out, {"rows": rows, "machine": machine(), "provenance": json_provenance()})


if __name__ == "__main__":
    main()
