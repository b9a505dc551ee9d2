"""Collect the qwen25coder runs (experiments/qwen25coder/run.sh) into results/qwen25coder/.

    python experiments/qwen25coder/collect.py [--runs results/qwen25coder/runs] [--out results/qwen25coder]

Writes summary.json (the main configuration's summary), tables/*.csv|md and figures/*.png. Every
number comes from a run's summary.json; the tables are derived, so rerunning this replaces them
(atomically). Runs that have not finished yet are listed as missing, never invented.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd

from kvtransfer.io import atomic_write_bytes, atomic_write_json

MAIN = "main"  # the run whose summary is results/qwen25coder/summary.json (falls back to wiki_k8_sink1)
# runs of the main configuration that add tasks run.sh schedules separately (same map, same eval settings):
# their tasks, CoQA drift and eval seconds are merged into the main summary, which names them in `merged_runs`
MAIN_PARTS = ("main_gsm8k", "main_coqa")


def merge_main(main: dict, parts: dict[str, dict]) -> dict:
    """The main summary with the tasks, drift and eval seconds of `parts` (name -> summary) added; refuses a part
    evaluated with another mapper (its `mapper.path` differs), since then it is not the main configuration."""
    out = json.loads(json.dumps(main))
    out["merged_runs"] = []
    for name, part in parts.items():
        if (part.get("mapper") or {}).get("path") != (main.get("mapper") or {}).get("path"):
            raise ValueError(f"{name} used mapper {part.get('mapper', {}).get('path')}, not the main run's "
                             f"{main.get('mapper', {}).get('path')}: rerun it with the main configuration")
        out.setdefault("tasks", {}).update(part.get("tasks") or {})
        for key in ("drift", "drift_summary"):
            if part.get(key):
                out[key] = part[key]
        for mode, sec in (part.get("eval_seconds") or {}).items():
            out.setdefault("eval_seconds", {}).setdefault(mode, {}).update(sec)
        out["warnings"] = list(out.get("warnings", [])) + [w for w in part.get("warnings", []) if w not in out.get("warnings", [])]
        out["merged_runs"].append(name)
    return out


# the paper's Table 2 rows and the run of each (experiments/qwen25coder/run.sh; FULL=1 for the rotated-key ones)
TABLE2 = (("full (k = 8)", "wiki_k8_sink1"), ("- RoPE re-rotation at inference", "wiki_no_rerotation"),
          ("- all RoPE handling (fit + apply on rotated keys)", "wiki_no_rope"),
          ("- RoPE - cross-layer (k = 1)", "wiki_no_rope_k1"),
          ("- RoPE - cross-layer - ridge (lambda = 0)", "wiki_no_rope_k1_no_ridge"))
MC = ("hellaswag", "arc_challenge", "winogrande", "mmlu", "gsm8k_cot")


def _write(df: pd.DataFrame, directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / f"{name}.csv", df.to_csv(index=False).encode())
    atomic_write_bytes(directory / f"{name}.md", (df.to_markdown(index=False, floatfmt=".4g") + "\n").encode())


def _fmt(x, se=None, pct=False):
    if x is None:
        return None
    scale = 100 if pct else 1
    return f"{scale * x:.1f}" + (f" ± {scale * se:.1f}" if se is not None else "") if pct else \
        f"{x:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def variant_row(name: str, s: dict) -> dict:
    """One row per run: calibration, map, sink, R², per-task scores, PPL, fidelity at the sink."""
    cal, mapper = s.get("calibration", {}), s.get("mapper", {})
    cfg = s.get("_config", {})
    row = {"run": name, "calibration": cal.get("domain"), "context_start": cal.get("context_start"),
           "k": mapper.get("k"), "mapper": mapper.get("kind"), "ablation": (s.get("ablation") or {}).get("name", "full"),
           "native_sink": mapper.get("native_sink", cfg.get("eval", {}).get("native_sink")),
           "K R² held-out": s.get("r2", {}).get("k", {}).get("heldout"),
           "V R² held-out": s.get("r2", {}).get("v", {}).get("heldout")}
    for task in MC:
        r = (s.get("tasks") or {}).get(task)
        if r:
            row[f"{task} transfer"] = _fmt(r.get("transfer"), r.get("stderr_transfer"))
            row[f"{task} gap closed %"] = _fmt(r.get("gap_closed"), r.get("stderr_gap_closed"), pct=True)
            row[f"{task} vs floor %"] = _fmt(r.get("context_gap_closed"), r.get("stderr_context_gap_closed"), pct=True)
    for r in s.get("ppl", []):
        if r["prefix"] > 0:
            row[f"ppl@{r['prefix']} transfer"] = r.get("transfer")
            t, f = r.get("target"), r.get("no_context")
            if None not in (t, f, r.get("transfer")) and f != t:
                row[f"ppl@{r['prefix']} gap closed %"] = round(100 * (f - r["transfer"]) / (f - t), 1)
    pos = (s.get("fidelity") or {}).get("per_position", {})
    for group in ("pos0", "all"):
        if group in pos:
            row[f"attn cos ({group} mapped)"] = pos[group]["attn_cosine"]
            row[f"KL ({group} mapped)"] = pos[group]["kl"]
    row["warnings"] = len(s.get("warnings", []))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="results/qwen25coder/runs")
    ap.add_argument("--out", default="results/qwen25coder")
    args = ap.parse_args()
    runs_dir, out = Path(args.runs), Path(args.out)
    summaries = {}
    for d in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            s["_config"] = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
            summaries[d.name] = s
        else:
            print(f"missing (not finished): {d.name}")
    tdir, fdir = out / "tables", out / "figures"
    main_name = MAIN if MAIN in summaries else "wiki_k8_sink1"
    if main_name in summaries:
        s = merge_main(summaries[main_name], {n: summaries[n] for n in MAIN_PARTS if n in summaries and main_name == MAIN})
        atomic_write_json(out / "summary.json", {k: v for k, v in s.items() if k != "_config"})
        rows = []
        for task, r in (s.get("tasks") or {}).items():
            rows.append({"task": task, "metric": r.get("metric"), "n": r.get("n"),
                         **{m: _fmt(r.get(m), r.get(f"stderr_{m}")) for m in
                            ("target", "source", "transfer", "native_injected", "no_context")},
                         "retention %": _fmt(r.get("retention"), r.get("stderr_retention"), pct=True),
                         "floor-normalised %": _fmt(r.get("floor_normalized"), r.get("stderr_floor_normalized"), pct=True),
                         "gap closed %": _fmt(r.get("gap_closed"), r.get("stderr_gap_closed"), pct=True),
                         "McNemar p (transfer vs target)": r.get("mcnemar_p")})
        _write(pd.DataFrame(rows), tdir, "main_tasks")
        _write(pd.DataFrame(s.get("ppl", [])), tdir, "main_ppl")
        if s.get("drift"):  # CoQA: per turn, both protocols (transfer vs target answers)
            _write(pd.DataFrame(s["drift"]), tdir, "main_coqa_drift")
            from kvtransfer.report.figures import drift_per_turn

            fdir.mkdir(parents=True, exist_ok=True)
            (fdir / "coqa_drift.png").unlink(missing_ok=True)  # a view of runs/, redrawn on every collect
            drift_per_turn(s["drift"], fdir / "coqa_drift.png")
        if s.get("drift_summary"):  # pooled over all turns, SEs over conversations
            _write(pd.DataFrame([{"protocol": r["protocol"], "conversations": r["conversations"], "turns": r["turns"],
                                  "target F1": _fmt(r["target_f1"], r["target_f1_se"]),
                                  "transfer F1": _fmt(r["transfer_f1"], r["transfer_f1_se"]),
                                  "retention %": _fmt(r["retention"], r["retention_se"], pct=True)}
                                 for r in s["drift_summary"]]), tdir, "main_coqa_summary")
        _write(pd.DataFrame([{"positions": g, **{k: v for k, v in r.items() if k != "positions"}}
                             for g, r in (s.get("fidelity") or {}).get("per_position", {}).items()]),
               tdir, "main_fidelity_positions")
        cost = []
        for mode, parts in (s.get("eval_seconds") or {}).items():
            for part, sec in parts.items():
                task = part[5:] if part.startswith("task.") else part
                n = ((s.get("tasks") or {}).get(task) or {}).get("n")
                cost.append({"mode": mode, "part": task, "seconds": sec, "items": n,
                             "s/item": None if not n or sec is None else sec / n})
        _write(pd.DataFrame(cost), tdir, "eval_cost")
    summaries = {n: v for n, v in summaries.items() if n not in MAIN_PARTS}   # merged into the main summary above
    _write(pd.DataFrame([variant_row(n, s) for n, s in summaries.items() if s.get("tasks") or s.get("ppl")]),
           tdir, "variants")
    # Table 2 (the paper's ablations) in its row order: each variant is one run on the Wikipedia calibration
    table2 = []
    for label, name in TABLE2:
        if name in summaries:
            r = summaries[name]
            hs = (r.get("tasks") or {}).get("hellaswag") or {}
            ppl = {row["prefix"]: row for row in r.get("ppl", [])}.get(256, {})
            table2.append({"variant": label, "run": name, "k": r["mapper"]["k"], "lambda": r["mapper"]["lambda"],
                           "key space": r["mapper"].get("key_space"),
                           "K / V R² held-out": f"{r['r2']['k']['heldout']:.3f} / {r['r2']['v']['heldout']:.3f}",
                           "HellaSwag acc_norm": _fmt(hs.get("transfer"), hs.get("stderr_transfer")),
                           "HS gap closed %": _fmt(hs.get("gap_closed"), hs.get("stderr_gap_closed"), pct=True),
                           "ppl@256": round(ppl["transfer"], 2) if ppl.get("transfer") else None,
                           "ppl@256 gap closed %": round(100 * (ppl["no_context"] - ppl["transfer"])
                                                         / (ppl["no_context"] - ppl["target"]), 1) if ppl else None,
                           "fidelity KL": round(((r.get("fidelity") or {}).get("per_layer") or {}).get("kl", float("nan")), 3),
                           "warnings": len(r.get("warnings", []))})
    if table2:
        _write(pd.DataFrame(table2), tdir, "table2_ablations")
    for name, s in summaries.items():
        if s.get("variance_explained"):
            _write(pd.DataFrame(s["variance_explained"]), tdir, f"table7_{s['calibration'].get('domain', name)}")
            for fig in ("r2_heatmap.png", "r2_vs_k.png"):
                src = runs_dir / name / "figures" / fig
                if src.exists():
                    fdir.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, fdir / f"{Path(fig).stem}_{s['calibration'].get('domain', name)}.png")
        if s.get("speed"):
            _write(pd.DataFrame(s["speed"]), tdir, "speed")
    curve = [{"run": n, "prefix": r["prefix"], **{m: r.get(m) for m in
                                                  ("target", "source", "transfer", "native_injected", "no_context")}}
             for n, s in summaries.items() for r in s.get("ppl", [])]
    if curve:
        _write(pd.DataFrame(curve), tdir, "ppl_curves")
        _ppl_figure(curve, fdir / "ppl_vs_prefix.png")
    print(f"wrote {out} from {len(summaries)} runs: {', '.join(summaries)}")


def _ppl_figure(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.DataFrame(curve)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    base = df[df.run == df.run.iloc[0]]
    for mode, style in (("target", "k-"), ("no_context", "k:"), ("source", "k--")):
        if base[mode].notna().any():
            ax.plot(base.prefix, base[mode], style, label=mode)
    for run, g in df.groupby("run"):
        ax.plot(g.prefix, g.transfer, marker="o", label=f"transfer: {run}")
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens P (mapped from the source)")
    ax.set_ylabel("perplexity of the continuation")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
