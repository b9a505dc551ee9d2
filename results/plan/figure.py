"""The plan figure and the plan README's generated numbers, from the committed plan.json files.

    python3 results/plan/figure.py [--check]

figures/memory.png: planned GPU and host memory of every stage of the six paper pairs on each node shape,
against the node's budget (one GPU; all GPUs; host). README.md's `key_numbers` block: the times the README's
reading cites, read from the same plans (so the prose never retypes them). Reads only results/plan/*/*/plan.json
(what make.py wrote); no planning is redone here. --check compares the README block only (exit 1 on a difference).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from kvtransfer.report import readme  # noqa: E402

NODE_DIRS = ("h200", "h200_fp32_device", "8xh100")
STAGES = ("calibrate", "fit", "eval", "bench", "report")


def load_plans() -> dict[str, dict[str, dict]]:
    """{node dir: {pair: plan.json}} of every committed plan."""
    return {node: {p.parent.name: json.loads(p.read_text()) for p in sorted((HERE / node).glob("*/plan.json"))}
            for node in NODE_DIRS if (HERE / node).is_dir()}


def duration(seconds: float) -> str:
    """"43 min" under 90 minutes, else "8.5 h" (the plan's own rounding)."""
    return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


def key_numbers(plans: dict) -> str:
    """The numbers the README's reading cites, each with the plan it comes from (stage figures are with the
    recommended knobs set; `as_typed` holds the figures of the config as typed). A set holding a knob that
    changes the numbers is one the run refuses until the command types it (`how`)."""
    h200, fp32, h100 = plans["h200"], plans["h200_fp32_device"], plans["8xh100"]
    q, ll = "qwen3_14b_32b", "llama31_8b_70b"
    cal = h200[q]["stages"]["calibrate"]

    def how(plan: dict) -> str:
        changing = [e["set"] for e in plan["applied"] if e.get("changes")]
        if changing:
            return f"with `{plan['overrides']}` typed (the run refuses until it is: {' '.join(changing)} changes the numbers)"
        return f"with `{plan['overrides']}`, which the run applies itself" if plan["applied"] else "as typed"
    lines = [
        f"- Qwen3-14B → 32B calibrate on 1 x H200: {duration(fp32[q]['stages']['calibrate']['seconds'])} with "
        f"`calib.dtype=float32 calib.accumulate=device` (`h200_fp32_device/`); {how(h200[q])} it takes "
        f"{duration(cal['seconds'])} (`h200/`; as typed it does not fit).",
        f"- Qwen3-14B → 32B calibrate + fit on 8 x H100: {duration(h100[q]['stages']['calibrate']['seconds'])} + "
        f"{duration(h100[q]['stages']['fit']['seconds'])} (`8xh100/`, {how(h100[q])}).",
        f"- Llama-3.1-8B → 70B eval on 8 x H100 {how(h100[ll])}: "
        f"{duration(h100[ll]['stages']['eval']['seconds'])} (`8xh100/`).",
    ]
    return "\n".join(lines) + "\n"


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    plans = load_plans()
    want = {"key_numbers": key_numbers(plans)}
    if args.check:
        have = readme.blocks((HERE / "README.md").read_text())
        raise SystemExit(int(have.get("key_numbers") != want["key_numbers"]))
    memory_figure(plans, HERE / "figures" / "memory.png")
    readme.rewrite(HERE / "README.md", want)
    print("wrote results/plan/figures/memory.png and README.md's key_numbers block")


if __name__ == "__main__":
    main()
