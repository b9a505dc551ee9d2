"""Collect the runs of a Hydra multirun into one set of tables (a Hydra callback)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from . import tables


def collect(sweep_dir: str | Path) -> dict[str, Path]:
    """Read every summary.json below `sweep_dir` (any depth: an override holding a path, e.g.
    pair.source.path=/x/y, nests Hydra's job directory); write sweep tables there; returns their paths."""
    sweep_dir = Path(sweep_dir)
    summaries = []
    for path in sorted(sweep_dir.rglob("summary.json")):
        if path.parent == sweep_dir:
            continue  # not a job of the sweep
        s = json.loads(path.read_text())
        s["_run"] = str(path.parent.relative_to(sweep_dir))
        summaries.append(s)
    if not summaries:
        return {}
    rows = []
    for s in summaries:
        row = {"run": s["_run"], "pair": s["pair"], "ablation": s.get("ablation", {}).get("name"),
               "mapper": s["mapper"]["kind"], "k": s["mapper"]["k"], "lambda": s["mapper"]["lambda"]}
        for kind, per in (s.get("r2") or {}).items():
            for split, v in per.items():
                row[f"r2_{kind}_{split}"] = v
        for task, r in s.get("tasks", {}).items():
            row[f"{task}_transfer"] = r.get("transfer")
            row[f"{task}_retention"] = r.get("retention")
        rows.append(row)
    out = {}
    for name, df in (("sweep", pd.DataFrame(rows)), ("sweep_retention", tables.retention_table(summaries)),
                     ("sweep_ablation", tables.ablation_table(summaries))):
        if len(df):
            for p in tables.write_table(df, sweep_dir, name):
                out[p.name] = p
    return out


try:
    from hydra.experimental.callback import Callback
except ImportError:  # Hydra is only needed when run through run.py
    Callback = object


class CollectSweep(Callback):
    """Hydra callback: after a multirun, write sweep.csv/md (+ retention and ablation tables)."""

    def on_multirun_end(self, config, **kwargs) -> None:
        paths = collect(config.hydra.sweep.dir)
        if paths:
            print(f"[kvtransfer] sweep tables: {', '.join(str(p) for p in paths.values() if p.suffix == '.md')}")
