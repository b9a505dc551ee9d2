"""Resource plan of a run: peak GPU memory, host memory, disk and estimated time per stage, before anything loads,
and the knobs the run will apply so that every stage fits.

    python -m kvtransfer.plan pair=qwen3_14b_32b [calib.dtype=float32 ...] [--node h200 | dry.node=h200 | --gpu-mem
        GiB --host-mem GiB --disk GiB --gpus N --gpu H100|H200|A100] [--weights-on-disk] [--json] [--out DIR]

The node is named as run.py names it (dry.node=<preset> or dry.node={gpus: 8, gpu_gib: 80, ...}) or by the flags.

No Hydra / lm-eval / W&B import at module level: `main` composes the Hydra config inside.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config.paths import conf_dir
from ..config.runconfig import check_groups, group_overrides
from .build import make_plan
from .knobs import get
from .node import NODES, Node, detect_node, node_from_spec
from .rates import DEVICES
from .text import format_plan, write_plan


def compose_config(overrides: list[str]) -> dict:
    """The run's resolved config from conf/ (Hydra compose API; out_dir defaults to a placeholder). ValueError, as
    run.py gives it, for a single value typed where the config has a group of keys (runconfig.check_groups)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    if not any(o.split("=", 1)[0].lstrip("+~") == "out_dir" for o in overrides):
        overrides = ["out_dir=plan", *overrides]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)), resolve=True)
        defaults = compose(config_name="config", overrides=group_overrides(overrides, conf_dir()))
    check_groups(cfg, OmegaConf.to_container(defaults, resolve=False))
    return cfg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py (pair=..., calib.dtype=...)")
    parser.add_argument("--node", choices=sorted(NODES), help="a node preset (sets the four below)")
    parser.add_argument("--gpu-mem", type=float, help="GiB per GPU")
    parser.add_argument("--host-mem", type=float, help="GiB of host memory")
    parser.add_argument("--disk", type=float, help="GiB of local disk")
    parser.add_argument("--gpus", type=int, help="number of GPUs (0 = CPU only)")
    parser.add_argument("--gpu", choices=sorted(DEVICES), help="GPU model for the rate table")
    parser.add_argument("--weights-on-disk", action="store_true", help="count the weights against --disk")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--out", help="write plan.json + plan.md here (default: ./runs/plan/<pair>)")
    return parser


def node_from_args(args, cfg: dict) -> tuple[Node, bool]:
    """(the node the flags or dry.node describe, whether it was given) -- a preset, a mapping, explicit flags (which
    override a named node's fields), or this machine."""
    explicit = any(v is not None for v in (args.gpu_mem, args.host_mem, args.disk, args.gpus, args.node))
    named = (cfg.get("dry") or {}).get("node")   # run.py's spelling, dry.node=<preset or mapping>, works here too
    if args.node:
        node = Node(**NODES[args.node])
    elif named is not None:   # the flags below still override its fields
        node, explicit = node_from_spec(named, cfg), True
    else:
        node = detect_node(cfg) if not explicit else Node(name="given", gpus=1 if args.gpu_mem else 0)
    for attr, value in (("gpu_gib", args.gpu_mem), ("host_gib", args.host_mem), ("disk_gib", args.disk),
                        ("gpus", args.gpus), ("gpu", args.gpu)):
        if value is not None:
            setattr(node, attr, value)
    if explicit and not args.node and named is None:
        if node.gpus and node.gpu is None:
            node.gpu = "H100"  # for the rates only; the name says so
            node.name = f"{node.gpus} x GPU {node.gpu_gib:g} GiB (H100 rates assumed)"
        else:
            node.name = f"{node.gpus} x {node.gpu} {node.gpu_gib:g} GiB" if node.gpus else "CPU only"
    node.weights_on_disk = args.weights_on_disk or bool(get(cfg, "plan.weights_on_disk", False))
    return node, explicit


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = compose_config(args.overrides)
    node, explicit = node_from_args(args, cfg)
    plan = make_plan(cfg, node, local=not explicit)
    out = Path(args.out or Path("runs") / "plan" / str(plan["pair"]))  # under the working directory, as a run
    write_plan(plan, out)
    if args.json:
        print(json.dumps(plan))
    else:
        print(format_plan(plan, details=False), end="")
        print(f"(written to {out}/plan.json and plan.md)")
    return 0
