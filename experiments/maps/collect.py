"""Collect the map-family runs (experiments/maps/run.sh) and the paper's map from experiments/qwen25coder
into results/maps/: one row per map (cost, fidelity, task retention), and the cost of each family at the
six paper pairs' real shapes.

    python experiments/maps/collect.py [--no-timing] [--allow-dirty] [--check]

Every number comes from a run's summary.json (read in the current schema: kvtransfer.eval.metrics), except
the CPU apply time at 1,024 tokens, which this script measures on the loaded artifacts
(`bench.measure.time_mapper`: warm-up 2, median of 7); run it on an idle machine. --no-timing reuses the
times maps.json holds (measured by an earlier collect) instead of measuring. Writes tables/, maps.json,
figures/maps_cost_vs_gap.png and the generated blocks of results/maps/README.md and README.md. Runs not
finished yet are left out, never invented. Writing from uncommitted code needs --allow-dirty; --check only
compares the README blocks.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

# the checkout this script is in, not an installed kvtransfer: its provenance is what the README header reports
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.bench.shapes import PAIRS, real_config
from kvtransfer.maps.families import map_cost
from kvtransfer.eval.metrics import format_with_se, gap_closed, upgrade_summary
from kvtransfer.core.io import atomic_write_bytes, atomic_write_json
from kvtransfer.core.models import kv_shape
from kvtransfer.config.provenance import json_provenance, provenance_header, refuse_dirty_write
from kvtransfer.report import readme

PAPER_RUNS = {"paper_k8_sink1": "results/qwen25coder/runs/wiki_k8_sink1",
              "paper_k8_sink0": "results/qwen25coder/runs/wiki_k8_sink0"}
QWEN3_14B_32B = PAIRS["qwen3_14b_32b"]
# {mapper path: apply FLOPs per token} counted by an earlier collect (maps.json), for summaries that predate the field
PREVIOUS_FLOPS: dict[str, float] = {}


def _write(df: pd.DataFrame, directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / f"{name}.csv", df.to_csv(index=False).encode())
    atomic_write_bytes(directory / f"{name}.md", (df.to_markdown(index=False, floatfmt=".4g") + "\n").encode())


def _pm(x, se, pct=False):
    """A value ± SE rounded to what the SE supports; a percentage without an SE is marked "(SE needs rerun)"."""
    if x is None:
        return None
    if pct:
        return format_with_se(x, se, scale=100) if se is not None else f"{100 * x:.1f} (SE needs rerun)"
    return format_with_se(x, se)


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
    if flops is None:  # summaries written before the cost fields: count them on the artifact, else the count an
        # earlier collect made on it (maps.json), where the artifact cache is not on this machine
        from kvtransfer.core.mapper import load_mapper

        try:
            flops = load_mapper(m["path"]).apply_flops_per_token
        except FileNotFoundError:
            flops = PREVIOUS_FLOPS[m["path"]]
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
        # gap closed on log-perplexity (kvtransfer.eval.metrics); its SE needs the per-window NLLs (scores.json)
        row["ppl@256 gap closed %"] = _pm(r.get("transfer_gap_closed"), r.get("transfer_gap_closed_se"), pct=True)
    for task, label in (("hellaswag", "HS"), ("arc_challenge", "ARC")):
        t = (s.get("tasks") or {}).get(task)
        if t:
            row[f"{label} n"] = t["n"]
            row[f"{label} {t['metric']}"] = _pm(t["transfer"], t["stderr_transfer"])
            row[f"{label} gap closed %"] = _pm(t.get("gap_closed"), t.get("stderr_gap_closed"), pct=True)  # vs no context
            row[f"{label} gap closed vs source %"] = _pm(t.get("gap_closed_vs_source"), t.get("stderr_gap_closed_vs_source"),
                                                         pct=True)
            row[f"{label} retention vs chance %"] = _pm(t.get("retention_vs_chance"), t.get("stderr_retention_vs_chance"),
                                                        pct=True)
            row[f"{label} retention %"] = _pm(t["retention"], t["stderr_retention"], pct=True)  # the paper's: transfer / target
    return row


ISSUE_COLUMNS = {  # the issue's columns, in its order, from the HS200 rows (maps rows, no tails)
    "map": "map", "params": "params", "apply MFLOP/token": "apply MFLOP/token",
    "FLOPs vs paper @14B->32B": "FLOPs vs paper @14B->32B", "CPU ms @1K": "CPU ms @1K", "fit s": "fit s",
    "K R² held-out": "K R²", "V R² held-out": "V R²", "attn cos": "attn cos", "next-token KL": "KL",
    "top-1 agree": "top-1", "ppl@256 gap closed %": "ppl@256 gap closed %", "HS acc_norm": "HS acc_norm (200)",
    "HS gap closed %": "HS gap closed %", "HS gap closed vs source %": "HS gap closed vs source %",
    # ARC-C's chance floor (0.25) is within one SE of this pair's target (0.35): its floor-normalised retention
    # has SEs near 100 %, so the table gives the paper's retention (transfer / target) instead
    "ARC acc_norm": "ARC acc_norm (100)", "ARC retention %": "ARC retention % (paper's)"}


def issue_table(hs_rows: list[dict]) -> pd.DataFrame:
    """One row per map (no native-tail rows) with the issue's columns, best perplexity first (maps with only
    an ARC-C run last)."""
    rows = [{new: r.get(old) for old, new in ISSUE_COLUMNS.items()} for r in hs_rows
            if not r.get("native tail") and (r.get("HS n") or r.get("ARC n"))]
    df = pd.DataFrame(rows)
    gap = df["ppl@256 gap closed %"].map(lambda v: float(str(v).split(" ")[0]) if isinstance(v, str) else -1e9)
    return df.iloc[gap.argsort()[::-1]].reset_index(drop=True)


def load_run(d: Path) -> dict:
    """A run directory's summary.json, with its resolved config.json (if any) under "_config"."""
    s = upgrade_summary(json.loads((d / "summary.json").read_text()))
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/maps/runs")
    ap.add_argument("--fidelity-runs", default="results/maps/fidelity_runs")
    ap.add_argument("--hs200-runs", default="results/maps/runs_hs200")
    ap.add_argument("--arc100-runs", default="results/maps/runs_arc100")
    ap.add_argument("--scored-runs", default="results/maps/runs_hs200_scored")
    ap.add_argument("--out", default="results/maps")
    ap.add_argument("--readme", default="README.md", help="the top-level README (its maps_headline block)")
    ap.add_argument("--no-timing", action="store_true", help="reuse maps.json's measured CPU apply times")
    ap.add_argument("--allow-dirty", action="store_true", help="write although the code has uncommitted changes")
    ap.add_argument("--check", action="store_true", help="compare the README blocks only; exit 1 on a difference")
    return ap.parse_args(argv)


