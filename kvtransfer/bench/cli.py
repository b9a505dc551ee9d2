"""Mapper vs target re-prefill speed (the paper's Table 5) of the paper's pairs, shapes only, with FLOP/byte
counts and device floors.

The command line and its outputs, never overwritten: rows JSON, the Table-5 Markdown with floors, CSV
and the speedup plot.

    python -m kvtransfer.bench --pair qwen3_14b_32b --tokens 64,256,1024 --layers 2 --out DIR
"""
from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path
from typing import Sequence

import torch

from . import timing
from .measure import DEFAULT_TOKENS, bench_pair, calibration_throughput
from .shapes import ASSUMPTIONS, PAIRS


TABLE_COLUMNS = ("tokens", "mapper_ms", "mapper_ms_min", "mapper_ms_max", "mapper_floor_ms", "prefill_ms",
                 "prefill_ms_min", "prefill_ms_max", "prefill_floor_ms", "speedup", "flop_ratio",
                 "mapper_gemm_frac", "mapper_ms_full_est", "prefill_ms_full_est", "skipped")


def _fmt(x, nd=1):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def table_markdown(rows: list[dict], caps: dict | None = None) -> str:
    """Table-5 layout (tokens | mapper | re-prefill | speedup) with floors and FLOP ratio, Markdown."""
    if not rows:
        return ""
    r0 = rows[0]
    lines = [f"### {r0['source']} → {r0['target']} (k={r0['k']}) — SHAPES-ONLY: random weights, real configs, "
             f"{r0['layers_run']} of {r0['layers_full']} target layers run; {r0['dtype']} caches, "
             f"{r0.get('mapper_dtype', r0['dtype'])} mapper on {r0['device']}",
             ""]
    if caps:
        lines += [f"Device rates: matmul {caps['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s, copy "
                  f"{caps['copy_bytes_per_s'] / 1e9:,.1f} GB/s. Load average: {r0.get('load_avg', 'n/a')}.", ""]
    rate = ("the rate torch.matmul reached on the workload's own dominant GEMM shape, timed right before it (best of 5; "
            "at least the device matmul rate above)" if "prefill_floor_rate_flops_per_s" in r0 or
            "mapper_floor_rate_flops_per_s" in r0 else "the device's square-matmul rate above (measured once, before "
            "the workloads; these rows predate the per-workload rate)")
    lines += [f"Times are medians (min–max) in ms; floor (an estimate, not a guaranteed bound) = max(FLOPs / {rate}, "
              "minimal bytes / copy bandwidth); a median below its floor is marked ↓ (its rate underestimates what the "
              "workload reached: another load, or another GEMM shape); "
              "FLOP ratio = prefill FLOPs / mapper FLOPs; GEMM % = mapper GEMM FLOPs / whole mapper time, relative to "
              "torch.matmul on the same shapes; full-depth estimates scale per-layer times by layers_full / layers_run.",
              ""]
    lines += ["| tokens | mapper ms (min–max) | floor | re-prefill ms (min–max) | floor | speedup | FLOP ratio "
              "| GEMM % of matmul | full-depth est. mapper / prefill ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r and "speedup" not in r:
            lines.append(f"| {r['tokens']:,} | skipped: {r['skipped']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['tokens']:,} | {_fmt(r.get('mapper_ms'))} ({_fmt(r.get('mapper_ms_min'))}–{_fmt(r.get('mapper_ms_max'))}) "
            f"| {_fmt(r.get('mapper_floor_ms'))}{' ↓' if _beaten(r, 'mapper') else ''} "
            f"| {_fmt(r.get('prefill_ms'))} ({_fmt(r.get('prefill_ms_min'))}–"
            f"{_fmt(r.get('prefill_ms_max'))}) | {_fmt(r.get('prefill_floor_ms'))}{' ↓' if _beaten(r, 'prefill') else ''} "
            f"| {_fmt(r.get('speedup'))}x "
            f"| {_fmt(r.get('flop_ratio'))} | {_fmt(100 * r['mapper_gemm_frac'] if 'mapper_gemm_frac' in r else None, 0)} "
            f"| {_fmt(r.get('mapper_ms_full_est'), 0)} / {_fmt(r.get('prefill_ms_full_est'), 0)} |")
    return "\n".join(lines) + "\n"


def _beaten(row: dict, side: str) -> bool:
    """Whether `side`'s median is below its floor (the row's flag, else computed: rows made before the flag)."""
    if f"{side}_floor_beaten" in row:
        return bool(row[f"{side}_floor_beaten"])
    return row.get(f"{side}_ms") is not None and row.get(f"{side}_floor_ms") is not None and \
        row[f"{side}_ms"] < row[f"{side}_floor_ms"]


def table_csv(rows: list[dict]) -> str:
    """The same rows as CSV (columns TABLE_COLUMNS plus pair/device/dtype/layers)."""
    buf = io.StringIO()
    cols = ("pair", "device", "dtype", "mapper_dtype", "layers_run", "layers_full") + TABLE_COLUMNS
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def plot_speedup(rows: list[dict], path: str | Path) -> Path:
    """Speedup vs tokens, log-x, one colour + marker per pair: the median ratio with the range the measured
    extremes allow (prefill min / mapper max .. prefill max / mapper min) as error bars, and the FLOP ratio
    dashed; the title names the device, load and repeats. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .timing import load_average

    colours = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
    markers = ("o", "s", "^", "D", "v", "P", "X", "<")

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (pair, mdt) in enumerate(dict.fromkeys(_group(r) for r in rows)):
        rs = [r for r in rows if _group(r) == (pair, mdt) and "speedup" in r]
        if not rs:
            continue
        style = {"color": colours[i % len(colours)], "marker": markers[i % len(markers)]}  # one per pair
        tokens = [r["tokens"] for r in rs]
        lo = [r["speedup"] - r["prefill_ms_min"] / r["mapper_ms_max"] for r in rs]
        hi = [r["prefill_ms_max"] / r["mapper_ms_min"] - r["speedup"] for r in rs]
        ax.errorbar(tokens, [r["speedup"] for r in rs], yerr=[lo, hi], capsize=3, label=f"{pair} ({mdt} mapper)",
                    **style)
        ax.plot(tokens, [r["flop_ratio"] for r in rs], "--", color=style["color"], alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("re-prefill time / mapper time (median; bars: min–max range)")
    r0 = rows[0]
    # rows are timed one after another, so the load differs per row: the title gives the range of the 1-min loads
    ones = sorted(float(w[0]) for w in (str(r.get("load_avg", "")).split() for r in rows)
                  if w and w[0].replace(".", "", 1).isdigit())
    load = f"1-min load {ones[0]:.2f}–{ones[-1]:.2f}" if ones else f"load {load_average()}"
    ax.set_title(f"shapes-only (random weights, real configs, {r0.get('layers_run')} layer(s) run), {r0['device']} "
                 f"{r0['dtype']}\n{load} over the rows; n = {r0.get('repeats', '?')} repeats; "
                 "dashed: FLOP ratio", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    _exclusive(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _group(row: dict) -> tuple[str, str]:
    """(pair, mapper dtype): the rows one table or curve shows."""
    return row["pair"], row.get("mapper_dtype", row["dtype"])


def _exclusive(path: Path) -> None:
    if path.exists():
        raise FileExistsError(f"{path} exists; write to a new directory")


def output_paths(out_dir: str | Path, stem: str = "bench") -> dict:
    """{kind: path} of the files `write_outputs` writes; FileExistsError if any exists already."""
    out = Path(out_dir)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "csv": out / f"{stem}.csv",
             "png": out / f"{stem}_speedup.png"}
    for p in paths.values():
        _exclusive(p)
    return paths


def write_outputs(rows: list[dict], out_dir: str | Path, *, caps: dict | None = None, extra: dict | None = None,
                  stem: str = "bench") -> dict:
    """Write {stem}.json (rows + caps + extra), {stem}.md, {stem}.csv, {stem}_speedup.png into out_dir.
    Never overwrites: raises FileExistsError if any of them exists. Returns {kind: path}."""
    paths = output_paths(out_dir, stem)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if k != "times_ms"} for r in rows]
    md = "".join(table_markdown([r for r in rows if _group(r) == group], caps)
                 for group in dict.fromkeys(_group(r) for r in rows))
    for key, text in (("json", json.dumps({"rows": clean, "caps": caps, "extra": extra or {}}, indent=1, default=str)),
                      ("md", md), ("csv", table_csv(rows))):
        with open(paths[key], "x") as f:
            f.write(text)
    plot_speedup(rows, paths["png"])
    return paths


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m kvtransfer.bench` (tests/test_doc_commands.py parses the docs' commands)."""
    ap = argparse.ArgumentParser(prog="python -m kvtransfer.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen3_14b_32b", help=f"comma list of {', '.join(PAIRS)}")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--layers", type=int, default=None, help="target layers to run (default: full depth)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="models and caches: float32 | bfloat16 (default: bf16 on cuda, "
                    "fp32 on cpu)")
    ap.add_argument("--mapper-dtype", default="float32", help="comma list of float32 | bfloat16: the mapper's "
                    "dtype(s) to time (default float32, the dtype evaluation maps with)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inputs", type=int, default=3, help="distinct random inputs to rotate among")
    ap.add_argument("--selection", default="random", choices=("random", "band"))
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--calibration", action="store_true", help="also measure calibration throughput")
    ap.add_argument("--out", help="output directory; existing files are never overwritten (default: a fresh "
                    "./runs/bench/<pair>/<time>, as a run's out_dir)")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry: benchmark one or more pairs (shapes-only) and write rows JSON + table + figure."""
    a = parser().parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[a.dtype] or (
        torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    tokens = [int(t.lower().replace("k", "")) * (1024 if "k" in t.lower() else 1) for t in a.tokens.split(",")]
    if a.out is None:
        import time

        a.out = str(Path("runs") / "bench" / a.pair.replace(",", "+") / time.strftime("%Y-%m-%d_%H-%M-%S"))
    output_paths(a.out)  # refuse before measuring anything
    caps = timing.measure_device(a.device, dtype)
    print(f"device {a.device} {dtype}: matmul {caps['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"copy {caps['copy_bytes_per_s'] / 1e9:.1f} GB/s; load {timing.load_average()}")
    rows = []
    for pair in a.pair.split(","):
        for mapper_dtype in a.mapper_dtype.split(","):
            rows += bench_pair(pair, tokens, layers=a.layers, device=a.device, dtype=dtype,
                               mapper_dtype=getattr(torch, mapper_dtype), warmup=a.warmup, repeats=a.repeats,
                               n_inputs=a.inputs, selection=a.selection, run_prefill=not a.no_prefill, caps=caps)
    from ..config.provenance import environment

    extra = {"assumptions": ASSUMPTIONS, "argv": list(argv) if argv is not None else None,
             "environment": environment(vars(a), argv=None if argv is None else ["python -m kvtransfer.bench", *argv])}
    if a.calibration:
        extra["calibration"] = calibration_throughput(a.pair.split(",")[0], device=a.device, dtype=dtype)
        print("calibration:", extra["calibration"])
    paths = write_outputs(rows, a.out, caps=caps, extra=extra)
    print(Path(paths["md"]).read_text())
    return {k: str(v) for k, v in paths.items()}


def cli() -> None:
    """`kvtransfer-bench`: `main` without its return value (a console script exits with what it returns)."""
    main()


if __name__ == "__main__":
    main()
