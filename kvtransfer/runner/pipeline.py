"""The stages of a run -- calibrate -> fit -> eval -> bench -> report -- with cached artifacts.

Takes a plain dict config (run.py resolves the Hydra config into one), so this module has no Hydra
import. Before anything loads, `plan_run` plans the run on this machine (kvtransfer.plan), applies the
knobs the plan recommends when a requested stage would not fit (plan.auto), and refuses a stage that does
not fit even so or runs past plan.max_hours. Every stage artifact lives under `cache_dir` in a directory
named by the hash of exactly its declared inputs (`artifacts.ARTIFACTS`: config keys, upstream
artifacts, model and data identities), so changing lambda or
k reuses the moments, changing tasks reuses the mapper, and an interrupted calibration resumes from
its checkpoint. A stage asked for pulls the artifacts it needs, computing the missing ones.
"""
from __future__ import annotations

from pathlib import Path

from .. import plan as resource_plan
from ..config.provenance import environment, summarize_producers
from ..config.runconfig import STAGES, needs_feature_sample, parse_stages  # noqa: F401 (STAGES: re-exported)
from ..core.io import atomic_write_json
from ..eval.metrics import SCHEMA_VERSION
from . import gate_stage
from .fidelity import fidelity
from .fit_stage import mean_r2
from .report_stage import variance_vs_k
from .preflight import preflight
from ..core.map_dtype import resolve_config
from .run import Run, check_cache_version, resolved_device  # noqa: F401 (re-exported: the run object and the cache-version check)

def plan_run(cfg: dict, out_dir: str | Path, stages: list[str] | None = None, *, log=print) -> tuple[dict, dict]:
    """What `execute` does first: plan this run on this machine (kvtransfer.plan), print the table, write
    out_dir/plan.json + plan.md, and return (the config to run, the plan).

    plan.enforce=true (default): with plan.auto=true (default) the knob set the plan recommends for `stages`
    (default cfg.stage) is applied to the returned config and printed; every knob of the list is number-neutral
    (placement, capture order, offload, checkpoint cadence, a skipped report figure), so one command gives the
    same numbers on every node it runs on (a knob with `changes` set would still be refused here); a stage that
    does not fit even so, or whose estimate exceeds plan.max_hours, raises PlanError before anything loads,
    naming the smallest node preset that runs it. plan.auto=false: the
    config is run as typed and any stage that does not fit raises PlanError naming the knobs (the behaviour
    before plan.auto). plan.enforce=false: the config is run as typed whatever the plan says (a warning).
    Errors in planning propagate: a planner that cannot plan fails the run, it never turns enforcement off."""
    import warnings

    stages = parse_stages(cfg.get("stage", "all")) if stages is None else stages
    settings = cfg.get("plan") or {}
    enforce = bool(settings.get("enforce", True))
    node = resource_plan.detect_node(cfg)
    plan = resource_plan.make_plan(cfg, node, local=True, stages=stages,
                                   auto=bool(settings.get("auto", True)) and enforce)
    resource_plan.write_plan(plan, out_dir)
    log(resource_plan.format_plan(plan, details=False).rstrip())
    msg = resource_plan.refusal_message(plan, stages)
    if msg and enforce:
        raise resource_plan.PlanError(msg)
    if msg:
        warnings.warn(msg + "\n(plan.enforce=false: running as typed)", stacklevel=2)
    changing = [e for e in plan["applied"] if e.get("changes")]
    if changing and enforce:  # one command, one number, on every node (issue 32)
        sets = " ".join(e["set"] for e in plan["applied"])
        raise resource_plan.PlanError(
            f"resource plan: on {plan['node']['name']} the run fits only with {sets}, and "
            f"{', '.join(e['set'] for e in changing)} changes the numbers ({'; '.join(e['changes'] for e in changing)}): "
            "applied here only, the same command would give other numbers on a node where it fits as typed. Set them "
            f"yourself (append `{sets}` to the command; every node then runs them), or use a larger node")
    if plan["applied"]:
        log(f"resource plan: applying {plan['overrides']} (plan.auto=false to refuse instead)")
    return resource_plan.applied_config(cfg, plan), plan


def check_feature_sample(cfg: dict) -> None:
    """Refuse, before anything loads or calibrates, a mapper that needs the feature sample when none is kept."""
    if needs_feature_sample(cfg["mapper"]) and not cfg["calib"].get("mlp_samples"):
        what = "mapper=mlp" if cfg["mapper"].get("kind") == "mlp" else "mapper.weighting=attention_mass"
        raise ValueError(f"{what} fits on calibration feature rows, but calib.mlp_samples=0 keeps none: set "
                         "calib.mlp_samples (e.g. 65536; host memory and disk: see the resource plan)")


