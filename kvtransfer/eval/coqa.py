"""CoQA multi-turn drift (lm-eval's built-in `coqa` task does not import under transformers 5).

Prompt format is lm-eval's coqa: story + "\\n\\n", then per turn "Q: {q}\\n\\nA:" and the answer
" {a}\\n\\n"; turn t's context holds the gold Q/A pairs of turns < t. Text is tokenized segment by
segment (first segment with special tokens), so both protocols see identical token streams:
  (a) `per_turn_transfer`: every turn the whole history is prefilled by the cache builder of the
      LM's mode (transfer: the source prefills, the mapper maps) and the target answers.
  (b) `transfer_once`: the cache is built once after the story; the scoring model then extends its
      own cache with each question, answers, and appends the gold answer (native continuation).
The equal-cost twin (LM mode `truncate`, kvtransfer.eval.truncate) reads, in (a), only the start ids and the
last m tokens of each turn's prompt and, in (b), only the story's last m tokens before the native turns.
Answers are greedy, stopped at "\\nQ:" / max_gen_toks, post-processed like lm-eval (strip, first
line). F1 is the official CoQA score (normalize; token-overlap F1; with several gold answers, the
average over leave-one-out maxima).
"""
from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

import torch

from ..core.cache import cache_to_layers, forward_on_cache
from .decode import greedy_decode
from .stats import clustered_mean, clustered_ratio, mean_se

UNTIL = ["\nQ:"]


def load_conversations(path: str | Path) -> list[dict]:
    """CoQA records (EleutherAI/coqa layout) from JSONL; raises if missing or empty."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: point to coqa.jsonl (data/benchmarks)")
    docs = [json.loads(line) for line in path.open() if line.strip()]
    if not docs:
        raise ValueError(f"{path} holds no conversations")
    return docs


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and articles (a/an/the), collapse whitespace (SQuAD/CoQA rule)."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(pred: str, gold: str) -> float:
    """Token-overlap F1 of normalized answers; 1.0 if both are empty, 0.0 if exactly one is."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def coqa_f1(pred: str, golds: list[str]) -> float:
    """Official CoQA turn F1: max over golds; with n > 1 golds, mean over the n leave-one-out maxima."""
    if len(golds) == 1:
        return f1_score(pred, golds[0])
    return sum(max(f1_score(pred, g) for g in golds[:i] + golds[i + 1:]) for i in range(len(golds))) / len(golds)


def turn_golds(doc: dict, t: int) -> list[str]:
    """Gold answers of turn t (0-based): the main answer plus the additional annotators' answers."""
    golds = [doc["answers"]["input_text"][t]]
    for extra in (doc.get("additional_answers") or {}).values():
        if extra and t < len(extra["input_text"]):
            golds.append(extra["input_text"][t])
    return golds


def turn_segments(doc: dict, t: int) -> list[str]:
    """Text segments of turn t's context: story, gold Q/A of turns < t, and "Q: {q_t}\\n\\nA:"."""
    qs, ans = doc["questions"]["input_text"], doc["answers"]["input_text"]
    segs = [doc["story"] + "\n\n"]
    for i in range(t):
        segs += [f"Q: {qs[i]}\n\nA:", f" {ans[i]}\n\n"]
    return segs + [f"Q: {qs[t]}\n\nA:"]


def turn_context(doc: dict, t: int) -> str:
    """Turn t's prompt string (equals lm-eval coqa's doc_to_text for that turn)."""
    return "".join(turn_segments(doc, t))


def encode_segments(lm, segments: list[str]) -> list[int]:
    """Token ids of the segments, tokenized one by one (only the first gets special tokens)."""
    ids = lm.tok_encode(segments[0])
    for seg in segments[1:]:
        ids += lm.tok_encode(seg, add_special_tokens=False)
    return ids


def _answer(lm, tokens: list[int]) -> str:
    text = lm.tok_decode(tokens)
    for stop in UNTIL:
        text = text.split(stop)[0]
    return text.strip().split("\n")[0]


def _n_turns(doc: dict, max_turns: int | None) -> int:
    n = len(doc["questions"]["input_text"])
    return n if max_turns is None else min(n, max_turns)


