"""Collect the map-family runs (experiments/maps/run.sh) and the paper's map from experiments/qwen25coder
into results/maps/: one row per map (cost, fidelity, task retention), and the cost of each family at the
six paper pairs' real shapes.

    python experiments/maps/collect.py [--no-timing]

Every number comes from a run's summary.json, except the CPU apply time at 1,024 tokens, which this
script measures on the loaded artifacts (`bench.measure.time_mapper`: warm-up 2, median of 7) unless
--no-timing; run it on an idle machine. Runs not finished yet are left out, never invented.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

# the checkout this script is in, not an installed kvtransfer: its provenance is what the README header reports
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.bench.shapes import PAIRS, real_config
from kvtransfer.families import map_cost
from kvtransfer.io import atomic_write_bytes, atomic_write_json
from kvtransfer.models import kv_shape

PAPER_RUNS = {"paper_k8_sink1": "results/qwen25coder/runs/wiki_k8_sink1",
              "paper_k8_sink0": "results/qwen25coder/runs/wiki_k8_sink0"}
QWEN3_14B_32B = PAIRS["qwen3_14b_32b"]


def _write(df: pd.DataFrame, directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / f"{name}.csv", df.to_csv(index=False).encode())
    atomic_write_bytes(directory / f"{name}.md", (df.to_markdown(index=False, floatfmt=".4g") + "\n").encode())


def _pm(x, se, pct=False):
    if x is None:
        return None
    s = 100 if pct else 1
    return f"{s * x:.1f} ± {s * se:.1f}" if pct else f"{x:.3f} ± {se:.3f}"


def _family(m: dict) -> tuple[str, int | None]:
    return m.get("support", "full"), m.get("rank")


def shape_cost(pair: str, support: str, rank: int | None, k: int | None = None) -> dict:
    """map_cost of one family at a paper pair's real shapes (k as in the paper unless given)."""
    src, tgt, k_paper = PAIRS[pair]
    k = k_paper if k is None else k
    s, t = kv_shape(real_config(src)), kv_shape(real_config(tgt))
    return map_cost(t.n_layers, k, s.n_kv, s.head_dim, t.n_kv, t.head_dim, support=support, rank=rank)


def row_of(name: str, s: dict, timing: dict | None) -> dict:
    """One table row of a run's summary (plus the measured apply time, if any)."""
    m, fid = s["mapper"], s.get("fidelity") or {}
    flops = m.get("apply_flops_per_token")
    if flops is None:  # summaries written before the cost fields: count them on the artifact
        from kvtransfer.mapper import load_mapper

        flops = load_mapper(m["path"]).apply_flops_per_token
    support, rank = _family(m)
    full = shape_cost("qwen3_14b_32b", "full", None)["apply_flops_per_token"]
    per_layer = fid.get("per_layer", {})
    cos = per_layer.get("attn_cosine") or []
    row = {"map": name, "k": m["k"], "support": support, "rank": rank, "weighting": m.get("weighting", "none"),
           # runs made before the sink moved into the artifact name it in their eval config
           "native_sink": m.get("native_sink", s["_config"].get("eval", {}).get("native_sink")),
           "params": m["n_parameters"], "apply MFLOP/token": round(flops / 1e6, 3),
           # the map's own k at 14B -> 32B shapes against the paper's map (k = 8 there)
           "FLOPs vs paper @14B->32B": round(shape_cost("qwen3_14b_32b", support, rank, m["k"])["apply_flops_per_token"]
                                             / full, 3),
           "CPU ms @1K": timing.get("median_ms") if timing else None, "fit s": m.get("fit_seconds"),
           "K R² held-out": round(s["r2"]["k"]["heldout"], 3), "V R² held-out": round(s["r2"]["v"]["heldout"], 3),
           "attn cos": round(sum(cos) / len(cos), 4) if cos else None,
           "next-token KL": round(per_layer["kl"], 3) if "kl" in per_layer else None,
           "top-1 agree": round(per_layer["top1_agreement"], 3) if "top1_agreement" in per_layer else None}
    ppl = {r["prefix"]: r for r in s.get("ppl", [])}
    tail = s.get("native_tail", 1)
    if tail != 1:
        row["native tail"] = tail
        row["re-prefill share @256"] = round(tail / 257, 3)  # of the 257-token context (start id + 256)
    if 64 in ppl:
        row["ppl@64"] = round(ppl[64]["transfer"], 2)
    if 256 in ppl:
        r = ppl[256]
        row["ppl@256"] = round(r["transfer"], 2)
        if "transfer_gap_closed" in r:  # per-window NLLs: paired bootstrap SE over windows
            row["ppl@256 gap closed %"] = _pm(r["transfer_gap_closed"], r["transfer_gap_closed_se"], pct=True)
        else:
            row["ppl@256 gap closed %"] = round(100 * (r["no_context"] - r["transfer"]) / (r["no_context"] - r["target"]), 1)
    for task, label in (("hellaswag", "HS"), ("arc_challenge", "ARC")):
        t = (s.get("tasks") or {}).get(task)
        if t:
            row[f"{label} n"] = t["n"]
            row[f"{label} {t['metric']}"] = _pm(t["transfer"], t["stderr_transfer"])
            row[f"{label} gap closed %"] = _pm(t["gap_closed"], t["stderr_gap_closed"], pct=True)
            row[f"{label} floor-norm. retention %"] = _pm(t["floor_normalized"], t["stderr_floor_normalized"], pct=True)
            row[f"{label} retention %"] = _pm(t["retention"], t["stderr_retention"], pct=True)  # the paper's: transfer / target
    return row


