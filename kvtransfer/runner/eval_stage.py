"""The eval stage of a run: benchmarks, prefix-conditioned PPL and multi-turn drift per mode, with the
protocols of kvtransfer.eval.

Results are cached per (mode, task | ppl | coqa) file, so an interrupted evaluation resumes where it
stopped and a rerun with the same config costs nothing. Modes that never read a mapped cache (target,
source, native_injected, no_context) live under cache_dir/eval/baseline/<key>/ with the keys of the
artifacts `eval_tasks`, `eval_ppl`, `eval_coqa` (kvtransfer.runner.artifacts: models, data and the eval
keys each part reads), so a k or lambda sweep, a native_sink change or an ablation computes them once;
`transfer` results are keyed by the mapper too (`eval_<part>_mapped`, cache_dir/eval/<key>/).

Content controls (`eval.controls`, run wherever `transfer` runs; kvtransfer.maps.controls): `target_wrong` is a
baseline (the target on each item's wrong context, cached once), `transfer_wrong`, `mean_map` and `random_map`
are mapped modes. Tasks and perplexity only: CoQA's conversations carry their own history, so a wrong story
there is a different protocol, not this control.
"""
from __future__ import annotations

import copy
import json
import math
import tempfile
import time
import warnings
from pathlib import Path

from ..eval.adapter import KVTransferLM, new_timing
from ..eval.items import attach_events, item_records
from ..eval.repair import (REPAIR_PREFIX, TRUNCATE_TOKENS_PREFIX, coqa_twins, is_truncate_mode, parse_repair_mode,
                           parse_truncate_mode, repair_modes, truncation_curve, truncation_twins)
from ..eval.coqa import coqa_summary, per_turn_transfer, transfer_once
from ..eval.perplexity import draw_windows, prefix_conditioned_ppl, prefix_pairs
from ..core.signals import DEFAULT_SCORE, check_score, check_signals
from ..maps.controls import CONTROLS, calibration_means, control_applies, mean_map, random_map, with_controls
from ..eval.metrics import CONTROL_MODES, control_statistics, paired_difference
from ..eval.retention import CHANCE, per_item_scores, retention_table
from ..eval.sources import coqa_docs, ppl_pages, ppl_set_names
from ..eval.tasks import PAPER_TASKS, task_manager
from ..eval.tiny_suite import TINY_TASKS, write_tiny_yamls
from ..config.hub import data_access
from ..core import io
from ..core.io import atomic_write_json
from ..core.map_dtype import DEFAULT_MAP_DTYPE
from ..core.models import kv_shape
from . import gate_stage
from .eval_rows import gate_summary, ppl_rows as _ppl_rows, timing_columns as _timing_columns


def _task_setup(ecfg: dict, work_dir: Path):
    """(TaskManager, {task: (lm-eval name, metric, chance)}) for the configured tasks."""
    from lm_eval.tasks import TaskManager

    tasks = list(ecfg["tasks"])
    if not tasks:
        raise ValueError("eval.tasks is empty: name at least one task (e.g. eval.tasks=[arc_challenge])")
    spec = {}
    tiny = [t for t in tasks if t in TINY_TASKS]
    paper = [t for t in tasks if t not in TINY_TASKS]
    for t in paper:
        if t not in PAPER_TASKS:
            raise KeyError(f"unknown task {t!r}: use {sorted(PAPER_TASKS) + sorted(TINY_TASKS)}")
        name, metric, chance, _ = PAPER_TASKS[t]
        spec[t] = (name, metric, chance)
    for t in tiny:
        metric, chance = TINY_TASKS[t]
        spec[t] = (t, metric, chance)
    data_dir = ecfg.get("data_dir")
    if paper:
        # each override YAML includes its built-in task by absolute path; only the hub `mmlu` group (57 built-in
        # subject tasks) needs lm-eval's index of every built-in YAML, which costs ~20 s per task and mode
        builtins = data_dir is None and "mmlu" in paper
        manager = task_manager(data_dir, include_defaults=builtins, out_dir=work_dir / "tasks", tasks=paper)
        if tiny:
            write_tiny_yamls(work_dir / "tasks", data_dir, max_gen_toks=ecfg.get("max_gen_toks", 16))
            manager = TaskManager(include_path=str(work_dir / "tasks"), include_defaults=builtins)
    else:
        if data_dir is None:
            raise ValueError("the tiny suite reads local files: set eval.data_dir=data/tiny")
        write_tiny_yamls(work_dir / "tasks", data_dir, max_gen_toks=ecfg.get("max_gen_toks", 16))
        manager = TaskManager(include_path=str(work_dir / "tasks"), include_defaults=False)
    return manager, spec


