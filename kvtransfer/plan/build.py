"""make_plan: the plan of a config on a node, with the knobs the run applies (plan.auto) and the stages it
refuses (over budget with every knob, or over plan.max_hours); refusal_message / check_plan for the runner."""
from __future__ import annotations

import math

from ..config.runconfig import parse_stages
from . import rates as rate_table
from .knobs import Context, apply_knobs, get, recommend, shell_overrides, tune
from .node import NODES, GiB, Node
from .setup import Setup, run_device
from .shapes import ModelShape, load_shape, mapper_params, weight_bytes
from .stages import stage_usage
from .usage import Usage

DEFAULT_HEADROOM = 0.95
DEFAULT_MAX_HOURS = 48.0


class PlanError(RuntimeError):
    """A requested stage will not fit the node (or runs past plan.max_hours); the message says what helps."""


def load_shapes(cfg: dict) -> tuple[ModelShape, ModelShape]:
    """(pair.source, pair.target) shapes as configured (Setup applies pair.direction)."""
    trc = bool(cfg.get("trust_remote_code", False))
    return load_shape(cfg["pair"]["source"], trc), load_shape(cfg["pair"]["target"], trc)


def over_budget(u: Usage, node: Node, headroom: float, device: str) -> dict:
    """{resource: need / (headroom * capacity)} for the resources over budget."""
    cap = node.capacity()
    need = {"gpu": u.gpu if device == "cuda" else 0.0, "host": u.host, "disk": u.disk}
    return {k: need[k] / (headroom * cap[k]) if cap[k] > 0 else math.inf for k in need
            if need[k] > headroom * cap[k]}


def _context(node: Node, shapes, rates, headroom: float, stages: list) -> Context:
    memo: dict = {}

    def usage(cfg):
        key = repr(cfg)
        if key not in memo:
            s = Setup(cfg, *shapes, node, rates)
            memo[key] = (s, stage_usage(s))
        return memo[key]

    def over(cfg):
        s, us = usage(cfg)
        out = {st: over_budget(us[st], node, headroom, s.device) for st in stages}
        return {st: o for st, o in out.items() if o}

    return Context(node, stages, headroom, usage, over)


def _figures(u: Usage) -> dict:
    return {"gpu_gib": round(u.gpu / GiB, 2), "host_gib": round(u.host / GiB, 2), "disk_gib": round(u.disk / GiB, 2),
            "seconds": round(u.seconds, 1)}


def _stage_entry(name: str, u: Usage, typed: Usage, s: Setup, node: Node, headroom: float, max_hours: float,
                 requested: list, label: str) -> dict:
    over = over_budget(u, node, headroom, s.device)
    typed_over = over_budget(typed, node, headroom, s.device)
    long = u.seconds > max_hours * 3600
    refused = None
    if over:
        refused = f"over budget ({', '.join(sorted(over))}) {label}"
    elif long:
        refused = f"estimated {u.seconds / 3600:.0f} h > plan.max_hours={max_hours:g}"
    return {**_figures(u), "fits": not over, "over": sorted(over), "over_time": long, "refused": refused,
            "requested": name in requested,
            "as_typed": {**_figures(typed), "fits": not typed_over, "over": sorted(typed_over)},
            "parts": {res: {k: round(v / GiB, 6) if res != "seconds" else round(v, 1) for k, v in part.items() if v}
                      for res, part in u.parts.items()},
            "notes": u.notes}