ISSUE_COLUMNS = {  # the issue's columns, in its order, from the HS200 rows (maps rows, no tails)
    "map": "map", "params": "params", "apply MFLOP/token": "apply MFLOP/token",
    "FLOPs vs paper @14B->32B": "FLOPs vs paper @14B->32B", "CPU ms @1K": "CPU ms @1K", "fit s": "fit s",
    "K R² held-out": "K R²", "V R² held-out": "V R²", "attn cos": "attn cos", "next-token KL": "KL",
    "top-1 agree": "top-1", "ppl@256 gap closed %": "ppl@256 gap closed %", "HS acc_norm": "HS acc_norm (200)",
    "HS gap closed %": "HS gap closed %", "HS floor-norm. retention %": "HS floor-norm. %",
    # ARC-C's chance floor (0.25) is within one SE of this pair's target (0.35): its floor-normalised retention
    # has SEs near 100 %, so the table gives the paper's retention (transfer / target) instead
    "ARC acc_norm": "ARC acc_norm (100)", "ARC retention %": "ARC retention % (paper's)"}


def issue_table(hs_rows: list[dict]) -> pd.DataFrame:
    """One row per map (no native-tail rows) with the issue's columns, best perplexity first (maps with only
    an ARC-C run last)."""
    rows = [{new: r.get(old) for old, new in ISSUE_COLUMNS.items()} for r in hs_rows
            if not r.get("native tail") and (r.get("HS n") or r.get("ARC n"))]
    df = pd.DataFrame(rows)
    gap = df["ppl@256 gap closed %"].map(lambda v: float(str(v).split(" ")[0]) if isinstance(v, str) else -1.0)
    return df.iloc[gap.argsort()[::-1]].reset_index(drop=True)


def load_run(d: Path) -> dict:
    """A run directory's summary.json, with its resolved config.json (if any) under "_config"."""
    s = json.loads((d / "summary.json").read_text())
    s["_config"] = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    return s


