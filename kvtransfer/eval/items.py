"""Per-item records of a multiple-choice task (lm-eval samples), so that a per-request signal (the gate's score)
can be paired with each mode's outcome on the same item, by (subtask, doc_id), never by position.

A record: {"task": subtask, "doc_id", "score": the task metric's 0/1, "margin": gold-answer margin, "prefixes":
[hash of each choice's cached prefix, as the adapter keys its repair events]} plus, in a repaired mode, "gate":
{"action", "fraction", "score"} of the event of that item's cached prefix (and its "signals" / "signal_costs" where
the gated mode recorded per-request signals: kvtransfer.core.signals, eval.gate.signals).

margin = the task metric's log-likelihood of the gold choice minus the best other choice's (acc: summed log-prob;
acc_norm: log-prob / len(choice), lm-eval's normalisation): > 0 exactly when the item is right (up to ties), and
larger when the gold answer wins by more. "Transfer below the no-context floor" on one item is transfer's margin
below no_context's (the mapped context made the gold answer less likely, relative to its rivals, than no context
at all); its binary variant is transfer wrong where no_context is right.
"""
from __future__ import annotations

import math

import numpy as np


def _choice_len(continuation: str) -> int:
    """len() of the choice string lm-eval normalises acc_norm by: the continuation without its target delimiter."""
    return max(1, len(continuation[1:] if continuation.startswith(" ") else continuation))


def _gold_index(sample: dict) -> int | None:
    """The gold choice's index of an lm-eval sample: its target when that is an index; for a task whose choices
    are contexts sharing one continuation (WinoGrande: the target is that continuation's text) the doc's 1-based
    "answer"; None when neither says."""
    gold = sample["target"]
    gold = gold[0] if isinstance(gold, (list, tuple)) else gold
    try:
        return int(gold)
    except (TypeError, ValueError):
        answer = str((sample.get("doc") or {}).get("answer", ""))
        return int(answer) - 1 if answer.isdigit() else None


def sample_margin(sample: dict, metric: str) -> float:
    """Gold-answer margin of one lm-eval multiple-choice sample (see module doc); NaN without a rival choice."""
    lls = np.array([float(r[0]) for r in sample["filtered_resps"]], dtype=np.float64)
    if metric == "acc_norm":
        lls = lls / np.array([_choice_len(a[1]) for a in sample["arguments"]], dtype=np.float64)
    gold = _gold_index(sample)
    if gold is None or len(lls) < 2 or not 0 <= gold < len(lls):
        return math.nan
    return float(lls[gold] - np.delete(lls, gold).max())


def prefix_key(lm, context: str, continuation: str) -> int:
    """The adapter's key of the cached prefix that request (context, continuation) is scored on (lm-eval's
    TemplateLM.loglikelihood tokenisation, then KVTransferLM.split): the key repair events carry."""
    if context == "":
        cont = lm.tok_encode(continuation, add_special_tokens=False)
        ctx, cont = ([lm.prefix_token_id], cont) if lm.prefix_token_id != cont[0] else (cont[:1], cont[1:])
    else:
        ctx, cont = lm._encode_pair(context, continuation)
    return hash(tuple(lm.split(list(ctx), list(cont))[0]))


def leaves(results: dict, task: str, seen: tuple = ()) -> list[str]:
    """The subtasks of `task` that hold samples in lm-eval results (a group's leaves, through nested groups)."""
    groups = results.get("group_subtasks", {})
    if not groups.get(task) or task in seen:
        return [task]
    return [leaf for sub in groups[task] for leaf in leaves(results, sub, (*seen, task))]


def item_records(results: dict, task: str, metric: str, lm=None) -> list[dict]:
    """One record per item of `task` (in kvtransfer.eval.retention.per_item_scores' order: subtask, then doc_id),
    from simple_evaluate results run with log_samples=True; prefix keys only when `lm` is given."""
    out = []
    for sub in sorted(leaves(results, task)):
        for s in sorted(results["samples"][sub], key=lambda s: s["doc_id"]):
            rec = {"task": sub, "doc_id": int(s["doc_id"]), "score": float(s[metric]),
                   "margin": sample_margin(s, metric)}
            if lm is not None:
                rec["prefixes"] = list(dict.fromkeys(prefix_key(lm, c, k) for c, k in s["arguments"]))
            out.append(rec)
    return out