def _protocol(s: Setup) -> dict:
    obs = s.n_train * s.kept
    return {"n_sequences": s.n_seq, "seq_len": s.seq, "stride": s.stride, "batch_size": s.batch,
            "k": s.k, "dx": s.dx, "dy": s.dy, "p": s.p, "observations": obs,
            "p_over_n": round(s.p / max(1, obs), 4), "calib_dtype": str(s.calib.get("dtype", "float64")),
            "compute_dtype": ("float32" if s.twolevel else
                              str(s.calib.get("compute_dtype") or s.calib.get("dtype", "float64"))),
            "capture": s.calib.get("capture", "co-resident"), "store_device": (s.device if s.in_place else s.store),
            "accumulate": ("device (in place)" if s.in_place else
                           f"two-level (float32 on {s.device} for {s.flush} batches, then into the masters)"
                           if s.twolevel else "host"),
            "buffer_gib": round(s.buffer / GiB, 2),
            "moments_split_gib": round(s.moments / GiB, 2),
            "heldout_observations": s.held_rows, "heldout_gib": round(s.heldout / GiB, 2),
            "source_weights_gib": round(weight_bytes(s.src, s.w) / GiB, 2),
            "target_weights_gib": round(weight_bytes(s.tgt, s.w) / GiB, 2),
            "mapper_params": mapper_params(s.fw, s.tgt, s.k), "source_features": s.src_features,
            "feature_width": s.fw}


def make_plan(cfg: dict, node: Node, *, shapes: tuple[ModelShape, ModelShape] | None = None,
              rates: rate_table.Rates | None = None, local: bool = False, knobs: bool = True,
              auto: bool | None = None, stages: list[str] | None = None, suggest: bool = True) -> dict:
    """The resource plan of `cfg` (a resolved plain config dict) on `node`, as one JSON-able dict:

    {"pair", "source", "target", "node", "protocol", "rates", "notes", "auto", "max_hours",
     "recommended": [{"key", "value", "set", "note", "changes"}], "applied": (= recommended when auto, else []),
     "overrides": the applied knobs as shell overrides, "refused": {stage: reason} of the requested stages,
     "stages": {stage: {"gpu_gib", "host_gib", "disk_gib", "seconds" (an estimate), "fits", "over",
                "over_time", "refused", "requested", "as_typed": {...figures, "fits", "over"}, "parts", "notes"}}}.
    Figures are of the config the run executes (the applied knobs in). shapes: (pair.source, pair.target)
    (default `load_shape`); knobs=False: no recommendation; auto: default plan.auto; stages: the requested
    stages (default cfg.stage). Raises on a config it cannot plan (never a silent plan)."""
    shapes = shapes or load_shapes(cfg)
    rates = rates or rate_table.rates_for(node, run_device(cfg, node), local=local)
    headroom = float(get(cfg, "plan.headroom", DEFAULT_HEADROOM))
    max_hours = float(get(cfg, "plan.max_hours", DEFAULT_MAX_HOURS))
    auto = bool(get(cfg, "plan.auto", True)) if auto is None else auto
    requested = parse_stages(cfg.get("stage", "all") if stages is None else stages)
    if stages is not None:
        cfg = dict(cfg, stage=list(requested))
    ctx = _context(node, shapes, rates, headroom, requested)
    recommended = recommend(cfg, ctx) if knobs else []
    if knobs:   # number-neutral settings applied whatever fits (the checkpoint cadence)
        recommended = recommended + tune(apply_knobs(cfg, recommended), ctx)
    applied = recommended if auto else []
    s, usage = ctx.usage(apply_knobs(cfg, applied))
    _, typed = ctx.usage(cfg)
    label = ("with the applied knobs" if applied else "with every knob the plan has") if auto else "as typed"
    entries = {name: _stage_entry(name, u, typed[name], s, node, headroom, max_hours, requested, label)
               for name, u in usage.items()}
    src, tgt = shapes
    refused = {k: v["refused"] for k, v in entries.items() if v["refused"] and k in requested}
    smallest = smallest_node(cfg, shapes, requested) if refused and suggest and knobs else None
    verdict = ("fits, as typed" if not refused and auto else "fits" if not refused else "refused")
    return {"pair": cfg["pair"].get("name"), "verdict": verdict, "smallest_node": smallest, "source": src.name, "target": tgt.name,
            "node": {**node.describe(), "device": s.device, "headroom": headroom},
            "protocol": _protocol(s), "rates": {"name": rates.name, "source": rates.source, "rates": rates.describe()},
            "notes": s.notes, "auto": auto, "max_hours": max_hours, "requested": requested,
            "recommended": recommended, "applied": applied, "overrides": shell_overrides(applied),
            "refused": refused, "stages": entries}


