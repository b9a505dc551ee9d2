"""Collect the qwen25coder runs (experiments/qwen25coder/run.sh) into results/qwen25coder/.

    python experiments/qwen25coder/collect.py [--runs results/qwen25coder/runs] [--out results/qwen25coder]
                                              [--allow-dirty] [--check]

Reads every run's summary.json and config.json under --runs (runs/*/figures/r2_*.png are copied), and the
per-turn CoQA F1s of results/baselines/runs/real_coqa/scores.json (the main configuration's CoQA SEs, clustered
by conversation, once they reproduce main_coqa's F1s turn for turn: with_coqa_ses).
Writes summary.json (the main configuration's summary), tables/*.csv|md, figures/*.png and the generated
blocks of results/qwen25coder/README.md and of the top-level README.md (`<!-- BEGIN generated:NAME -->`,
kvtransfer.report.readme); prints the runs it read and the missing ones. Every other number comes from a run's
summary.json (read in the current schema, kvtransfer.eval.metrics.upgrade_summary), every SE from
kvtransfer.eval.metrics / .stats; the outputs are derived, so rerunning this replaces them
(atomically). Runs that have not finished yet are listed as missing, never invented. Writing from a tree
with uncommitted code needs --allow-dirty; --check only compares the README blocks and exits 1 on a difference.
"""
from __future__ import annotations

import argparse
import json
import sys
import shutil
from pathlib import Path

import pandas as pd

# the checkout this script is in, not an installed kvtransfer: its provenance is what the README header reports
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtransfer.eval.coqa import coqa_summary_from_scores
from kvtransfer.eval.metrics import format_with_se, upgrade_summary
from kvtransfer.eval.stats import t_quantile
from kvtransfer.core.io import atomic_write_bytes, atomic_write_json
from kvtransfer.config.provenance import describe_commit, provenance_header, refuse_dirty_write
from kvtransfer.report import readme

MAIN = "main"  # the run whose summary is results/qwen25coder/summary.json (falls back to wiki_k8_sink1)
# runs of the main configuration that add tasks run.sh schedules separately (same map, same eval settings):
# their tasks, CoQA drift and eval seconds are merged into the main summary, which names them in `merged_runs`
MAIN_PARTS = ("main_gsm8k", "main_coqa")
MAIN_PPL = "main_ppl"  # the main configuration's perplexity rerun with per-window NLLs (run.sh step 5e)
# per-turn CoQA F1s of the main configuration's map: main_coqa kept only per-turn means; results/baselines' CoQA run
# (the same map, conversations and protocols) kept each conversation's turns, so its clustered SEs are main's once
# its per-turn means reproduce main_coqa's (with_coqa_ses)
COQA_TURNS = Path(__file__).resolve().parents[2] / "results" / "baselines" / "runs" / "real_coqa" / "scores.json"
PPL_REPRODUCED = 1e-4  # relative: float32 CPU kernels with another thread count, same windows and map


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
        out.setdefault("merged_environments", {})[name] = part.get("environment")
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
    """A value with its SE, rounded to what the SE supports (kvtransfer.eval.metrics.format_with_se)."""
    if x is None:
        return None
    return format_with_se(x, se, scale=100, unit=" %" if pct else "", places=1 if pct and se is None else None) \
        if pct else format_with_se(x, se)


RERUN = "SE needs rerun"  # a number whose per-item / per-window scores were not kept with its summary


def _pct(x, se):
    """A percentage with its SE, or the point value marked "(SE needs rerun)" when the run kept no per-item data."""
    if x is None:
        return None
    return _fmt(x, se, pct=True) if se is not None else f"{100 * x:.1f} % ({RERUN})"


def variant_row(name: str, s: dict) -> dict:
    """One row per run: calibration, map, sink, R², per-task scores, PPL, fidelity at the sink."""
    cal, mapper = s.get("calibration", {}), s.get("mapper", {})
    cfg = s.get("_config", {})
    row = {"run": name, "commit": describe_commit(s.get("environment")), "calibration": cal.get("domain"),
           "context_start": cal.get("context_start"),
           "k": mapper.get("k"), "mapper": mapper.get("kind"), "ablation": (s.get("ablation") or {}).get("name", "full"),
           "native_sink": mapper.get("native_sink", cfg.get("eval", {}).get("native_sink")),
           "K R² held-out": s.get("r2", {}).get("k", {}).get("heldout"),
           "V R² held-out": s.get("r2", {}).get("v", {}).get("heldout")}
    for task in MC:
        r = (s.get("tasks") or {}).get(task)
        if r:
            row[f"{task} transfer"] = _fmt(r.get("transfer"), r.get("stderr_transfer"))
            row[f"{task} gap closed %"] = _fmt(r.get("gap_closed"), r.get("stderr_gap_closed"), pct=True)
            row[f"{task} gap closed vs source %"] = _fmt(r.get("gap_closed_vs_source"),
                                                         r.get("stderr_gap_closed_vs_source"), pct=True)
    for r in s.get("ppl", []):
        if r["prefix"] > 0:
            row[f"ppl@{r['prefix']} transfer"] = r.get("transfer")
            row[f"ppl@{r['prefix']} gap closed % (log-ppl)"] = _pct(r.get("transfer_gap_closed"),
                                                                    r.get("transfer_gap_closed_se"))
    pos = (s.get("fidelity") or {}).get("per_position", {})
    for group in ("pos0", "all"):
        if group in pos:
            row[f"attn cos ({group} mapped)"] = pos[group]["attn_cosine"]
            row[f"KL ({group} mapped)"] = pos[group]["kl"]
    row["warnings"] = len(s.get("warnings", []))
    return row


