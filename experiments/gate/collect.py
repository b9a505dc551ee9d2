"""The recompute curve, the gated rows beside transfer / no_context / target, the gate's action counts, and the
signal's ROC AUC. Reads results/gate/runs/*/ (summary.json, scores.json, config.json); writes results/gate/README.md
(atomically) and prints it. Every SE is kvtransfer.eval.metrics', .stats' or kvtransfer.core.gate's (the AUC's).

    python experiments/gate/collect.py

Definitions: gap closed = (log ppl no_context - log ppl mode) / (log ppl no_context - log ppl target), paired
bootstrap SE over windows (one window per document). cost = FLOPs of what the mode computes beyond the map (the
recomputed tokens, the deviation rule's one layer of prefill, the gate's tail tokens) as a fraction of a
re-prefill of the context (kvtransfer.core.recompute.recompute_cost). AUC: the gated mode's per-window score against
"transfer's NLL on the window is above no_context's" (the map hurts), bootstrap SE over windows. Tasks: accuracy
(the task's lm-eval metric: acc_norm for HellaSwag and ARC-C, acc for MMLU) ± its SE over items (sample SD / sqrt(n));
gated minus no_context with a paired bootstrap SE over items; per item (joined on (subtask, doc_id), never on
position: kvtransfer.eval.items) "transfer below the floor" is either transfer's gold-answer margin (the metric's
log-likelihood of the gold choice minus the best other choice's) below the floor mode's ("margin": the mapped
context made the gold answer less likely against its rivals than the floor does; every item counts, so the AUC has
positives at small n) or transfer wrong where the floor mode is right ("flip": the accuracy-level event, rarer);
AUC of the gated mode's tail score for each, bootstrap SE over items (a gated item without a score ranks highest).
"""
# (Not in the README's header, which repeats the docstring above for every run, old ones included:) runs that
# recorded per-request signals beside the gate's score (eval.gate.signals, kvtransfer.core.signals) get a table per
# task and per perplexity prefix, each signal's AUC for the same events and its cost, explained by SIGNALS_NOTE.
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.eval.metrics import paired_difference  # noqa: E402
from kvtransfer.eval.stats import mean_se  # noqa: E402
from kvtransfer.core.gate import bootstrap_auc  # noqa: E402
from kvtransfer.eval.items import pair_items, task_signal  # noqa: E402
from kvtransfer.eval.repair import repair_mode  # noqa: E402
from kvtransfer.core.io import atomic_write_bytes  # noqa: E402
from kvtransfer.config.provenance import public_path  # noqa: E402

RUNS = ROOT / "results" / "gate" / "runs"


def _f(x, d=1, pct=False):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{100 * x:.{d}f}" if pct else f"{x:.{d}f}"


# signals whose larger values do not obviously mean "worse": an AUC far below 0.5 predicts the other way
TWO_SIDED = ("tail_kl", "tail_entropy_mapped", "tail_entropy_nocontext")
SIGNALS_NOTE = ("Signals (kvtransfer.core.signals; docs/evaluation.md): tail_kv is the gate's tail score; first_layer "
                "the layer-0 K/V error against the target's own one layer of prefill; tail_kl the KL of the target's "
                "next-token distribution at the tail, mapped context vs no context, with the two entropies at the last "
                "tail position; tail_nll_gain the tail's NLL under the mapped context minus under no context. Cost: "
                "FLOPs of computing the signal alone (LM head included where it reads logits) as a fraction of a "
                "re-prefill of the context. A larger value is read as 'more likely hurt'; for the signals marked "
                "two-sided (tail_kl, the entropies) larger is not obviously worse, so an AUC far below 0.5 is a signal "
                "too: it predicts the other way. The verdict judges |AUC - 0.5| against 2 bootstrap SE either way.")


def _recorded(gates: list) -> list[str]:
    """The signal names recorded in gate records (kvtransfer.eval.items), in first-seen order."""
    return list(dict.fromkeys(k for g in gates if g and g.get("signals") for k in g["signals"]))


def _cost(gates: list, name: str):
    """Mean cost (× re-prefill) of a signal over gate records; an entropy comes with tail_kl's forwards."""
    key = "tail_kl" if name.startswith("tail_entropy") else name
    costs = [g["signal_costs"][key] for g in gates if g and key in (g.get("signal_costs") or {})]
    return sum(costs) / len(costs) if costs else None


