"""results/gate/README.md from results/gate/runs/*/ (summary.json + scores.json): the recompute curve, the gated
rows beside transfer / no_context / target, the gate's action counts, and the signal's ROC AUC.

    python experiments/gate/collect.py

Definitions: gap closed = (log ppl no_context - log ppl mode) / (log ppl no_context - log ppl target), paired
bootstrap SE over windows (one window per document). cost = FLOPs of what the mode computes beyond the map (the
recomputed tokens, the deviation rule's one layer of prefill, the gate's tail tokens) as a fraction of a
re-prefill of the context (kvtransfer.core.recompute.recompute_cost). AUC: the gated mode's per-window score against
"transfer's NLL on the window is above no_context's" (the map hurts), bootstrap SE over windows.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.eval.metrics import paired_difference  # noqa: E402
from kvtransfer.core.gate import bootstrap_auc  # noqa: E402
from kvtransfer.core.io import atomic_write_bytes  # noqa: E402

RUNS = ROOT / "results" / "gate" / "runs"


def _f(x, d=1, pct=False):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{100 * x:.{d}f}" if pct else f"{x:.{d}f}"


def _modes(row: dict) -> list[str]:
    repair = sorted({k[:-len("_gap_closed")] for k in row if k.endswith("_gap_closed") and k != "transfer_gap_closed"},
                    key=lambda m: (m == "gated", m.split("_")[1] if m.count("_") == 2 else "deviation",
                                   float(m.rsplit("_", 1)[1]) if m != "gated" else 0))
    return repair


def ppl_table(summary: dict) -> list[str]:
    lines = []
    for row in summary.get("ppl", []):
        if row["prefix"] == 0:
            continue
        lines += [f"P = {row['prefix']}, {row.get('windows')} windows ({row.get('documents')} documents):", "",
                  "| mode | perplexity | gap closed (%) | cost (× re-prefill) | recompute rate | gate actions |",
                  "|---|---|---|---|---|---|"]
        for m in ("target", "no_context", "transfer"):
            gap = {"target": "100", "no_context": "0"}.get(m) or \
                f"{_f(row.get('transfer_gap_closed'), pct=True)} ± {_f(row.get('transfer_gap_closed_se'), pct=True)}"
            cost = {"target": "1", "no_context": "0", "transfer": "0"}[m]
            lines.append(f"| {m} | {_f(row.get(m), 2)} | {gap} | {cost} | – | – |")
        for m in _modes(row):
            acts = row.get("gated_actions") if m == "gated" else None
            acts = ", ".join(f"{a} {n}" for a, n in acts.items()) if acts else "–"
            lines.append(f"| {m} | {_f(row.get(m), 2)} | {_f(row.get(m + '_gap_closed'), pct=True)} ± "
                         f"{_f(row.get(m + '_gap_closed_se'), pct=True)} | {_f(row.get(m + '_cost'), 3)} | "
                         f"{_f(row.get(m + '_recompute_rate'), 3)} | {acts} |")
        lines.append("")
    return lines


def signal(scores: dict, seed: int = 0) -> list[str]:
    lines = []
    for set_name, part in (scores.get("ppl_sets") or {}).items():
        gated = (part.get("events") or {}).get("gated") or {}
        for p, events in gated.items():
            nll = part["window_nll"].get(p) or {}
            if not all(m in nll for m in ("transfer", "no_context", "target", "gated")):
                continue
            s = [e["score"] if e and e["score"] is not None else math.inf for e in events]
            below_floor = [t > f for t, f in zip(nll["transfer"], nll["no_context"])]
            gap = [t - g for t, g in zip(nll["transfer"], nll["target"])]
            med = sorted(gap)[len(gap) // 2]
            worse = [g > med for g in gap]
            a = bootstrap_auc(s, below_floor, n_boot=1000, seed=seed)
            b = bootstrap_auc(s, worse, n_boot=1000, seed=seed)
            d = paired_difference(nll["gated"], nll["no_context"])
            lines += [f"{set_name} P = {p}: ROC AUC of the tail score for 'transfer below the no-context floor' "
                      f"(positives {a['positives']} of {a['n']}): {_f(a['auc'], 2)} ± {_f(a['se'], 2)}; for 'transfer's "
                      f"loss over the target above the median': {_f(b['auc'], 2)} ± {_f(b['se'], 2)}. "
                      f"Gated minus no-context NLL: {d['difference']:+.4f} ± {d['se']:.4f} nats/token "
                      f"({'above the floor by more than one SE' if d['difference'] > d['se'] else 'not worse than the floor by more than one SE'}).",
                      ""]
    return lines


def timing(summary: dict) -> list[str]:
    rows = []
    for mode, parts in sorted((summary.get("gate") or {}).items()):
        for part, by_p in parts.items():
            if part.startswith("ppl."):
                for p, g in by_p.items():
                    rows.append(f"| {mode} | {part[4:]} P = {p} | {g['requests']} | {_f(g['cost'], 3)} | "
                                f"{_f(g['seconds_per_prefix'], 3)} |")
    if not rows:
        return []
    return ["Measured time of the repair step per cached prefix (on top of the map; loaded shared 2-core host):", "",
            "| mode | part | prefixes | cost (FLOPs × re-prefill) | seconds per prefix |", "|---|---|---|---|---|",
            *rows, ""]


def goals(summary: dict) -> list[str]:
    hits = []
    for row in summary.get("ppl", []):
        for m in _modes(row):
            g, c = row.get(m + "_gap_closed"), row.get(m + "_cost")
            if g is not None and c is not None and g >= 0.8 and c <= 0.3:
                hits.append(f"{m} at P = {row['prefix']} ({_f(g, pct=True)} % at {_f(c, 3)})")
    return [f"Goal '>= 80 % of the log-ppl gap at <= 30 % of a re-prefill': "
            f"{'met by ' + '; '.join(hits) if hits else 'not met by any repair mode of this run'}.", ""]


def main() -> None:
    out = ["# Selective recompute and the per-request gate (issue 30)", "",
           "Generated by `python experiments/gate/collect.py` from `results/gate/runs/*` (runs: "
           "`bash experiments/gate/run.sh`). " + __doc__.split("\n\n", 2)[2].replace("\n", " "), ""]
    for run in sorted(p for p in RUNS.glob("*") if (p / "summary.json").exists()):
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        scores = json.loads((run / "scores.json").read_text()) if (run / "scores.json").exists() else {}
        env = summary.get("environment") or {}
        machine = env.get("machine") or {}
        out += [f"## {run.name}", "", f"Run at commit `{str(env.get('commit'))[:7]}` ({'dirty' if env.get('dirty') else 'clean'} tree) "
                f"on {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, no GPU (load average at the start "
                f"{machine.get('load_avg')}).", "", f"pair {summary.get('pair')}: {summary.get('source')} -> {summary.get('target')}; "
                f"gate: {json.dumps(config.get('eval', {}).get('gate'))}; thresholds (held-out calibration text): "
                f"{json.dumps(summary.get('gate_artifact'))}", ""]
        out += ppl_table(summary) + signal(scores, config.get("seed", 0)) + timing(summary) + goals(summary)
    atomic_write_bytes(ROOT / "results" / "gate" / "README.md", ("\n".join(out) + "\n").encode())
    print("\n".join(out))


if __name__ == "__main__":
    main()
