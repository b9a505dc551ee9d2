"""Prefix-conditioned perplexity and CoQA multi-turn drift on tiny models."""
from __future__ import annotations

import copy

import pytest
import torch
from tolerance import assert_close, assert_within, forward_factor

from kvtransfer.eval import KVTransferLM
from kvtransfer.eval.coqa import (coqa_f1, drift_curve, f1_score, load_conversations, normalize_answer,
                                  per_turn_transfer, transfer_once, turn_context, turn_golds)
from kvtransfer.eval.perplexity import draw_windows, load_pages, ppl_curve, prefix_conditioned_ppl

PS = [0, 16, 64]

FEW = "float64 hand arithmetic, a handful of roundings: x10 their count, since a few ops sit near their worst case"
PPL_REASON = ("ppl = exp(mean NLL): its relative error is the NLL's absolute error, a float32 forward's (FORWARD "
              "bound, forward_factor) on log-probs up to ~log(vocab) = 8")



@pytest.fixture(scope="module")
def lm(eval_model, eval_tokenizer, eval_mapper):
    return KVTransferLM(source_model=eval_model, target_model=eval_model, tokenizer=eval_tokenizer,
                        mapper=eval_mapper, mode="transfer", batch_size=4)


@pytest.fixture(scope="module")
def windows(eval_tokenizer, bench_dir):
    return draw_windows(eval_tokenizer, load_pages(bench_dir / "wikitext2.jsonl"), max_prefix=max(PS), cont_len=32,
                        n_windows=4, seed=0)


def test_ppl_scores_the_same_text_for_every_prefix(lm, windows):
    """Windows are drawn once at max(P): the scored continuation is identical for every P."""
    res = prefix_conditioned_ppl(lm, windows, PS)
    conts = [res[p]["continuation"] for p in PS]
    assert all(c == conts[0] for c in conts) and res[0]["tokens"] == 4 * 32
    assert res[0]["ppl"] != res[64]["ppl"]  # the prefix changes the prediction


def test_ppl_uses_the_transferred_prefix(lm, windows, eval_mapper):
    """Near-identity mapper ~ target at every P; a perturbed mapper changes PPL for P > 0 only."""
    curve = ppl_curve(lm, windows, PS)
    assert set(curve) == {"target", "transfer", "source", "native_injected"}
    for p in PS:
        assert_within(curve["transfer"][p], curve["target"][p], atol=1e-4 * curve["target"][p], reason=(
            "the near-identity self-mapper (lam 1e-4) is an approximation: 0.01 % of the perplexity"))
        assert_close(curve["native_injected"][p], curve["target"][p], dtype=torch.float32,
                     factor=forward_factor(lm.target_model, max(PS) + 32), magnitude=curve["target"][p] * 8,
                     reason=PPL_REASON)
    bad = copy.deepcopy(eval_mapper)
    bad.weight = bad.weight + 0.5 * torch.randn(bad.weight.shape, generator=torch.Generator().manual_seed(0))
    noisy = prefix_conditioned_ppl(lm.with_mode("transfer", mapper=bad), windows, PS)
    assert noisy[0]["ppl"] == curve["target"][0]  # nothing transferred at P=0: the same target forward
    for p in PS[1:]:
        assert abs(noisy[p]["ppl"] / curve["target"][p] - 1) > 1e-3


def test_ppl_bad_input(lm, eval_tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="wikitext2.jsonl"):
        load_pages(tmp_path / "wikitext2.jsonl")
    with pytest.raises(ValueError, match="no page has"):
        draw_windows(eval_tokenizer, ["too short"], max_prefix=64, cont_len=32)


def test_coqa_history_bookkeeping(bench_dir):
    """Turn t's context holds the story and gold Q/A of turns < t, ending in 'Q: q_t\\n\\nA:'."""
    doc = load_conversations(bench_dir / "coqa.jsonl")[0]
    qs, ans = doc["questions"]["input_text"], doc["answers"]["input_text"]
    assert turn_context(doc, 0) == doc["story"] + "\n\n" + f"Q: {qs[0]}\n\nA:"
    ctx = turn_context(doc, 2)
    assert ctx.endswith(f"Q: {qs[1]}\n\nA: {ans[1]}\n\nQ: {qs[2]}\n\nA:")
    assert f"Q: {qs[0]}\n\nA: {ans[0]}\n\n" in ctx and ans[2] not in ctx.split(qs[2])[-1]
    assert turn_golds(doc, 0) == ["white", "white", "white", "white"]