def per_turn_transfer(lm, docs: list[dict], *, max_turns: int | None = 10, max_gen_toks: int = 24) -> list[list[dict]]:
    """Protocol (a): per conversation, per turn {turn, pred, golds, f1}; the cache is rebuilt every turn."""
    jobs = [(c, t) for c, doc in enumerate(docs) for t in range(_n_turns(doc, max_turns))]
    contexts = [encode_segments(lm, turn_segments(docs[c], t)) for c, t in jobs]
    gens = lm.generate_tokens(contexts, until=UNTIL, max_gen_toks=max_gen_toks)
    out = [[] for _ in docs]
    for (c, t), toks in zip(jobs, gens):
        pred, golds = _answer(lm, toks), turn_golds(docs[c], t)
        out[c].append({"turn": t + 1, "pred": pred, "golds": golds, "f1": coqa_f1(pred, golds)})
    return out


@torch.no_grad()
def transfer_once(lm, docs: list[dict], *, max_turns: int | None = 10, max_gen_toks: int = 24) -> list[list[dict]]:
    """Protocol (b): cache built once after the story (per the LM's mode), then native turns."""
    model = lm.scoring_model
    eos_ids = lm._eos_ids()
    out = []
    bar = lm._bar(sum(_n_turns(d, max_turns) for d in docs), f"CoQA turns, story cached once ({lm.mode})", False) \
        if hasattr(lm, "_bar") else None
    for doc in docs:
        story = lm.tok_encode(doc["story"] + "\n\n")
        if lm.mode == "truncate":  # the equal-cost twin: the target reads only the story's last tokens
            story = lm.truncated_context(story)
        prefix, pending = lm.cut(story)  # pending: tokens not yet in the cache
        layers, pmask = lm.prefix_cache([prefix])
        turns = []
        for t in range(_n_turns(doc, max_turns)):
            q = lm.tok_encode(f"Q: {doc['questions']['input_text'][t]}\n\nA:", add_special_tokens=False)
            layers, pmask = _extend(model, layers, pmask, pending + q[:-1])
            last = torch.tensor([q[-1:]], device=model.device)
            toks = greedy_decode(model, layers, pmask, last, torch.ones_like(last), max_gen_toks=max_gen_toks,
                                 eos_ids=eos_ids, is_done=lambda g: any(s in lm.tok_decode(g) for s in UNTIL))[0]
            pred, golds = _answer(lm, toks), turn_golds(doc, t)
            turns.append({"turn": t + 1, "pred": pred, "golds": golds, "f1": coqa_f1(pred, golds)})
            if bar is not None:
                bar.update(1)
            pending = q[-1:] + lm.tok_encode(f" {doc['answers']['input_text'][t]}\n\n", add_special_tokens=False)
        out.append(turns)
    if bar is not None:
        bar.close()
    return out


def _extend(model, layers, pmask, ids: list[int]):
    """Append `ids` to a batch-1 cache with the model's own forward; returns (layers, mask)."""
    x = torch.tensor([ids], device=model.device)
    _, cache = forward_on_cache(model, layers, pmask, x, return_cache=True)
    mask = torch.ones_like(x) if pmask is None else torch.cat([pmask, torch.ones_like(x)], dim=-1)
    return cache_to_layers(cache), mask


def drift_curve(reference: list[list[dict]], mapped: list[list[dict]], max_turn: int = 10) -> list[dict]:
    """Per turn 1..max_turn: mean F1 of both runs over conversations that reach it (with its SE over
    those conversations, kvtransfer.eval.stats.mean_se: one turn per conversation, so independent), and the gap."""
    rows = []
    for turn in range(1, max_turn + 1):
        ref = [c[turn - 1]["f1"] for c in reference if len(c) >= turn]
        got = [c[turn - 1]["f1"] for c in mapped if len(c) >= turn]
        if not ref:
            break
        (r, r_se), (m, m_se) = mean_se(ref), mean_se(got)
        rows.append({"turn": turn, "n": len(ref), "target_f1": r, "transfer_f1": m, "gap": r - m,
                     "target_f1_se": r_se, "transfer_f1_se": m_se})
    return rows