def _benchmarks(lm: KVTransferLM, mode: str, ecfg: dict, seed: int, items: dict | None = None,
                timing: dict | None = None) -> dict:
    """{task: per-item scores} for one mode through lm-eval's simple_evaluate; `items` (a dict) also gets
    {task: per-item records} of multiple-choice tasks (kvtransfer.eval.items), `timing` (a dict) {task: the mode's
    context timing (KVTransferLM.timing)}."""
    from lm_eval import simple_evaluate

    model = lm.with_mode(mode)
    with tempfile.TemporaryDirectory(prefix="kvtransfer_eval_") as tmp, data_access():
        manager, spec = _task_setup(ecfg, Path(tmp))
        results = simple_evaluate(model=model, tasks=[name for name, _, _ in spec.values()],
                                  task_manager=manager, limit=ecfg.get("limit"), num_fewshot=ecfg.get("num_fewshot"),
                                  log_samples=True, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed, gen_kwargs=_gen_kwargs(ecfg))
    if timing is not None and model.time_contexts:
        timing.update({task: dict(model.timing) for task in spec})
    if items is not None:
        items.update({task: item_records(results, name, metric, lm.with_mode(mode))
                      for task, (name, metric, _) in spec.items() if metric in ("acc", "acc_norm")})
    return {task: per_item_scores(results, name, metric) for task, (name, metric, _) in spec.items()}


def _gen_kwargs(ecfg: dict) -> dict | None:
    """lm-eval gen_kwargs of the run: eval.max_gen_toks caps every generative task (lm-eval merges it into each
    task's generation_kwargs, as `--gen_kwargs max_gen_toks=N` does; multiple-choice tasks ignore it)."""
    n = ecfg.get("max_gen_toks")
    return None if n is None else {"max_gen_toks": int(n)}


def _ppl(lm: KVTransferLM, mode: str, ecfg: dict, seed: int, ppl_set: str = "wikitext2") -> dict:
    """{P: perplexity, "window_nll": {P: [mean NLL of each window]}, "window_doc": [page index of each window]}
    for one mode on set `ppl_set`'s windows, drawn once at max(P) by eval.ppl.draw (results cached before the
    per-window NLLs were kept have only the perplexities)."""
    pcfg = ecfg["ppl"]
    pages = ppl_pages(ecfg, ppl_set)  # data_dir's file, the bundled file, or the hub dataset (kvtransfer.eval.sources)
    windows, docs = draw_windows(lm.tokenizer, pages, max_prefix=max(pcfg["prefixes"]), cont_len=pcfg["continuation"],
                                 n_windows=pcfg["windows"], seed=seed, draw=pcfg.get("draw", "per_document"),
                                 return_docs=True)
    other = lm.with_mode(mode)
    prefixes = list(pcfg["prefixes"])
    repair = getattr(other, "repair", False)
    # one P at a time (the same computation as all at once: each P scores on its own), so each window's repair
    # record (kvtransfer.eval.adapter events) and the mode's context timing are known per P
    result, events, timing = {}, {}, {}
    for p in prefixes:
        del other.events[:]
        other.timing = new_timing()
        result.update(prefix_conditioned_ppl(other, windows, [p], max_prefix=max(prefixes)))
        if other.time_contexts:
            timing[str(p)] = dict(other.timing)
        if repair:
            by_key = {e["key"]: {k: v for k, v in e.items() if k != "key"} for e in other.events}
            pairs = prefix_pairs(windows, p, max(prefixes), other.prefix_token_id, other._start_ids)
            events[str(p)] = [by_key.get(hash(tuple(other.split(list(c), list(k))[0]))) for c, k in pairs]
    out = {**{str(p): r["ppl"] for p, r in result.items()},
           "window_nll": {str(p): r["window_nll"] for p, r in result.items()}, "window_doc": docs}
    if repair:
        out["events"] = events  # {P: [record per window, None where nothing was cached (P = 0)]}
    if timing:
        out["timing"] = timing  # {P: KVTransferLM.timing of this mode at P}
    return out


