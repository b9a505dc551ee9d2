"""Retention statistics over per-item results (pure Python + numpy; no lm-eval needed).

For one task with per-item scores of each mode (0/1 accuracy or exact match, or F1 in [0, 1]), the
metric vocabulary of kvtransfer.eval.metrics:
    gap_closed           = (transfer - no_context) / (target - no_context)   (when the floor mode ran;
                           below_no_context flags a transfer below that floor by more than one paired SE)
    retention            = transfer / target
    gap_closed_vs_source = (transfer - source) / (target - source)
    retention_vs_chance  = (transfer - chance) / (target - chance)   chance: 25 % ARC-C/HellaSwag/MMLU,
                                                                      50 % WinoGrande, 0 % GSM8K
Standard errors are seeded paired bootstraps over items; McNemar compares transfer and target
per-item correctness (exact binomial when the discordant count is < 25, else chi² with continuity).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .metrics import (bootstrap_se, gap_closed, gap_closed_vs_source, ppl_gap_closed, retention,  # noqa: F401
                      retention_vs_chance)

CHANCE = {"arc_challenge": 0.25, "hellaswag": 0.25, "mmlu": 0.25, "winogrande": 0.5, "gsm8k": 0.0, "gsm8k_cot": 0.0}
MODES = ("target", "transfer", "source", "native_injected", "no_context")


def per_item_scores(results: dict, task: str, metric: str) -> list[float]:
    """Per-item scores from lm-eval results (run with log_samples=True), ordered by (subtask, doc_id).

    metric: "acc", "acc_norm", or "name,filter" (e.g. "exact_match,strict-match"). A group name
    (e.g. "mmlu") concatenates its tasks' items, through nested groups (lm-eval's hub `mmlu` is
    mmlu -> mmlu_humanities, ... -> subjects; only the subjects hold samples).
    """
    name, _, filt = metric.partition(",")
    samples = results.get("samples") or {}
    groups = results.get("group_subtasks", {})

    def leaves(t: str, seen: tuple = ()) -> list[str]:
        if not groups.get(t) or t in seen:
            return [t]
        return [leaf for sub in groups[t] for leaf in leaves(sub, (*seen, t))]

    out = []
    for sub in sorted(leaves(task)):
        if sub not in samples:
            raise KeyError(f"no samples for {sub!r}: run simple_evaluate with log_samples=True")
        rows = [s for s in samples[sub] if not filt or s.get("filter") == filt]
        out += [float(s[name]) for s in sorted(rows, key=lambda s: s["doc_id"])]
    return out


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), np.nan)


def mcnemar_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided McNemar p for paired 0/1 outcomes; exact binomial when discordant pairs < 25."""
    a, b = np.asarray(a) > 0.5, np.asarray(b) > 0.5
    n01, n10 = int((~a & b).sum()), int((a & ~b).sum())
    n = n01 + n10
    if n == 0:
        return 1.0
    if n < 25:
        k = min(n01, n10)
        tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
        return min(1.0, 2 * tail)
    stat = (abs(n01 - n10) - 1) ** 2 / n
    return math.erfc(math.sqrt(stat / 2))


def task_summary(scores: dict[str, Sequence[float]], *, chance: float = 0.0, metric: str = "acc",
                 n_boot: int = 1000, seed: int = 0) -> dict:
    """One task's row: means per mode, gap_closed / retention / gap_closed_vs_source / retention_vs_chance
    (kvtransfer.eval.metrics; None where their mode did not run), paired bootstrap SEs, McNemar p.

    scores: {mode: per-item scores (same items, same order)}; needs "target" and "transfer".
    """
    for need in ("target", "transfer"):
        if need not in scores:
            raise KeyError(f"per-item scores for mode {need!r} are required")
    arrays = {m: np.asarray(v, dtype=float) for m, v in scores.items() if v is not None}
    n = len(arrays["target"])
    if n == 0:
        raise ValueError("no items: the task produced no per-item results")
    if any(len(v) != n for v in arrays.values()):
        raise ValueError(f"modes have different item counts { {m: len(v) for m, v in arrays.items()} }")
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot = {m: v[idx].mean(1) for m, v in arrays.items()}  # [n_boot] paired resamples

    def stats(means: dict) -> dict:
        t, x = means["target"], means["transfer"]
        s = means.get("source")
        f = means.get("no_context")
        return {"gap_closed": None if f is None else gap_closed(x, t, f), "retention": retention(x, t),
                "gap_closed_vs_source": None if s is None else gap_closed_vs_source(x, t, s),
                "retention_vs_chance": retention_vs_chance(x, t, chance)}

    point = {m: v.mean() for m, v in arrays.items()}
    row = {"metric": metric, "n": n, "chance": chance}
    row.update({m: float(point[m]) if m in point else None for m in MODES})
    for key, value in stats(point).items():
        row[key] = None if value is None or np.isnan(value) else float(value)
    for m in MODES:
        row[f"stderr_{m}"] = float(boot[m].std(ddof=1)) if m in boot else None
    dropped = {}
    for key, value in stats(boot).items():
        # a ratio's replicates are non-finite where its denominator resampled to 0: counted, and no SE past
        # metrics.MAX_DROPPED of them (the finite rest is a conditional distribution), nor for an undefined point
        se, dropped[key] = (None, 0) if value is None else bootstrap_se(value)
        row[f"stderr_{key}"] = None if row[key] is None else se
    row["bootstrap_dropped"] = {k: n for k, n in dropped.items() if n}
    # a transfer below the no-context floor by more than its paired SE destroys the context
    if "no_context" in arrays:
        diff = boot["transfer"] - boot["no_context"]
        row["below_no_context"] = bool(point["transfer"] < point["no_context"] - float(diff.std(ddof=1)))
    binary = all(set(np.unique(arrays[m])) <= {0.0, 1.0} for m in ("target", "transfer"))
    row["mcnemar_p"] = mcnemar_p(arrays["target"], arrays["transfer"]) if binary else None
    return row


def retention_table(per_item: dict[str, dict[str, Sequence[float]]], *, metrics: dict[str, str] | None = None,
                    chance: dict[str, float] | None = None, n_boot: int = 1000, seed: int = 0) -> dict[str, dict]:
    """{task: task_summary row} for per_item[task][mode] lists, plus "average" (mean over tasks).

    Chance levels default to the paper's (`CHANCE`, 0 for unknown tasks); metric names are labels.
    """
    chance = {**CHANCE, **(chance or {})}
    table = {task: task_summary(modes, chance=chance.get(task, 0.0), metric=(metrics or {}).get(task, "acc"),
                                n_boot=n_boot, seed=seed) for task, modes in per_item.items()}
    keys = ("target", "transfer", "source", "no_context", "gap_closed", "retention", "gap_closed_vs_source",
            "retention_vs_chance")
    avg = {}
    for k in keys:
        vals = [row[k] for row in table.values() if row[k] is not None]
        avg[k] = sum(vals) / len(vals) if vals and len(vals) == len(table) else None
    table["average"] = avg
    return table