def load_all(args: argparse.Namespace) -> dict[str, dict]:
    """{run label: summary} of every finished run this script reads (for provenance): the paper's maps, maps,
    fidelity-only, HS200 and ARC100 runs."""
    out = {}
    for name, d in PAPER_RUNS.items():
        if (Path(d) / "summary.json").exists():
            out[f"qwen25coder/{Path(d).name}"] = load_run(Path(d))
    for folder in (args.runs, args.fidelity_runs, args.hs200_runs, args.arc100_runs, args.scored_runs):
        for d in sorted(Path(folder).iterdir()) if Path(folder).is_dir() else []:
            if (d / "summary.json").exists():
                out[f"{Path(folder).name}/{d.name}"] = load_run(d)
    return out


def build(args: argparse.Namespace) -> dict:
    """Every row of every table (no writing): {"rows", "fid_rows", "hs_rows", "speed", "cost_rows", "timings",
    "runs"}. CPU times are measured unless args.no_timing, which reuses maps.json's."""
    runs = dict(PAPER_RUNS)
    runs.update({d.name: str(d) for d in sorted(Path(args.runs).iterdir()) if d.is_dir()} if Path(args.runs).is_dir() else {})
    summaries = {}
    for name, d in runs.items():
        if (Path(d) / "summary.json").exists():
            summaries[name] = load_run(Path(d))
        else:
            print(f"missing (not finished): {name}")
    if not summaries:
        raise SystemExit("no finished runs: run experiments/qwen25coder/run.sh and experiments/maps/run.sh first")
    previous = json.loads((Path(args.out) / "maps.json").read_text()) if (Path(args.out) / "maps.json").exists() else {}
    timings = dict(previous.get("timing_ms_1k", {})) if args.no_timing else {}
    for r in previous.get("rows", []):
        path = str(Path(runs.get(r["map"], "")) / "summary.json")
        if Path(path).exists() and "apply MFLOP/token" in r:
            PREVIOUS_FLOPS.setdefault(json.loads(Path(path).read_text())["mapper"]["path"], r["apply MFLOP/token"] * 1e6)

    def timing(s: dict) -> dict | None:
        """Apply time at 1,024 tokens of a run's mapper (measured once per artifact, or maps.json's)."""
        path = s["mapper"]["path"]
        if args.no_timing:
            return timings.get(path)
        from transformers import AutoConfig

        from kvtransfer.bench.measure import time_mapper
        from kvtransfer.core.mapper import load_mapper

        if path not in timings:
            configs = [AutoConfig.from_pretrained(s[side]) for side in ("source", "target")]
            timings[path] = time_mapper(load_mapper(path), *configs, tokens=1024)
        return timings[path]

    rows = [row_of(name, s, timing(s)) for name, s in summaries.items()]
    fid_dir = Path(args.fidelity_runs)
    fid_rows = [row_of(d.name, load_run(d), None) for d in (sorted(fid_dir.iterdir()) if fid_dir.is_dir() else [])
                if (d / "summary.json").exists()]
    hs_rows, speed = hs200_rows(args, summaries, timing)
    return {"rows": rows, "fid_rows": fid_rows, "hs_rows": hs_rows, "speed": speed, "timings": timings,
            "runs": runs, "cost_rows": cost_rows(summaries), "goal2": goal2_difference(args)}