# modes whose cache is the scoring model's own prefill: CoQA's two protocols are the same computation there
# (a full re-prefill each turn vs the cache extended turn by turn, over identical token streams)
OWN_CACHE_MODES = ("target", "native_injected")


def _coqa(lm: KVTransferLM, mode: str, ecfg: dict) -> dict:
    """{protocol: per-conversation turn records} for one mode. In an own-cache mode the protocols coincide,
    so only the cheaper one (`once`: no re-prefill per turn) runs and its records serve every protocol."""
    ccfg = ecfg["coqa"]
    docs = coqa_docs(ecfg)  # data_dir's file, or the hub dataset (eval.coqa.dataset) when data_dir is null
    out = {}
    other = lm.with_mode(mode)
    protocols = list(ccfg["protocols"])
    if mode in OWN_CACHE_MODES and "once" in protocols:
        protocols.remove("once")
        protocols.insert(0, "once")
    for protocol in protocols:
        if mode in OWN_CACHE_MODES and out:
            out[protocol] = copy.deepcopy(next(iter(out.values())))
            continue
        run = {"every_turn": per_turn_transfer, "once": transfer_once}[protocol]
        if lm.progress:   # the longest eval part on a CPU: say what runs before its bar starts
            print(f"[kvtransfer] CoQA drift, {mode}, {protocol}: {len(docs)} conversations x up to {ccfg['turns']} "
                  "turns", flush=True)
        out[protocol] = run(other, docs, max_turns=ccfg["turns"], max_gen_toks=ccfg["max_gen_toks"])
    return {protocol: out[protocol] for protocol in ccfg["protocols"]}


BASELINE_MODES = ("target", "source", "native_injected", "no_context", "target_wrong")
assert tuple(CONTROLS) == CONTROL_MODES  # one vocabulary: the modes kvtransfer.maps.controls builds, metrics reads


def is_baseline(mode: str) -> bool:
    """Whether `mode` never reads a mapped cache (cached once per models and data: cache_dir/eval/baseline)."""
    return mode in BASELINE_MODES or is_truncate_mode(mode)


def run_modes(ecfg: dict) -> list[str]:
    """eval.modes, then each of eval.controls not already there when `transfer` runs (the controls read it), the
    repair modes, their truncation twins and (perplexity only) the truncation curve (kvtransfer.eval.repair)."""
    modes = with_controls(ecfg["modes"], ecfg.get("controls"))
    repair = repair_modes(ecfg)
    extra = repair + truncation_twins(ecfg) + truncation_curve(ecfg, repair=bool(repair)) + coqa_twins(ecfg)
    return modes + [m for m in dict.fromkeys(extra) if m not in modes]


def coqa_only(ecfg: dict) -> set[str]:
    """CoQA's truncation twins that no other part asked for: computed on CoQA alone (no perplexity, no tasks)."""
    repair = repair_modes(ecfg)
    asked = set(ecfg["modes"]) | set(truncation_twins(ecfg)) | set(truncation_curve(ecfg, repair=bool(repair)))
    return set(coqa_twins(ecfg)) - asked


def curve_mode(mode: str) -> bool:
    """A truncation-curve point: computed on the perplexity sets only."""
    return mode.startswith(TRUNCATE_TOKENS_PREFIX)


def control_lm(lm: KVTransferLM, mode: str, run, seed: int) -> tuple[KVTransferLM, str]:
    """(LM, adapter mode) that computes eval mode `mode`: itself for a plain mode, else the control's setup."""
    if mode.startswith(REPAIR_PREFIX):
        fraction, select = parse_repair_mode(mode)
        return lm.with_mode("transfer", recompute_fraction=fraction, recompute_select=select, recompute_seed=seed,
                            gate=None, repair=True, events=[]), "transfer"
    if is_truncate_mode(mode):
        return lm.with_mode("truncate", **parse_truncate_mode(mode), events=[]), "truncate"
    if mode == "gated":
        gcfg, artifact = run.cfg["eval"]["gate"], gate_stage.gate(run)
        # the gate decides by the artifact's score (kvtransfer.core.signals; an artifact without one: tail_kv)
        return lm.with_mode("transfer", gate=artifact["thresholds"], gate_tail=int(gcfg["tail"]),
                            gate_score=check_score(artifact.get("score", DEFAULT_SCORE)),
                            gate_signals=check_signals(gcfg.get("signals")),
                            recompute_fraction=0.0, recompute_select=gcfg.get("select", "deviation"),
                            recompute_seed=seed, repair=True, events=[]), "transfer"
    if mode not in CONTROLS:
        return lm, mode
    base, change = CONTROLS[mode]
    if change == "wrong_context":
        return lm.with_mode(base, wrong_context=True, wrong_context_seed=seed), base
    moments, _, _ = run.moments()
    mean_x, mean_y = calibration_means(moments, lm.mapper)
    dev = lm.mapper.device
    control = mean_map(lm.mapper, mean_y.to(dev)) if change == "mean_map" else \
        random_map(lm.mapper, mean_x.to(dev), mean_y.to(dev), seed=seed)
    return lm.with_mode(base, mapper=control.to(dev)), base