def load_runs(runs_dir: Path) -> dict[str, dict]:
    """{run name: summary in the current schema, its config.json under "_config"} of the finished runs."""
    summaries = {}
    for d in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        if (d / "summary.json").exists():
            s = upgrade_summary(json.loads((d / "summary.json").read_text()))
            s["_config"] = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
            summaries[d.name] = s
        else:
            print(f"missing (not finished): {d.name}")
    return summaries


def main_summary(summaries: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, the main configuration's summary with MAIN_PARTS merged in) or None when it has not run."""
    name = MAIN if MAIN in summaries else "wiki_k8_sink1"
    if name not in summaries:
        return None
    parts = {n: summaries[n] for n in MAIN_PARTS if n in summaries and name == MAIN}
    merged = merge_main(summaries[name], parts)
    if name == MAIN and MAIN_PPL in summaries:
        merged = with_ppl_ses(merged, summaries[MAIN_PPL])
    if name == MAIN and merged.get("drift_summary") and COQA_TURNS.exists():
        merged = with_coqa_ses(merged, json.loads(COQA_TURNS.read_text())["coqa"],
                               COQA_TURNS.parent.relative_to(COQA_TURNS.parents[4]).as_posix())
    return name, merged


def with_coqa_ses(main: dict, turns: dict, source: str) -> dict:
    """`main` with its pooled CoQA SEs recomputed, clustered by conversation (kvtransfer.eval.coqa.drift_summary),
    from `turns` ({protocol: {mode: [[F1 per turn] per conversation]}}, a run's scores.json) once those reproduce
    main's per-turn target and transfer F1s exactly; records the source in `coqa_ses_from`. Turns that do not
    reproduce main are an error, not a source of SEs."""
    new = coqa_summary_from_scores({p: {m: part[m] for m in ("target", "transfer")} for p, part in turns.items()})
    got = {(r["protocol"], r["series"], r["turn"]): r["f1"] for r in new["drift"]}
    want = {(r["protocol"], r["series"], r["turn"]): r["f1"] for r in main.get("drift") or []}
    if got != want:
        raise ValueError(f"{source}'s CoQA turns are not the main configuration's (per-turn F1s differ): its SEs are "
                         "not main's")
    pooled = {r["protocol"]: r for r in new["drift_summary"]}
    out = json.loads(json.dumps(main))
    for row in out["drift_summary"]:
        row.update({k: v for k, v in pooled[row["protocol"]].items() if k.endswith("_se") or k == "se_df"})
    out["coqa_ses_from"] = source
    return out


def with_ppl_ses(main: dict, rerun: dict) -> dict:
    """`main` with the perplexity SEs of `rerun` (the same protocol rerun by a commit that keeps per-window NLLs),
    once the rerun has reproduced every perplexity of main within PPL_REPRODUCED (relative); records the largest
    difference in `ppl_ses_from`. A rerun that does not reproduce main is an error, not a source of SEs."""
    old, new = _ppl_rows(main), _ppl_rows(rerun)
    if sorted(old) != sorted(new):
        raise ValueError(f"{MAIN_PPL} has prefixes {sorted(new)}, main {sorted(old)}: rerun it with main's eval.ppl")
    worst = max(abs(new[p][m] - old[p][m]) / old[p][m] for p in old for m in ("target", "source", "transfer", "no_context")
                if old[p].get(m) is not None)
    if worst > PPL_REPRODUCED:
        raise ValueError(f"{MAIN_PPL} differs from main's perplexities by up to {worst:.2g} (relative): it did not "
                         "reproduce the main run, so its SEs are not main's")
    out = json.loads(json.dumps(main))
    for row in out["ppl"]:
        row.update({k: v for k, v in new[row["prefix"]].items() if k.endswith("_se")})
    out["ppl_ses_from"] = {"run": MAIN_PPL, "max_relative_difference": worst,
                           "environment": rerun.get("environment")}
    return out


def main_task_rows(s: dict) -> list[dict]:
    """tables/main_tasks: every mode with its SE, then gap_closed (floor), retention, gap_closed_vs_source,
    retention_vs_chance with paired bootstrap SEs (kvtransfer.eval.metrics), McNemar p."""
    rows = []
    for task, r in (s.get("tasks") or {}).items():
        rows.append({"task": task, "metric": r.get("metric"), "n": r.get("n"),
                     **{m: _fmt(r.get(m), r.get(f"stderr_{m}")) for m in
                        ("target", "source", "transfer", "native_injected", "no_context")},
                     "gap closed %": _fmt(r.get("gap_closed"), r.get("stderr_gap_closed"), pct=True),
                     "retention %": _fmt(r.get("retention"), r.get("stderr_retention"), pct=True),
                     "gap closed vs source %": _fmt(r.get("gap_closed_vs_source"), r.get("stderr_gap_closed_vs_source"),
                                                    pct=True),
                     "retention vs chance %": _fmt(r.get("retention_vs_chance"), r.get("stderr_retention_vs_chance"),
                                                   pct=True),
                     "McNemar p (transfer vs target)": r.get("mcnemar_p")})
    return rows


def eval_cost_rows(s: dict) -> list[dict]:
    """tables/eval_cost: seconds per (mode, part) of the main summary and seconds per item."""
    cost = []
    for mode, parts in (s.get("eval_seconds") or {}).items():
        for part, sec in parts.items():
            task = part[5:] if part.startswith("task.") else part
            n = ((s.get("tasks") or {}).get(task) or {}).get("n")
            cost.append({"mode": mode, "part": task, "seconds": sec, "items": n,
                         "s/item": None if not n or sec is None else sec / n})
    return cost


def table2_rows(summaries: dict[str, dict]) -> list[dict]:
    """The paper's Table 2 rows (TABLE2) that have run, in its order."""
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
                           "ppl@256 gap closed % (log-ppl)": _pct(ppl.get("transfer_gap_closed"),
                                                                  ppl.get("transfer_gap_closed_se")),
                           "fidelity KL": round(((r.get("fidelity") or {}).get("per_layer") or {}).get("kl", float("nan")), 3),
                           "warnings": len(r.get("warnings", []))})
    return table2


