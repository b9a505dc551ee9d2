"""Summary rows of the eval stage (kvtransfer.runner.eval_stage): per perplexity set and prefix, each mode's
perplexity and log-ppl gap closed (paired bootstrap SE over windows), the repair modes' cost and actions, the
truncation baselines, the context timing of every mode against the target's re-prefill, and the map's worth in
native tokens (kvtransfer.eval.metrics.native_token_worth)."""
from __future__ import annotations

from ..core.gate import action_counts
from ..eval.metrics import CONTROL_MODES, control_statistics, log_ppl_gap_closed, native_token_worth, ppl_gap_closed
from ..eval.repair import REPAIR_PREFIX, TRUNCATE_TOKENS_PREFIX, is_truncate_mode


def _finite(row: dict) -> dict:
    """NaN/inf (e.g. a ratio with a zero denominator) -> None, so summaries stay strict JSON."""
    import math

    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def gate_summary(events: list[dict]) -> dict:
    """What the gate (or a fixed recompute) did over a part's cached prefixes: kvtransfer.core.gate.action_counts
    plus the mean cost (FLOPs as a fraction of a re-prefill, the gate's score included) and seconds per prefix."""
    out = action_counts(events)
    n = max(1, len(events))
    out["cost"] = float(sum(e["cost"] for e in events) / n)
    out["seconds_per_prefix"] = float(sum(e["seconds"] for e in events) / n)
    return out


def timing_columns(timing: dict) -> dict:
    """Row columns of each mode's context timing (KVTransferLM.timing) at one perplexity prefix or task:
    <mode>_seconds (per context: what reading it cost the target; map + repair in mapped modes, the source's
    prefill apart), <mode>_seconds_rel (against `target`'s re-prefill of the same contexts in the same run),
    <mode>_flops_rel (target FLOPs of reading them against a re-prefill's; the map's own as <mode>_map_flops_rel)."""
    out = {}
    ref = timing.get("target")
    for m, t in timing.items():
        if not t or not t.get("contexts"):
            continue
        out[f"{m}_seconds"] = t["seconds"] / t["contexts"]
        if t.get("source_seconds"):
            out[f"{m}_source_seconds"] = t["source_seconds"] / t["contexts"]
        if ref and ref.get("seconds") and ref.get("contexts"):  # per context (distinct prefixes may differ in count)
            out[f"{m}_seconds_rel"] = (t["seconds"] / t["contexts"]) / (ref["seconds"] / ref["contexts"])
        if t.get("reference_flops"):
            if t.get("flops") or m in ("target", "no_context") or is_truncate_mode(m):
                out[f"{m}_flops_rel"] = t["flops"] / t["reference_flops"]
            if t.get("map_flops"):
                out[f"{m}_map_flops_rel"] = t["map_flops"] / t["reference_flops"]
    return out


def ppl_rows(per_mode: dict, set_name: str, ecfg: dict, seed: int) -> list[dict]:
    """Summary rows of one perplexity set: per prefix P, each mode's perplexity, the log-ppl gap closed with a
    paired bootstrap SE over windows (= over documents under eval.ppl.draw=per_document), the controls'
    content share and gap closed above each control, the window and document counts."""
    parts = {m: r["ppl_sets"][set_name] for m, r in per_mode.items() if set_name in (r.get("ppl_sets") or {})}
    prefixes = sorted({int(p) for part in parts.values() for p in part["ppl"]})
    windows = {m: part.get("windows") for m, part in parts.items()}
    docs = next((part.get("docs") for part in parts.values() if part.get("docs") is not None), None)
    rows = []
    for p in prefixes:
        row = {"prefix": p, **({"set": set_name} if set_name else {}),
               **{m: part["ppl"].get(str(p)) for m, part in parts.items()}}
        per_window = {m: w[str(p)] for m, w in windows.items() if w and str(p) in w}
        if docs is not None:
            row["windows"], row["documents"] = len(docs), len(set(docs))
        # gap_closed on log-perplexity (kvtransfer.eval.metrics): a paired bootstrap SE over windows when every
        # mode kept its per-window NLLs, else the point value with SE None (results cached before they were kept)
        if p > 0 and all(m in per_window for m in ("target", "transfer", "no_context")):
            gap = ppl_gap_closed(per_window, n_boot=ecfg.get("bootstrap", 1000), seed=seed)
            row["transfer_gap_closed"], row["transfer_gap_closed_se"] = gap["gap_closed"], gap["gap_closed_se"]
        elif p > 0 and None not in (row.get("transfer"), row.get("target"), row.get("no_context")):
            row["transfer_gap_closed"] = float(log_ppl_gap_closed(row["transfer"], row["target"], row["no_context"]))
            row["transfer_gap_closed_se"] = None
        for m in [m for m in per_window if m == "gated" or m.startswith(REPAIR_PREFIX) or is_truncate_mode(m)]:
            if p > 0 and all(x in per_window for x in ("target", "no_context")):
                gap = ppl_gap_closed({"target": per_window["target"], "transfer": per_window[m],
                                      "no_context": per_window["no_context"]}, n_boot=ecfg.get("bootstrap", 1000), seed=seed)
                row[f"{m}_gap_closed"], row[f"{m}_gap_closed_se"] = gap["gap_closed"], gap["gap_closed_se"]
            events = [e for e in ((parts[m].get("events") or {}).get(str(p)) or []) if e]
            if events:
                summary = gate_summary(events)
                row[f"{m}_cost"], row[f"{m}_recompute_rate"] = summary["cost"], summary["recompute_rate"]
                if m == "gated":
                    row["gated_actions"] = {a: summary[a] for a in ("map", "recompute", "full")}
        row.update(timing_columns({m: (part.get("timing") or {}).get(str(p)) for m, part in parts.items()}))
        curve = {int(m[len(TRUNCATE_TOKENS_PREFIX):]): w for m, w in per_window.items()
                 if m.startswith(TRUNCATE_TOKENS_PREFIX)}
        if p > 0 and curve and all(x in per_window for x in ("target", "no_context")):
            # the map's worth in native tokens: where the truncation curve reaches each mapped mode's gap closed
            # (curve points m >= P are the target itself and are left out)
            curve = {m: w for m, w in curve.items() if m < p}
            for m in [m for m in per_window if m == "transfer" or m.startswith(REPAIR_PREFIX) or m == "gated"]:
                if curve:
                    row[f"{m}_native_tokens"] = native_token_worth(
                        {"target": per_window["target"], "no_context": per_window["no_context"], m: per_window[m]},
                        curve, mode=m, n_boot=ecfg.get("bootstrap", 1000), seed=seed)
        if p > 0 and "target" in per_window and "transfer" in per_window and \
                any(m in per_window for m in CONTROL_MODES):
            row.update(control_statistics(per_window, n_boot=ecfg.get("bootstrap", 1000), seed=seed))
        rows.append(_finite(row))
    return rows