def _verdict(aucs: dict) -> str:
    """One line from {signal: [bootstrap_auc records]}: which signals differ from 0.5 by more than 2 bootstrap SE
    (AUCs with at least 10 items in each class only)."""
    apart, chance, few = [], [], []
    for name, recs in aucs.items():
        ok = [a for a in recs if a["se"] is not None and math.isfinite(a["se"])
              and min(a["positives"], a["n"] - a["positives"]) >= 10]
        if not ok:
            few.append(name)
            continue
        far = [a for a in ok if abs(a["auc"] - 0.5) > 2 * a["se"]]
        (apart if far else chance).append(f"{name} ({len(far)} of {len(ok)})" if far else name)
    parts = [f"beyond 2 SE of 0.5: {', '.join(apart)}" if apart else "no signal beyond 2 SE of 0.5",
             f"within 2 SE of 0.5 on every AUC: {', '.join(chance)}" if chance else "",
             f"fewer than 10 items in a class (not judged): {', '.join(few)}" if few else ""]
    return "Verdict: " + "; ".join(x for x in parts if x) + "."


def signal_task_table(task: str, items: dict) -> list[str]:
    """Per recorded signal of the gated items: AUC ± bootstrap SE for transfer below no_context and below target
    (gold margin, kvtransfer.eval.items.task_signal) and its cost; [] when no signal was recorded."""
    gates = [r.get("gate") for r in items["gated"]]
    names = _recorded(gates)
    if not names:
        return []
    lines = [f"Per-request signals on {task} (ROC AUC ± bootstrap SE for 'transfer below', by gold margin; positives/n;"
             " an item without a value ranks highest). " + SIGNALS_NOTE, "",
             "| signal | below no_context | below target | cost (× re-prefill) |", "|---|---|---|---|"]
    aucs = {}
    for name in names:
        sig = task_signal(items, signal=name, seed=0)
        a, b = sig["no_context_margin"], sig["target_margin"]
        aucs[name] = [a, b]
        lines.append(f"| {name}{' (two-sided)' if name in TWO_SIDED else ''} | {_f(a['auc'], 2)} ± {_f(a['se'], 2)} "
                     f"({a['positives']}/{a['n']}) | {_f(b['auc'], 2)} ± {_f(b['se'], 2)} ({b['positives']}/{b['n']}) | "
                     f"{_f(_cost(gates, name), 4)} |")
    return lines + ["", _verdict(aucs), ""]


