"""Per-item pairing of the gate's score with each mode's outcome (kvtransfer.eval.items): records join on
(task, doc_id), never on position, and the margin follows lm-eval's acc / acc_norm."""
from __future__ import annotations

import math
import random

import pytest

from kvtransfer.eval.items import attach_events, below, item_records, pair_items, sample_margin, task_signal


def _rec(task, doc, score, margin, gate=None):
    return {"task": task, "doc_id": doc, "score": score, "margin": margin, "gate": gate}


def test_pairing_is_by_doc_id_not_by_position():
    floor = [_rec("a", i, float(i % 2), float(i)) for i in range(8)]
    mode = [_rec("a", i, 1.0, float(i) - (1 if i in (2, 5) else -1)) for i in range(8)]
    shuffled = mode[:]
    random.Random(3).shuffle(shuffled)
    assert [r["doc_id"] for r in shuffled] != list(range(8))
    order, paired = pair_items({"transfer": shuffled, "no_context": floor})
    assert order == [("a", i) for i in range(8)]
    flags = below(paired["transfer"], paired["no_context"])
    assert [i for i, f in enumerate(flags["margin"]) if f] == [2, 5]
    # positional pairing of the shuffled list would flag other items: the test above can fail
    assert [i for i, f in enumerate(below(shuffled, floor)["margin"]) if f] != [2, 5]
    assert flags["flip"] == [False] * 8


def test_pairing_refuses_different_or_repeated_items():
    a = [_rec("a", i, 1.0, 1.0) for i in range(4)]
    with pytest.raises(ValueError, match="different items"):
        pair_items({"x": a, "y": a[:3]})
    with pytest.raises(ValueError, match="different items"):
        pair_items({"x": a, "y": a[:3] + [_rec("b", 3, 1.0, 1.0)]})
    with pytest.raises(ValueError, match="repeats"):
        pair_items({"x": a + a[:1], "y": a})


def _sample(doc, lls, conts, gold, acc, acc_norm):
    return {"doc_id": doc, "filtered_resps": [(x, False) for x in lls], "arguments": [("ctx", c) for c in conts],
            "target": gold, "acc": acc, "acc_norm": acc_norm}


def test_margin_follows_the_metric_and_records_keep_doc_order():
    # raw log-likelihoods favour the short wrong choice; per character (delimiter not counted) the long gold one
    s = _sample(1, [-3.0, -2.0], [" abcdef", " ab"], 0, 0.0, 1.0)
    assert sample_margin(s, "acc") == -1.0
    assert sample_margin(s, "acc_norm") == -3.0 / 6 - (-2.0 / 2)
    assert (sample_margin(s, "acc") > 0) == bool(s["acc"]) and (sample_margin(s, "acc_norm") > 0) == bool(s["acc_norm"])
    assert math.isnan(sample_margin(_sample(2, [-1.0], [" a"], 0, 1.0, 1.0), "acc"))
    results = {"samples": {"t": [_sample(5, [-1.0, -2.0], [" a", " b"], 1, 0.0, 0.0), s]}}
    recs = item_records(results, "t", "acc")
    assert [r["doc_id"] for r in recs] == [1, 5] and [r["score"] for r in recs] == [0.0, 0.0]


def test_events_attach_by_prefix_key():
    items = [{"task": "t", "doc_id": 0, "prefixes": [11]}, {"task": "t", "doc_id": 1, "prefixes": [22, 33]},
             {"task": "t", "doc_id": 2, "prefixes": [44]}]
    ev = [{"key": 22, "action": "map", "fraction": 0.0, "score": 0.1},
          {"key": 33, "action": "full", "fraction": 1.0, "score": 0.9},
          {"key": 11, "action": "recompute", "fraction": 0.15, "score": 0.5}]
    out = attach_events(items, ev)
    assert [o["gate"] and o["gate"]["action"] for o in out] == ["recompute", "full", None]


def test_task_signal_pairs_the_score_with_the_same_items_outcomes():
    n = 12
    # the score ranks items exactly by how far transfer falls below the floor: AUC 1 when paired by doc id
    floor = [_rec("t", i, 1.0, 0.0) for i in range(n)]
    transfer = [_rec("t", i, 1.0 if i < 6 else 0.0, 1.0 if i < 6 else -1.0) for i in range(n)]
    gated = [_rec("t", i, 1.0, 0.0, {"action": "map", "fraction": 0.0, "score": float(i)}) for i in range(n)]
    target = [_rec("t", i, 1.0, 2.0) for i in range(n)]
    by_mode = {"gated": gated, "transfer": transfer, "no_context": floor, "target": target}
    got = task_signal(by_mode, n_boot=20)
    assert got["no_context_margin"]["auc"] == 1 and got["no_context_flip"]["auc"] == 1
    assert got["no_context_margin"]["positives"] == 6 and got["target_margin"]["positives"] == n
    shuffled = dict(by_mode, gated=random.Random(1).sample(gated, n))
    assert task_signal(shuffled, n_boot=20)["no_context_margin"]["auc"] == 1
    # a wrong pairing (the scores moved to other doc ids) breaks the ranking, and the test sees it
    moved = [dict(r, doc_id=(r["doc_id"] + 6) % n) for r in gated]
    assert task_signal(dict(by_mode, gated=moved), n_boot=20)["no_context_margin"]["auc"] == 0