# README row labels of the tasks (metric, protocol) of the main configuration
TASK_LABELS = {"hellaswag": "HellaSwag acc_norm", "arc_challenge": "ARC-C acc_norm", "winogrande": "WinoGrande acc",
               "mmlu": "MMLU acc (5-shot)", "gsm8k_cot": "GSM8K-CoT strict EM (8-shot)"}
COLLECT = "experiments/qwen25coder/collect.py"


def _ppl_rows(s: dict) -> dict[int, dict]:
    return {r["prefix"]: r for r in s.get("ppl", [])}


def _gap_cell(r: dict) -> str:
    return _pct(r.get("transfer_gap_closed"), r.get("transfer_gap_closed_se"))


def block_main_tasks(s: dict) -> str:
    rows = []
    for task in TASK_LABELS:
        r = (s.get("tasks") or {}).get(task)
        if not r:
            continue
        p = r.get("mcnemar_p")
        rows.append([f"{TASK_LABELS[task]}, n = {r['n']}", *(_fmt(r.get(m), r.get(f"stderr_{m}")) for m in
                                                             ("target", "source")),
                     f"**{_fmt(r['transfer'], r.get('stderr_transfer'))}**", _fmt(r.get("no_context"), r.get("stderr_no_context")),
                     f"**{_fmt(r.get('gap_closed'), r.get('stderr_gap_closed'), pct=True)}**",
                     _fmt(r.get("retention"), r.get("stderr_retention"), pct=True),
                     _fmt(r.get("gap_closed_vs_source"), r.get("stderr_gap_closed_vs_source"), pct=True),
                     _fmt(r.get("retention_vs_chance"), r.get("stderr_retention_vs_chance"), pct=True),
                     None if p is None else f"{p:.2g}"])
    return readme.md_table(["task", "target", "source", "**transfer**", "no_context (floor)", "**gap closed**",
                            "retention", "gap closed vs source", "retention vs chance", "McNemar p"], rows)


# the content-control runs of the main configuration's map (run.sh step 10), in table order
CONTROL_RUNS = (("controls_hs", "task", "hellaswag", "HellaSwag acc_norm"),
                ("controls_arc", "task", "arc_challenge", "ARC-C acc_norm"),
                ("controls_ppl", "ppl", "wikitext2", "WikiText-2 log-ppl @ P = 256"),
                ("controls_ppl", "ppl", "python_stdlib", "Python stdlib log-ppl @ P = 256"))
