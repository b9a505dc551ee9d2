"""The plan figure, from the committed plan.json files.

    python3 results/plan/figure.py

figures/memory.png: planned GPU and host memory of every stage of the six paper pairs on each node preset,
against the node's budget (one GPU; all GPUs; host). Reads only results/plan/*/*/plan.json (what make.py wrote);
no planning is redone here. The numbers the docs quote are make.py's generated blocks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


NODE_DIRS = ("dgx-h200", "dgx-h100", "8xh100", "1xh200-cloud", "1xh100-cloud", "h200")
STAGES = ("calibrate", "fit", "eval", "bench", "report")


def load_plans() -> dict[str, dict[str, dict]]:
    """{node dir: {pair: plan.json}} of every committed plan."""
    return {node: {p.parent.name: json.loads(p.read_text()) for p in sorted((HERE / node).glob("*/plan.json"))}
            for node in NODE_DIRS if (HERE / node).is_dir()}


def memory_figure(plans: dict, path: Path) -> None:
    """Per node (column) and memory kind (row: GPU, host): planned GiB of each stage per pair, budget lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")
    hatches = ("", "//", "..", "xx", "--")
    fig, axes = plt.subplots(2, len(plans), figsize=(6.2 * len(plans), 8.2), squeeze=False)
    for col, (node, per_pair) in enumerate(plans.items()):
        pairs = list(per_pair)
        spec = next(iter(per_pair.values()))["node"]
        for row, (kind, budget) in enumerate((("gpu_gib", spec["gpu_gib"]), ("host_gib", spec["host_gib"]))):
            ax = axes[row, col]
            width = 0.8 / len(STAGES)
            for i, stage in enumerate(STAGES):
                xs = [j + (i - (len(STAGES) - 1) / 2) * width for j in range(len(pairs))]
                ax.bar(xs, [per_pair[p]["stages"][stage][kind] for p in pairs], width, color=colours[i],
                       hatch=hatches[i], edgecolor="white", label=stage)
            ax.axhline(budget * spec.get("headroom", 1.0), color="black", lw=1.2,
                       label=f"one {spec.get('gpu', 'GPU')} usable ({budget * spec.get('headroom', 1.0):.0f} GiB)"
                       if kind == "gpu_gib" else f"host usable ({budget * spec.get('headroom', 1.0):.0f} GiB)")
            if kind == "gpu_gib" and spec["gpus"] > 1:
                ax.axhline(spec["gpus"] * budget * spec.get("headroom", 1.0), color="black", ls="--", lw=1.0,
                           label=f"all {spec['gpus']} GPUs")
            ax.set_xticks(range(len(pairs)), [p.replace("_", "\n", 1) for p in pairs], fontsize=7)
            ax.set_ylabel(f"planned {'GPU' if kind == 'gpu_gib' else 'host'} GiB")
            ax.set_title(f"{node}: {spec['name']}, {'GPU' if kind == 'gpu_gib' else 'host'} memory", fontsize=9)
            ax.legend(fontsize=6.5, ncol=2)
    fig.suptitle("Resource plan of the six paper pairs at the paper's protocol (500 × 1,024 tokens): planned memory per "
                 "stage vs the node (kvtransfer.plan estimates from shapes and datasheet rates, not measured)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    memory_figure(load_plans(), HERE / "figures" / "memory.png")
    print("wrote results/plan/figures/memory.png")


if __name__ == "__main__":
    main()