def signal_ppl_table(set_name: str, p: str, events: list, nll: dict, seed: int = 0) -> list[str]:
    """As `signal_task_table` for perplexity windows: 'transfer's NLL above no_context's' and 'transfer's loss over
    the target above the median' (the definitions of `signal`)."""
    names = _recorded(events)
    if not names:
        return []
    below_floor = [t > f for t, f in zip(nll["transfer"], nll["no_context"])]
    gap = [t - g for t, g in zip(nll["transfer"], nll["target"])]
    med = sorted(gap)[len(gap) // 2]
    worse = [g > med for g in gap]
    lines = [f"Per-request signals, {set_name} P = {p} (ROC AUC ± bootstrap SE over windows; positives/n; a window "
             "without a value ranks highest). " + SIGNALS_NOTE, "",
             "| signal | transfer above no_context | transfer's loss over target above the median | cost (× re-prefill) |",
             "|---|---|---|---|"]
    aucs = {}
    for name in names:
        s = [math.inf if not e or (e.get("signals") or {}).get(name) is None else e["signals"][name] for e in events]
        a = bootstrap_auc(s, below_floor, n_boot=1000, seed=seed)
        b = bootstrap_auc(s, worse, n_boot=1000, seed=seed)
        aucs[name] = [a, b]
        lines.append(f"| {name}{' (two-sided)' if name in TWO_SIDED else ''} | {_f(a['auc'], 2)} ± {_f(a['se'], 2)} "
                     f"({a['positives']}/{a['n']}) | {_f(b['auc'], 2)} ± {_f(b['se'], 2)} ({b['positives']}/{b['n']}) | "
                     f"{_f(_cost(events, name), 4)} |")
    return lines + ["", _verdict(aucs), ""]


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
            lines += signal_ppl_table(set_name, p, events, nll, seed)
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
    return ["Measured time of the repair step per cached prefix (on top of the map; loaded shared 2-core host). These "
            "runs are older than the batched recompute (one target pass for a batch of equal-length rows; these ran "
            "one pass per row), so these seconds overstate a repair's time today; results/baselines times the "
            "repairs with the batched pass, beside the target's re-prefill in the same runs.", "",
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


def task_rows(summary: dict, scores: dict) -> list[dict]:
    """Per task of a run: {"task", "n", "modes": {mode: (accuracy, SE)}, "minus_floor": {mode: paired difference},
    "gate": gate summary of the gated mode, "signal": kvtransfer.eval.items.task_signal or None}."""
    out = []
    for task, row in sorted((summary.get("tasks") or {}).items()):
        per = scores.get("tasks", {}).get(task, {})
        modes = {m: mean_se(per[m]) for m in ("target", "no_context", "transfer", "gated") if per.get(m)}
        minus = {m: paired_difference(per[m], per["no_context"]) for m in modes if m != "no_context"} \
            if "no_context" in per else {}
        items = (scores.get("task_items") or {}).get(task) or {}
        sig = task_signal(items, seed=0) if all(m in items for m in ("gated", "transfer", "no_context", "target")) \
            else None
        if sig:  # a pairing check on real data: an item the gate sent to a full prefill is the target's own item
            _, paired = pair_items({m: items[m] for m in ("gated", "target")})
            full = [abs(a["margin"] - b["margin"]) for a, b in zip(paired["gated"], paired["target"])
                    if a.get("gate") and a["gate"]["action"] == "full"]
            sig["full_vs_target"] = (len(full), max(full) if full else None)
            finite = sorted(g["gate"]["score"] for g in items["gated"] if g.get("gate") and g["gate"]["score"] is not None)
            sig["score_quartiles"] = [finite[int(f * (len(finite) - 1))] for f in (0.25, 0.5, 0.75)] if finite else None
        out.append({"task": task, "n": len(per.get("transfer", [])), "modes": modes, "minus_floor": minus,
                    "gate": row.get("gated_gate"), "signal": sig, "items": items if sig else None,
                    "thresholds": (summary.get("gate_artifact") or {}).get("thresholds")})
    return out


def task_table(rows: list[dict]) -> list[str]:
    """Markdown of `task_rows`."""
    lines = []
    for r in rows:
        lines += [f"{r['task']}: n = {r['n']} items.", "",
                  "| mode | accuracy (%) | minus no_context (pp, paired SE) | recompute rate | cost (× re-prefill) | "
                  "gate actions |", "|---|---|---|---|---|---|"]
        for m, (acc, se) in r["modes"].items():
            d = r["minus_floor"].get(m)
            diff = "–" if d is None else f"{100 * d['difference']:+.1f} ± {100 * d['se']:.1f}"
            g = r["gate"] if m == "gated" and r["gate"] else None
            acts = ", ".join(f"{a} {g[a]}" for a in ("map", "recompute", "full")) if g else "–"
            lines.append(f"| {m} | {_f(acc, pct=True)} ± {_f(se, pct=True)} | {diff} | "
                         f"{_f(g['recompute_rate'], 3) if g else '–'} | {_f(g['cost'], 3) if g else '–'} | {acts} |")
        lines.append("")
        sig = r["signal"]
        if sig:
            q = sig.get("score_quartiles") or [None] * 3
            lines += [f"ROC AUC of the gate's tail score on {r['task']} ({sig['n']} items, {sig['unscored']} without "
                      f"a gate record; score quartiles {_f(q[0], 3)} / {_f(q[1], 3)} / {_f(q[2], 3)} against the thresholds "
                      f"recompute {_f((r['thresholds'] or {}).get('recompute'), 3)}, full "
                      f"{_f((r['thresholds'] or {}).get('full'), 3)}; pairing check: on the "
                      f"{sig['full_vs_target'][0]} items the gate sent to a full prefill, max |gated - target| gold "
                      f"margin = {_f(sig['full_vs_target'][1], 6)}):", "", "| transfer below | by | AUC | bootstrap SE | positives |", "|---|---|---|---|---|"]
            for floor in ("no_context", "target"):
                for how in ("margin", "flip"):
                    a = sig[f"{floor}_{how}"]
                    few = " (fewer than 10 in a class: the AUC and its bootstrap SE are not reliable)" \
                        if min(a["positives"], a["n"] - a["positives"]) < 10 else ""
                    lines.append(f"| {floor} | {how} | {_f(a['auc'], 2)} | {_f(a['se'], 2)} | {a['positives']} of {a['n']}{few} |")
            lines.append("")
            lines += signal_task_table(r["task"], r["items"])
    return lines


# the real-pair runs of experiments/gate/run.sh this README reports on (a missing one is named as missing)
EXPECTED = ("real_ppl_a", "real_arc", "real_hellaswag", "real_mmlu", "real_curve_a", "real_curve_b", "real_curve_c",
            "real_arc_curve_a", "real_arc_curve_b", "real_hellaswag_curve_a", "real_hellaswag_curve_b",
            "real_arc_signals", "real_hellaswag_signals", "real_ppl_signals")
CURVE_R = (0.05, 0.15, 0.3, 0.5)
CURVE_SELECT = ("deviation", "random", "recent")


def floor_goal(runs: dict) -> list[str]:
    """Goal 1 per task: gated vs its no-context floor, with the paired SE (tasks: accuracy; WikiText-2: NLL)."""
    lines = ["| task | run (commit) | n | no_context | transfer | gated | gated minus floor (paired SE) | recompute rate "
             "| goal met |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (summary, scores, commit) in runs.items():
        for r in task_rows(summary, scores):
            d = r["minus_floor"].get("gated")
            if d is None:
                continue
            acc = {m: f"{_f(a, pct=True)} ± {_f(e, pct=True)}" for m, (a, e) in r["modes"].items()}
            met = "yes" if d["difference"] >= -d["se"] else f"no (below by {-d['difference'] / d['se']:.1f} SE)"
            g = r["gate"] or {}
            if g.get("requests") and g.get("full") == g["requests"]:
                met += " (trivially: every item fell back to a full prefill)"
            lines.append(f"| {r['task']} (accuracy, %) | {name} ({commit}) | {r['n']} | {acc.get('no_context')} | "
                         f"{acc.get('transfer')} | {acc.get('gated')} | {100 * d['difference']:+.1f} ± "
                         f"{100 * d['se']:.1f} pp | {_f((r['gate'] or {}).get('recompute_rate'), 3)} | {met} |")
        for set_name, part in (scores.get("ppl_sets") or {}).items():
            for p, nll in part.get("window_nll", {}).items():
                if p == "0" or not all(m in nll for m in ("gated", "no_context", "transfer")):
                    continue
                d = paired_difference(nll["gated"], nll["no_context"])
                row = next(x for x in summary["ppl"] if str(x["prefix"]) == p)
                met = "yes" if d["difference"] <= d["se"] else f"no (above by {d['difference'] / d['se']:.1f} SE)"
                lines.append(f"| {set_name} P = {p} (perplexity; NLL nats/token) | {name} ({commit}) | {len(nll['gated'])} "
                             f"windows | {_f(row.get('no_context'), 2)} | {_f(row.get('transfer'), 2)} | "
                             f"{_f(row.get('gated'), 2)} | {d['difference']:+.4f} ± {d['se']:.4f} nats | "
                             f"{_f(row.get('gated_recompute_rate'), 3)} | {met} |")
    return ["## Goal: no task's gated score below its no-context floor by more than one SE", "",
            "Met on a task when gated minus no_context >= -1 paired SE (accuracy) or <= +1 SE (NLL).", "", *lines, ""]


def signal_summary(runs: dict) -> list[str]:
    """Per task the tail score's AUC for each definition, and whether it is distinguishable from chance."""
    lines = ["| task (run) | n | AUC: below no_context by margin | by flip | below target by margin | by flip |",
             "|---|---|---|---|---|---|"]
    verdicts = []
    for name, (summary, scores, commit) in runs.items():
        for r in task_rows(summary, scores):
            sig = r["signal"]
            if not sig:
                continue
            cells = []
            for k in ("no_context_margin", "no_context_flip", "target_margin", "target_flip"):
                a = sig[k]
                cells.append(f"{_f(a['auc'], 2)} ± {_f(a['se'], 2)} ({a['positives']}/{a['n']})")
                if a["se"] is not None and math.isfinite(a["se"]) and min(a["positives"], a["n"] - a["positives"]) >= 10:
                    verdicts.append(abs(a["auc"] - 0.5) <= 2 * a["se"])
            lines.append(f"| {r['task']} ({name}, {commit}) | {sig['n']} | " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return []
    verdict = (f"On all {len(verdicts)} AUCs with at least 10 items in each class the score is within 2 bootstrap SE "
               "of 0.5: per item, the gate's tail score is no better than chance at telling which items the map hurts."
               if verdicts and all(verdicts) else
               f"{sum(not v for v in verdicts)} of {len(verdicts)} AUCs (at least 10 items per class) differ from 0.5 "
               "by more than 2 bootstrap SE.")
    return ["## The signal per item: ROC AUC of the gate's tail score (bootstrap SE; positives/n)", "", *lines, "",
            verdict, ""]


def curve(runs: dict) -> list[str]:
    """The recompute curve on WikiText-2 at P = 256 over every run (same windows), and goal 2."""
    points, base = {}, None
    for name, (summary, _, commit) in runs.items():
        for row in summary.get("ppl", []):
            if row["prefix"] != 256:
                continue
            base = base or (row, name, commit)
            for m in _modes(row):
                if m != "gated" and row.get(m + "_gap_closed") is not None:
                    points.setdefault(m, (row, name, commit))
    if base is None:
        return []
    lines = ["## The recompute curve (WikiText-2, P = 256)", "",
             f"Windows: {base[0].get('windows')} (one per document, so the paired bootstrap SE over windows is clustered "
             f"by document). r = 0 is the transfer row: transfer gap closed {_f(base[0].get('transfer_gap_closed'), pct=True)}"
             f" ± {_f(base[0].get('transfer_gap_closed_se'), pct=True)} % ({base[1]}, {base[2]}).", "",
             "| tokens chosen by | r | gap closed (%) | cost (× re-prefill) | run (commit) |", "|---|---|---|---|---|"]
    hits, missing = [], []
    for sel in CURVE_SELECT:
        lines.append(f"| {sel} | 0 (the transfer row) | {_f(base[0].get('transfer_gap_closed'), pct=True)} ± "
                     f"{_f(base[0].get('transfer_gap_closed_se'), pct=True)} | 0 | {base[1]} ({base[2]}) |")
        for r in CURVE_R:
            m = repair_mode(r, sel)
            if m not in points:
                missing.append(f"{sel} r = {r:g}")
                continue
            row, name, commit = points[m]
            g, c = row[m + "_gap_closed"], row.get(m + "_cost")
            lines.append(f"| {sel} | {r:g} | {_f(g, pct=True)} ± {_f(row.get(m + '_gap_closed_se'), pct=True)} | "
                         f"{_f(c, 3)} | {name} ({commit}) |")
            if g >= 0.8 and c is not None and c <= 0.3:
                hits.append(f"{sel} r = {r:g} ({_f(g, pct=True)} % at {_f(c, 3)})")
    lines += ["", "Goal '>= 80 % of the log-ppl gap at <= 30 % of a re-prefill': " +
              (f"met by {'; '.join(hits)}." if hits else "not met by any measured point.") +
              (f" Not measured (runs missing or unfinished): {', '.join(missing)}." if missing else ""), ""]
    return lines


# the recompute curve on the tasks (runs named real_<task>_curve_*): accuracy along r x rule
TASK_CURVE = {"arc_challenge": ("real_arc_curve_a", "real_arc_curve_b"),
              "hellaswag": ("real_hellaswag_curve_a", "real_hellaswag_curve_b")}


def _pp(d: dict) -> str:
    """A paired difference of 0/1 scores in percentage points with its SE."""
    return f"{100 * d['difference']:+.1f} ± {100 * d['se']:.1f}"


def task_curve(runs: dict) -> list[str]:
    """ARC-C / HellaSwag accuracy along the recompute curve: per rule and r, accuracy ± SE over items, minus transfer
    and minus no_context with paired SEs (items joined on (subtask, doc_id)), and the measured cost."""
    lines = ["## The recompute curve on the tasks (accuracy)", "",
             "Accuracy (the task's lm-eval metric) ± SE over items; differences are paired over the same items (joined "
             "on (subtask, doc_id)), SE = sd of the per-item difference / sqrt(n). cost = FLOPs beyond the map as a "
             "fraction of a re-prefill of each item's context, mean over items. r = 0 is the transfer row.", ""]
    found = False
    for task, names in TASK_CURVE.items():
        have = [n for n in names if n in runs]
        if not have:
            continue
        found = True
        modes, base = {}, None
        for name in have:
            summary, scores, commit = runs[name]
            items = (scores.get("task_items") or {}).get(task) or {}
            row = (summary.get("tasks") or {}).get(task) or {}
            for m, recs in items.items():
                if m in ("no_context", "transfer", "target") and base is None and \
                        all(b in items for b in ("no_context", "transfer", "target")):
                    base = (items, name, commit)
                if m.startswith("recompute_"):
                    modes.setdefault(m, (recs, (row.get(f"{m}_gate") or {}).get("cost"), name, commit))
        if base is None:
            continue
        ref_items, ref_name, ref_commit = base
        n = len(ref_items["transfer"])
        lines += [f"{task}: n = {n} items; baselines from {ref_name} ({ref_commit}).", "",
                  "| tokens chosen by | r | accuracy (%) | minus transfer (pp) | minus no_context (pp) | cost (× re-prefill) "
                  "| run (commit) |", "|---|---|---|---|---|---|---|"]
        _, paired = pair_items({b: ref_items[b] for b in ("no_context", "transfer", "target")})
        acc = {b: mean_se([r["score"] for r in paired[b]]) for b in paired}
        for b, r_label, cost in (("no_context", "–", "0"), ("transfer", "0", "0"), ("target", "1", "1")):
            dn = "" if b == "no_context" else _pp(paired_difference([r["score"] for r in paired[b]],
                                                                     [r["score"] for r in paired["no_context"]]))
            dt = "" if b == "transfer" else _pp(paired_difference([r["score"] for r in paired[b]],
                                                                   [r["score"] for r in paired["transfer"]]))
            lines.append(f"| {b} | {r_label} | {_f(acc[b][0], pct=True)} ± {_f(acc[b][1], pct=True)} | {dt} | {dn} | "
                         f"{cost} | {ref_name} ({ref_commit}) |")
        for sel in CURVE_SELECT:
            for r in CURVE_R:
                m = repair_mode(r, sel)
                if m not in modes:
                    lines.append(f"| {sel} | {r:g} | not run | | | | |")
                    continue
                recs, cost, name, commit = modes[m]
                _, pp = pair_items({"m": recs, "transfer": ref_items["transfer"], "no_context": ref_items["no_context"]})
                xs = [x["score"] for x in pp["m"]]
                a, se = mean_se(xs)
                dt = paired_difference(xs, [x["score"] for x in pp["transfer"]])
                dn = paired_difference(xs, [x["score"] for x in pp["no_context"]])
                lines.append(f"| {sel} | {r:g} | {_f(a, pct=True)} ± {_f(se, pct=True)} | {_pp(dt)} | {_pp(dn)} | "
                             f"{_f(cost, 3)} | {name} ({commit}) |")
        lines.append("")
    return lines if found else []


def allocation(values: dict[str, list[float]], actions: list[str], *, lower_is_better: bool) -> dict:
    """What the gate's choice of requests is worth against chance and against hindsight, at the same action counts.

    values: per action ("map", "recompute", "full") each request's outcome under that action (map = transfer,
    recompute = the recompute mode at the gate's fraction and rule, full = target); actions: what the gate did per
    request. Returns {"gated": mean outcome of the gate's choice, "random": the mean under a uniformly random
    assignment of the same counts (each request gets each action with probability count / n), "minus_random":
    paired difference gated - random per request (SE over requests), "oracle": the best assignment of the same
    counts in hindsight (exact, by dynamic programming over requests), "counts"}."""
    n = len(actions)
    counts = {a: actions.count(a) for a in ("map", "recompute", "full")}
    gated = [values[a][i] for i, a in enumerate(actions)]
    random_ = [sum(counts[a] * values[a][i] for a in counts if counts[a]) / n for i in range(n)]
    sign = 1.0 if lower_is_better else -1.0
    # best[(m, r)]: least signed total over the requests so far with m maps and r recomputes (the rest full)
    best = {(0, 0): 0.0}
    for i in range(n):
        nxt = {}
        for (m, r), tot in best.items():
            f = i - m - r
            for a, key in (("map", (m + 1, r)), ("recompute", (m, r + 1)), ("full", (m, r))):
                if (a == "map" and m >= counts["map"]) or (a == "recompute" and r >= counts["recompute"]) or \
                        (a == "full" and f >= counts["full"]):
                    continue
                cand = tot + sign * values[a][i]
                if cand < nxt.get(key, math.inf):
                    nxt[key] = cand
        best = nxt
    oracle = sign * best[(counts["map"], counts["recompute"])] / n
    return {"gated": sum(gated) / n, "random": sum(random_) / n, "minus_random": paired_difference(gated, random_),
            "oracle": oracle, "counts": counts, "n": n}


def gate_control(runs: dict) -> list[str]:
    """The gate's control: its choice of which requests to repair against a random choice of the same counts (and
    the hindsight best), per task and on the WikiText-2 windows, where each action's per-request outcome is known."""
    rows, skipped = [], []
    for name, (summary, scores, commit) in runs.items():
        for P, per in (scores.get("ppl_window_nll") or {}).items():
            events = (((scores.get("ppl_sets") or {}).get("wikitext2") or {}).get("events") or {}).get("gated", {}).get(P)
            if not events or not all(m in per for m in ("gated", "transfer", "target")):
                continue
            acts = [e["action"] for e in events]
            rec = _recompute_values(runs, "ppl", P, summary)
            if "recompute" in acts and rec is None:
                skipped.append(f"wikitext2 P = {P} ({name})")
                continue
            vals = {"map": per["transfer"], "full": per["target"], "recompute": rec or per["transfer"]}
            check = max(abs(g - vals[a][i]) for i, (g, a) in enumerate(zip(per["gated"], acts)))
            rows.append((f"wikitext2 P = {P} (NLL, nats/token; lower is better)", name, commit,
                         allocation(vals, acts, lower_is_better=True), check, 1.0))
        for task, items in (scores.get("task_items") or {}).items():
            if not all(m in items for m in ("gated", "transfer", "target")):
                continue
            _, paired = pair_items({m: items[m] for m in ("gated", "transfer", "target")})
            acts = [r["gate"]["action"] if r.get("gate") else "full" for r in paired["gated"]]
            rec = None
            if "recompute" in acts:
                rec = _recompute_values(runs, task, [(r["task"], int(r["doc_id"])) for r in paired["gated"]], summary)
                if rec is None:
                    skipped.append(f"{task} ({name})")
                    continue
            vals = {"map": [r["score"] for r in paired["transfer"]], "full": [r["score"] for r in paired["target"]],
                    "recompute": rec or [r["score"] for r in paired["transfer"]]}
            check = max(abs(r["score"] - vals[a][i]) for i, (r, a) in enumerate(zip(paired["gated"], acts)))
            rows.append((f"{task} (accuracy, %)", name, commit, allocation(vals, acts, lower_is_better=False), check,
                         100.0))
    if not rows:
        return []
    lines = ["## The gate's control: its choice against a random choice of the same counts", "",
             "Each request's outcome under each action is measured (map = transfer, recompute = the recompute mode of the "
             "gate's fraction and rule, full = target), so the gated row is their mixture by the gate's choice. random = "
             "the expected outcome when the same numbers of requests are mapped, recomputed and prefilled but chosen "
             "at random; gated - random is paired over requests (SE = sd / sqrt(n)); oracle = the best choice of the same "
             "counts in hindsight. consistency = max |gated - the chosen action's outcome| over requests (0: the gated "
             "row is exactly its actions' outcomes).", "",
             "| part | run (commit) | n | map / recompute / full | gated | random, same counts | gated - random (SE) | "
             "oracle, same counts | consistency |", "|---|---|---|---|---|---|---|---|---|"]
    for part, name, commit, a, check, scale in rows:
        c, d = a["counts"], a["minus_random"]
        lines.append(f"| {part} | {name} ({commit}) | {a['n']} | {c['map']} / {c['recompute']} / {c['full']} | "
                     f"{scale * a['gated']:.3f} | {scale * a['random']:.3f} | {scale * d['difference']:+.3f} ± "
                     f"{scale * d['se']:.3f} | {scale * a['oracle']:.3f} | {check:.1e} |")
    chose = [r[3] for r in rows if sum(1 for v in r[3]["counts"].values() if v) > 1]  # more than one action used
    within = sum(abs(a["minus_random"]["difference"]) <= 2 * a["minus_random"]["se"] for a in chose)
    lines += ["", f"{len(rows) - len(chose)} of {len(rows)} parts used one action only (no choice to test). On {within} "
              f"of the {len(chose)} where the gate chose, its choice is within 2 SE of a random choice of the same counts:"
              " there, what the gated row gains over transfer comes from how many requests it repairs, not from which."
              + (f" Not shown: {', '.join(skipped)} (a recompute action whose per-request outcome no run measured)."
                 if skipped else ""), ""]
    return lines


def _recompute_values(runs: dict, part: str, key, summary: dict):
    """Per request, the outcome of the recompute mode the gate's recompute runs (its fraction and rule), from any run
    that measured it on the same requests: WikiText-2 windows (part "ppl", key P) in window order, or task items
    (part = task, key = [(subtask, doc_id)] in order); None when no run did."""
    gate = ((summary.get("gate_artifact") or {}).get("thresholds") or {})
    fraction = gate.get("fraction")
    select = (summary.get("gate_config") or {}).get("select") or "deviation"
    if fraction is None:
        return None
    mode = repair_mode(float(fraction), select)
    for _, scores, _ in runs.values():
        if part == "ppl":
            per = (scores.get("ppl_window_nll") or {}).get(key) or {}
            if mode in per and len(per[mode]) == len(per.get("gated") or per[mode]):
                return per[mode]
        else:
            recs = ((scores.get("task_items") or {}).get(part) or {}).get(mode)
            if recs:
                by = {(r["task"], int(r["doc_id"])): r["score"] for r in recs}
                if all(k in by for k in key):
                    return [by[k] for k in key]
    return None


def dirty_producers(summary: dict) -> list[str]:
    """A line naming the artifacts this run read that were made from an uncommitted tree, and what was uncommitted
    (summary.json `producers`); none when every producer was clean."""
    prod = summary.get("producers") or {}
    dirty = prod.get("dirty") or []
    if not dirty:
        return []
    arts = prod.get("artifacts") or {}
    paths = sorted({p for a in dirty for p in (arts.get(a) or {}).get("dirty_paths") or []})
    commits = sorted({str((arts.get(a) or {}).get("commit"))[:7] for a in dirty})
    return [f"Read artifacts made from an uncommitted tree: {', '.join(dirty)} (at {', '.join(commits)}; uncommitted: "
            f"{', '.join(paths) or 'not recorded'}).", ""]


def main() -> None:
    out = ["# Selective recompute and the per-request gate", "",
           "Generated by `python experiments/gate/collect.py` from `results/gate/runs/*` (runs: "
           "`bash experiments/gate/run.sh`). " + __doc__.split("\n\n", 2)[2].replace("\n", " "), ""]
    real = {}
    for run in sorted(p for p in RUNS.glob("*") if (p / "summary.json").exists()):
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        scores = json.loads((run / "scores.json").read_text()) if (run / "scores.json").exists() else {}
        env = summary.get("environment") or {}
        machine = env.get("machine") or {}
        out += [f"## {run.name}", "", f"Run at commit `{str(env.get('commit'))[:7]}` ({'dirty' if env.get('dirty') else 'clean'} tree) "
                f"on {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, no GPU (load average at the start "
                f"{machine.get('load_avg')}).", "", f"pair {summary.get('pair')}: {public_path(summary.get('source'))} -> {public_path(summary.get('target'))}; "
                f"gate: {json.dumps(config.get('eval', {}).get('gate'))}; thresholds (held-out calibration text): "
                f"{json.dumps(summary.get('gate_artifact'))}", ""]
        out += dirty_producers(summary)
        out += task_table(task_rows(summary, scores))
        out += ppl_table(summary) + signal(scores, config.get("seed", 0)) + timing(summary) + goals(summary)
        if run.name in EXPECTED:
            real[run.name] = (summary | {"gate_config": config.get("eval", {}).get("gate")}, scores, f"{str(env.get('commit'))[:7]}{', dirty' if env.get('dirty') else ''}")
    missing = [n for n in EXPECTED if n not in real]
    head = floor_goal(real) + gate_control(real) + signal_summary(real) + curve(real) + task_curve(real)
    if missing:
        head += [f"Missing (not run or unfinished by the time this README was generated): {', '.join(missing)}.", ""]
    out = out[:4] + head + out[4:]
    atomic_write_bytes(ROOT / "results" / "gate" / "README.md", ("\n".join(out) + "\n").encode())
    print("\n".join(out))


if __name__ == "__main__":
    main()
