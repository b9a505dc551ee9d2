"""`python run.py pair=P dry_run=true`: the whole pipeline on stand-ins, before a node is booked.

Order: (1) the resource plan of the REAL run for `dry.node`, printed and written (plan.json); (2) the
preflight of the REAL run: every data source it reads resolves, and the model table agrees with each
reachable config.json (kvtransfer.runner.preflight); (3) device maps are validated; (4) stand-ins of the
pair's hub models are written under their real ids (kvtransfer.dryrun.standin) and the SAME `execute`
runs every requested stage -- calibrate, fit, eval (every task, perplexity, CoQA), bench, report -- on
them, with the run's real data sources at tiny sizes (`shrink`). Only sizes and weights differ from the
real run. What it cannot show is printed and written to dry_run.json (`CANNOT_SHOW`).
"""
from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

from ..config.hub import standin_models
from ..core.io import atomic_write_json
from .standin import STANDIN_NOTE, write_standins

CANNOT_SHOW = (
    "online resolution of the model hub ids: the stand-ins load from a local cache under those ids (the preflight "
    "reads each real config.json where it can: online, or from the HF cache)",
    "multi-GPU placement: device_map / max_memory are validated, not applied (the stand-ins run on one device)",
    "GPU memory: the plan above estimates it; the stand-ins' sizes say nothing about it",
    "the real tokenizers: a stand-in BPE trained on the repository's benchmark samples, with the real vocabulary "
    "size and special-token ids (token counts within about 10-30 % of a real tokenizer's on English)",
    "any number: scores, R² and times of a dry run are of random weights",
)


class DryRunError(RuntimeError):
    """The real run would be refused (its plan on the named node), found by the dry run before it ran."""


def plan_node(cfg: dict):
    """The kvtransfer.plan.Node the printed plan is for: dry.node = null (this machine), a preset name of the
    planner (kvtransfer.plan.NODES: dgx-h200, dgx-h100, 8xh100, ...) or a mapping {gpus, gpu_gib, host_gib, disk_gib, gpu}."""
    from ..plan.node import node_from_spec

    return node_from_spec((cfg.get("dry") or {}).get("node"), cfg)


def plan_real_run(cfg: dict, out_dir: Path, stages: list[str], *, log=print) -> tuple[dict, dict]:
    """(the real run's config with the knobs its plan applies, the plan) on `dry.node`, printed and written to
    out_dir. A requested stage the plan refuses on a named node (it does not fit even with the knobs, or runs
    past plan.max_hours) fails the dry run, as it fails the run there (unless plan.enforce=false); on this
    machine it only warns. The dry run then runs the applied config, so it rehearses the knobs too."""
    from .. import plan as resource_plan

    named = (cfg.get("dry") or {}).get("node") is not None
    node = plan_node(cfg)
    settings = cfg.get("plan") or {}
    enforce = bool(settings.get("enforce", True))
    plan = resource_plan.make_plan(cfg, node, local=not named, stages=stages,
                                   auto=bool(settings.get("auto", True)) and enforce)
    resource_plan.write_plan(plan, out_dir)
    log(f"[dry run] resource plan of the REAL run on {node.name}:")
    log(resource_plan.format_plan(plan, details=False).rstrip())
    msg = resource_plan.refusal_message(plan, stages)
    if msg:
        if named and enforce:
            raise DryRunError(f"the real run on {node.name}: {msg}")
        log(f"[dry run] NOTE: {msg}" + ("" if named else "; name the node you will book with dry.node=..."))
    changing = [e["set"] for e in plan["applied"] if e.get("changes")]
    if changing:
        log(f"[dry run] the real run refuses unless you type {plan['overrides']} ({' '.join(changing)} changes the "
            "numbers); the dry run runs with them")
    elif plan["applied"]:
        log(f"[dry run] the real run applies {plan['overrides']}; the dry run runs with them")
    return resource_plan.applied_config(cfg, plan), plan


def check_placement(cfg: dict) -> None:
    """Validate what the dry run does not apply: each side's device_map and max_memory as the loader reads them."""
    from ..core.models import device_map_for, max_memory_for

    for side in ("source", "target"):
        device_map_for(cfg, side)
        max_memory_for(cfg, side)


def _side_kv(cfg: dict, side: str, dry: dict) -> tuple[int, int, int]:
    """(layers, KV width, hidden size) of the model playing `side` in the dry run: the stand-in's, or a local
    model's own."""
    from transformers import AutoConfig

    from ..core.hidden import hidden_size
    from ..core.models import kv_shape
    from ..resources.model_configs import MODEL_CONFIGS

    spec = cfg["pair"][_config_side(cfg, side)]
    if spec.get("path"):
        config = AutoConfig.from_pretrained(spec["path"], trust_remote_code=cfg.get("trust_remote_code", False))
        shape = kv_shape(config)
        return shape.n_layers, shape.n_kv * shape.head_dim, hidden_size(config)
    row = MODEL_CONFIGS[spec["id"]]
    n_kv = row.get("num_key_value_heads") or row["num_attention_heads"]
    return row["num_hidden_layers"], n_kv * dry["head_dim"], int(dry["hidden_size"])