PARTS = ("tasks", "ppl", "coqa")


# the artifact (kvtransfer.runner.artifacts) each kind of result directory of a part holds
_ARTIFACT_OF_KIND = {"baseline": "eval_{part}", "native": "eval_{part}_native", "mapped": "eval_{part}_mapped"}


def result_dirs(run, part: str = "tasks") -> dict[str, Path]:
    """{"baseline": dir, "native": dir, "mapped": dir}: where per-mode results of `part` ("tasks", "ppl" or "coqa")
    live ("native": native_injected's, keyed by eval.native_tail too).

    Each is the artifact `eval_<part>` / `eval_<part>_mapped` of kvtransfer.runner.artifacts, keyed by the
    eval keys that part reads: switching CoQA or perplexity on or off, or adding a task or a mode, reuses
    every cached result (each (mode, task) is its own file), while a key that changes a number changes
    the key of exactly the parts that read it."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    where = {"baseline": ("eval", "baseline"), "native": ("eval", "native"), "mapped": ("eval",)}
    return {kind: run.cache_dir.joinpath(*where[kind], run.key(_ARTIFACT_OF_KIND[kind].format(part=part)))
            for kind in where}


def eval_lm(run, modes: list[str]) -> tuple[KVTransferLM, list[str]]:
    """(the adapter every mode of `run`'s eval derives from, `modes` less those that do not apply): the models and
    map as the eval stage loads them (the source only when a mode reads it), eval.batch_size, the map's dtype."""
    ecfg = run.cfg["eval"]
    modes = list(modes)
    # the source is loaded only when a mode reads it (target-only runs: the baselines and truncation, one model)
    target, tokenizer = run.model("target")
    source = run.model("source")[0] if any(not is_baseline(m) or m == "source" for m in modes) else None
    if "identity" in modes and kv_shape(source) != kv_shape(target):
        warnings.warn("eval mode 'identity' skipped: source and target caches differ in shape", stacklevel=2)
        modes.remove("identity")
    mapper = run.mapper() if any(not is_baseline(m) for m in modes) else None
    for mode in [m for m in modes if m in CONTROLS and mapper is not None and not control_applies(mapper, m)]:
        warnings.warn(f"eval control {mode!r} skipped: it is not defined for a {mapper.kind!r} map "
                      "(kvtransfer.maps.controls.control_applies)", stacklevel=2)
        modes.remove(mode)
    lm = KVTransferLM(source_model=source, target_model=target, tokenizer=tokenizer, mapper=mapper,
                      mode="transfer" if mapper is not None else "target", batch_size=ecfg["batch_size"],
                      native_sink=run.native_sink(mapper) if mapper is not None else 0,
                      native_tail=ecfg.get("native_tail", 1), rope_at_inference=run.rope_at_inference,
                      context_start=run.context_start, share_prefix=ecfg.get("share_prefix", False),
                      allow_context_start_mismatch=ecfg.get("allow_context_start_mismatch", False),
                      progress=run.progress is not None, time_contexts=ecfg.get("time_contexts", True),
                      map_dtype=ecfg.get("map_dtype", DEFAULT_MAP_DTYPE))
    return lm, modes


def evaluate(run, on_compute=None) -> dict:
    """{"tasks": {task: row}, "ppl": [rows], "drift": [rows]} for a pipeline `Run` (see module doc).

    Each (mode, task), (mode, ppl) and (mode, coqa) result is its own cached file, so adding a task
    computes only that task. on_compute(mode): called once per mode that computes anything.
    """
    ecfg = run.cfg["eval"]
    seed = run.cfg.get("seed", 0)
    dirs = {part: result_dirs(run, part) for part in PARTS}
    lm, modes = eval_lm(run, run_modes(ecfg))
    per_mode = {}
    ppl_sets = ppl_set_names(ecfg) if ecfg["ppl"].get("enabled") else []
    twins_coqa, only_coqa = set(coqa_twins(ecfg)), coqa_only(ecfg)
    for mode in modes:
        kind = "native" if mode == "native_injected" else "baseline" if is_baseline(mode) else "mapped"
        limits = ecfg.get("limits") or {}
        moded: list = []  # the control's LM, built on first use (mean/random maps read the calibration moments)
        side: dict = {}  # per-item records of the task just computed (kvtransfer.eval.items)
        timed: dict = {}  # the context timing of the task just computed (KVTransferLM.timing)

        def mode_lm(mode=mode, moded=moded):
            if not moded:
                moded.extend(control_lm(lm, mode, run, seed))
            return moded
        parts = {f"task.{t}": (lambda t=t: _benchmarks(*mode_lm(), dict(ecfg, tasks=[t], limit=limits.get(t, ecfg.get("limit"))),
                                                       seed, side, timed)[t])
                 for t in ([] if curve_mode(mode) else ecfg["tasks"])}
        for name in ([] if mode in only_coqa else ppl_sets):
            parts[f"ppl.{name}"] = lambda name=name: _ppl(*mode_lm(), ecfg, seed, name)
        if ecfg["coqa"].get("enabled") and (mode in ("target", "transfer") or mode in twins_coqa):
            parts["coqa"] = lambda: _coqa(*mode_lm(), ecfg)
        result: dict = {"tasks": {}}
        announced = False
        for name, compute in parts.items():
            part = "tasks" if name.startswith("task.") else name.split(".")[0]
            directory, artifact = dirs[part][kind], _ARTIFACT_OF_KIND[kind].format(part=part)
            directory.mkdir(parents=True, exist_ok=True)
            # the gated mode's numbers follow its thresholds: its files carry the gate artifact's key
            label = gated_label(run) if mode == "gated" else mode
            path = directory / f"{label}.{name}.json"
            if not path.exists():
                if on_compute is not None and not announced:
                    on_compute(mode)
                announced = True
                started = time.perf_counter()
                if moded:
                    del moded[0].events[:]
                value = compute()
                record = {"value": value, "seconds": round(time.perf_counter() - started, 2)}
                if moded and moded[0].events and not name.startswith("ppl."):
                    record["gate"] = gate_summary(moded[0].events)
                if name.startswith("task.") and name[5:] in timed:  # what reading the contexts cost (seconds, FLOPs)
                    record["timing"] = timed.pop(name[5:])
                if name[5:] in side:  # per item: doc id, correctness, gold margin, and the gate's event
                    record["items"] = [{k: v for k, v in r.items() if k != "prefixes"} for r in
                                       attach_events(side.pop(name[5:]), moded[0].events if moded else [])]
                if name.startswith("ppl.") and isinstance(value, dict) and value.get("events"):
                    record["gate"] = {p: gate_summary([e for e in ev if e]) for p, ev in value["events"].items()
                                      if any(ev)}
                record["produced_by"] = run.stamp(artifact)
                atomic_write_json(path, record)
            record = json.loads(path.read_text())
            run.note(artifact, path, record.get("produced_by"))
            if record.get("gate"):
                result.setdefault("gate", {})[name] = record["gate"]
            if record.get("timing"):
                result.setdefault("timing", {})[name] = record["timing"]
            elif name.startswith("ppl.") and isinstance(record["value"], dict) and record["value"].get("timing"):
                result.setdefault("timing", {})[name] = record["value"]["timing"]
            if name.startswith("task."):
                result["tasks"][name[5:]] = record["value"]
                if record.get("items"):
                    result.setdefault("items", {})[name[5:]] = record["items"]
            elif name.startswith("ppl."):
                set_name = name[4:]
                value = record["value"]
                result.setdefault("ppl_sets", {})[set_name] = {
                    "ppl": {p: v for p, v in value.items() if p not in ("window_nll", "window_doc", "events", "timing")},
                    **({"timing": value["timing"]} if value.get("timing") else {}),
                    "windows": value.get("window_nll"), "docs": value.get("window_doc"),
                    **({"events": value["events"]} if value.get("events") else {})}
                if set_name == ppl_sets[0]:  # the first set is the run's `ppl` (the rows every table reads)
                    result["ppl"] = result["ppl_sets"][set_name]["ppl"]
                    if value.get("window_nll"):
                        result["ppl_windows"] = value["window_nll"]
            else:
                result[name] = record["value"]
            result.setdefault("seconds", {})[name] = record.get("seconds")
        per_mode[mode] = result
    out = summarise(per_mode, ecfg, seed)
    write_scores(run.out_dir / SCORES_FILE, per_mode)
    out["scores_file"] = SCORES_FILE
    out["native_tail"] = lm.native_tail
    out["eval_seconds"] = {mode: r.get("seconds", {}) for mode, r in per_mode.items()}
    out["eval_timing"] = {mode: r["timing"] for mode, r in per_mode.items() if r.get("timing")}
    return out


SCORES_FILE = "scores.json"


def gated_label(run) -> str:
    """The gated mode's file label: the gate artifact's key (its numbers follow the thresholds) and, when
    eval.gate.signals records per-request signals beside the decision, a digest of that list (the records differ;
    no number does), so a file cached without them is not read as one with them."""
    from .keys import artifact_key

    signals = check_signals((run.cfg["eval"].get("gate") or {}).get("signals"))
    return f"gated-{run.key('gate')[:16]}" + (f"-signals-{artifact_key(signals)[:8]}" if signals else "")


def write_scores(path: Path, per_mode: dict) -> None:
    """The per-item / per-window scores behind a summary, next to it (small JSON), so paired SEs and
    paired differences between runs can be recomputed from committed files: {"tasks": {task: {mode:
    [score per item, in (subtask, doc_id) order]}}, "task_items": {task: {mode: [kvtransfer.eval.items record per
    item: task, doc_id, score, margin, gate]}} (multiple choice), "ppl_window_nll": {P: {mode: [mean NLL per window,
    nats/token]}} (the first perplexity set), "ppl_sets": {set: {"window_doc": [page index per window],
    "window_nll": {P: {mode: [...]}}, "events": {repair mode: {P: [gate / recompute record per window]}}}},
    "coqa": {protocol: {mode: [[F1 per turn] per conversation]}}}."""
    scores: dict = {"tasks": {}, "task_items": {}, "ppl_window_nll": {}, "coqa": {}, "ppl_sets": {}}
    for mode, result in per_mode.items():
        for task, items in (result.get("tasks") or {}).items():
            scores["tasks"].setdefault(task, {})[mode] = items
        for task, items in (result.get("items") or {}).items():
            scores["task_items"].setdefault(task, {})[mode] = items
        for prefix, nll in (result.get("ppl_windows") or {}).items():
            scores["ppl_window_nll"].setdefault(prefix, {})[mode] = nll
        for set_name, part in (result.get("ppl_sets") or {}).items():
            entry = scores["ppl_sets"].setdefault(set_name, {"window_doc": part.get("docs"), "window_nll": {}})
            for prefix, nll in (part.get("windows") or {}).items():
                entry["window_nll"].setdefault(prefix, {})[mode] = nll
            if part.get("events"):  # what the gate / a fixed recompute did per window (score, action, cost)
                entry.setdefault("events", {})[mode] = {p: [None if e is None else {k: e[k] for k in (
                    "action", "fraction", "score", "recomputed", "tokens", "cost", "signals", "signal_costs") if k in e}
                    for e in ev]
                    for p, ev in part["events"].items()}
        for protocol, convs in (result.get("coqa") or {}).items():
            scores["coqa"].setdefault(protocol, {})[mode] = [[turn["f1"] for turn in conv] for conv in convs]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # one eval per out_dir (execute refuses a used one): a second writer is a bug
        raise FileExistsError(f"{path} exists; per-item scores are never overwritten (use a new out_dir)")
    io.atomic_write_json(path, scores)  # an output of this run, not a cached result (those use atomic_write_json)


def _finite(row: dict) -> dict:
    """NaN/inf (e.g. a ratio with a zero denominator) -> None, so summaries stay strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def summarise(per_mode: dict, ecfg: dict, seed: int = 0) -> dict:
    """Turn per-mode raw results into summary rows (retention table, PPL vs P, drift per turn)."""
    out: dict = {}
    tasks = sorted({t for r in per_mode.values() for t in r.get("tasks", {})})
    if tasks and "target" in per_mode and "transfer" in per_mode:
        per_item = {t: {m: per_mode[m]["tasks"][t] for m in per_mode if t in per_mode[m].get("tasks", {})}
                    for t in tasks}
        chance = {t: TINY_TASKS[t][1] if t in TINY_TASKS else CHANCE.get(t, 0.0) for t in tasks}
        metrics = {t: TINY_TASKS[t][0] if t in TINY_TASKS else PAPER_TASKS[t][1] for t in tasks}
        table = retention_table(per_item, metrics=metrics, chance=chance, n_boot=ecfg.get("bootstrap", 1000),
                                seed=seed)
        out["tasks"] = {t: _finite(dict(row, transfer_stderr=row.get("stderr_transfer"))) for t, row in table.items()
                        if t != "average"}
        out["tasks_average"] = _finite(table["average"])
        for t, row in out["tasks"].items():  # content controls (kvtransfer.eval.metrics.control_statistics)
            row.update({m: float(sum(v) / len(v)) for m, v in per_item[t].items() if m in CONTROL_MODES and v})
            if any(m in per_item[t] for m in CONTROL_MODES) and row.get("n", 0) >= 2:  # an SE needs two items
                row.update(_finite(control_statistics(per_item[t], n_boot=ecfg.get("bootstrap", 1000), seed=seed)))
    sets = list(dict.fromkeys(n for r in per_mode.values() for n in (r.get("ppl_sets") or {})))
    if sets:
        out["ppl_sets"] = {name: _ppl_rows(per_mode, name, ecfg, seed) for name in sets}
        out["ppl"] = out["ppl_sets"][sets[0]]
    elif any("ppl" in r for r in per_mode.values()):  # per-mode results without sets (callers building them by hand)
        out["ppl"] = _ppl_rows({m: {"ppl_sets": {"": {"ppl": r["ppl"], "windows": r.get("ppl_windows")}}}
                                for m, r in per_mode.items() if "ppl" in r}, "", ecfg, seed)
    gate = {m: r["gate"] for m, r in per_mode.items() if r.get("gate")}
    if gate:
        out["gate"] = gate
    for t, row in (out.get("tasks") or {}).items():  # repair modes beside transfer (kvtransfer.core.recompute / gate)
        row.update(_timing_columns({m: r.get("timing", {}).get(f"task.{t}") for m, r in per_mode.items()}))
        for m in [m for m in per_item[t] if m == "gated" or m.startswith(REPAIR_PREFIX) or is_truncate_mode(m)]:
            items = per_item[t][m]
            row[m] = float(sum(items) / len(items)) if items else None
            if "no_context" in per_item[t] and len(items) >= 2 and len(items) == len(per_item[t]["no_context"]):
                d = paired_difference(items, per_item[t]["no_context"])
                row[f"{m}_minus_no_context"], row[f"{m}_minus_no_context_se"] = d["difference"], d["se"]
            if gate.get(m, {}).get(f"task.{t}"):
                row[f"{m}_gate"] = gate[m][f"task.{t}"]
    out["warnings"] = floor_warnings(out)
    if "coqa" in per_mode.get("target", {}) and "coqa" in per_mode.get("transfer", {}):
        twins = [m for m in coqa_twins(ecfg) if "coqa" in per_mode.get(m, {})]
        rows = coqa_summary({m: per_mode[m]["coqa"] for m in ("target", "transfer", *twins)}, twins,
                            max_turn=ecfg["coqa"]["turns"])
        for key, part in rows.items():  # strict JSON: a non-finite number is None there
            out[key] = part if key == "drift" else [_finite(r) for r in part]
    return out


def floor_warnings(summary: dict) -> list[str]:
    """Loud lines for every place a transfer is worse than giving the target no context at all."""
    lines = []
    for task, row in summary.get("tasks", {}).items():
        if row.get("below_no_context"):
            lines.append(f"TRANSFER BELOW NO-CONTEXT FLOOR on {task}: transfer {row['transfer']:.3f} < no_context "
                         f"{row['no_context']:.3f} (the mapped cache destroys the context)")
    for row in summary.get("ppl", []):
        floor = row.get("no_context")
        if row["prefix"] > 0 and floor is not None and row.get("transfer") is not None and row["transfer"] > floor:
            lines.append(f"TRANSFER BELOW NO-CONTEXT FLOOR on perplexity at P={row['prefix']}: transfer "
                         f"{row['transfer']:.2f} > no_context {floor:.2f} (the mapped prefix hurts)")
    for line in lines:
        warnings.warn(line, stacklevel=2)
    return lines
