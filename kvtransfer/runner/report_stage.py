"""What the report stage computes from the calibration (the figures and tables are kvtransfer.report's)."""
from __future__ import annotations

from ..core.ridge import UnderdeterminedFit, fit_ridge
from ..core.select import select_topk

def variance_vs_k(run) -> list[dict]:
    """Mean R² (train, held-out; K and V) of top-k ridge fits for each k in report.variance_k."""
    train, heldout, info = run.moments()
    r2m = run.r2()["train"]
    rows = []
    for k in run.cfg.get("report", {}).get("variance_k", []):
        k_eff = len(train.source_layers) if k == "all" else int(k)
        if k_eff > len(train.source_layers):
            continue
        try:
            fit = fit_ridge(train, select_topk(r2m, k_eff), lam=run.lam, heldout=heldout,
                            head_dim=run.target_head_dim(), stride=info["stride"])
        except UnderdeterminedFit as err:
            rows.append({"k": k, "skipped": str(err)})
            continue
        row = {"k": k, "features": k_eff * train.source_width, "p_over_n": k_eff * train.source_width / train.n}
        for split, per in fit.r2.items():
            for kind, t in per.items():
                row[f"{kind}_{split}"] = float(t.mean())
        rows.append(row)
    return rows