def test_the_margin_of_a_task_whose_choices_are_contexts():
    """WinoGrande's lm-eval target is the shared continuation's text, not an index (a dry run crashed on it): the
    gold choice comes from the doc's 1-based answer; with no index anywhere the margin is NaN, never a crash."""
    import math

    from kvtransfer.eval.items import sample_margin

    sample = {"filtered_resps": [[-3.0, False], [-1.0, False]], "arguments": [["a _", " ends."], ["b _", " ends."]],
              "target": "ends.", "doc": {"answer": "2"}}
    assert sample_margin(sample, "acc") == 2.0           # gold = option 2 (index 1): -1 - (-3)
    assert sample_margin(dict(sample, doc={"answer": "1"}), "acc") == -2.0
    assert math.isnan(sample_margin(dict(sample, doc={}), "acc"))


def test_task_signal_of_a_recorded_signal_reads_that_signal_not_the_score():
    n = 12
    floor = [_rec("t", i, 1.0, 0.0) for i in range(n)]
    transfer = [_rec("t", i, 1.0 if i < 6 else 0.0, 1.0 if i < 6 else -1.0) for i in range(n)]
    target = [_rec("t", i, 1.0, 2.0) for i in range(n)]
    # the score ranks the items backwards, the recorded signal "first_layer" forwards; "tail_kl" is missing on two
    gated = [_rec("t", i, 1.0, 0.0, {"action": "map", "fraction": 0.0, "score": float(-i),
                                     "signals": {"first_layer": float(i), "tail_kl": None if i in (0, 1) else 0.0}})
             for i in range(n)]
    by_mode = {"gated": gated, "transfer": transfer, "no_context": floor, "target": target}
    assert task_signal(by_mode, n_boot=20)["no_context_margin"]["auc"] == 0
    assert task_signal(by_mode, signal="first_layer", n_boot=20)["no_context_margin"]["auc"] == 1
    # a missing value ranks highest (as a fall-back's score does): items 0, 1 are not below the floor
    got = task_signal(by_mode, signal="tail_kl", n_boot=20)["no_context_margin"]["auc"]
    assert got == (6 * 4 * 0.5 + 6 * 2 * 0) / 36
    # records without signals (runs from before them): every item is unscored for that signal
    old = dict(by_mode, gated=[_rec("t", i, 1.0, 0.0, {"action": "map", "fraction": 0.0, "score": 0.0}) for i in range(n)])
    assert task_signal(old, signal="first_layer", n_boot=20)["no_context_margin"]["auc"] == 0.5


def _collect():
    from scripts import load_script

    return load_script("experiments/gate/collect.py")


def test_collect_tabulates_each_recorded_signal_with_its_auc_cost_and_a_verdict():
    collect = _collect()
    n = 40
    floor = [_rec("t", i, 1.0, 0.0) for i in range(n)]
    transfer = [_rec("t", i, 1.0, -1.0 if i % 2 else 1.0) for i in range(n)]  # odd items below the floor
    target = [_rec("t", i, 1.0, 2.0 if i < 20 else -2.0) for i in range(n)]
    costs = {"first_layer": 0.25, "tail_kl": 0.5, "tail_kv": 0.1}
    gated = [_rec("t", i, 1.0, 0.0, {"action": "map", "fraction": 0.0, "score": 0.0, "signal_costs": costs,
                                     "signals": {"first_layer": float(i % 2), "tail_kl": float(-(i % 2)),
                                                 "tail_entropy_mapped": 1.0, "tail_kv": float(i % 7)}})
             for i in range(n)]
    items = {"gated": gated, "transfer": transfer, "no_context": floor, "target": target}
    lines = collect.signal_task_table("t", items)
    rows = {ln.split(" |")[0][2:]: ln for ln in lines if ln.startswith("| ") and not ln.startswith("| signal")}
    assert list(rows) == ["first_layer", "tail_kl (two-sided)", "tail_entropy_mapped (two-sided)", "tail_kv"]
    assert "| 1.00 ± 0.00 (20/40) |" in rows["first_layer"] and rows["first_layer"].endswith("| 0.2500 |")
    assert "| 0.00 ± 0.00 (20/40) |" in rows["tail_kl (two-sided)"]  # predicts the other way: reported as is
    assert rows["tail_entropy_mapped (two-sided)"].endswith("| 0.5000 |")  # an entropy costs what tail_kl costs
    verdict = next(ln for ln in lines if ln.startswith("Verdict"))
    assert "beyond 2 SE of 0.5: first_layer (1 of 2), tail_kl (1 of 2)" in verdict and "tail_entropy_mapped" in verdict
    assert "AUC far below 0.5 is a signal" in " ".join(lines)
    # perplexity windows: the same from the events and the per-window NLLs
    events = [g["gate"] for g in gated]
    nll = {"transfer": [2.0 + (i % 2) for i in range(n)], "no_context": [2.5] * n, "target": [1.0] * n}
    ppl = collect.signal_ppl_table("wikitext2", "256", events, nll)
    assert any(ln.startswith("| first_layer | 1.00 ± 0.00 (20/40)") for ln in ppl)
    # records without signals (the committed runs): no table at all
    old = dict(items, gated=[_rec("t", i, 1.0, 0.0, {"action": "map", "fraction": 0.0, "score": 0.0}) for i in range(n)])
    assert collect.signal_task_table("t", old) == [] and collect.signal_ppl_table("w", "1", [None] * n, nll) == []