GOAL2 = ("head_local_k16_sink1", "paper_sink1")  # (the cheaper map, the paper's map) of goal 2


def goal2_difference(args: argparse.Namespace) -> dict | None:
    """Goal 2's comparison from the SCORED=1 reruns (run.sh): head_local k = 16 minus the paper's map (sink 1)
    on the same 200 HellaSwag items and 32 windows, from their scores.json -- the gap-closed difference with
    its paired bootstrap SE (kvtransfer.eval.metrics.gap_closed_difference), the accuracy difference with
    its paired SE, and whether each rerun reproduced the committed HS200 row of its map. None until both ran."""
    from kvtransfer.eval.metrics import gap_closed_difference, paired_difference

    dirs = [Path(args.scored_runs) / name for name in GOAL2]
    if not all((d / "scores.json").exists() for d in dirs):
        return None
    (a, b) = (json.loads((d / "scores.json").read_text()) for d in dirs)
    hs_a, hs_b = a["tasks"]["hellaswag"], b["tasks"]["hellaswag"]
    nll_a, nll_b = a["ppl_window_nll"]["256"], b["ppl_window_nll"]["256"]
    out = {"maps": list(GOAL2), "hs_n": len(hs_a["target"]), "windows": len(nll_a["target"]),
           "hs_gap_closed": gap_closed_difference(hs_a, hs_b),
           "hs_acc": paired_difference(hs_a["transfer"], hs_b["transfer"]),
           "ppl256_log_gap_closed": gap_closed_difference(nll_a, nll_b), "reproduced": {}}
    for name, d in zip(GOAL2, dirs):  # the rerun against the committed HS200 row of the same map
        old = Path(args.hs200_runs) / name / "summary.json"
        if old.exists():
            new_s, old_s = load_run(d), load_run(old.parent)
            pairs = [(new_s["tasks"]["hellaswag"][m], old_s["tasks"]["hellaswag"][m]) for m in ("target", "transfer")]
            pairs += [({r["prefix"]: r for r in new_s["ppl"]}[256][m], {r["prefix"]: r for r in old_s["ppl"]}[256][m])
                      for m in ("target", "transfer", "no_context")]
            out["reproduced"][name] = max(abs(x - y) for x, y in pairs)
    return out


