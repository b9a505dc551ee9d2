"""Resource plan of a run: peak GPU memory, host memory, disk and estimated time per stage, before anything
loads, from the code's own data structures, and the knob set the run applies when a stage does not fit.

    rates.py     device table + measured CPU rates, each with its source (times are estimates)
    node.py      Node (GPUs, host memory, disk), the presets NODES, detect_node (this machine)
    shapes.py    ModelShape from real transformers configs; sizes asked of the run's structures
                 (Moments / HeldOut / FeatureSampler .nbytes_at, the mapper kinds' params_at)
    setup.py     Setup: the config read once, through the run's resolver (kvtransfer.config.runconfig)
    stages.py    calibrate / fit / report usage and stage_usage; evalbench.py: eval and bench
    knobs.py     the fixed, ordered knob list, recommend and apply_knobs
    build.py     make_plan, refusal_message, check_plan, PlanError, resources_summary
    text.py      format_plan, write_plan
    cli.py       python -m kvtransfer.plan pair=... [--node h200 | --gpu-mem ...] [--json]
"""
from .build import (PlanError, applied_config, check_plan, load_shapes, make_plan, over_budget, refusal_message,
                    resources_summary)
from .knobs import KNOBS, apply_knobs, recommend, shell_overrides
from .node import GiB, NODES, Node, detect_node
from .rates import DEVICES, Rates, measure_cpu, rates_for
from .setup import LOAD_SHARD, Setup, run_device
from .shapes import (ModelShape, dtype_bytes, forward_bytes, heldout_bytes, load_shape, mapper_params,
                     moments_bytes, offloaded_bytes, prefill_flops, sample_bytes, shape_from_config, weight_bytes)
from .stages import STAGES, stage_usage
from .text import dur, format_plan, write_plan
from .cli import main

__all__ = ["PlanError", "applied_config", "check_plan", "load_shapes", "make_plan", "over_budget",
           "refusal_message", "resources_summary", "KNOBS", "apply_knobs", "recommend", "shell_overrides", "GiB",
           "NODES", "Node", "detect_node", "DEVICES", "Rates", "measure_cpu", "rates_for", "LOAD_SHARD", "Setup",
           "run_device", "ModelShape", "dtype_bytes", "forward_bytes", "heldout_bytes", "load_shape",
           "mapper_params", "moments_bytes", "offloaded_bytes", "prefill_flops", "sample_bytes",
           "shape_from_config", "weight_bytes", "STAGES", "stage_usage", "dur", "format_plan", "write_plan", "main"]
