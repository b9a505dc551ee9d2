"""Paper-layout tables from run summaries, written as CSV and Markdown (atomic, never overwriting)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..core.io import atomic_write_bytes

TASK_ORDER = ["arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k_cot", "gsm8k"]
# Column / row labels of tasks whose name alone does not say the protocol: both GSM8K variants
# (kvtransfer.eval.tasks.PAPER_TASKS) name how their few-shot exemplars were chosen.
TASK_LABELS = {"gsm8k_cot": "gsm8k_cot (CoT, fixed exemplars)", "gsm8k": "gsm8k (train exemplars, sampled)"}


def task_label(task: str) -> str:
    """The header a task gets in every table (its name, plus the variant for GSM8K)."""
    return TASK_LABELS.get(task, task)


def write_table(df: pd.DataFrame, directory: str | Path, name: str) -> list[Path]:
    """Write `df` to directory/name.csv and directory/name.md; returns the paths."""
    directory = Path(directory)
    paths = [directory / f"{name}.csv", directory / f"{name}.md"]
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} exists; tables are never overwritten (use a new out_dir)")
    atomic_write_bytes(paths[0], df.to_csv(index=False).encode())
    atomic_write_bytes(paths[1], (df.to_markdown(index=False, floatfmt=".4g") + "\n").encode())
    return paths


def _ordered_tasks(tasks: dict) -> list[str]:
    return [t for t in TASK_ORDER if t in tasks] + sorted(t for t in tasks if t not in TASK_ORDER)


def retention_table(summaries: list[dict]) -> pd.DataFrame:
    """Table-1 layout: one row per run (pair), retention % per task, average, and the average retention_vs_chance
    (the paper's "floor-normalised"; kvtransfer.eval.metrics)."""
    rows = []
    for s in summaries:
        tasks = s.get("tasks", {})
        row = {"pair": s["pair"], "k": s["mapper"]["k"]}
        rets, floors = [], []
        for task in _ordered_tasks(tasks):
            r = tasks[task]
            if r.get("retention") is not None:
                row[task_label(task)] = 100 * r["retention"]
                rets.append(r["retention"])
            if r.get("retention_vs_chance") is not None:
                floors.append(r["retention_vs_chance"])
        row["avg_retention"] = 100 * sum(rets) / len(rets) if rets else None
        row["avg_retention_vs_chance"] = 100 * sum(floors) / len(floors) if floors else None
        rows.append(row)
    return pd.DataFrame(rows)


def task_table(summary: dict) -> pd.DataFrame:
    """Per task: metric, the modes' scores, gap_closed (vs the no-context floor), retention, gap_closed_vs_source,
    retention_vs_chance (kvtransfer.eval.metrics), n, SEs."""
    rows = []
    for task in _ordered_tasks(summary.get("tasks", {})):
        r = summary["tasks"][task]
        rows.append({"task": task_label(task), **{k: r.get(k) for k in (
            "metric", "target", "transfer", "source", "native_injected", "no_context", "gap_closed", "stderr_gap_closed",
            "retention", "stderr_retention", "gap_closed_vs_source", "retention_vs_chance", "below_no_context", "n",
            "transfer_stderr", "mcnemar_p", *CONTROL_COLUMNS) if k in r or k not in CONTROL_COLUMNS}})
    return pd.DataFrame(rows)


# the content controls' columns (kvtransfer.maps.controls, kvtransfer.eval.metrics.control_statistics), where they ran
CONTROL_COLUMNS = ("target_wrong", "transfer_wrong", "mean_map", "random_map", "content_share", "content_share_se",
                   "target_content_gain", "target_content_gain_se", "gap_closed_above_transfer_wrong",
                   "gap_closed_above_mean_map", "gap_closed_above_random_map")


def ablation_table(summaries: list[dict]) -> pd.DataFrame:
    """Table-2 layout: one row per ablation variant, transfer score per task (+ PPL if present)."""
    rows = []
    for s in summaries:
        row = {"variant": s.get("ablation", {}).get("name", "full"), "k": s["mapper"]["k"]}
        for task in _ordered_tasks(s.get("tasks", {})):
            row[task_label(task)] = s["tasks"][task].get("transfer")
        if s.get("ppl"):
            longest = max(s["ppl"], key=lambda r: r["prefix"])
            row[f"ppl@P={longest['prefix']}"] = longest.get("transfer")
        rows.append(row)
    return pd.DataFrame(rows)


def variance_table(summary: dict) -> pd.DataFrame:
    """Table-7 layout: mean stripped-K / V R² (train = in-sample, held-out) per k."""
    return pd.DataFrame(summary.get("variance_explained", []))


def speed_table(summary: dict) -> pd.DataFrame:
    """Table-5 layout: tokens, mapper ms, re-prefill ms, speedup (+ floors when measured)."""
    return pd.DataFrame(summary.get("speed", []))


def ppl_table(summary: dict) -> pd.DataFrame:
    """Prefix-conditioned perplexity vs prefix length P, per mode, one block of rows per perplexity set (`set`),
    with the controls' columns and the content share where they ran."""
    sets = summary.get("ppl_sets")
    return pd.DataFrame([r for rows in sets.values() for r in rows] if sets else summary.get("ppl", []))


def drift_table(summary: dict) -> pd.DataFrame:
    """Multi-turn F1 per turn and protocol."""
    return pd.DataFrame(summary.get("drift", []))


def coqa_twin_table(summary: dict) -> pd.DataFrame:
    """CoQA against its equal-cost twins: per protocol and m, the target reading only the last m tokens (its F1) beside
    the map's F1, and transfer - twin with a paired SE over conversations."""
    return pd.DataFrame(summary.get("coqa_twins", []))


def fidelity_table(summary: dict) -> pd.DataFrame:
    """Per prefix-position group (pos0 = the sink, pos1-3, rest, all): mapped K/V relative error and the
    damage of swapping only that group into the native cache (attention-output cosine, next-token KL)."""
    fid = summary.get("fidelity") or {}
    rows = [{"positions": name, **{k: v for k, v in r.items() if k != "positions"}}
            for name, r in (fid.get("per_position") or {}).items()]
    return pd.DataFrame(rows)