def hs200_rows(args: argparse.Namespace, summaries: dict, timing) -> tuple[list[dict], list[dict] | None]:
    """The issue's sizes (HS200=1 run.sh): one row per map with its ARC-C n = 100 columns, native tails with
    their truncation floor; and the tail speed rows (None when not run). Adds the HS200 summaries to
    `summaries` (for the shapes-only cost table)."""
    hs_dir, arc_dir = Path(args.hs200_runs), Path(args.arc100_runs)
    hs_rows = []
    # the target alone at P = 4 / 16 / 64 on the same windows: what a native tail of m tokens gives without any map
    floor_path = hs_dir / "truncation_floor" / "summary.json"
    truncated = {r["prefix"]: r["target"] for r in json.loads(floor_path.read_text())["ppl"]} if floor_path.exists() else {}
    for d in sorted(hs_dir.iterdir()) if hs_dir.is_dir() else []:
        if d.name in ("truncation_floor", "speed_tail") or not (d / "summary.json").exists():
            continue  # no map of their own: used by the rows below
        s = load_run(d)
        row = row_of(d.name, s, timing(s) if s.get("native_tail", 1) == 1 else None)
        arc = arc_dir / d.name
        if (arc / "summary.json").exists():  # ARC-C n = 100 of the same map (ARC100=1 run.sh)
            a = load_run(arc)
            if a["mapper"]["path"] != s["mapper"]["path"]:
                raise SystemExit(f"{arc} evaluated another map than {d}: rerun ARC100=1 for {d.name}")
            row.update({k: v for k, v in row_of(d.name, a, None).items() if k.startswith("ARC")})
        p256 = {r["prefix"]: r for r in s.get("ppl", [])}.get(256)
        rerun = Path(args.scored_runs) / d.name / "summary.json"
        if p256 and p256.get("transfer_gap_closed_se") is None and rerun.exists():
            row.update(scored_ppl_cells(p256, load_run(rerun.parent), rerun.parent))
        m = s.get("native_tail", 1)
        if m in truncated and p256:  # share of the (target at P = m) -> target log-ppl gap the mapped rest closes
            row["truncated target ppl (last m only)"] = round(truncated[m], 2)
            row["ppl@256 gap closed over truncation % (log-ppl)"] = round(100 * float(gap_closed(
                math.log(p256["transfer"]), math.log(p256["target"]), math.log(truncated[m]))), 1)
        hs_rows.append(row)
        summaries.setdefault(d.name, s)
    for d in sorted(arc_dir.iterdir()) if arc_dir.is_dir() else []:  # maps with ARC-C but no HS200 row yet
        if (d / "summary.json").exists() and not (hs_dir / d.name / "summary.json").exists():
            hs_rows.append(row_of(d.name, load_run(d), None))
    speed_path = hs_dir / "speed_tail" / "summary.json"
    speed = None
    if speed_path.exists():  # what a tail costs on this CPU: mapper + the target's forward over m tokens
        speed = [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
                  if k == "tokens" or k.startswith(("mapper_ms", "prefill_ms", "speedup", "tail"))}
                 for r in json.loads(speed_path.read_text())["speed"]]
    tails = {r["native tail"] for r in hs_rows if r.get("native tail") and r.get("HS n")}
    if tails:  # the tail's share of a HellaSwag context (short: the share is far above the 256-token one)
        share = hellaswag_tail_shares(args, next(iter(summaries.values()))["target"], tails)
        for r in hs_rows:
            if r.get("native tail") and r.get("HS n"):
                r["re-prefill share HS"] = share[r["native tail"]]
    return hs_rows, speed


PPL_REPRODUCED = 1e-4  # relative: float32 CPU kernels at another thread count, same windows and map


def scored_ppl_cells(p256: dict, rerun: dict, where: Path) -> dict:
    """The ppl@256 gap-closed cell of a committed HS200 row with the SE of its SCORED=1 rerun (per-window NLLs),
    once the rerun reproduced every perplexity of the row at P = 256 within PPL_REPRODUCED (relative); a rerun
    that did not reproduce it is an error, not a source of SEs."""
    new = {r["prefix"]: r for r in rerun.get("ppl", [])}.get(256) or {}
    worst = max(abs(new[m] - p256[m]) / p256[m] for m in ("target", "transfer", "no_context"))
    if worst > PPL_REPRODUCED:
        raise SystemExit(f"{where} differs from the committed row's perplexities at P = 256 by up to {worst:.2g} "
                         "(relative): it did not reproduce that row, so its SE is not the row's")
    return {"ppl@256 gap closed %": _pm(new.get("transfer_gap_closed"), new.get("transfer_gap_closed_se"), pct=True),
            "ppl SE from": f"{where.parent.name}/{where.name} (reproduced to {worst:.1g})"}


def hellaswag_tail_shares(args: argparse.Namespace, tokenizer_path: str, tails: set[int]) -> dict[int, float]:
    """{m: mean share of a HellaSwag context (first 200) that a native tail of m re-prefills}; counted with the
    target's tokenizer, or, where it is not on this machine, read from the maps.json an earlier collect wrote."""
    try:
        lengths = hellaswag_context_tokens(tokenizer_path, 200)
        return {m: round(sum(min(m, n - 1) / n for n in lengths) / len(lengths), 3) for m in tails}
    except OSError:
        previous = json.loads((Path(args.out) / "maps.json").read_text())["hs200_rows"]
        return {r["native tail"]: r["re-prefill share HS"] for r in previous if "re-prefill share HS" in r}