def hellaswag_context_tokens(tokenizer_path: str, n: int, data: str = "data/benchmarks/hellaswag.jsonl") -> list[int]:
    """Token counts of the first n HellaSwag contexts as the runs score them: <|endoftext|> + lm-eval's query
    (activity label + ": " + ctx_a + " " + ctx_b capitalised; its bracket/space clean-up left out, which
    changes a count by a token at most)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    out = []
    for line in Path(data).open():
        if len(out) == n:
            break
        d = json.loads(line)
        query = f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}"
        out.append(1 + len(tok.encode(query, add_special_tokens=False)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/maps/runs")
    ap.add_argument("--fidelity-runs", default="results/maps/fidelity_runs")
    ap.add_argument("--hs200-runs", default="results/maps/runs_hs200")
    ap.add_argument("--arc100-runs", default="results/maps/runs_arc100")
    ap.add_argument("--out", default="results/maps")
    ap.add_argument("--no-timing", action="store_true", help="skip the measured CPU apply time")
    args = ap.parse_args()
    runs = dict(PAPER_RUNS)
    runs.update({d.name: str(d) for d in sorted(Path(args.runs).iterdir()) if d.is_dir()} if Path(args.runs).is_dir() else {})
    summaries = {}
    for name, d in runs.items():
        if (Path(d) / "summary.json").exists():
            s = load_run(Path(d))
            summaries[name] = s
        else:
            print(f"missing (not finished): {name}")
    if not summaries:
        raise SystemExit("no finished runs: run experiments/qwen25coder/run.sh and experiments/maps/run.sh first")
    timings = {}

    def timing(s: dict) -> dict | None:
        """Measured apply time at 1,024 tokens of a run's mapper (once per artifact); None with --no-timing."""
        if args.no_timing:
            return None
        from transformers import AutoConfig

        from kvtransfer.bench.measure import time_mapper
        from kvtransfer.mapper import load_mapper

        path = s["mapper"]["path"]
        if path not in timings:
            configs = [AutoConfig.from_pretrained(s[side]) for side in ("source", "target")]
            timings[path] = time_mapper(load_mapper(path), *configs, tokens=1024)
        return timings[path]

    rows = [row_of(name, s, timing(s)) for name, s in summaries.items()]
    out = Path(args.out)
    _write(pd.DataFrame(rows), out / "tables", "maps")
    # fidelity-only rows (FIDELITY=1 run.sh): cost, R² and the held-out fidelity of more maps, no benchmark
    fid_dir = Path(args.fidelity_runs)
    fid_rows = []
    for d in sorted(fid_dir.iterdir()) if fid_dir.is_dir() else []:
        if (d / "summary.json").exists():
            s = load_run(d)
            fid_rows.append(row_of(d.name, s, None))
    if fid_rows:
        _write(pd.DataFrame(fid_rows).dropna(axis=1, how="all"), out / "tables", "fidelity_sweep")
    # the issue's sizes (HS200=1 run.sh): HellaSwag n = 200, perplexity on 32 windows with SEs, native tails
    hs_dir = Path(args.hs200_runs)
    hs_rows = []
    arc_dir = Path(args.arc100_runs)
    # the target alone at P = 4 / 16 / 64 on the same windows: what a native tail of m tokens gives without any map
    floor_path = hs_dir / "truncation_floor" / "summary.json"
    truncated = {r["prefix"]: r["target"] for r in json.loads(floor_path.read_text())["ppl"]} if floor_path.exists() else {}
    for d in sorted(hs_dir.iterdir()) if hs_dir.is_dir() else []:
        if d.name in ("truncation_floor", "speed_tail"):  # no map of their own: used by the rows below
            continue
        if (d / "summary.json").exists():
            s = load_run(d)
            row = row_of(d.name, s, timing(s) if s.get("native_tail", 1) == 1 else None)
            arc = arc_dir / d.name
            if (arc / "summary.json").exists():  # ARC-C n = 100 of the same map (ARC100=1 run.sh)
                a = load_run(arc)
                if a["mapper"]["path"] != s["mapper"]["path"]:
                    raise SystemExit(f"{arc} evaluated another map than {d}: rerun ARC100=1 for {d.name}")
                row.update({k: v for k, v in row_of(d.name, a, None).items() if k.startswith("ARC")})
            p256 = {r["prefix"]: r for r in s.get("ppl", [])}.get(256)
            m = s.get("native_tail", 1)
            if m in truncated and p256:  # share of the (target at P = m) -> target gap the mapped rest closes
                row["truncated target ppl (last m only)"] = round(truncated[m], 2)
                row["ppl@256 gap closed over truncation %"] = round(
                    100 * (truncated[m] - p256["transfer"]) / (truncated[m] - p256["target"]), 1)
            hs_rows.append(row)
            summaries.setdefault(d.name, s)  # for the shapes-only cost table below
    for d in sorted(arc_dir.iterdir()) if arc_dir.is_dir() else []:  # maps with ARC-C but no HS200 row yet
        if (d / "summary.json").exists() and not (hs_dir / d.name / "summary.json").exists():
            hs_rows.append(row_of(d.name, load_run(d), None))
    speed_path = hs_dir / "speed_tail" / "summary.json"
    if speed_path.exists():  # what a tail costs on this CPU: mapper + the target's forward over m tokens
        speed = json.loads(speed_path.read_text())["speed"]
        _write(pd.DataFrame([{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
                              if k == "tokens" or k.startswith(("mapper_ms", "prefill_ms", "speedup", "tail"))}
                             for r in speed]), out / "tables", "native_tail_speed")
    if hs_rows:
        tails = {r["native tail"] for r in hs_rows if r.get("native tail")}
        if tails:  # the tail's share of a HellaSwag context (short: the share is far above the 256-token one)
            lengths = hellaswag_context_tokens(next(iter(summaries.values()))["target"], 200)
            for r in hs_rows:
                if r.get("native tail") and r.get("HS n"):
                    r["re-prefill share HS"] = round(sum(min(r["native tail"], n - 1) / n for n in lengths) / len(lengths), 3)
        _write(pd.DataFrame(hs_rows).dropna(axis=1, how="all"), out / "tables", "maps_hs200")
        _write(issue_table(hs_rows), out / "tables", "maps_issue")
    # (support, rank, k relative to this pair's k = 8): a map over twice the layers costs twice at any pair
    families = sorted({(*_family(s["mapper"]), s["mapper"]["k"] / 8) for s in summaries.values()},
                      key=lambda f: (f[0], f[1] or 0, f[2]))
    cost_rows = []
    for pair in PAIRS:
        paper = shape_cost(pair, "full", None)
        for support, rank, k_scale in families:
            k = round(PAIRS[pair][2] * k_scale)
            c = shape_cost(pair, support, rank, k)
            cost_rows.append({"pair": pair, "k": k, "support": support, "rank": rank,
                              "params (M)": round(c["n_parameters"] / 1e6, 1),
                              "apply GFLOP/token": round(c["apply_flops_per_token"] / 1e9, 4),
                              "vs paper map": round(c["apply_flops_per_token"] / paper["apply_flops_per_token"], 3)})
    _write(pd.DataFrame(cost_rows), out / "tables", "cost_paper_pairs")
    atomic_write_json(out / "maps.json", {"rows": rows, "hs200_rows": hs_rows, "timing_ms_1k": timings, "runs": runs})
    if hs_rows:
        print(pd.DataFrame(hs_rows).dropna(axis=1, how="all").to_markdown(index=False))
    print(pd.DataFrame(rows).to_markdown(index=False))


if __name__ == "__main__":
    main()
