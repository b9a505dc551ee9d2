"""Usage of the eval and bench stages: token counts of the configured tasks (approximate dataset sizes and
prompt lengths) and the largest batch's device working set."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from ..maps.controls import CONTROLS, with_controls
from .node import GiB
from .setup import Setup
from .shapes import forward_bytes, prefill_flops, weight_bytes
from .usage import Usage, place

# lm-eval tasks: items (full split), requests per item, distinct contexts per item, mean context and
# continuation tokens, generated tokens (generation tasks), longest context. APPROXIMATE (public split
# sizes; prompt lengths estimated for Llama/Qwen tokenizers); the "tiny" rows are data/tiny's sizes.
EVAL_TASKS = {
    "arc_challenge": dict(items=1172, choices=4, contexts=1, ctx=45, cont=6, gen=0, longest=256),
    "hellaswag": dict(items=10042, choices=4, contexts=1, ctx=75, cont=30, gen=0, longest=256),
    "winogrande": dict(items=1267, choices=2, contexts=2, ctx=25, cont=10, gen=0, longest=128),
    "mmlu": dict(items=14042, choices=4, contexts=1, ctx=620, cont=1, gen=0, longest=2048),
    "gsm8k_cot": dict(items=1319, choices=1, contexts=1, ctx=900, cont=0, gen=-1, longest=1536),
    "gsm8k": dict(items=1319, choices=1, contexts=1, ctx=800, cont=0, gen=-1, longest=1536),
    "tiny_cloze": dict(items=300, choices=4, contexts=1, ctx=60, cont=20, gen=0, longest=256),
    "tiny_completion": dict(items=200, choices=1, contexts=1, ctx=100, cont=0, gen=-1, longest=256),
}
_UNKNOWN_TASK = dict(items=1000, choices=4, contexts=1, ctx=200, cont=10, gen=0, longest=1024)
COQA_CONTEXT = 350  # tokens of story + history per turn (approximate)
MODES = ["target", "source", "transfer", "native_injected", "no_context"]


MMLU_HUB_SUBJECTS = 57  # lm-eval's mmlu group: 57 subject tasks, ~246 test items each (14,042 in all)


def mmlu_subject_sizes(data_dir) -> list[int]:
    """Test items per MMLU subject the eval runs: per subject of the local file when `data_dir` holds mmlu.jsonl
    (eval.tasks._write_mmlu reads the same file and keeps its known subjects: never more than counted here),
    else the hub's 57 subjects at their mean size (approximate)."""
    path = Path(data_dir) / "mmlu.jsonl" if data_dir else None
    if path is not None and path.is_file():
        return list(Counter(json.loads(line)["subject"] for line in path.open() if line.strip()).values())
    n = EVAL_TASKS["mmlu"]["items"]
    return [n // MMLU_HUB_SUBJECTS] * MMLU_HUB_SUBJECTS


def _jobs(e: dict) -> list[dict]:
    """The configured tasks (limits applied as lm-eval applies them: to each subject task of the MMLU group) and
    perplexity windows, as EVAL_TASKS-like rows."""
    limits, limit = e.get("limits") or {}, e.get("limit")
    jobs = []
    for task in e.get("tasks", []):
        t = dict(EVAL_TASKS.get(task, _UNKNOWN_TASK))
        lim = limits.get(task, limit)
        if task == "mmlu":
            t["items"] = sum(n if lim is None else min(n, int(lim)) for n in mmlu_subject_sizes(e.get("data_dir")))
        elif lim is not None:
            t["items"] = min(t["items"], int(lim))
        if t["gen"] < 0:
            t["gen"] = int(e.get("max_gen_toks", 256))
        jobs.append(t)
    ppl = e.get("ppl") or {}
    if ppl.get("enabled"):
        for _ in ppl.get("sets") or ["wikitext2"]:  # each set: its own windows (at most eval.ppl.windows)
            for prefix in ppl.get("prefixes", []):
                jobs.append(dict(items=int(ppl.get("windows", 32)), choices=1, contexts=1, ctx=max(1, int(prefix)),
                                 cont=int(ppl.get("continuation", 256)), gen=0))
    return jobs


def shares_prefix(e: dict) -> bool:
    """eval.share_prefix: each distinct context prefilled once per mode (its choices scored on that cache)."""
    return str(e.get("share_prefix")).lower() in ("true", "1", "yes")


def _count_mode(out: dict, mode: str, t: dict, b: int, shared: bool = False) -> None:
    """Add one (mode, task) to the token / pass counts `out`; `shared`: eval.share_prefix (target and source
    modes prefill each distinct context once, then score last context token + continuation per request)."""
    req, ctx_once = t["items"] * t["choices"], t["items"] * t["contexts"] * t["ctx"]
    calls, ctx_calls = math.ceil(req / b), math.ceil(t["items"] * t["contexts"] / b)
    short = req * (1 + t["cont"])
    if mode in ("target", "source") and shared and not t["gen"]:
        out[mode] += ctx_once + short
        out[f"passes_{mode}"] += ctx_calls + calls
    elif mode in ("target", "source"):
        out[mode] += req * (t["ctx"] + t["cont"])
        out[f"passes_{mode}"] += calls
    elif mode in ("transfer", "identity"):
        out["source"] += ctx_once
        out["map"] += ctx_once if mode == "transfer" else 0
        out["target"] += short
        out["passes_source"] += ctx_calls
        out["passes_target"] += calls
    elif mode == "native_injected":
        out["target"] += ctx_once + short
        out["passes_target"] += ctx_calls + calls
    elif mode == "no_context":
        out["target"] += req * (2 + t["cont"])
        out["passes_target"] += calls
    if t["gen"]:
        side = "source" if mode == "source" else "target"
        out[f"decode_batches_{side}"] += math.ceil(t["items"] / b) * t["gen"]
        out[f"passes_{side}"] += math.ceil(t["items"] / b) * t["gen"]


def repair_costs(e: dict) -> list[tuple[float, bool, float, int]]:
    """Per repair mode of eval.recompute_fraction x eval.recompute_select and eval.gate (kvtransfer.eval.repair.repair_modes):
    (expected fraction of each context the target recomputes, whether the deviation rule's one layer of
    prefill over the context is read, expected fraction of contexts that read it, gate tail tokens per context).
    The gated mode is planned at the rates its thresholds were chosen for on calibration text: full_rate of the
    contexts re-prefilled, recompute_rate recomputing `fraction` of theirs."""
    out = []
    selects = list(e.get("recompute_select") or ["deviation"])
    for select in selects:
        for r in e.get("recompute_fraction") or []:
            r = float(r)
            out.append((r, select == "deviation" and 0 < r < 1, 1.0, 0))
    g = e.get("gate") or {}
    if g.get("enabled"):
        full, part, frac = float(g.get("full_rate", 0.1)), float(g.get("recompute_rate", 0.2)), float(g.get("fraction", 0.15))
        out.append((full + part * frac, g.get("select", "deviation") == "deviation", part, int(g.get("tail", 8))))
    return out


def signal_work(e: dict) -> tuple[bool, int]:
    """What the gated mode's recorded signals (eval.gate.signals, kvtransfer.core.signals) add per context: (one layer
    of target prefill over the context: first_layer, the no-context forward's tokens: start + tail for tail_kl /
    tail_nll_gain, ~tail + 1). tail_kv is the gate's own tail forward, counted already."""
    g = e.get("gate") or {}
    if not g.get("enabled"):
        return False, 0
    names = set(g.get("signals") or []) | {g.get("score") or "tail_kv"}
    return "first_layer" in names, (int(g.get("tail", 8)) + 1) if names & {"tail_kl", "tail_nll_gain"} else 0


def _count_repair(out: dict, e: dict, t: dict, b: int, shared: bool, target_layers: int) -> None:
    """Add the repair modes of one task: each costs a transfer plus the target's recomputed context tokens (each
    reads the mapped rest, counted as a token of prefill), the deviation rule's one layer of prefill (1/L of a
    context's tokens) and the gate's tail; the gated mode adds its recorded signals' work (`signal_work`)."""
    contexts = t["items"] * t["contexts"]
    for fraction, one_layer, layer_share, tail in repair_costs(e):
        _count_mode(out, "transfer", t, b, shared)
        out["target"] += contexts * (fraction * t["ctx"] + tail) + (layer_share * contexts * t["ctx"] / target_layers
                                                                     if one_layer else 0.0)
        out["passes_target"] += math.ceil(contexts / b) * (1 + (tail > 0))
        if tail > 0:  # the gated mode
            first_layer, nocontext = signal_work(e)
            out["target"] += contexts * (t["ctx"] / target_layers * first_layer + nocontext)
            out["passes_target"] += math.ceil(contexts / b) * (int(first_layer) + (nocontext > 0))


def _count_coqa(out: dict, coqa: dict, modes: list) -> None:
    conv, turns = int(coqa.get("conversations", 100)), int(coqa.get("turns", 10))
    n_all = conv * turns * len(coqa.get("protocols", ["every_turn", "once"]))
    gen = int(coqa.get("max_gen_toks", 32))
    for mode in [m for m in modes if m in ("target", "transfer")]:
        if mode == "transfer":
            out["source"] += n_all * COQA_CONTEXT
            out["map"] += n_all * COQA_CONTEXT
            out["passes_source"] += n_all
        n = n_all if mode == "transfer" else conv * turns   # target: one protocol serves both (eval_stage._coqa)
        if mode == "target":
            out["target"] += n * COQA_CONTEXT
        out["decode_single_target"] += n * gen
        out["passes_target"] += n * (1 + gen)
    for m in coqa.get("truncate") or []:   # the equal-cost twins: the target reads the last m tokens, both protocols
        out["target"] += n_all * min(int(m), COQA_CONTEXT)
        out["decode_single_target"] += n_all * gen
        out["passes_target"] += n_all * (1 + gen)


def eval_tokens(s: Setup) -> dict:
    """Token counts per model and decode steps over the configured modes and tasks (see EVAL_TASKS)."""
    e = s.cfg.get("eval") or {}
    # content controls count as the mode they run in (kvtransfer.maps.controls.CONTROLS): a wrong context costs what
    # the right one does, a control map what the map does
    modes = [CONTROLS[m][0] if m in CONTROLS else m for m in with_controls(e.get("modes", MODES), e.get("controls"))]
    b = max(1, int(e.get("batch_size", 8)))
    out = {"source": 0.0, "target": 0.0, "map": 0.0, "decode_batches_source": 0.0, "decode_batches_target": 0.0,
           "decode_single_target": 0.0, "passes_source": 0.0, "passes_target": 0.0}   # passes: forward calls
    jobs, shared = _jobs(e), shares_prefix(e)
    for mode in modes:
        for t in jobs:
            _count_mode(out, mode, t, b, shared)
    for t in jobs:   # selective recompute and the gate (eval.recompute_fraction, eval.gate)
        _count_repair(out, e, t, b, shared, s.tgt.layers)
    if (e.get("coqa") or {}).get("enabled"):
        _count_coqa(out, e["coqa"], modes)
    fid = e.get("fidelity") or {}
    if fid.get("enabled", True):
        n = int(fid.get("sequences", 4)) * s.seq
        out["source"] += n
        out["target"] += 2 * n
        out["map"] += n
    return out


def _longest(s: Setup) -> tuple[int, int]:
    """(longest context + continuation, longest scored continuation) in tokens over the tasks and perplexity."""
    e = s.cfg.get("eval") or {}
    rows = [EVAL_TASKS.get(t, _UNKNOWN_TASK) for t in e.get("tasks", [])]
    longest = max([t["longest"] for t in rows] or [256])
    cont = max([t["cont"] for t in rows] or [1])
    ppl = e.get("ppl") or {}
    if ppl.get("enabled"):
        cont = max(cont, int(ppl.get("continuation", 256)))
        if ppl.get("prefixes"):
            longest = max(longest, max(ppl["prefixes"]) + int(ppl.get("continuation", 256)))
    return longest, cont


def map_buffers(s: Setup, rows: int) -> float:
    """map_layers per chunk (float32 mapper): used source layers [2, rows, used*W] (+ stripped keys
    when not in place), gather buffer [2, rows, p]; W = the feature width per source layer (n_kv_s * d_s,
    or H (+ n_kv_s * d_s) for a hidden-state map, whose K/V part is gathered once more before the copy)."""
    used = s.used_layers
    return 2 * rows * used * s.fw * 4 + rows * used * s.src.width * 4 * (3 if s.src_features == "hidden_kv" else 1) \
        + 2 * rows * s.p * 4


def _eval_device(s: Setup, e: dict) -> dict:
    b, (n, cont) = max(1, int(e.get("batch_size", 8))), _longest(s)
    math_attn = s.math_attention()
    # logits (model dtype + the float32 log-softmax): for every position of a one-pass forward; with
    # share_prefix the context is prefilled by the decoder body alone (no LM head, cache.prefill) and only
    # the last context token + continuation reach the head
    logit_rows = min(n, cont + 1) if shares_prefix(e) else n
    target_pass = forward_bytes(s.tgt, b, n, s.w, math_attention=math_attn)
    # (+ a hidden-state map's normed layer inputs of the used source layers, captured in the source prefill)
    transfer_pass = (forward_bytes(s.src, b, n, s.w, math_attention=math_attn) + b * n * s.hidden_per_token * s.w
                     + s.tgt.layers * 2 * b * n * s.tgt.width * s.w + map_buffers(s, min(b * n, 8192)))
    return {"source + target weights": s.weights("src", "tgt"), "mapper (float32)": s.mapper_w32,
            f"largest batch ({b} x {n} tokens: caches, activations)": max(target_pass, transfer_pass),
            f"logits ({b} x {logit_rows} rows x vocab, + float32 log-softmax)": b * logit_rows * s.tgt.vocab * (s.w + 4)}


def evaluate(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """The eval stage (runner.eval_stage): benchmarks, perplexity, CoQA, fidelity, per mode."""
    u, r = Usage(), s.rates
    e = s.cfg.get("eval") or {}
    loads = [s.load_host(x) for x in ("src", "tgt") if x not in loaded]
    host = {"held from earlier stages": held_host,
            "model loading / mapper load (transient)": (max(loads + [s.mapper_w32]) if s.device == "cuda"
                                                        else s.mapper_w32),
            "lm-eval datasets and requests": GiB if not e.get("data_dir") else GiB / 4}
    place(s, u, _eval_device(s, e), host, ("src", "tgt"))
    u.set_disk({"earlier artifacts": disk_before, "HF datasets cache": 2 * GiB if not e.get("data_dir") else 0})
    tok = eval_tokens(s)
    rate = s.flops_rate(s.mdtype)
    step_t, step_s = weight_bytes(s.tgt, s.w) / r.bw, weight_bytes(s.src, s.w) / r.bw
    u.set_seconds({
        "load weights": s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded]),
        "source forward": prefill_flops(s.src, tok["source"], 512, lm_head=True) / rate,
        "target forward": prefill_flops(s.tgt, tok["target"], 512, lm_head=True) / rate,
        "mapping (float32 GEMMs)": 2 * 2 * s.p * s.q * s.tgt.layers * tok["map"] / s.flops_rate("float32"),
        "generation (memory-bound decode)": (tok["decode_batches_target"] + tok["decode_single_target"]) * step_t
        + tok["decode_batches_source"] * step_s,
        "offloaded weights streamed (one copy per forward call)":
            s.stream_seconds("src", tok["passes_source"]) + s.stream_seconds("tgt", tok["passes_target"])})
    u.notes.append("eval time from approximate task sizes and prompt lengths (EVAL_TASKS)")
    return u