def cost_rows(summaries: dict) -> list[dict]:
    """Parameters and apply GFLOP/token of every family measured here, at each paper pair's real shapes."""
    # (support, rank, k relative to this pair's k = 8): a map over twice the layers costs twice at any pair
    families = sorted({(*_family(s["mapper"]), s["mapper"]["k"] / 8) for s in summaries.values()},
                      key=lambda f: (f[0], f[1] or 0, f[2]))
    rows = []
    for pair in PAIRS:
        paper = shape_cost(pair, "full", None)
        for support, rank, k_scale in families:
            k = round(PAIRS[pair][2] * k_scale)
            c = shape_cost(pair, support, rank, k)
            rows.append({"pair": pair, "k": k, "support": support, "rank": rank,
                         "params (M)": round(c["n_parameters"] / 1e6, 1),
                         "apply GFLOP/token": round(c["apply_flops_per_token"] / 1e9, 4),
                         "vs paper map": round(c["apply_flops_per_token"] / paper["apply_flops_per_token"], 3)})
    return rows


COLLECT = "experiments/maps/collect.py"


def _pc(v: str | None) -> str | None:
    """A table cell "24 ± 14" / "36.3 (SE needs rerun)" as prose: "24 ± 14 %" / "36.3 % (SE needs rerun)"."""
    if v is None:
        return None
    return v.replace(" (SE", " % (SE") if "(SE" in v else f"{v} %"


def _r2(r: dict) -> str:
    return f"{r['K R² held-out']:.3f} / {r['V R² held-out']:.3f}"


def _ms(v) -> str | None:
    return None if v is None or v != v else f"{v:.0f}"


def block_n100(rows: list[dict]) -> str:
    out = [[r["map"], f"{r['apply MFLOP/token']:.1f}", _ms(r.get("CPU ms @1K")), f"{r['FLOPs vs paper @14B->32B']:g}",
            _r2(r), f"{r['attn cos']:.3f}", f"{r['next-token KL']:.2f}", f"{r['top-1 agree']:.2f}",
            f"{r['ppl@256']:.1f}; {_pc(r['ppl@256 gap closed %'])}",
            f"{r.get('HS acc_norm')}; {_pc(r.get('HS gap closed %'))}", r.get("ARC acc_norm")] for r in rows]
    return readme.md_table(["map", "apply MFLOP/token (this pair)", "CPU ms @ 1,024 tokens", "vs paper at 14B→32B",
                            "K / V R² held-out", "attn cos", "KL", "top-1", "ppl@256 (gap closed, log-ppl)",
                            "HellaSwag (gap closed)", "ARC-C"], out)


def block_fidelity(rows: list[dict]) -> str:
    out = [[r["map"], f"{r['apply MFLOP/token']:.1f}", f"{r['FLOPs vs paper @14B->32B']:g}", _r2(r),
            f"{r['attn cos']:.3f}", f"{r['next-token KL']:.3f}", f"{r['top-1 agree']:.3f}"] for r in rows]
    return readme.md_table(["map", "apply MFLOP/token", "vs paper at 14B→32B", "K / V R² held-out", "attn cos", "KL",
                            "top-1"], out)


def block_issue(hs_rows: list[dict]) -> str:
    df = issue_table(hs_rows)
    out = []
    for r in df.to_dict("records"):
        na = lambda v: None if v is None or v != v else v  # noqa: E731  (NaN from a missing column value)
        out.append([r["map"], f"{r['FLOPs vs paper @14B->32B']:g}", _ms(na(r["CPU ms @1K"])), f"{r['fit s']:.2f}",
                    f"{r['K R²']:.3f} / {r['V R²']:.3f}", f"{r['attn cos']:.3f}", f"{r['KL']:.3f}", f"{r['top-1']:.3f}",
                    na(r["ppl@256 gap closed %"]), na(r["HS acc_norm (200)"]), na(r["HS gap closed %"]),
                    na(r["HS gap closed vs source %"]), na(r["ARC acc_norm (100)"]), na(r["ARC retention % (paper's)"])])
    return readme.md_table(["map", "apply FLOPs vs paper @14B→32B", "CPU ms @1K", "fit s", "K / V R²", "attn cos", "KL",
                            "top-1", "ppl@256 gap closed % (log-ppl)", "HellaSwag (n = 200)", "HS gap closed %",
                            "HS gap closed vs source %", "ARC-C (n = 100)", "ARC retention %"], out)