CONTROL_COLUMNS = ("target", "transfer", "no_context", "target_wrong", "transfer_wrong", "mean_map", "random_map")


def control_rows(summaries: dict[str, dict]) -> list[dict]:
    """One row per (benchmark | perplexity set) of the control runs: every mode's score (perplexity: mean NLL,
    nats/token = log ppl) and the statistics of kvtransfer.eval.metrics.control_statistics, with their SEs."""
    rows = []
    for run, kind, name, label in CONTROL_RUNS:
        s = summaries.get(run)
        if s is None:
            continue
        if kind == "task":
            r = (s.get("tasks") or {}).get(name)
            if not r:
                continue
            row = {"metric": label, "n": r["n"], **{m: r.get(m) for m in CONTROL_COLUMNS},
                   "gap_closed": r.get("gap_closed"), "gap_closed_se": r.get("stderr_gap_closed")}
        else:
            r = {x["prefix"]: x for x in (s.get("ppl_sets") or {}).get(name, [])}.get(256)
            if not r:
                continue
            row = {"metric": label, "n": r.get("windows"), "documents": r.get("documents"),
                   **{m: None if r.get(m) is None else float(__import__("math").log(r[m])) for m in CONTROL_COLUMNS},
                   "gap_closed": r.get("transfer_gap_closed"), "gap_closed_se": r.get("transfer_gap_closed_se")}
        for key in ("content_share", "target_content_gain", "transfer_content_gain",
                    *(f"gap_closed_above_{c}" for c in ("target_wrong", "transfer_wrong", "mean_map", "random_map"))):
            row[key], row[f"{key}_se"] = r.get(key), r.get(f"{key}_se")
        row["run"], row["commit"] = run, ((s.get("environment") or {}).get("commit") or "?")[:7]
        rows.append(row)
    return rows


def block_controls(summaries: dict[str, dict]) -> str:
    """The content-control table: scores per mode, gap closed, the content share and the target's own content gain."""
    rows = []
    for r in control_rows(summaries):
        n = f"{r['n']}" + (f" ({r['documents']} documents)" if r.get("documents") else "")
        rows.append([r["metric"], n, *(None if r[m] is None else f"{r[m]:.3f}" for m in CONTROL_COLUMNS),
                     _fmt(r["gap_closed"], r["gap_closed_se"], pct=True),
                     f"**{_pct(r['content_share'], r['content_share_se'])}**",
                     _fmt(r["target_content_gain"], r["target_content_gain_se"]),
                     _pct(r["gap_closed_above_mean_map"], r["gap_closed_above_mean_map_se"]),
                     _pct(r["gap_closed_above_random_map"], r["gap_closed_above_random_map_se"]), f"`{r['commit']}`"])
    return readme.md_table(["metric", "n", "target", "transfer", "no context", "target, wrong ctx",
                            "transfer, wrong ctx", "mean map", "random map", "gap closed", "**content share**",
                            "target's own content gain", "gap closed above mean map", "gap closed above random map",
                            "commit"], rows)


def block_main_ppl(s: dict, injected: dict | None) -> str:
    ppl = _ppl_rows(s)
    prefixes = sorted(ppl)
    modes = [("target", "target"), ("source", "source (0.5B alone)"), ("transfer", "**transfer** (sink 1)"),
             ("no_context", "no_context (floor)")]
    rows = [[label, *(None if ppl[p].get(m) is None else f"{ppl[p][m]:.1f}" for p in prefixes)] for m, label in modes]
    if injected:
        rows.append(["native_injected (`wiki_k8_sink1`)", *(None if injected.get(p, {}).get("native_injected") is None
                                                             else f"{injected[p]['native_injected']:.1f}" for p in prefixes)])
    rows.append(["**gap closed** (log-perplexity)", *("–" if p == 0 else _gap_cell(ppl[p]) for p in prefixes)])
    return readme.md_table(["WikiText-2 perplexity of 64 tokens after P prefix tokens", *(f"P = {p}" for p in prefixes)],
                           rows)


def block_coqa(s: dict) -> str:
    rows = [[r["protocol"], f"{r['conversations']} × {r['turns'] // max(1, r['conversations'])}",
             _fmt(r["target_f1"], r["target_f1_se"]), f"**{_fmt(r['transfer_f1'], r['transfer_f1_se'])}**",
             _fmt(r["retention"], r["retention_se"], pct=True)] for r in s.get("drift_summary", [])]
    return readme.md_table(["protocol", "conversations × turns", "target F1", "**transfer F1**", "retention"], rows)


