"""Write results/bench_cpu/breakdown.md from results/bench_cpu/breakdown_*.json (kvtransfer.bench.breakdown rows).

    python -m kvtransfer.bench.breakdown --pair qwen3_14b_32b --layers 2 --tokens 1024,4096 \
        --dtype float32,bfloat16 --selection random,band --before <ref> --out results/bench_cpu/breakdown_14b_32b.json
    python experiments/bench_cpu/collect_breakdown.py

One table row per JSON row, every number from the JSON (the commit and load average with it), and per row the
CPU goal -- the map's GEMMs at >= 70 % of a same-shape matmul's rate, the time outside them < 20 % of the whole --
met, or what holds it back.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FOLDER = Path("results/bench_cpu")
RATE_GOAL, OUTSIDE_GOAL = 0.70, 0.20


def goal(r: dict) -> str:
    """The row's CPU goal in words: "met", or each part missed and what holds it back. The time outside the GEMMs
    is split into RoPE, the check and the counted extra bytes at the copy rate (each measured or priced in the
    same rounds); what is left is per-call overhead the split does not name. A bf16 rate on a CPU without native
    bf16 (no AMX, no AVX512-BF16) is not held to the rate goal."""
    missed = []
    native = r["dtype"] != "bfloat16" or r["machine"]["bf16"] != "no native bf16"
    if not native:
        missed.append("rate goal n/a (no native bf16)")
    elif r["gemm_rate_of_matmul"] < RATE_GOAL:
        blocks = max(r["blocks_per_target"])
        why = (f"{blocks} block GEMMs per target, each 1/{blocks} of the contraction"
               if blocks > 1 and r["dtype"] == "float32" else
               "one addmm with its bias per kind and target, against one plain matmul")
        missed.append(f"GEMMs at {r['gemm_rate_of_matmul']:.0%} of matmul ({why})")
    if r["other_share"] >= OUTSIDE_GOAL:
        parts = {"RoPE": max(r["rope_ms"], 0.0), "check": max(r["check_ms"], 0.0),
                 "extra bytes": r["data_ms_at_copy_rate"]}
        parts["unnamed overhead"] = max(r["other_ms"] - sum(parts.values()), 0.0)
        top = max(parts, key=parts.get)
        missed.append(f"{r['other_share']:.0%} outside the GEMMs, most of it {top} "
                      f"({parts[top]:,.0f} of {r['other_ms']:,.0f} ms)")
    return "met" if not missed else "; ".join(missed)


def table(rows: list[dict]) -> str:
    head = ["pair", "L_t", "tokens", "dtype", "selection", "buffers", "blocks / target", "map ms: median (p95, max)",
            "before ms", "GEMM share", "GEMMs at % of matmul", "RoPE ms", "check ms", "extra bytes (MB)",
            "data ms at copy rate", "% of floor", "peak MB", "load before → after", "ISA (bf16)", "CPU goal"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f = r["full_ms"]
        la = r["load_avg"]
        m = r["machine"]
        out.append("| " + " | ".join([
            r["pair"], str(r["layers"]), f"{r['tokens']:,}", r["dtype"], r["selection"],
            "kept (workspace)" if r.get("workspace") else "fresh per call", ",".join(map(str, r["blocks_per_target"])), f"{f['median']:,.0f} ({f['p95']:,.0f}, {f['max']:,.0f})",
            f"{r['before_ms']:,.0f}" if r.get("before_ms") else "–", f"{r['gemm_share']:.0%}",
            f"{r['gemm_rate_of_matmul']:.0%}", f"{r['rope_ms']:,.0f}", f"{r['check_ms']:,.0f}",
            f"{r['extra_bytes']['total'] / 1e6:,.0f}", f"{r['data_ms_at_copy_rate']:,.0f}",
            f"{r['floor_fraction']:.0%}", f"{r['peak_bytes'] / 1e6:,.0f}",
            f"{la['before'][0]:.1f} → {la['after'][0]:.1f}" if la.get("before") else "n/a",
            f"{m['torch_cpu_capability']} ({m['bf16']})", goal(r)]) + " |")
    return "\n".join(out)


ALLOC = FOLDER / "alloc_ab"   # <plain|keep><run>.json: the same rows without and with glibc keeping freed memory
KEEP_ENV = "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000"


def alloc_table(folder: Path = ALLOC) -> str:
    """The allocator A/B (runs alternating plain, keep, plain, keep): per row the map's median and GEMM share in
    each setting (mean over its runs) and the CPU goal under `keep`. `plain`: glibc's defaults, where each call's
    large buffers are fresh mmap pages the kernel zeroes on first touch; `keep`: KEEP_ENV, freed memory kept and
    reused."""
    runs: dict[str, list[list[dict]]] = {"plain": [], "keep": []}
    for f in sorted(folder.glob("*.json")):
        runs[f.stem.rstrip("0123456789")].append(json.loads(f.read_text())["rows"])
    if not runs["plain"] or not runs["keep"]:
        return ""
    head = ["pair", "tokens", "dtype", "selection", "map ms: plain → keep", "GEMM share: plain → keep",
            "CPU goal with keep"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(runs["plain"][0]):
        by = {env: [rows[i] for rows in rs] for env, rs in runs.items()}
        ms = {env: sum(x["full_ms"]["median"] for x in xs) / len(xs) for env, xs in by.items()}
        share = {env: sum(x["gemm_share"] for x in xs) / len(xs) for env, xs in by.items()}
        kept = dict(by["keep"][0], **{k: sum(x[k] for x in by["keep"]) / len(by["keep"]) for k in (
            "gemm_share", "other_share", "gemm_rate_of_matmul", "other_ms", "rope_ms", "check_ms",
            "data_ms_at_copy_rate")})
        out.append("| " + " | ".join([
            r["pair"], f"{r['tokens']:,}", r["dtype"], r["selection"], f"{ms['plain']:,.0f} → {ms['keep']:,.0f}",
            f"{share['plain']:.0%} → {share['keep']:.0%}", goal(kept)]) + " |")
    n = {env: len(rs) for env, rs in runs.items()}
    return "\n".join([
        "## The allocator: fresh pages per call", "",
        f"The same rows run {n['plain']} times with glibc's defaults (`plain`) and {n['keep']} times with `{KEEP_ENV}` "
        "(`keep`), alternating, each a separate process of `python -m kvtransfer.bench.breakdown`; means over each "
        "setting's runs. With the defaults every large buffer a call allocates is a fresh mmap whose pages the kernel "
        "zeroes on first touch; with `keep` glibc serves them from memory it kept. The GEMMs alone reuse their "
        "buffers in both.", "", *out, ""])


def load_note(files: list[Path]) -> str:
    """One sentence on the load the rows ran under (from their recorded 1-minute load averages)."""
    loads = [x for f in files for r in json.loads(f.read_text())["rows"]
             for x in (r["load_avg"].get("before", [None])[0], r["load_avg"].get("after", [None])[0]) if x is not None]
    cpus = {r["machine"]["cpus"] for f in files for r in json.loads(f.read_text())["rows"]}
    lo, hi = min(loads), max(loads)
    quiet = hi <= max(cpus) + 1   # the tool's own threads keep about one per CPU busy
    return (f"1-minute load average over the rows: {lo:.1f}-{hi:.1f} on {max(cpus)} CPUs ("
            + ("about the tool's own threads, one per CPU: nothing else of note ran, medians are what to read"
               if quiet else
               "other jobs shared the cores: the ratios measured within one set of rounds -- GEMM share, rate of "
               "matmul -- and the byte counts are what to read; the medians move by tens of percent between runs")
            + ").")


def main() -> int:
    files = sorted(FOLDER.glob("breakdown_*.json"))
    if not files:
        print("no results/bench_cpu/breakdown_*.json", file=sys.stderr)
        return 1
    parts = ["# Where the map's time goes (CPU, kvtransfer.bench.breakdown)", "",
             "Generated by experiments/bench_cpu/collect_breakdown.py from " + ", ".join(f.name for f in files) + ".",
             "",
             "Shapes-only: random weights and caches at the real configs, the map on L_t target layers, cache = map = "
             "output dtype, batch 1, one chunk. Every mode ran interleaved in the same rounds (after one warm-up): "
             "the map (`map ms`, median with p95 and max; `buffers`: allocated fresh by each call, or kept across calls in "
             "one `kvtransfer.core.transfer.Workspace`, as a serving worker keeps them), the apply as of the `before` "
             "ref where one was given, the map's GEMMs alone "
             "(same calls, same shapes: `GEMM share` = their median over the map's), one contiguous matmul of the "
             "same FLOPs (`GEMMs at % of matmul`), the map without RoPE (strip and re-rotation) and without the "
             "check (`RoPE ms`, `check ms`: differences of medians, within the noise when small), and a 64 MiB "
             "copy (the copy rate). `extra bytes` = bytes moved beyond the floor, counted "
             "(kvtransfer.bench.breakdown.extra_bytes), priced at that copy rate in `data ms`. `% of floor` = floor "
             "/ median, the floor from the matmul rate and copy rate of the same rounds. `peak MB` = the apply's "
             "allocations by construction.",
             "",
             f"`CPU goal`: the map's GEMMs at >= {RATE_GOAL:.0%} of the matmul's rate and < {OUTSIDE_GOAL:.0%} "
             "of its time outside them; where a part is missed the row names the largest share of the time outside "
             "(RoPE, the check, the extra bytes at the copy rate, or overhead none of these names).",
             "", load_note(files),
             "No GPU was available: the GPU table is not measured here.", ""]
    for f in files:
        b = json.loads(f.read_text())
        parts += [f"## {f.name} (commit {b['commit'][:10]})", "", table(b["rows"]), ""]
        parts += [f"- {r['pair']} {r['tokens']:,} {r['dtype']} {r['selection']}: {r['note']}" for r in b["rows"]
                  if r.get("note")] + [""]
    parts.append(alloc_table())
    (FOLDER / "breakdown.md").write_text("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