def block_tail(hs_rows: list[dict]) -> str:
    rows = sorted([r for r in hs_rows if r["map"] == "paper_sink1" or r.get("native tail")],
                  key=lambda r: r.get("native tail") or 1)
    out = [[f"{r.get('native tail') or 1}" + (" (paper)" if not r.get("native tail") else ""),
            f"{100 * (r.get('native tail') or 1) / 257:.1f} %", f"{r['ppl@256']:.2f}", _pc(r["ppl@256 gap closed %"]),
            r.get("truncated target ppl (last m only)"),
            None if r.get("ppl@256 gap closed over truncation % (log-ppl)") is None
            else f"{r['ppl@256 gap closed over truncation % (log-ppl)']:.1f} %"] for r in rows]
    return readme.md_table(["m", "re-prefilled share at P = 256", "ppl@256", "gap closed (vs no context, log-ppl)",
                            "truncation floor (target, last m only)", "gap closed over the truncation floor (log-ppl)"],
                           out)


def _by_map(hs_rows: list[dict]) -> dict[str, dict]:
    return {r["map"]: r for r in hs_rows}


def block_goal2(hs_rows: list[dict], diff: dict | None = None) -> str:
    rows = _by_map(hs_rows)
    a, b = rows.get("head_local_k16_sink1"), rows.get("paper_sink1")
    if not (a and b):
        return ""
    if diff is not None:
        return goal2_text(a, b, diff)
    return (f"head_local k = 16 (sink 1) against the paper's map (sink 1), same items and windows: HellaSwag (n = 200) "
            f"{a['HS acc_norm']} vs {b['HS acc_norm']}, gap closed {_pc(a['HS gap closed %'])} vs {_pc(b['HS gap closed %'])}; "
            f"log-perplexity gap at P = 256 {_pc(a['ppl@256 gap closed %'])} vs {_pc(b['ppl@256 gap closed %'])}. "
            "**The SE of the paired difference** (`kvtransfer.eval.metrics.paired_difference` / `gap_closed_difference`), "
            "the comparison that decides \"as good within one SE\", **needs rerun**: these runs kept their per-item "
            "and per-window scores only in the artifact cache; `SCORED=1 bash experiments/maps/run.sh` reruns both with "
            "`scores.json` (`runs_hs200_scored/`: " + (", ".join(sorted(d.name for d in Path("results/maps/runs_hs200_scored").iterdir()
                                                                       if (d / "scores.json").exists())) or "none yet")
            + " so far).\n")


def goal2_text(a: dict, b: dict, diff: dict) -> str:
    """The goal-2 paragraph from the paired differences (`goal2_difference`)."""
    hs, acc, ppl = diff["hs_gap_closed"], diff["hs_acc"], diff["ppl256_log_gap_closed"]
    # "as good within one SE": head_local may be better by any amount, worse by at most one SE of the difference
    within = [x["difference"] >= -x["se"] for x in (hs, ppl)]
    verdict = ("met: on both, head_local is not worse than the paper's map by more than one SE of the paired "
               "difference" if all(within) else "not met: head_local is worse by more than one SE of the paired "
               "difference on " + " and ".join(w for w, ok in zip(("HellaSwag", "log-perplexity"), within) if not ok))
    repro = "; ".join(f"{name} {'reproduced the committed HS200 row exactly' if d == 0 else f'differs from the committed HS200 row by up to {d:.2g}'}"
                      for name, d in diff["reproduced"].items())
    return (f"head_local k = 16 (sink 1) against the paper's map (sink 1), same {diff['hs_n']} HellaSwag items and "
            f"{diff['windows']} windows (SCORED=1 reruns with per-item scores, `runs_hs200_scored/`): HellaSwag "
            f"{a['HS acc_norm']} vs {b['HS acc_norm']}, gap closed {_pc(a['HS gap closed %'])} vs {_pc(b['HS gap closed %'])}. "
            f"**Paired differences (head_local − paper):** HellaSwag gap closed "
            f"{format_with_se(hs['difference'], hs['se'], scale=100)} points (accuracy "
            f"{format_with_se(acc['difference'], acc['se'])}), log-perplexity gap closed at P = 256 "
            f"{format_with_se(ppl['difference'], ppl['se'], scale=100)} points (paired bootstrap SEs, "
            f"`kvtransfer.eval.metrics.gap_closed_difference`). Goal 2 (as good within one SE): **{verdict}**. "
            f"Reruns: {repro or 'no committed row to compare'}.\n")