def block_table2(summaries: dict) -> str:
    rows = [[r["variant"], f"`{r['run']}`", r["K / V R² held-out"], r["HellaSwag acc_norm"], r["HS gap closed %"],
             f"{r['ppl@256']:,.1f}" if r["ppl@256"] is not None else None, r["ppl@256 gap closed % (log-ppl)"],
             f"{r['fidelity KL']:.2f}"] for r in table2_rows(summaries)]
    return readme.md_table(["variant (paper's Table 2 row)", "run", "K / V R² held-out", "HellaSwag", "HS gap closed",
                            "ppl@256", "ppl@256 gap closed (log-ppl)", "fidelity KL"], rows)


VARIANTS = (("wiki_k8_sink1", "(main)"), ("wiki_k12_sink1", "(best held-out R²)"), ("wiki_mlp", "(MLP, hidden 256, 5 epochs)"),
            ("wiki_k8_sink0", ""), ("handbook_k8_sink1", ""), ("handbook_k8_sink0", ""),
            ("wiki_no_rerotation", "(Table 2 ablation)"), ("wiki_k8_sink1_fp32", "(float32 moments)"))


def block_variants(summaries: dict) -> str:
    rows = []
    for name, note in VARIANTS:
        s = summaries.get(name)
        if s is None:
            continue
        r2 = s.get("r2", {})
        tasks, ppl = s.get("tasks") or {}, _ppl_rows(s)
        kl = ((s.get("fidelity") or {}).get("per_layer") or {}).get("kl")
        sink = s["mapper"].get("native_sink", s.get("_config", {}).get("eval", {}).get("native_sink"))
        rows.append([f"`{name}` {note}".strip(), s["calibration"].get("domain"), sink,
                     f"{r2['k']['heldout']:.3f} / {r2['v']['heldout']:.3f}" if "heldout" in r2.get("k", {}) else
                     f"train {r2['k']['train']:.3f} / {r2['v']['train']:.3f}",
                     *(_fmt(tasks[t]["transfer"], tasks[t].get("stderr_transfer")) if t in tasks else None
                       for t in ("hellaswag", "arc_challenge")),
                     *(None if p not in ppl else f"{ppl[p]['transfer']:,.1f}" for p in (64, 256)),
                     _gap_cell(ppl[256]) if 256 in ppl else None, None if kl is None else f"{kl:.2f}",
                     len(s.get("warnings", [])), describe_commit(s.get("environment"))])
    return readme.md_table(["run", "calibration", "native sink", "K / V R² held-out", "HellaSwag transfer",
                            "ARC-C transfer", "ppl@64", "ppl@256", "ppl@256 gap closed (log-ppl)",
                            "fidelity KL, all mapped", "warnings", "commit"], rows)


def block_long_ppl(s: dict) -> str:
    rows = [[r["prefix"], f"{r['target']:.1f}", f"{r['transfer']:.1f}", f"{r['no_context']:.1f}", _gap_cell(r)]
            for r in s.get("ppl", []) if r["prefix"] > 0]
    return readme.md_table(["prefix", "target", "transfer", "no context", "gap closed (log-ppl)"], rows)


def block_speed(s: dict) -> str:
    rows = [[f"{r['tokens']:,}", f"{r['mapper_ms']:.0f} ms ({r['mapper_ms_min']:.0f}–{r['mapper_ms_max']:.0f})",
             f"{r['prefill_ms'] / 1000:.2f} s ({r['prefill_ms_min'] / 1000:.2f}–{r['prefill_ms_max'] / 1000:.2f})",
             f"{r['speedup']:.0f}×", f"{r['flop_ratio']:.0f}×"] for r in s.get("speed", [])]
    return readme.md_table(["tokens", "mapper, median (min–max)", "re-prefill, median (min–max)", "speedup",
                            "FLOP ratio"], rows)


def block_eval_cost(s: dict) -> str:
    cost = {(r["mode"], r["part"]): r["s/item"] for r in eval_cost_rows(s) if r["s/item"] is not None}
    parts = []
    for task in ("mmlu", "hellaswag", "winogrande"):
        vals = [cost.get((m, task)) for m in ("target", "transfer", "source", "no_context")]
        if all(v is not None for v in vals):
            parts.append(f"{TASK_LABELS[task].split()[0]} " + " / ".join(f"{v:.1f}" for v in vals))
    return ("**Seconds per item** (`tables/eval_cost.md`; target / transfer / source / no context, shared prefixes, "
            "partly contended): " + "; ".join(parts) + ".\n")


# why a run that ran from a dirty tree or records no commit was not rerun (the provenance block prints it)
NOT_RERUN = {
    "main_coqa": ("10-turn CoQA costs about 36 min of 2-core CPU for target and transfer (eval_seconds), and a rerun "
                  "must not reuse the cached answers; the main configuration's other numbers come from clean `main`"),
    "handbook_k8_sink0": "a calibration-data ablation that needs its own handbook calibration, not a headline",
    "handbook_k8_sink1": "a calibration-data ablation that needs its own handbook calibration, not a headline",
    "wiki_k8_sink0": "the paper map without the native sink, an ablation row at n = 100",
    "wiki_no_rerotation": "an ablation row at n = 100 (the RoPE re-rotation switched off)",
    "speed": "CPU timing of the real pair, which needs the idle machine to be worth redoing",
}