def execute(cfg: dict, out_dir: str | Path, *, plan: dict | None = None) -> dict:
    """Run the configured stages; write summary.json (+ tables/figures in the report stage).

    Returns the summary dict. Refuses an out_dir that already holds a summary (never overwrites).
    Before anything loads: the resource plan (`plan_run`; a given `plan` -- the dry run's plan of the real
    run, already written -- replaces it) and the preflight of every data source (kvtransfer.runner.preflight).
    """
    out_dir = Path(out_dir)
    if (out_dir / "summary.json").exists():
        raise FileExistsError(f"{out_dir} already holds a run; choose another out_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = parse_stages(cfg.get("stage", "all"))
    cfg = resolve_config(cfg, resolved_device(cfg))   # eval.map_dtype=auto: the dtype that runs, in every key
    check_feature_sample(cfg)
    if plan is None:  # prints + writes plan.json, applies the plan's knobs (plan.auto); PlanError before any load
        cfg, plan = plan_run(cfg, out_dir, stages)
    atomic_write_json(out_dir / "config.json", cfg)  # the resolved config that made this run, knobs applied
    preflight(cfg, stages)  # every data source resolves, or PreflightError in seconds naming the fix
    run = Run(cfg, out_dir)
    summary: dict = {"pair": cfg["pair"]["name"], "direction": cfg["pair"].get("direction", "forward"),
                     "source": run.model_ref("source"), "target": run.model_ref("target"), "stages": stages,
                     "ablation": cfg.get("ablation", {}), "resources": resource_plan.resources_summary(plan),
                     "environment": environment(cfg), "schema_version": SCHEMA_VERSION}
    r2_figure: dict = {}
    # moments are read only where a stage needs them and released after it (issue 10 §2): eval and bench never
    # hold them, and the rotated-key calibration of the report does not sit next to the stripped moments
    if "calibrate" in stages or "report" in stages:
        summary["calibration"] = run.calibration_info()
        if "report" in stages:
            r2_figure = {f"{run.key_space} keys": run.r2()["train"]}
            run.release_moments()
            if cfg.get("report", {}).get("rotated_heatmap"):
                other = "rotated" if run.key_space == "stripped" else "stripped"
                r2_figure[f"{other} keys"] = run.r2(other)["train"]
                run.release_moments()
    if "fit" in stages or "report" in stages or ("eval" in stages and _eval_reads_map(cfg)):
        mapper = run.mapper()
        run.release_moments()
        summary["mapper"] = {"kind": mapper.kind, "k": mapper.k, "lambda": mapper.lam,
                             "selection": cfg["mapper"].get("selection", "topk"),
                             "selected_layers": mapper.selected_layers.tolist(), "key_space": mapper.key_space,
                             "n_parameters": mapper.n_parameters, "apply_flops_per_token": mapper.apply_flops_per_token,
                             "native_sink": mapper.native_sink, **mapper.extra_manifest(), "path": str(run.mapper_dir()),
                             "fit_seconds": mapper.calibration.get("fit_seconds")}
        summary["calibration"] = {k: v for k, v in mapper.calibration.items() if k != "fit_seconds"}
        summary["r2"] = mean_r2(mapper.r2)
    else:
        summary["mapper"] = {"kind": cfg["mapper"]["kind"], "k": run.k, "lambda": run.lam}
    if "eval" in stages:
        from .eval_stage import evaluate

        if (cfg["eval"].get("fidelity") or {}).get("enabled", True):
            summary["fidelity"] = fidelity(run)
        summary.update(evaluate(run))
        if (cfg["eval"].get("gate") or {}).get("enabled"):  # the thresholds the gated rows were decided with
            gate = gate_stage.gate(run)
            summary["gate_artifact"] = {"score": gate.get("score", "tail_kv"), "thresholds": gate["thresholds"],
                                        "tail": gate["tail"],
                                        "calibration_sequences": len(gate["sequences"]),
                                        "on_train_sequences": gate["on_train_sequences"]}
    if "bench" in stages:
        from .bench_stage import benchmark

        summary["speed"] = benchmark(run)
    if "report" in stages:
        summary["variance_explained"] = variance_vs_k(run)
        run.release_moments()
        from ..report.outputs import write_outputs

        summary["outputs"] = write_outputs(cfg, summary, out_dir, r2_figure)
    summary["producers"] = summarize_producers(run.producers)  # what made each cached artifact this run read
    atomic_write_json(out_dir / "summary.json", summary)
    return summary


def _eval_reads_map(cfg) -> bool:
    """Whether the eval stage reads the map: a mode that is not a baseline (kvtransfer.runner.eval_stage.is_baseline)
    or the fidelity check. A target-only evaluation (the baselines, truncation) needs no calibration."""
    from .eval_stage import is_baseline, run_modes

    ecfg = cfg["eval"]
    return bool((ecfg.get("fidelity") or {}).get("enabled", True)) or any(not is_baseline(m) for m in run_modes(ecfg))