def attach_events(items: list[dict], events: list[dict]) -> list[dict]:
    """Items with "gate" = the repair event of their cached prefix (events keyed by prefix hash); an item whose
    choices were scored on several prefixes takes the one the gate scored highest (the most repaired). Items whose
    prefix no event matches get "gate": None (a pairing bug shows up as missing events, never as a wrong one)."""
    by_key = {e["key"]: e for e in events}
    out = []
    for rec in items:
        hits = [by_key[k] for k in rec.get("prefixes", []) if k in by_key]
        best = max(hits, key=lambda e: (-math.inf if e["score"] is None else e["score"], e["fraction"]), default=None)
        out.append({**rec, "gate": None if best is None else
                    {"action": best["action"], "fraction": best["fraction"], "score": best["score"],
                     **{k: best[k] for k in ("signals", "signal_costs") if k in best}}})
    return out


def pair_items(by_mode: dict[str, list[dict]]) -> tuple[list[tuple[str, int]], dict[str, list[dict]]]:
    """(item ids, {mode: records in that id order}): records joined on (task, doc_id). ValueError when a mode
    repeats an item or the modes do not hold the same items (a per-item comparison would pair wrong items)."""
    keyed = {}
    for mode, recs in by_mode.items():
        ids = [(r["task"], int(r["doc_id"])) for r in recs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"mode {mode!r} repeats an item (task, doc_id)")
        keyed[mode] = dict(zip(ids, recs))
    sets = {mode: set(k) for mode, k in keyed.items()}
    first = next(iter(sets.values()), set())
    if any(s != first for s in sets.values()):
        raise ValueError(f"modes hold different items: {[(m, len(s)) for m, s in sets.items()]}")
    order = sorted(first)
    return order, {mode: [k[i] for i in order] for mode, k in keyed.items()}


def below(mode_items: list[dict], floor_items: list[dict]) -> dict[str, list[bool]]:
    """Per item (paired lists): "margin": the mode's gold margin below the floor's; "flip": the mode wrong where
    the floor is right (see module doc)."""
    return {"margin": [a["margin"] < b["margin"] for a, b in zip(mode_items, floor_items)],
            "flip": [a["score"] < b["score"] for a, b in zip(mode_items, floor_items)]}


def gate_value(gate: dict | None, signal: str | None = None) -> float | None:
    """The gate record's score (signal None) or its recorded signal `signal`; None where there is none."""
    if gate is None:
        return None
    return gate["score"] if signal is None else (gate.get("signals") or {}).get(signal)


def task_signal(by_mode: dict[str, list[dict]], *, signal: str | None = None, n_boot: int = 1000, seed: int = 0) -> dict:
    """ROC AUC (bootstrap SE over items, kvtransfer.core.gate.bootstrap_auc) of the gated mode's per-item score
    (or, with `signal`, that recorded signal: `gate_value`) for transfer below the no-context floor and below the
    target, each by margin and by flip (module doc), on items joined by (task, doc_id). A gated item without a value
    (a fall-back, a row too short) ranks highest. Needs modes gated, transfer, no_context, target; {"n", "unscored":
    items without a gate record, "<floor>_<definition>": {...}}."""
    from ..core.gate import bootstrap_auc

    _, paired = pair_items({m: by_mode[m] for m in ("gated", "transfer", "no_context", "target")})
    gates = [r.get("gate") for r in paired["gated"]]
    score = [math.inf if gate_value(g, signal) is None else float(gate_value(g, signal)) for g in gates]
    out = {"n": len(score), "unscored": sum(g is None for g in gates)}
    for floor in ("no_context", "target"):
        for definition, flags in below(paired["transfer"], paired[floor]).items():
            out[f"{floor}_{definition}"] = bootstrap_auc(score, flags, n_boot=n_boot, seed=seed)
    return out