def readme_blocks(summaries: dict[str, dict], out: Path) -> dict[str, str]:
    """{block name: Markdown} of results/qwen25coder/README.md, from the runs alone (no model, no timing)."""
    blocks = {"provenance": provenance_header(summaries, COLLECT, not_rerun=NOT_RERUN)}
    main = main_summary(summaries)
    if main is not None:
        s = main[1]
        injected = _ppl_rows(summaries["wiki_k8_sink1"]) if "wiki_k8_sink1" in summaries else None
        blocks.update(main_tasks=block_main_tasks(s), main_ppl=block_main_ppl(s, injected), eval_cost=block_eval_cost(s))
        if s.get("drift_summary"):
            blocks["coqa"] = block_coqa(s)
    blocks["table2"] = block_table2(summaries)
    blocks["variants"] = block_variants(summaries)
    if "main_long_ppl" in summaries:
        blocks["long_ppl"] = block_long_ppl(summaries["main_long_ppl"])
    if "speed" in summaries:
        blocks["speed"] = block_speed(summaries["speed"])
    if control_rows(summaries):
        blocks["controls"] = block_controls(summaries)
    return blocks


def top_readme_blocks(summaries: dict[str, dict]) -> dict[str, str]:
    """{"real_pair": the top-level README's headline table}: floor-based gap closed (accuracy; log-perplexity)
    with paired bootstrap SEs, or "SE needs rerun" where the run kept no per-window scores."""
    main = main_summary(summaries)
    if main is None:
        return {}
    s = main[1]
    controls = {r["run"] + ":" + r["metric"]: r for r in control_rows(summaries)}
    share = {task: next((r for r in controls.values() if r["run"] == run), None)
             for run, kind, task, _ in CONTROL_RUNS if kind == "task"}

    def share_cell(r: dict | None, transfer: float | None = None) -> str:
        # the content share of a control run on the same items, if its transfer is the main run's (same map)
        if r is None or (transfer is not None and r["transfer"] != transfer):
            return "–"
        return _pct(r["content_share"], r["content_share_se"])
    rows = []
    for task, label in TASK_LABELS.items():
        r = (s.get("tasks") or {}).get(task)
        if r:
            rows.append([f"{label}, n = {r['n']}", *(_fmt(r.get(m), r.get(f"stderr_{m}")) for m in
                                                     ("target", "source", "no_context")),
                         f"**{_fmt(r['transfer'], r.get('stderr_transfer'))}**",
                         _gap_or_degenerate(r), share_cell(share.get(task), r["transfer"])])
    p256 = _ppl_rows(s).get(256)
    if p256:
        windows = ((s.get("_config") or {}).get("eval") or {}).get("ppl", {}).get("windows")
        rows.append([f"WikiText-2 perplexity after 256 tokens ({windows} windows, drawn with replacement from 15 pages)",
                     *(f"{p256[m]:.1f}" for m in ("target", "source", "no_context")), f"**{p256['transfer']:.1f}**",
                     f"**{_gap_cell(p256)}** (on log-perplexity)", "–"])
    for r in controls.values():
        if r["run"] != "controls_ppl":
            continue
        exp = {m: None if r[m] is None else __import__("math").exp(r[m]) for m in ("target", "no_context", "transfer")}
        rows.append([f"{r['metric'].split(' log-ppl')[0]} perplexity after 256 tokens ({r['n']} documents, one window "
                     "each)", f"{exp['target']:.1f}", "–", f"{exp['no_context']:.1f}", f"**{exp['transfer']:.1f}**",
                     f"**{_pct(r['gap_closed'], r['gap_closed_se'])}** (on log-perplexity)",
                     _pct(r["content_share"], r["content_share_se"])])
    for r in s.get("drift_summary", []):
        rows.append([f"CoQA F1, {r['conversations']} × {r['turns'] // max(1, r['conversations'])} turns, "
                     f"{'story mapped once' if r['protocol'] == 'once' else 'every turn mapped'}",
                     _fmt(r["target_f1"], r["target_f1_se"]), "–", "–", f"**{_fmt(r['transfer_f1'], r['transfer_f1_se'])}**",
                     f"retention {_fmt(r['retention'], r['retention_se'], pct=True)}", "–"])
    table = readme.md_table(["metric", "target", "source", "no context (floor)", "**transfer**",
                             "**gap closed** (floor → target)", "content share"], rows)
    note = ("content share = (transfer − transfer on a wrong context) / (target − target on a wrong context): the share "
            "of the target's own gain from this context over another item's of the same length that the map carries "
            "(`runs/controls_*`, the same map and items; – where no control ran). "
            "gap closed = (transfer − no context) / (target − no context) (`kvtransfer/eval/metrics.py`), on "
            "accuracy and on log-perplexity (nats/token); ± is a paired bootstrap SE over items. \"SE needs rerun\": "
            "that run kept its per-window scores only in the artifact cache; a rerun at this commit writes them "
            f"(`scores.json`).{_coqa_se_note(s)}{_ppl_se_note(s)} Generated by `{COLLECT}` from the runs' summaries.\n")
    return {"real_pair": table + "\n" + note}


