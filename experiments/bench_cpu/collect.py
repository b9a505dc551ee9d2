"""Write the generated blocks of results/bench_cpu/README.md from results/bench_cpu/bench.json.

    python -m kvtransfer.bench --pair qwen3_14b_32b,qwen3_8b_32b,llama31_8b_70b,ministral3_3b_8b,ministral3_3b_14b,ministral3_8b_14b \
        --tokens 256,1024 --layers 1 --out results/bench_cpu.new        # on an idle machine, from a clean commit
    replace results/bench_cpu/bench.{json,md,csv} and bench_speedup.png with results/bench_cpu.new's, then:
    python experiments/bench_cpu/collect.py [--allow-dirty] [--check]

Every number comes from bench.json (its rows, its device rates and its `extra.environment`); --check compares
the blocks only (exit 1 on a difference).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the checkout this script is in, not an installed kvtransfer
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.config.provenance import provenance_header, refuse_dirty_write  # noqa: E402
from kvtransfer.report import readme  # noqa: E402

COLLECT = "experiments/bench_cpu/collect.py"
FOLDER = Path("results/bench_cpu")


def load(folder: Path = FOLDER) -> dict:
    """bench.json: {"rows": [...], "caps": {...}, "extra": {...}}."""
    return json.loads((folder / "bench.json").read_text())


def _range(r: dict, side: str) -> str:
    return f"{r[f'{side}_ms']:,.1f} ({r[f'{side}_ms_min']:,.1f}–{r[f'{side}_ms_max']:,.1f})"


def block_speed(b: dict) -> str:
    """One row per pair and length: both medians with their range, both floors (↓ where a median beat its
    floor, i.e. the rate behind the floor was wrong), the speedup, the FLOP ratio and their quotient."""
    rows = []
    for r in b["rows"]:
        ratio = r["prefill_flops"] / r["mapper_flops"]
        speedup = r["prefill_ms"] / r["mapper_ms"]
        floors = [f"{r[f'{s}_floor_ms']:,.1f}" + (" ↓" if r[f"{s}_ms"] < r[f"{s}_floor_ms"] else "")
                  for s in ("mapper", "prefill")]
        rows.append([f"{r['source']} → {r['target']} (k = {r['k']})", f"{r['tokens']:,}", _range(r, "mapper"), floors[0],
                     _range(r, "prefill"), floors[1], f"{speedup:.1f}x", f"{ratio:.1f}", f"{speedup / ratio:.2f}"])
    return readme.md_table(["pair", "tokens", "mapper ms, median (min–max)", "mapper floor", "re-prefill ms, median (min–max)",
                            "re-prefill floor", "speedup", "FLOP ratio", "speedup / FLOP ratio"], rows)


def block_summary(b: dict) -> str:
    """The lines the README's prose rests on: floors beaten, pairs reaching 2/3 of the FLOP ratio, GEMM rate share."""
    rows = b["rows"]
    beaten = [f"{r['pair']} {r['tokens']} ({s})" for r in rows for s in ("mapper", "prefill") if r[f"{s}_ms"] < r[f"{s}_floor_ms"]]
    long = [r for r in rows if r["tokens"] == max(x["tokens"] for x in rows)]
    reach = [r["pair"] for r in long if (r["prefill_ms"] / r["mapper_ms"]) >= (2 / 3) * (r["prefill_flops"] / r["mapper_flops"])]
    gemm = [100 * r["mapper_gemm_frac"] for r in long if r.get("mapper_gemm_frac") is not None]
    same: dict[tuple, list[float]] = {}  # one target's re-prefill at one length, timed once per pair that has it
    for r in rows:
        same.setdefault((r["target"], r["tokens"]), []).append(r["prefill_ms"])
    spread = max(((max(v) / min(v), k, v) for k, v in same.items() if len(v) > 1), default=None)
    noise = ("" if spread is None else
             f"- Run-to-run noise: the same target's re-prefill at the same length, timed in two rows, differs by up to "
             f"{spread[0]:.1f}x ({spread[1][0]} at {spread[1][1]:,} tokens: "
             f"{' vs '.join(f'{x:,.1f}' for x in spread[2])} ms).\n")
    return noise + (f"- Medians below their floor: {len(beaten)} of {2 * len(rows)}" + (f" ({', '.join(beaten)})" if beaten else "")
            + ".\n"
            f"- At {long[0]['tokens']:,} tokens the measured speedup reaches ≥ 2/3 of the FLOP ratio for {len(reach)} of "
            f"{len(long)} pairs" + (f" ({', '.join(reach)})" if reach else "") + ".\n"
            + (f"- At {long[0]['tokens']:,} tokens the mapper's GEMMs ran at {min(gemm):.0f}–{max(gemm):.0f} % of "
               "torch.matmul's rate on the same shapes.\n" if gemm else ""))


def blocks(b: dict) -> dict[str, str]:
    """{block name: Markdown} of results/bench_cpu/README.md."""
    env = (b.get("extra") or {}).get("environment") or {}
    mach = env.get("machine") or {}
    caps = b["caps"]
    loads = sorted({r["load_avg"] for r in b["rows"] if r.get("load_avg")})
    machine = (f"Machine: {mach.get('cpu') or env.get('platform', 'unrecorded')}, {env.get('cpu_count', '?')} CPUs, "
               f"{mach.get('memory_gib', '?')} GiB, torch threads {mach.get('torch_threads', '?')}; device rates before the workloads: square matmul "
               f"{caps['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, copy {caps['copy_bytes_per_s'] / 1e9:.1f} GB/s; load average "
               f"(1/5/15 min) per row from {loads[0]} to {loads[-1]}.\n" if loads else "")
    header = provenance_header({"bench": {"environment": env}}, COLLECT,
                               not_rerun={"bench": "it was made before bench.json recorded its commit"})
    return {"provenance": header + "\n" + machine, "speed": block_speed(b), "summary": block_summary(b)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", default=str(FOLDER))
    ap.add_argument("--allow-dirty", action="store_true", help="write from an uncommitted tree (the header says so)")
    ap.add_argument("--check", action="store_true", help="only compare the README's blocks (exit 1 on a difference)")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    want = blocks(load(folder))
    if args.check:
        stale = readme.stale_blocks(folder / "README.md", want)
        for name in stale:
            print(f"{folder / 'README.md'}: block {name!r} is stale: rerun {COLLECT}")
        return 1 if stale else 0
    refuse_dirty_write(folder, args.allow_dirty)
    readme.rewrite(folder / "README.md", want)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
