"""Optional Weights & Biases logging. Never breaks a run: any W&B failure is reported and skipped."""
from __future__ import annotations

import os
import warnings
from pathlib import Path


def log_run(cfg: dict, summary: dict, out_dir: Path, tables: dict[str, Path], figures: dict[str, Path]) -> str | None:
    """Log config, scalar metrics, tables and figures; returns the W&B run dir (or None if skipped).

    With wandb.mode=offline nothing leaves the machine and files go only under `out_dir`.
    """
    wcfg = cfg.get("wandb") or {}
    if not wcfg.get("enabled"):
        return None
    try:
        import pandas as pd
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project=wcfg.get("project", "kvtransfer"), entity=wcfg.get("entity"),
                         mode=wcfg.get("mode", "offline"), dir=str(out_dir), config=cfg,
                         name=f"{summary['pair']}-{out_dir.name}", tags=list(wcfg.get("tags") or []),
                         reinit="finish_previous")
        metrics = {}
        for task, r in summary.get("tasks", {}).items():
            for key in ("target", "transfer", "source", "no_context", "gap_closed", "retention", "gap_closed_vs_source",
                        "retention_vs_chance"):
                if isinstance(r.get(key), (int, float)):
                    metrics[f"{task}/{key}"] = r[key]
        for kind, per in (summary.get("r2") or {}).items():
            for split, value in per.items():
                if isinstance(value, (int, float)):
                    metrics[f"r2/{kind}_{split}"] = value
        run.log(metrics)
        for name, path in tables.items():
            if path.suffix == ".csv":
                run.log({f"table/{name}": wandb.Table(dataframe=pd.read_csv(path))})
        for name, path in figures.items():
            run.log({f"figure/{name}": wandb.Image(str(path))})
        run.summary.update(metrics)
        run_dir = run.dir
        run.finish()
        return run_dir
    except Exception as err:  # W&B is optional: a run must never fail because of it
        warnings.warn(f"W&B logging skipped: {type(err).__name__}: {err}", stacklevel=2)
        return None