# why a run that ran from a dirty tree or records no commit was not rerun (the provenance block prints it);
# a run rerun at a clean commit that reproduced it goes through `clean_reruns` instead
NOT_RERUN = {
    "fidelity_runs/rank64": "an ablation row (held-out fidelity only), not a headline",
    "fidelity_runs/rank64_attn": "an ablation row (held-out fidelity only), not a headline",
    "runs_hs200/paper_sink1_tail4": "a native-tail ablation row, not a headline",
    "runs_hs200/paper_sink1_tail16": "a native-tail ablation row, not a headline",
    "runs_hs200/paper_sink1_tail64": "a native-tail ablation row, not a headline",
    "runs_hs200/truncation_floor": "the native-tail rows' reference (the target alone on the last m tokens)",
    "runs_hs200/speed_tail": "CPU timing of the native tails, which needs an idle machine to be worth redoing",
    "qwen25coder/wiki_k8_sink0": "the n = 100 paper-map row without the native sink, not a headline",
}


def clean_reruns(goal2: dict | None, summaries: dict[str, dict]) -> dict[str, str]:
    """{run: sentence} for the committed HS200 rows whose SCORED=1 rerun (runs_hs200_scored/, a clean commit)
    reproduced every HellaSwag and P = 256 perplexity number exactly (`goal2_difference` compared them)."""
    out = {}
    for name, d in ((goal2 or {}).get("reproduced") or {}).items():
        rerun = summaries.get(f"runs_hs200_scored/{name}") or {}
        env = rerun.get("environment") or {}
        if d == 0 and env.get("commit") and not env.get("dirty"):
            out[f"runs_hs200/{name}"] = (f"`runs_hs200_scored/{name}` at clean `{env['commit'][:7]}` (every HellaSwag "
                                         "accuracy and P = 256 perplexity equal)")
    return out


def readme_blocks(data: dict, summaries: dict[str, dict]) -> dict[str, str]:
    """{block name: Markdown} of results/maps/README.md, from the rows `build` made (no model, no timing)."""
    blocks = {"provenance": provenance_header(summaries, COLLECT, reproduced=clean_reruns(data.get("goal2"), summaries),
                                              not_rerun=NOT_RERUN),
              "maps_n100": block_n100(data["rows"])}
    if data["fid_rows"]:
        blocks["fidelity_only"] = block_fidelity(data["fid_rows"])
    if data["hs_rows"]:
        blocks.update(maps_issue=block_issue(data["hs_rows"]), native_tail=block_tail(data["hs_rows"]),
                      goal2=block_goal2(data["hs_rows"], data.get("goal2")))
    return blocks


def top_readme_blocks(data: dict) -> dict[str, str]:
    """{"maps_headline": the top-level README's numbers on the map families}."""
    rows = _by_map(data["hs_rows"])
    p, h = rows.get("paper_sink1"), rows.get("head_local_k16_sink1")
    if not (p and h):
        return {}
    return {"maps_headline": (
        f"at HellaSwag n = 200 and 32 perplexity windows the paper's map closes {_pc(p['ppl@256 gap closed %'])} of the "
        f"log-perplexity gap at P = 256 and {_pc(p['HS gap closed %'])} of the HellaSwag gap to the no-context floor; "
        f"head_local at k = 16 (1/4 of its FLOPs at 14B → 32B): {_pc(h['ppl@256 gap closed %'])} and {_pc(h['HS gap closed %'])} "
        f"({_headline_difference(data.get('goal2'))});\n")}


def _headline_difference(diff: dict | None) -> str:
    if diff is None:
        return "the SE of their paired difference needs rerun"
    hs, ppl = diff["hs_gap_closed"], diff["ppl256_log_gap_closed"]
    return (f"paired difference head_local − paper: {format_with_se(hs['difference'], hs['se'], scale=100)} points on "
            f"HellaSwag, {format_with_se(ppl['difference'], ppl['se'], scale=100)} on log-perplexity")


