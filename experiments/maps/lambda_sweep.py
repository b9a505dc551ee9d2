"""Does more ridge regularisation help the real pair's map? Held-out R² of the k = 8 map against lambda.

    python experiments/maps/lambda_sweep.py     # ~1 min on 2 cores, after experiments/qwen25coder/run.sh step 1

Reads the main Wikipedia calibration of experiments/qwen25coder (moments cached under artifacts/qwen25coder;
no model is loaded) and the main run's top-k selection, refits every target layer's K and V map at each
lambda and scores it on the held-out sequences' raw features. lambda is given relative to the mean diagonal
of the selected features' centred sum of squares (per layer and kind), so one value means the same
shrinkage for K and V; the runs use lambda = 0.01 absolute, i.e. ~1e-6 relative here.
Writes results/maps/tables/lambda_sweep.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtransfer.core.io import atomic_write_bytes  # noqa: E402
from kvtransfer.core.ridge import fit_layer, head_r2  # noqa: E402
from kvtransfer.runner import Run  # noqa: E402
from kvtransfer.runner.fit_stage import selected_layers  # noqa: E402

RELATIVE = [0.0, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def main() -> None:
    import os

    os.chdir(ROOT)  # the experiment's cache_dir is relative to the repository
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=qwen25coder_cpu", "out_dir=unused"])
    run = Run(OmegaConf.to_container(cfg, resolve=True), ROOT / "unused")
    if not (run.moments_dir(run.key_space) / "calibration.json").exists():  # never start a 20-min calibration here
        raise SystemExit("no cached Wikipedia calibration: run experiments/qwen25coder/run.sh (step 1) first")
    train, held, _ = run.moments()
    selected = selected_layers(run)
    head_dim = run.target_head_dim()
    lines = ["# Ridge lambda vs held-out R² (k = 8, Wikipedia calibration, 128 train / 32 held-out sequences)", "",
             "Made by `python experiments/maps/lambda_sweep.py` on the 2-core CPU machine. lambda relative to the",
             "mean diagonal of the selected features' centred sum of squares (per layer and kind); 0 = the runs'",
             "lambda = 0.01 absolute. Mean over 28 target layers x 2 KV heads.", "",
             "| relative lambda | K R² held-out | V R² held-out |", "|---|---|---|"]
    for rel in RELATIVE:
        r2 = {}
        for kind in ("k", "v"):
            per_layer = []
            for t, layers in zip(train.target_layers, selected):
                cols = train.source_columns(layers)
                scale = float(train.cov_xx(kind, cols).diagonal().mean())
                fit = fit_layer(train, kind, list(layers), t, lam=max(rel * scale, run.lam))
                per_layer.append(head_r2(held, kind, fit, t, head_dim).mean())
            r2[kind] = float(torch.stack(per_layer).mean())
        lines.append(f"| {rel:g} | {r2['k']:.4f} | {r2['v']:.4f} |")
        print(lines[-1], flush=True)
    out = ROOT / "results" / "maps" / "tables" / "lambda_sweep.md"
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
