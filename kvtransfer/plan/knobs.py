"""The knobs the plan applies when a requested stage does not fit, from one fixed, ordered list of knobs that
change no number of the run (one command, one set of numbers on every node).

`recommend` walks `KNOBS` in order (twice): a knob that applies to the config (its `offer` returns a value) is
kept when it lowers how far the requested stages are over budget, and the walk stops once everything fits; then
any kept knob the others no longer need is dropped. That is a few plans per knob, not a search over sets:

    calib.mlp_samples=0          keep no feature sample (only mapper=mlp / weighting=attention_mass read it)
    device_map=auto              spread each model over the node's GPUs
    calib.capture=sequential     one model resident at a time, the source's features via disk (bit-identical moments)
    report.rotated_heatmap=false skip the report's second (rotated-key) calibration (one figure fewer)
    report.variance_k=[1,2,4,8]  Table-7 rows up to k = 8 (smaller fits in the report; the rows kept are the same)
    pair.<side>.max_memory       keep part of the target's weights on the host (slow: streamed every forward)

and, whatever fits, `tune`: calib.checkpoint_every raised so the rolling checkpoint's rewrites cost at most
CHECKPOINT_SHARE of the calibration's estimated time (the result is the same: checkpoints fall on flush
boundaries). The moments' precision is no knob: the default (calib.accumulate=twolevel, float64 masters on the
host) is the same on a laptop and a DGX. When no number-neutral layout fits, the run refuses and names the
smallest node preset that would run it (`build.smallest_node`).
"""
from __future__ import annotations

import copy
import math
import shlex
from dataclasses import dataclass
from typing import Callable

from ..config.runconfig import needs_feature_sample
from .node import GiB
from .shapes import weight_bytes

@dataclass(frozen=True)
class Knob:
    """One entry of the fixed list: config key, what it does, how it changes the run's numbers (None: it does
    not), and `offer(cfg, ctx)` -> the value to set for this config, or None when the knob does not apply."""

    key: str
    note: str
    changes: str | None
    offer: Callable


@dataclass
class Context:
    """What the knob walk needs: the node, the stages it plans for, and `over(cfg)` ->
    {stage: {resource: need / budget}} of the requested stages over budget (with the usages behind it)."""

    node: object
    stages: list
    headroom: float
    usage: Callable   # cfg -> (Setup, {stage: Usage})
    over: Callable    # cfg -> {stage: {resource: ratio}}


def get(cfg: dict, dotted: str, default=None):
    """cfg's value at a dotted key, or `default`."""
    d = cfg
    for key in dotted.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def set_key(cfg: dict, dotted: str, value) -> dict:
    """A deep copy of cfg with `dotted` set to value."""
    out = copy.deepcopy(cfg)
    d = out
    keys = dotted.split(".")
    for key in keys[:-1]:
        d = d.setdefault(key, {})
    d[keys[-1]] = value
    return out


def _offer_no_sample(cfg, ctx):
    keeps = int(get(cfg, "calib.mlp_samples", 0) or 0) > 0
    return 0 if keeps and not needs_feature_sample(cfg["mapper"]) else None


def _offer_device_map(cfg, ctx):
    spread = ctx.node.gpus > 1 and str(cfg.get("device", "auto")) != "cpu" and not cfg.get("device_map")
    return "auto" if spread else None


def _offer_sequential(cfg, ctx):
    both = "calibrate" in ctx.stages or ("report" in ctx.stages and get(cfg, "report.rotated_heatmap"))
    return "sequential" if both and get(cfg, "calib.capture", "co-resident") == "co-resident" else None


def _offer_no_rotated(cfg, ctx):
    return False if "report" in ctx.stages and get(cfg, "report.rotated_heatmap") else None


def _offer_small_variance_k(cfg, ctx):
    ks = get(cfg, "report.variance_k", []) or []
    small = [k for k in ks if k != "all" and int(k) <= 8]
    return small if "report" in ctx.stages and small != list(ks) else None


def offload_value(cfg: dict, ctx: Context) -> dict | None:
    """The `max_memory` ({0: "<n>GiB", "cpu": "<m>GiB"}) that leaves every GPU-bound requested stage the room
    it needs besides the target's weights (whole GiB, the smallest over those stages), or None (not one GPU,
    no stage over on the GPU, or too little GPU left to keep 4 layers resident)."""
    s, usage = ctx.usage(cfg)
    over = ctx.over(cfg)
    if s.device != "cuda" or ctx.node.gpus != 1 or get(cfg, f"pair.{_target_side(cfg)}.max_memory") is not None:
        return None
    budgets = [math.floor((ctx.headroom * ctx.node.gpu_gib * GiB - (usage[st].gpu - s.weights("tgt"))) / GiB)
               for st, res in over.items() if "gpu" in res]
    if not budgets:
        return None
    budget = min(budgets)
    if budget * GiB < 4 * s.tgt.layer_params * s.w or budget * GiB >= weight_bytes(s.tgt, s.w):
        return None
    return {0: f"{budget}GiB", "cpu": f"{math.floor(ctx.headroom * ctx.node.host_gib)}GiB"}


def _target_side(cfg: dict) -> str:
    """The pair.<side> key of the model playing the target (pair.direction applied)."""
    return "source" if (cfg.get("pair") or {}).get("direction", "forward") == "reverse" else "target"


class _OffloadKnob(Knob):
    """The weight-offload knob: its key follows pair.direction (see `key_for`)."""

    def key_for(self, cfg: dict) -> str:
        return f"pair.{_target_side(cfg)}.max_memory"