def bench(s: Setup, held_host: float, loaded: frozenset, disk_before: float) -> Usage:
    """The bench stage (runner.bench_stage): mapper vs re-prefill at each of bench.tokens."""
    u, r = Usage(), s.rates
    bc = s.cfg.get("bench") or {}
    tokens = [int(t) for t in bc.get("tokens", [])] or [64]
    n_max = max(tokens)
    n_inputs, reps = 3, int(bc.get("warmup", 3)) + int(bc.get("repeats", 10))
    mapped = s.tgt.layers * 2 * n_max * s.tgt.width * s.w
    work = (n_inputs * (s.src.layers * 2 * s.src.width + s.hidden_per_token) * n_max * s.w + mapped
            + max(forward_bytes(s.tgt, 1, n_max, s.w, math_attention=s.math_attention()),
                  map_buffers(s, min(n_max, 8192))))
    shapes_only = bool(bc.get("shapes_only"))
    dev = {"source + target weights": s.weights("src", "tgt") if not shapes_only else 0.0,
           "mapper": s.mapper_w32, f"caches + prefill at {n_max} tokens": work}
    if shapes_only:
        dev["shapes-only models (bench dtype)"] = s.weights("src", "tgt")
    place(s, u, dev, {"held from earlier stages": held_host}, () if shapes_only else ("src", "tgt"))
    u.set_disk({"earlier artifacts": disk_before})
    rate, secs = s.flops_rate(s.mdtype), 0.0
    for t in tokens:
        mp = 2 * 2 * s.p * s.q * s.tgt.layers * t / s.flops_rate("float32")
        mp = max(mp, (s.mapper_w32 + mapped * t / n_max * 2) / r.bw)
        secs += reps * (prefill_flops(s.tgt, t, t) / rate + mp) + n_inputs * prefill_flops(s.src, t, t) / rate
    u.set_seconds({"timed runs": secs,
                   "offloaded weights streamed": s.stream_seconds("tgt", reps * len(tokens))
                   + s.stream_seconds("src", n_inputs * len(tokens)),
                   "load weights": s.load_seconds(*[x for x in ("src", "tgt") if x not in loaded])})
    return u