def maps_figure(data: dict, path: Path, any_summary: dict) -> None:
    """Apply cost (FLOPs vs the paper's map at Qwen3-14B -> 32B, log) against gap closed, one point per map of the
    issue's table: HellaSwag n = 200 (floor-based, ± paired bootstrap SE) and log-perplexity at P = 256."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtransfer.report.figures import machine_label

    rows = [r for r in data["hs_rows"] if not r.get("native tail") and r.get("HS n")]
    if not rows:
        return
    parse = lambda v: (float(v.split(" ")[0]), float(v.split("±")[1]) if "±" in v else None)  # noqa: E731
    colours = plt.get_cmap("tab20").colors
    markers = {"full": "o", "head_local": "s"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for i, r in enumerate(sorted(rows, key=lambda r: r["map"])):
        x = r["FLOPs vs paper @14B->32B"]
        style = {"color": colours[i % 20], "marker": markers.get(r["support"], "D") if r.get("rank") != r.get("rank")
                 or r.get("rank") is None else "^", "ms": 7, "capsize": 3, "linestyle": "none"}
        hs, hs_se = parse(r["HS gap closed %"])
        ppl, ppl_se = parse(r["ppl@256 gap closed %"])
        jitter = 1 + 0.04 * (i % 5 - 2)  # maps of equal cost side by side, not on top of each other
        axes[0].errorbar(x * jitter, hs, yerr=hs_se, label=r["map"], **style)
        axes[1].errorbar(x * jitter, ppl, yerr=ppl_se, label=r["map"], **style)
    for ax, what in zip(axes, ("HellaSwag (n = 200): gap closed % (± paired bootstrap SE)",
                               "WikiText-2 P = 256 (32 windows): log-ppl gap closed %\n(no SE: per-window NLLs not kept, rerun)")):
        ax.set_xscale("log")
        ax.set_xlabel("apply FLOPs per token vs the paper's map, at Qwen3-14B → 32B shapes")
        ax.set_ylabel("gap closed % (vs the no-context floor)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(what, fontsize=9)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"{any_summary.get('pair')}: map families, cost vs what the target keeps ({machine_label(any_summary)}; "
                 "markers: ● full, ■ head_local, ▲ reduced rank)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.check:
        args.no_timing = True
        raise SystemExit(check_readmes(args))
    refuse_dirty_write(out, args.allow_dirty)
    data = build(args)
    _write(pd.DataFrame(data["rows"]), out / "tables", "maps")
    if data["fid_rows"]:  # fidelity-only rows (FIDELITY=1 run.sh): cost, R² and held-out fidelity, no benchmark
        _write(pd.DataFrame(data["fid_rows"]).dropna(axis=1, how="all"), out / "tables", "fidelity_sweep")
    if data["speed"]:
        _write(pd.DataFrame(data["speed"]), out / "tables", "native_tail_speed")
    if data["hs_rows"]:
        _write(pd.DataFrame(data["hs_rows"]).dropna(axis=1, how="all"), out / "tables", "maps_hs200")
        _write(issue_table(data["hs_rows"]), out / "tables", "maps_issue")
    _write(pd.DataFrame(data["cost_rows"]), out / "tables", "cost_paper_pairs")
    atomic_write_json(out / "maps.json", {"rows": data["rows"], "hs200_rows": data["hs_rows"],
                                          "timing_ms_1k": data["timings"], "runs": data["runs"],
                                          "goal2_paired_difference": data.get("goal2"),
                                          "provenance": json_provenance()})
    summaries = load_all(args)
    maps_figure(data, out / "figures" / "maps_cost_vs_gap.png", next(iter(summaries.values())))
    readme.rewrite(out / "README.md", readme_blocks(data, summaries))
    readme.rewrite(Path(args.readme), top_readme_blocks(data))
    print(f"wrote {out}: {len(data['rows'])} map rows, {len(data['hs_rows'])} HS200 rows")


def check_readmes(args: argparse.Namespace) -> int:
    """0 when the generated blocks of results/maps/README.md and README.md equal what the runs give now."""
    data, summaries = build(args), load_all(args)
    bad = 0
    for path, want in ((Path(args.out) / "README.md", readme_blocks(data, summaries)),
                       (Path(args.readme), top_readme_blocks(data))):
        for name in readme.stale_blocks(path, want):
            print(f"{path}: block {name!r} differs from the runs")
            bad = 1
    return bad


if __name__ == "__main__":
    main()