KNOBS = (
    Knob("calib.mlp_samples", "keep no feature sample (only mapper=mlp and mapper.weighting=attention_mass read it)",
         None, _offer_no_sample),
    Knob("device_map", "spreads each model over all GPUs", None, _offer_device_map),
    Knob("calib.capture", "one model resident at a time during calibration: the source's features go to disk, "
         "then the target runs against them (the same moments, bit for bit)", None, _offer_sequential),
    Knob("report.rotated_heatmap", "skip the report's second (rotated-key) calibration: the R² figure shows "
         "stripped keys only", None, _offer_no_rotated),
    Knob("report.variance_k", "Table-7 rows up to k = 8 only (smaller ridge fits in the report)", None,
         _offer_small_variance_k),
    _OffloadKnob("pair.target.max_memory", "keeps part of the target's weights on the host; accelerate copies "
                 "them to the GPU on every forward pass (time: the plan's 'offloaded weights streamed')",
                 None, offload_value),
)


def _key(knob: Knob, cfg: dict) -> str:
    return knob.key_for(cfg) if isinstance(knob, _OffloadKnob) else knob.key


def _score(over: dict) -> float:
    """How far the stages are over budget: the sum of (need / budget - 1) over every over-budget resource."""
    return sum(min(v, 1e6) - 1 for res in over.values() for v in res.values())


def _entry(key: str, value, knob: Knob) -> dict:
    return {"key": key, "value": value, "set": f"{key}={fmt_value(value)}", "note": knob.note,
            "changes": knob.changes}


def _build(cfg: dict, knobs: list, ctx: Context) -> tuple[dict, list[dict]]:
    """cfg with `knobs` applied in list order (the weight offload last, its value computed for the config the
    others make), and the entries set."""
    entries = []
    for knob in sorted(knobs, key=lambda k: isinstance(k, _OffloadKnob)):
        value = knob.offer(cfg, ctx)
        if value is not None:
            entries.append(_entry(_key(knob, cfg), value, knob))
            cfg = set_key(cfg, entries[-1]["key"], value)
    return cfg, entries


def recommend(cfg: dict, ctx: Context) -> list[dict]:
    """The knobs of `KNOBS` that make the requested stages fit, as entries {"key", "value", "set", "note",
    "changes"} in list order; empty when everything fits as typed. May not fit (the caller checks).

    Two passes over the list (a knob that did not help before the weight offload may help next to it, whose
    value is recomputed for every set); then each kept knob the others no longer need is dropped."""
    chosen: list = []
    over = ctx.over(cfg)
    for _ in range(2):
        for knob in KNOBS:
            if not over or knob in chosen or knob.offer(_build(cfg, chosen, ctx)[0], ctx) is None:
                continue
            trial_over = ctx.over(_build(cfg, chosen + [knob], ctx)[0])
            if _score(trial_over) < _score(over):
                chosen, over = chosen + [knob], trial_over
    if not over:
        for knob in list(reversed(chosen)):   # drop what the others no longer need
            rest = [k for k in chosen if k is not knob]
            if not ctx.over(_build(cfg, rest, ctx)[0]):
                chosen = rest
    return _build(cfg, chosen, ctx)[1]


CHECKPOINT_SHARE = 0.1   # the rolling checkpoint's rewrites may cost at most this share of the calibration


def tune(cfg: dict, ctx: Context) -> list[dict]:
    """Number-neutral settings applied whatever fits: calib.checkpoint_every (sequences) raised so that the rolling
    checkpoint (one directory rewritten in place, piece by piece) is rewritten at most as often as costs
    CHECKPOINT_SHARE of the calibration's other estimated time; at least one checkpoint besides the last stays
    when the calibration has more than one checkpoint's worth of batches. Empty when the typed cadence is cheap."""
    if "calibrate" not in ctx.stages:
        return []
    s, usage = ctx.usage(cfg)
    secs = usage["calibrate"].parts.get("seconds", {})
    ck = secs.get("checkpoints", 0.0)
    rest = sum(v for k, v in secs.items() if k != "checkpoints")
    if s.n_checkpoints <= 1 or ck <= CHECKPOINT_SHARE * rest:
        return []
    per = ck / s.n_checkpoints
    n = max(2, int(CHECKPOINT_SHARE * rest // per))   # checkpoints affordable, the last one included
    if n >= s.n_checkpoints:
        return []
    step = -(-s.n_batches // n)                          # batches between checkpoints
    if s.twolevel:
        step = -(-step // s.flush) * s.flush
    value = step * s.batch
    note = (f"checkpoint the rolling calibration every {value} sequences ({-(-s.n_batches // step)} writes of "
            f"{s.checkpoint / GiB:.1f} GiB instead of {s.n_checkpoints}): the rewrites stay within "
            f"{CHECKPOINT_SHARE:.0%} of the calibration's time")
    return [{"key": "calib.checkpoint_every", "value": value, "set": f"calib.checkpoint_every={value}", "note": note,
             "changes": None}]


def apply_knobs(cfg: dict, entries: list[dict]) -> dict:
    """cfg with each entry's key set to its value, in order (a copy)."""
    for entry in entries:
        cfg = set_key(cfg, entry["key"], entry["value"])
    return cfg


def fmt_value(v) -> str:
    """A value in Hydra's override syntax: true/false, [a,b], {0:84GiB,cpu:121GiB}."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{x}" for k, x in v.items()) + "}"
    return str(v)


def shell_overrides(entries) -> str:
    """Knob entries (or a knob set "a=1 + b={0:8GiB,cpu:9GiB}") as shell-ready overrides: values with braces,
    brackets or commas quoted, since bash would expand `{0:8GiB,cpu:9GiB}` into two words."""
    parts = ([e["set"] for e in entries] if not isinstance(entries, str)
             else [p.strip() for p in entries.split(" + ")])
    return " ".join(shlex.quote(p) if any(c in p for c in "{}[],") else p for p in parts)