def _config_side(cfg: dict, side: str) -> str:
    return {"source": "target", "target": "source"}[side] if cfg["pair"].get("direction") == "reverse" else side


def calib_sequences(cfg: dict, dry: dict, seq_len: int) -> int:
    """Calibration sequences for the dry run: enough that the fit's features / observations <= dry.p_over_n
    (the ridge refuses >= 0.5), at least 10 (one held out)."""
    calib, mapper, ablation = cfg["calib"], cfg["mapper"], cfg.get("ablation") or {}
    from ..core.hidden import feature_width
    from ..config.runconfig import source_features

    layers, width, hidden = _side_kv(cfg, "source", dry)
    width = feature_width(source_features(mapper), hidden, width)  # mapper=hidden reads H (+ K/V) per layer
    k = ablation.get("k") if ablation.get("k") is not None else mapper["k"]
    p = (layers if k == "all" else int(k)) * width
    per_seq = len(range(0, seq_len, int(calib["stride"])))
    n_train = math.ceil(p / float(dry["p_over_n"]) / per_seq)
    return max(10, math.ceil(n_train / (1 - float(calib["heldout_fraction"]))) + 1)


def shrink(cfg: dict, out_dir: Path) -> dict:
    """The dry run's config: `cfg` with tiny sizes (dry.*), on dry.device (default this CPU), artifacts under out_dir.
    Everything else -- data sources, protocol keys, tasks, modes, stages, dtypes, mapper kind -- stays as given."""
    dry = cfg["dry"]
    device = str(dry.get("device") or "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"dry.device={device!r}: use cpu (the default) or cuda / cuda:N")
    small = copy.deepcopy(cfg)
    small.update(device=device, device_map=None, cache_dir=str(out_dir / "artifacts"))
    for side in ("source", "target"):
        small["pair"][side] = dict(small["pair"][side], device_map=None, max_memory=None)
    calib = small["calib"]
    seq_len = min(int(calib["seq_len"]), int(dry["seq_len"]))
    calib.update(seq_len=seq_len, n_sequences=calib_sequences(cfg, dry, seq_len), batch_size=min(calib["batch_size"], 4),
                 heldout_observations=min(calib.get("heldout_observations") or 512, 512),
                 mlp_samples=min(calib.get("mlp_samples") or 0, 2048), store_device="cpu")
    if small["mapper"].get("kind") == "mlp":
        small["mapper"].update(hidden=min(small["mapper"]["hidden"], 16), epochs=1, device=device)
    if small["mapper"].get("kind") == "trained":  # the calibration keeps >= 10 sequences: 2 stop + up to 4 to train on
        m = small["mapper"]
        m.update(train_sequences=min(int(m["train_sequences"]), 4), stop_sequences=min(int(m["stop_sequences"]), 2),
                 query_positions=min(int(m["query_positions"]), seq_len), steps=min(int(m["steps"]), 4),
                 eval_every=min(int(m["eval_every"]), 2), device=device)
        if m.get("continuation_tokens") is not None:  # end_to_end: context + continuation within the short sequences
            cont = min(int(m["continuation_tokens"]), seq_len // 2)
            ctx = m.get("context_tokens")
            m.update(continuation_tokens=cont, context_tokens=None if ctx is None else min(int(ctx), seq_len - cont))
    ev = small["eval"]
    shots = dry.get("num_fewshot")  # few-shot prompts are the longest contexts (MMLU 5, GSM8K 8 shots)
    if shots is not None:
        ev["num_fewshot"] = int(shots) if ev.get("num_fewshot") is None else min(int(ev["num_fewshot"]), int(shots))
    ev.update(limit=int(dry["eval_limit"]), limits={}, batch_size=min(ev["batch_size"], 2),
              max_gen_toks=min(ev["max_gen_toks"], int(dry["max_gen_toks"])), bootstrap=min(ev.get("bootstrap", 0), 20))
    if int(dry["eval_limit"]) < 2 and ev.get("controls"):
        # a wrong context is another item's: with one item per task there is none (kvtransfer.maps.controls.wrong_contexts)
        ev["controls"] = [c for c in ev["controls"] if c not in ("target_wrong", "transfer_wrong")]
    ev["fidelity"] = dict(ev.get("fidelity") or {}, sequences=2, continuation=8)
    ev["ppl"] = dict(ev["ppl"], windows=int(dry["ppl_windows"]), continuation=max(4, ev["ppl"]["continuation"] // 16),
                     prefixes=sorted({int(p) // 16 for p in ev["ppl"]["prefixes"]}))
    ev["coqa"] = dict(ev["coqa"], conversations=int(dry["coqa_conversations"]), turns=int(dry["coqa_turns"]),
                      max_gen_toks=min(ev["coqa"]["max_gen_toks"], int(dry["max_gen_toks"])))
    small["bench"] = dict(small["bench"], tokens=list(dry["bench_tokens"]), warmup=1, repeats=2,
                          layers=1 if small["bench"].get("shapes_only") else small["bench"].get("layers"))
    if (small.get("wandb") or {}).get("enabled"):
        small["wandb"] = dict(small["wandb"], mode="offline")
    return small


def standin_check(small: dict, snapshots: dict, stages: list[str]) -> dict:
    """The plan evaluated at the stand-in shapes on this machine (CPU rates measured here) against what the stand-in
    run used: its process's peak RSS (the whole run: every stage, the runtime included) and the bytes each artifact
    family holds on disk (moments = calibrate's rolling checkpoint, mappers = fit). Recorded, not enforced: the
    plan's host model at tiny shapes is dominated by its runtime allowance."""
    import resource

    from transformers import AutoConfig

    from .. import plan as resource_plan

    shapes = []
    for side in ("source", "target"):
        spec = small["pair"][side]
        where = spec.get("path") or snapshots.get(spec.get("id"))
        shapes.append(resource_plan.shape_from_config(AutoConfig.from_pretrained(str(where)), side)
                      if where else resource_plan.load_shape(spec))
    node = resource_plan.Node("this machine (stand-in shapes)", 0, 0.0, resource_plan.node._host_gib(), 1e6)
    plan = resource_plan.make_plan(small, node, shapes=tuple(shapes), local=True, stages=stages, knobs=False)
    cache = Path(small.get("cache_dir", "artifacts"))

    def du(name: str) -> int:
        root = cache / name
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0

    gib = resource_plan.GiB
    measured = {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib, 3),
                "moments_disk_gib": round(du("moments") / gib, 4), "mappers_disk_gib": round(du("mappers") / gib, 4)}
    st = plan["stages"]
    predicted = {name: {k: st[name][k] for k in ("host_gib", "disk_gib")} for name in stages}
    cal = st["calibrate"]["parts"]["disk"] if "calibrate" in st else {}
    predicted["calibration_disk_gib"] = round(sum(v for k, v in cal.items() if k.startswith("checkpoint")), 4)
    predicted["peak_host_gib"] = max(st[n]["host_gib"] for n in stages)
    return {"predicted": predicted, "measured": measured}


def dry_run(cfg: dict, out_dir: str | Path, *, log=print) -> dict:
    """Run `cfg` as a dry run into `out_dir` (see module doc); returns the run's summary."""
    from ..runner.preflight import preflight
    from ..runner.pipeline import check_feature_sample, execute, parse_stages

    started = time.perf_counter()
    out_dir = Path(out_dir)
    if (out_dir / "summary.json").exists():
        raise FileExistsError(f"{out_dir} already holds a run; choose another out_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = parse_stages(cfg.get("stage", "all"))
    log(f"[dry run] {cfg['pair']['name']}: stages {stages} on stand-in models with the real data sources at tiny "
        f"sizes, on {(cfg.get('dry') or {}).get('device') or 'cpu'}")
    check_feature_sample(cfg)
    cfg, plan = plan_real_run(cfg, out_dir, stages, log=log)
    checks = preflight(cfg, stages, log=log)
    check_placement(cfg)
    small = shrink(cfg, out_dir)
    dry = cfg["dry"]
    ids = [cfg["pair"][s]["id"] for s in ("source", "target") if not cfg["pair"][s].get("path")]
    cache = Path(dry.get("model_cache") or Path(cfg.get("cache_dir", "artifacts")) / "standins").resolve()
    sizes = {k: int(dry[k]) for k in ("hidden_size", "intermediate_size", "head_dim")}
    snapshots = write_standins(ids, cache, **sizes)
    log(f"[dry run] {STANDIN_NOTE}: {', '.join(ids) or 'none (local model paths are used as they are)'} in {cache}")
    with standin_models(cache):
        summary = execute(small, out_dir, plan=plan)
    check = standin_check(small, snapshots, stages)
    log(f"[dry run] plan at the stand-in shapes vs the stand-in run: predicted {json.dumps(check['predicted'])}; "
        f"measured {json.dumps(check['measured'])}")
    record = {"pair": cfg["pair"]["name"], "stages": stages, "standins": {i: str(p) for i, p in snapshots.items()},
              "standin_sizes": sizes, "note": STANDIN_NOTE, "preflight": checks, "cannot_show": list(CANNOT_SHOW),
              "calibration_sequences": small["calib"]["n_sequences"], "seconds": round(time.perf_counter() - started, 1),
              "standin_check": check}
    atomic_write_json(out_dir / "dry_run.json", record)
    log(f"[dry run] every stage ran in {record['seconds']:.0f} s. What a dry run cannot show:")
    for line in CANNOT_SHOW:
        log(f"  - {line}")
    return summary