def _gap_or_degenerate(r: dict) -> str:
    """The task's gap closed with its SE; where transfer and the floor score 0 on every item (bootstrap SE 0), that
    is said instead of a "0 ± 0 %" that reads like a precise measurement."""
    if r.get("stderr_gap_closed") == 0 and r.get("transfer") == r.get("no_context") == 0:
        return "**0 %** (transfer and floor 0 on every item: no SE)"
    return f"**{_fmt(r.get('gap_closed'), r.get('stderr_gap_closed'), pct=True)}**"


def _coqa_se_note(s: dict) -> str:
    """The CoQA rows' SE in words: clustered by conversation, with its t multiplier (empty for a bootstrap SE)."""
    r = next(iter(s.get("drift_summary") or []), {})
    if r.get("se_df") is None:
        return ""
    return (f" CoQA's ± is an SE clustered by conversation ({r['conversations']} conversations: a 95 % interval is "
            f"± {t_quantile(0.975, r['se_df']):.2f} SE, Student t with {r['se_df']} degrees of freedom).")


def _ppl_se_note(s: dict) -> str:
    src = s.get("ppl_ses_from")
    if not src:
        return ""
    commit = ((src.get("environment") or {}).get("commit") or "?")[:7]
    return (f" The perplexity SEs come from the same protocol rerun at `{commit}` with per-window NLLs, which "
            f"reproduced every perplexity of the main run (largest relative difference "
            f"{src['max_relative_difference']:.1g}).")


def write_figures(summaries: dict[str, dict], main: dict | None, fdir: Path) -> None:
    """figures/ of this folder, redrawn from the summaries on every collect: the main configuration's score per
    task (every merged task, GSM8K included), CoQA drift, and perplexity against the prefix length."""
    from kvtransfer.report import figures

    fdir.mkdir(parents=True, exist_ok=True)
    for name in ("retention.png", "coqa_drift.png", "ppl_vs_prefix.png"):
        (fdir / name).unlink(missing_ok=True)  # views of runs/, redrawn on every collect
    if main is not None:
        figures.retention_bars(main, fdir / "retention.png")
        if main.get("drift"):
            figures.drift_per_turn(main["drift"], fdir / "coqa_drift.png",
                                   figures.title(main, "CoQA F1 per turn").replace("\n", " "))
    _ppl_figure(summaries, fdir / "ppl_vs_prefix.png")


