"""Write a run's tables, figures and W&B log from its summary (the report stage)."""
from __future__ import annotations

from pathlib import Path

from . import figures, tables
from .wandb_log import log_run


def write_outputs(cfg: dict, summary: dict, out_dir: Path, r2_matrices: dict | None = None) -> dict:
    """Write tables/*.csv|md and figures/*.png for whatever the summary holds; returns their paths."""
    out_dir = Path(out_dir)
    tdir, fdir = out_dir / "tables", out_dir / "figures"
    tdir.mkdir(parents=True, exist_ok=True)
    fdir.mkdir(parents=True, exist_ok=True)
    written_tables: dict[str, Path] = {}
    frames = {"retention": tables.retention_table([summary]) if summary.get("tasks") else None,
              "tasks": tables.task_table(summary) if summary.get("tasks") else None,
              "ablation": tables.ablation_table([summary]) if summary.get("tasks") else None,
              "variance_explained": tables.variance_table(summary),
              "speed": tables.speed_table(summary),
              "ppl": tables.ppl_table(summary),
              "drift": tables.drift_table(summary),
              "coqa_twins": tables.coqa_twin_table(summary),
              "fidelity_positions": tables.fidelity_table(summary)}
    for name, df in frames.items():
        if df is not None and len(df):
            for path in tables.write_table(df, tdir, name):
                written_tables[f"{name}{path.suffix}"] = path
    cal = summary.get("calibration") or {}
    calib = f"calibration {cal.get('domain', '?')}, {cal.get('sequences', '?')} sequences"
    made = {
        "retention": figures.retention_bars(summary, fdir / "retention.png"),
        "r2_heatmap": figures.r2_heatmaps(r2_matrices or {}, fdir / "r2_heatmap.png",
                                          figures.title(summary, "single-source-layer R² (train)", calib)),
        "r2_vs_k": figures.r2_vs_k(summary.get("variance_explained", []), fdir / "r2_vs_k.png",
                                   figures.title(summary, "mean R² vs k", calib)),
        "speedup": figures.speedup_vs_tokens(summary.get("speed", []), fdir / "speedup.png",
                                             figures.title(summary, "mapper vs re-prefill",
                                                           f"median of {(summary.get('speed') or [{}])[0].get('repeats', '?')}")),
        "drift": figures.drift_per_turn(summary.get("drift", []), fdir / "drift.png",
                                        figures.title(summary, "multi-turn F1").replace("\n", " ")),
        "fidelity": figures.fidelity_per_layer(summary.get("fidelity") or {}, fdir / "fidelity.png",
                                               figures.title(summary, "fidelity per layer").replace("\n", " ")),
    }
    written_figures = {name: path for name, path in made.items() if path is not None}
    wandb_dir = log_run(cfg, summary, out_dir, written_tables, written_figures)
    return {"tables": {k: str(v) for k, v in written_tables.items()},
            "figures": {k: str(v) for k, v in written_figures.items()}, "wandb_dir": wandb_dir}