def drift_summary(reference: list[list[dict]], mapped: list[list[dict]]) -> dict:
    """Mean F1 over every turn of every conversation for both runs, retention (mapped / reference), the gap, and
    SEs clustered by conversation (turns of one conversation are not independent; kvtransfer.eval.stats).

    reference / mapped: per conversation, per turn {"f1", ...} (the protocols' output), same conversations.
    Every SE is the clustered SE from conversation totals with the small-sample factor C / (C - 1); `se_df` = C - 1
    is the Student-t degrees of freedom of an interval (at C = 5, a 95 % interval is +- 2.78 SE, not 1.96).
    """
    if len(reference) != len(mapped) or not reference:
        raise ValueError("drift_summary needs the same (non-empty) list of conversations for both runs")
    ref = [[t["f1"] for t in c] for c in reference]
    got = [[t["f1"] for t in c] for c in mapped]
    if [len(c) for c in ref] != [len(c) for c in got]:
        raise ValueError("drift_summary: the runs answered different numbers of turns per conversation")
    ids = [c for c, turns in enumerate(ref) for _ in turns]
    r_all, g_all = [f for c in ref for f in c], [f for c in got for f in c]
    t, m = clustered_mean(r_all, ids), clustered_mean(g_all, ids)
    ret = clustered_ratio(g_all, r_all, ids)
    gap = clustered_mean([a - b for a, b in zip(r_all, g_all)], ids)
    return {"conversations": len(ref), "turns": len(ids), "target_f1": t["value"], "transfer_f1": m["value"],
            "retention": ret["value"], "target_f1_se": t["se"], "transfer_f1_se": m["se"], "retention_se": ret["se"],
            "gap_se": gap["se"], "se_df": t["df"]}


def coqa_summary(convs: dict, twins: list[str], *, max_turn: int = 10) -> dict:
    """The summary's CoQA rows from {mode: {protocol: per-conversation turn records}} holding target, transfer and
    each truncation twin (mode truncate_tokens_<m>):
      drift: per protocol and turn, each series' mean F1 and SE (target, transfer, the twins);
      drift_summary: per protocol, drift_summary(target, transfer);
      coqa_twins: per twin and protocol, the twin's mean F1 over every turn beside the map's, and transfer - twin with
        its paired SE clustered by conversation (`se_df`: the t interval's degrees of freedom)."""
    drift, summary, twin_rows = [], [], []
    for protocol, mapped in convs["transfer"].items():
        for r in drift_curve(convs["target"][protocol], mapped, max_turn=max_turn):
            drift.append({"protocol": protocol, "turn": r["turn"], "series": f"target ({protocol})",
                          "f1": r["target_f1"], "f1_se": r["target_f1_se"], "n": r["n"]})
            drift.append({"protocol": protocol, "turn": r["turn"], "series": f"transfer ({protocol})",
                          "f1": r["transfer_f1"], "f1_se": r["transfer_f1_se"], "n": r["n"], "gap": r["gap"]})
        summary.append({"protocol": protocol, **drift_summary(convs["target"][protocol], mapped)})
        for twin in twins:
            own = convs[twin][protocol]
            for r in drift_curve(own, own, max_turn=max_turn):
                drift.append({"protocol": protocol, "turn": r["turn"], "series": f"{twin} ({protocol})",
                              "f1": r["target_f1"], "f1_se": r["target_f1_se"], "n": r["n"]})
            d = drift_summary(own, mapped)
            twin_rows.append({"protocol": protocol, "mode": twin, "tokens": int(twin.rpartition("_")[2]),
                              "conversations": d["conversations"], "turns": d["turns"], "twin_f1": d["target_f1"],
                              "twin_f1_se": d["target_f1_se"], "transfer_f1": d["transfer_f1"],
                              "transfer_f1_se": d["transfer_f1_se"],
                              "transfer_minus_twin": d["transfer_f1"] - d["target_f1"],
                              "transfer_minus_twin_se": d["gap_se"], "se_df": d["se_df"]})
    return {"drift": drift, "drift_summary": summary, **({"coqa_twins": twin_rows} if twins else {})}


def coqa_summary_from_scores(scores: dict, *, max_turn: int | None = None) -> dict:
    """coqa_summary recomputed from a run's scores.json `coqa` part ({protocol: {mode: [[F1 per turn] per
    conversation]}}, kvtransfer.runner.eval_stage): the twins are its modes other than target and transfer, in order."""
    modes = list(dict.fromkeys(m for part in scores.values() for m in part))
    for need in ("target", "transfer"):
        if need not in modes:
            raise KeyError(f"the CoQA scores hold no {need!r} turns: modes {modes}")
    convs = {m: {p: [[{"f1": f} for f in conv] for conv in part[m]] for p, part in scores.items() if m in part}
             for m in modes}
    longest = max(len(conv) for part in scores.values() for per in part.values() for conv in per)
    return coqa_summary(convs, [m for m in modes if m not in ("target", "transfer")],
                        max_turn=longest if max_turn is None else max_turn)