def _ppl_figure(summaries: dict[str, dict], path: Path) -> None:
    """Transfer perplexity vs P of every run, one panel per window draw: a run is drawn against the baselines
    (target, no context, source) of its own windows, never another draw's (main_long_ppl draws at 768 + 64)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtransfer.report.figures import MODE_STYLE, machine_label

    groups: dict = {}
    for name, s in summaries.items():
        ppl = s.get("ppl") or []
        if ppl and name not in MAIN_PARTS + (MAIN_PPL,):
            key = tuple((r["prefix"], round(r["target"], 6)) for r in ppl)  # same windows -> same target curve
            groups.setdefault(key, []).append((name, s))
    if not groups:
        return
    groups = sorted(groups.values(), key=len, reverse=True)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.8 * len(groups), 5.0), squeeze=False)
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours: no transfer run shares one with another
    markers = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
    i = 0
    for ax, runs in zip(axes[0], groups):
        base = runs[0][1]["ppl"]
        top = 1.5 * max(r.get(m) or 0 for r in base for m in ("target", "source", "no_context"))  # off scale: named
        for mode, ls in (("target", "-"), ("no_context", ":"), ("source", "--")):
            pts = [(r["prefix"], r[mode]) for r in base if r.get(mode) is not None]
            if pts:
                ax.plot(*zip(*pts), linestyle=ls, color="black", marker=MODE_STYLE[mode][1], lw=1.8,
                        label=f"{mode} (baseline of these windows)")
        off = []
        for name, s in runs:
            pts = [(r["prefix"], r["transfer"]) for r in s["ppl"] if r.get("transfer") is not None]
            if max(p[1] for p in pts) > top:
                off.append(f"{name} (ppl@{pts[-1][0]} = {pts[-1][1]:,.0f})")
                continue
            ax.plot(*zip(*pts), label=f"transfer: {name}", color=colours[i % 20], marker=markers[i % len(markers)],
                    lw=1.2, ms=5)
            i += 1
        ax.set_yscale("log")
        ax.set_ylim(top=top)
        ax.set_xlabel("prefix tokens P (mapped from the source)")
        ax.set_ylabel("perplexity of the continuation")
        windows = max(r["prefix"] for r in base)
        ax.set_title(f"windows drawn at P ≤ {windows} (+ continuation)"
                     + (f"\noff scale: {', '.join(off)}" if off else ""), fontsize=8)
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    first = groups[0][0][1]
    fig.suptitle(f"{first.get('pair')}: WikiText-2 perplexity vs mapped prefix ({machine_label(first)}, 16 windows; "
                 "no SE: these runs kept no per-window NLLs, rerun for bands)", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="results/qwen25coder/runs")
    ap.add_argument("--out", default="results/qwen25coder")
    ap.add_argument("--readme", default="README.md", help="the top-level README (its real_pair block)")
    ap.add_argument("--allow-dirty", action="store_true", help="write although the code has uncommitted changes")
    ap.add_argument("--check", action="store_true", help="compare the README blocks only; exit 1 on a difference")
    args = ap.parse_args()
    runs_dir, out = Path(args.runs), Path(args.out)
    summaries = load_runs(runs_dir)
    if args.check:
        raise SystemExit(check_readmes(summaries, out, Path(args.readme)))
    refuse_dirty_write(out, args.allow_dirty)
    tdir, fdir = out / "tables", out / "figures"
    main = main_summary(summaries)
    if main is not None:
        s = main[1]
        # the content controls of the same map (run.sh step 10) ride along in the main summary
        atomic_write_json(out / "summary.json", {**{k: v for k, v in s.items() if k != "_config"},
                                                 **({"controls": control_rows(summaries)} if control_rows(summaries) else {})})
        _write(pd.DataFrame(main_task_rows(s)), tdir, "main_tasks")
        _write(pd.DataFrame(s.get("ppl", [])), tdir, "main_ppl")
        if s.get("drift"):  # CoQA: per turn, both protocols (transfer vs target answers)
            _write(pd.DataFrame(s["drift"]), tdir, "main_coqa_drift")
        if s.get("drift_summary"):  # pooled over all turns, SEs over conversations
            _write(pd.DataFrame([{"protocol": r["protocol"], "conversations": r["conversations"], "turns": r["turns"],
                                  "target F1": _fmt(r["target_f1"], r["target_f1_se"]),
                                  "transfer F1": _fmt(r["transfer_f1"], r["transfer_f1_se"]),
                                  "retention %": _fmt(r["retention"], r["retention_se"], pct=True)}
                                 for r in s["drift_summary"]]), tdir, "main_coqa_summary")
        _write(pd.DataFrame([{"positions": g, **{k: v for k, v in r.items() if k != "positions"}}
                             for g, r in (s.get("fidelity") or {}).get("per_position", {}).items()]),
               tdir, "main_fidelity_positions")
        _write(pd.DataFrame(eval_cost_rows(s)), tdir, "eval_cost")
    if control_rows(summaries):
        _write(pd.DataFrame(control_rows(summaries)), tdir, "controls")
    variants = {n: v for n, v in summaries.items() if n not in MAIN_PARTS}   # merged into the main summary above
    _write(pd.DataFrame([variant_row(n, s) for n, s in variants.items() if s.get("tasks") or s.get("ppl")]),
           tdir, "variants")
    table2 = table2_rows(variants)
    if table2:
        _write(pd.DataFrame(table2), tdir, "table2_ablations")
    for name, s in variants.items():
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
             for n, s in variants.items() for r in s.get("ppl", [])]
    if curve:
        _write(pd.DataFrame(curve), tdir, "ppl_curves")
    write_figures(summaries, main[1] if main else None, fdir)
    readme.rewrite(out / "README.md", readme_blocks(summaries, out))
    readme.rewrite(Path(args.readme), top_readme_blocks(summaries))
    print(f"wrote {out} from {len(summaries)} runs: {', '.join(summaries)}")


def check_readmes(summaries: dict[str, dict], out: Path, top: Path) -> int:
    """0 when every generated block of the two READMEs equals what the runs give now, else 1 (and a diff)."""
    bad = 0
    for path, want in ((out / "README.md", readme_blocks(summaries, out)), (top, top_readme_blocks(summaries))):
        for name in readme.stale_blocks(path, want):
            print(f"{path}: block {name!r} differs from the runs")
            bad = 1
    return bad


if __name__ == "__main__":
    main()