def _node_size(spec: dict) -> tuple:
    return (spec["gpus"] * spec["gpu_gib"], spec["host_gib"], spec["disk_gib"])


def smallest_node(cfg: dict, shapes, stages: list) -> str | None:
    """The smallest node preset (total GPU memory, then host, then disk) on which every stage of `stages` runs at
    `cfg` with the plan's number-neutral knobs, or None when none does."""
    for name, spec in sorted(NODES.items(), key=lambda kv: _node_size(kv[1])):
        node = Node(**spec)
        plan = make_plan(cfg, node, shapes=shapes, stages=stages, auto=True, suggest=False)
        if not plan["refused"]:
            return name
    return None


def applied_config(cfg: dict, plan: dict) -> dict:
    """cfg with the plan's applied knobs set (what the run executes)."""
    return apply_knobs(cfg, plan["applied"])


def refusal_message(plan: dict, stages: list[str] | None = None) -> str | None:
    """None when every stage of `stages` (default: the plan's requested ones) fits within plan.max_hours with
    the applied knobs; else the message naming each failing stage and the knob set that helps."""
    stages = plan["requested"] if stages is None else stages
    bad = {k: v for k, v in plan["stages"].items() if v["refused"] and k in stages}
    if not bad:
        return None
    n = plan["node"]
    lines = [f"resource plan: {', '.join(bad)} will not run on {n['name']} ({n['gpus']} x {n['gpu_gib']:.1f} GiB "
             f"GPU, {n['host_gib']:.1f} GiB host, {n['disk_gib']:.1f} GiB disk):"]
    for name, st in bad.items():
        lines.append(f"  {name}: {st['refused']}; needs GPU {st['gpu_gib']:.1f} GiB, host {st['host_gib']:.1f} GiB, "
                     f"disk {st['disk_gib']:.1f} GiB, ~{st['seconds'] / 3600:.1f} h (estimate)")
    if plan["recommended"]:
        lines.append(f"  the plan's knobs ({'applied' if plan['applied'] else 'not applied: plan.auto=false'}): "
                     f"{shell_overrides(plan['recommended'])}")
    if plan.get("smallest_node"):
        spec = NODES[plan["smallest_node"]]
        lines.append(f"  no layout that keeps the numbers fits this node; the smallest node preset that runs it: "
                     f"{plan['smallest_node']} ({spec['name']}: {spec['gpus']} x {spec['gpu_gib']:g} GiB GPU, "
                     f"{spec['host_gib']:g} GiB host, {spec['disk_gib']:.0f} GiB disk)")
    lines.append("Leave out the stages above (stage=...), use a larger node, or plan.enforce=false to run anyway. "
                 "Details: plan.json / python -m kvtransfer.plan pair=... --help")
    return "\n".join(lines)


def check_plan(cfg: dict, node: Node | None = None, *, shapes=None, rates=None,
               stages: list[str] | None = None) -> dict:
    """The plan of `cfg` on `node` (default: this machine); raises PlanError when a stage of `stages` (default:
    the requested ones) is refused. Returns the plan."""
    from .node import detect_node

    plan = make_plan(cfg, node or detect_node(cfg), shapes=shapes, rates=rates, local=True, stages=stages)
    msg = refusal_message(plan)
    if msg:
        raise PlanError(msg)
    return plan


def resources_summary(plan: dict) -> dict:
    """What summary.json records of the plan: the knobs applied, the node, and each requested stage's figures."""
    return {"applied": [{k: e[k] for k in ("set", "key", "value", "changes")} for e in plan["applied"]],
            "auto": plan["auto"], "node": plan["node"], "max_hours": plan["max_hours"],
            "stages": {k: {f: v[f] for f in ("gpu_gib", "host_gib", "disk_gib", "seconds", "fits")}
                       for k, v in plan["stages"].items() if v["requested"]}}