def test_coqa_f1_hand_checked():
    assert normalize_answer("The  Cat, an animal!") == "cat animal"
    assert f1_score("in a barn", "in the barn") == 1.0
    assert_close(f1_score("white cat", "white"), 2 / 3, factor=10 * 4, reason=FEW)
    assert f1_score("", "") == 1.0 and f1_score("no", "") == 0.0
    assert coqa_f1("white", ["white", "white", "white kitten"]) == 1.0
    # leave-one-out: (max(0, 2/3) + max(0, 2/3) + max(0, 0)) / 3
    assert_close(coqa_f1("kitten", ["white", "white", "white kitten"]), 4 / 9, factor=10 * 12, reason=FEW)
    assert coqa_f1("orange", ["Orange."]) == 1.0


def test_coqa_both_protocols_run(lm, bench_dir):
    """(a) per-turn transfer and (b) transfer-once both run; the near-identity mapper gives the target's answers."""
    docs = load_conversations(bench_dir / "coqa.jsonl")[:2]
    kw = dict(max_turns=3, max_gen_toks=4)
    target_a = per_turn_transfer(lm.with_mode("target"), docs, **kw)
    transfer_a = per_turn_transfer(lm, docs, **kw)
    target_b = transfer_once(lm.with_mode("target"), docs, **kw)
    transfer_b = transfer_once(lm, docs, **kw)
    preds = lambda run: [[t["pred"] for t in conv] for conv in run]  # noqa: E731
    assert [len(c) for c in target_a] == [3, 3] and [t["turn"] for t in target_a[0]] == [1, 2, 3]
    assert preds(transfer_a) == preds(target_a) == preds(target_b) == preds(transfer_b)
    curve = drift_curve(target_a, transfer_a, max_turn=10)
    assert [r["turn"] for r in curve] == [1, 2, 3] and all(r["gap"] == 0 for r in curve)
    assert all(0 <= t["f1"] <= 1 for conv in transfer_b for t in conv)


def test_coqa_target_runs_one_protocol_for_both(lm, bench_dir, monkeypatch):
    """The target reads its own cache under both protocols (same token streams), so its every-turn re-prefill
    is waste: only `once` runs and serves both; a mapped mode still runs each protocol. The reuse is exact
    because the two coincide in target mode (test_eval_leakage.py::test_coqa_both_protocols_by_hand)."""
    from kvtransfer.runner import eval_stage

    calls = []
    for name in ("per_turn_transfer", "transfer_once"):
        real = getattr(eval_stage, name)
        monkeypatch.setattr(eval_stage, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    ecfg = {"data_dir": str(bench_dir), "coqa": {"file": "coqa.jsonl", "conversations": 2, "turns": 2,
                                                 "max_gen_toks": 3, "protocols": ["every_turn", "once"]}}
    target = eval_stage._coqa(lm, "target", ecfg)
    assert calls == ["transfer_once"] and list(target) == ["every_turn", "once"]
    assert target["every_turn"] == target["once"] and target["every_turn"] is not target["once"]
    calls.clear()
    eval_stage._coqa(lm, "transfer", ecfg)
    assert calls == ["per_turn_transfer", "transfer_once"]


def test_drift_summary_pools_turns_and_clusters_the_se_by_conversation():
    """Pooled F1 over all turns (hand numbers), retention, and SEs clustered by conversation: zero when
    every conversation scores alike, positive otherwise; mismatched runs are refused."""
    from kvtransfer.eval.coqa import drift_summary

    def conv(*f1):
        return [{"turn": i + 1, "f1": f} for i, f in enumerate(f1)]

    ref = [conv(1.0, 0.5), conv(1.0, 0.5, 0.0)]
    got = [conv(0.5, 0.5), conv(0.0, 0.5, 0.0)]
    s = drift_summary(ref, got)
    assert s["turns"] == 5 and s["conversations"] == 2
    assert_close(s["target_f1"], 3.0 / 5, factor=10 * 6, reason=FEW)
    assert_close(s["transfer_f1"], 1.5 / 5, factor=10 * 6, reason=FEW)
    assert_close(s["retention"], 0.5, factor=10 * 13, reason=FEW)
    assert s["transfer_f1_se"] > 0
    same = drift_summary([conv(1.0, 0.5)] * 4, [conv(0.5, 0.5)] * 4)
    assert_close(same["transfer_f1_se"], 0.0, factor=10 * 8, magnitude=1.0, reason=(
        "the clustered SE of identical conversations: residuals of 4 totals of 2 turns, ~8 roundings of values <= 1"))
    assert_close(same["retention"], 2 / 3, factor=10 * 20, reason=FEW)
    with pytest.raises(ValueError, match="turns"):
        drift_summary([conv(1.0, 0.5)], [conv(1.0)])
