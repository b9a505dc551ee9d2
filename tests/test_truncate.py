"""The equal-cost baseline: truncation (the target reads the start ids and only the last context tokens, nothing
mapped), its twin of each recompute fraction, the truncation curve, the map's worth in native tokens, and the
measured seconds / FLOPs of reading the contexts beside each row."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvtransfer.eval import KVTransferLM
from kvtransfer.eval.truncate import truncate_keep
from kvtransfer.eval.metrics import crossing, native_token_worth
from kvtransfer.eval.repair import (parse_truncate_mode, truncate_mode, truncate_tokens_mode, truncation_curve,
                                    truncation_twins)
from kvtransfer.core.recompute import choose_tokens, prefill_flops
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 (the module fixture)
from tolerance import assert_close


def test_names_and_counts():
    assert truncate_mode(0.3) == "truncate_0.3" and truncate_tokens_mode(16) == "truncate_tokens_16"
    assert parse_truncate_mode("truncate_0.3") == {"truncate_fraction": 0.3}
    assert parse_truncate_mode("truncate_tokens_16") == {"truncate_tokens": 16}
    ecfg = {"recompute_fraction": [0.15, 0.3], "recompute_select": ["recent", "random"],
            "ppl": {"enabled": True, "prefixes": [0, 64]}, "truncate": {"curve": [1, 4, 64, 128]}}
    assert truncation_twins(ecfg) == ["truncate_0.15", "truncate_0.3"]
    assert truncation_curve(ecfg, repair=True) == ["truncate_tokens_1", "truncate_tokens_4"]  # m >= P: the target
    assert truncation_curve(ecfg, repair=False) == []
    assert truncation_curve({**ecfg, "truncate": {"curve": [4], "always": True}}, repair=False) == ["truncate_tokens_4"]
    assert truncation_twins({**ecfg, "truncate": {"twins": False}}) == []
    # the twin keeps exactly the tokens `recent` at r recomputes (native sink = the start id) + the last one
    for n_body in (1, 2, 13, 64, 255):
        for r in (0.0, 0.05, 0.15, 0.3, 0.5, 1.0):
            prefix = 1 + n_body - 1  # start id + context[:-1]
            recent = choose_tokens(prefix, r, "recent", native_sink=1)
            assert truncate_keep(n_body, fraction=r) == len(recent) + 1
            assert recent.tolist() == list(range(prefix - len(recent), prefix))  # the most recent ones
    assert truncate_keep(10, tokens=4) == 4 and truncate_keep(3, tokens=16) == 3
    with pytest.raises(ValueError, match="exactly one"):
        truncate_keep(10)


def test_crossing_interpolates_in_log_tokens():
    # curve 0 at m = 1, 0.5 at m = 4, 1 at m = 16: level 0.25 is halfway between log 1 and log 4 -> m = 2
    exp_log = "exp of a float64 log-linear interpolation (a few roundings)"
    assert_close(crossing([1, 4, 16], [0.0, 0.5, 1.0], 0.25), 2.0, factor=16, reason=exp_log)
    assert_close(crossing([1, 4, 16], [0.0, 0.5, 1.0], 0.75), 8.0, factor=16, reason=exp_log)
    assert crossing([1, 4, 16], [0.0, 0.5, 1.0], 1.5) == math.inf      # beyond the curve: a bound
    assert crossing([1, 4, 16], [0.0, 0.5, 1.0], -0.1) == -math.inf    # below the floor
    # the first upward crossing counts on a curve that dips back
    assert_close(crossing([1, 4, 16, 64], [0.0, 0.5, 0.4, 1.0], 0.45), 4 ** 0.9, factor=16, reason=exp_log)
    got = crossing([1, 4, 16], np.array([[0.0, 0.5, 1.0], [0.0, 1.0, 1.0]]), np.array([0.25, 0.5]))
    assert_close(torch.tensor(got), torch.tensor([2.0, 2.0], dtype=torch.float64), factor=16, reason=exp_log)


def test_native_token_worth_on_windows_with_a_known_answer():
    rng = np.random.default_rng(0)
    n = 40
    target = rng.normal(2.0, 0.3, n)
    floor = target + 1.0 + rng.normal(0, 0.05, n)
    # truncation at m closes log4(m) / 3 of the gap per window (m = 1: nothing, m = 64: all of it)
    curve = {m: floor - (floor - target) * math.log(m, 4) / 3 for m in (1, 4, 16, 64)}
    mapped = floor - (floor - target) * 0.5  # the map closes half of every window's gap -> m = 4 ** 1.5 = 8
    out = native_token_worth({"target": target, "no_context": floor, "transfer": mapped}, curve, n_boot=200)
    assert_close(out["tokens"], 8.0, factor=64, magnitude=8,
                 reason="exp of a log-linear interpolation of ratios of float64 means of 40 values")
    assert out["lo"] <= out["tokens"] <= out["hi"] and not out["above"] and not out["below"]
    assert out["curve"][1] == 0.0 and out["windows"] == n
    # a map better than the whole curve is a bound, not a value
    far = native_token_worth({"target": target, "no_context": floor, "transfer": target - 0.1}, curve, n_boot=50)
    assert far["tokens"] is None and far["above"]


@pytest.fixture(scope="module")
def lm(eval_model, eval_tokenizer, eval_mapper):
    return KVTransferLM(source_model=eval_model, target_model=eval_model, tokenizer=eval_tokenizer,
                        mapper=eval_mapper, mode="transfer", batch_size=4, time_contexts=True)


def _pairs(lm, n=5, length=40, cont=6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(lm.tokenizer) - 1, (n, length + cont), generator=g).tolist()
    return [(lm._start_ids + row[:length], row[length:]) for row in ids]


@pytest.mark.parametrize("share_prefix", [False, True])
def test_truncate_is_the_target_on_a_truncated_prompt(lm, share_prefix):
    pairs = _pairs(lm)
    start = len(lm._start_ids)
    target = lm.with_mode("target", share_prefix=share_prefix)
    for change, keep in (({"truncate_tokens": 7}, 7), ({"truncate_fraction": 0.3}, round(0.3 * 39) + 1)):
        trunc = lm.with_mode("truncate", share_prefix=share_prefix, **change)
        got = trunc.score_tokens(pairs, disable_tqdm=True)
        # the prediction made without the truncate mode: the target scoring the cut prompt itself
        want = target.score_tokens([(c[:start] + c[start:][-keep:], k) for c, k in pairs], disable_tqdm=True)
        for (a, _), (b, _) in zip(got, want):
            assert torch.equal(a, b)  # the same tokens through the same kernels
        full = target.score_tokens(pairs, disable_tqdm=True)
        assert any(not torch.equal(a, b) for (a, _), (b, _) in zip(got, full))  # and not the whole context
    # m = 1 is the no-context floor, exactly (one pass each)
    one = lm.with_mode("truncate", truncate_tokens=1).score_tokens(pairs, disable_tqdm=True)
    floor = lm.with_mode("no_context").score_tokens(pairs, disable_tqdm=True)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(one, floor))


def test_context_timing_counts_tokens_and_flops(lm):
    pairs = _pairs(lm, n=5, length=40)
    cfg = lm.target_model.config
    for mode, change, read in (("target", {}, 40), ("truncate", {"truncate_tokens": 7}, 7), ("no_context", {}, 1),
                               ("transfer", {}, 40)):
        other = lm.with_mode(mode, **change)
        other.score_tokens(pairs, disable_tqdm=True)
        t = other.timing
        assert t["contexts"] == 5 and t["seconds"] > 0 and t["reference_tokens"] == 5 * 40  # start + 40 - last one
        assert t["tokens"] == 5 * (start_len := len(lm._start_ids)) + 5 * (read - 1) if mode != "transfer" \
            else t["tokens"] == 5 * 40
        assert_close(t["reference_flops"], 5 * prefill_flops(cfg, 40), factor=10, reason="float64 sums of 5 terms")
        if mode == "transfer":
            assert t["flops"] == 0 and t["map_flops"] == 5 * 40 * lm.mapper.apply_flops_per_token
            assert t["source_seconds"] > 0
        else:
            assert_close(t["flops"], 5 * prefill_flops(cfg, start_len + read - 1), factor=10,
                         reason="float64 sums of 5 terms")
    assert lm.timing["contexts"] == 0  # every mode (copy) times its own contexts


def test_tiny_pair_run_writes_truncation_twin_curve_seconds_and_worth(tiny_pair_dirs, tmp_path):  # noqa: F811
    """The check of the issue: eval.recompute_fraction=[0.3] eval.recompute_select=[recent] writes truncate_0.3
    beside recompute_recent_0.3 with measured seconds for both and for target, and the map's worth in native
    tokens; truncate_0.3's numbers are predicted independently (the target scoring the truncated prompts)."""
    from kvtransfer.eval.perplexity import draw_windows, prefix_pairs
    from kvtransfer.eval.sources import ppl_pages
    from kvtransfer.runner.pipeline import Run, execute

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[calibrate,fit,eval]", "eval.limit=4", "eval.tasks=[tiny_cloze]",
                    "eval.ppl.prefixes=[0,16]", "eval.ppl.continuation=8", "eval.ppl.windows=5",
                    "eval.coqa.enabled=false", "eval.fidelity.enabled=false", "eval.bootstrap=50", "eval.controls=[]",
                    "eval.modes=[target,transfer,no_context]", "eval.recompute_fraction=[0.3]",
                    "eval.recompute_select=[recent]")
    summary = execute(cfg, tmp_path / "eval")
    row = {r["prefix"]: r for r in summary["ppl"]}[16]
    for mode in ("truncate_0.3", "recompute_recent_0.3", "target", "transfer"):
        assert row[f"{mode}_seconds"] > 0, mode   # measured, per context
        assert row[f"{mode}_seconds_rel"] > 0, mode
    assert row["no_context_seconds"] >= 0  # (0 where there are no start ids: a 1-token context has no prefix)
    assert row["target_seconds_rel"] == 1.0 and row["target_flops_rel"] == 1.0
    assert row["truncate_0.3_gap_closed_se"] is not None and row["recompute_recent_0.3_cost"] > 0
    run = Run(cfg, tmp_path / "x")
    target, tokenizer = run.model("target")
    lm = KVTransferLM(target_model=target, tokenizer=tokenizer, mode="target", batch_size=16,
                      context_start=run.context_start)
    start = lm._start_ids
    keep = round(0.3 * 15) + 1  # the tokens recent at 0.3 recomputes of the 16 - 1 cached ones, + the last one
    # FLOPs: a prefill of start + keep - 1 tokens against one of start + 15
    cfg_t = target.config
    assert_close(row["truncate_0.3_flops_rel"],
                 prefill_flops(cfg_t, len(start) + keep - 1) / prefill_flops(cfg_t, len(start) + 15),
                 factor=10, reason="float64 ratio of sums of 5 equal terms")
    worth = row["transfer_native_tokens"]
    assert set(worth["curve"]) == {1, 4, 8} and worth["curve"][1] == 0.0  # m = 1 is the floor
    gaps = [row[f"truncate_tokens_{m}_gap_closed"] for m in (1, 4, 8)]
    want = crossing([1, 4, 8], gaps, row["transfer_gap_closed"])
    if math.isfinite(want):
        assert_close(worth["tokens"], want, factor=64, magnitude=8, reason="the same interpolation, float64")
    else:
        assert worth["tokens"] is None and (worth["above"] or worth["below"])
    nll = json.loads((tmp_path / "eval" / summary["scores_file"]).read_text())["ppl_sets"]["wikitext2"]["window_nll"]
    assert nll["16"]["truncate_tokens_1"] == nll["16"]["no_context"]  # the same tokens, one pass each
    # independent prediction: the target scoring each window's prompt cut to start + the last round(0.3 x 15) + 1
    ecfg = run.cfg["eval"]
    windows = draw_windows(tokenizer, ppl_pages(ecfg, "wikitext2"), max_prefix=16, cont_len=8, n_windows=5, seed=0)
    pairs = [(start + c[len(start):][-keep:], k)
             for c, k in prefix_pairs(windows, 16, 16, lm.prefix_token_id, start)]
    want = [-float(lp.sum()) / len(k) for (lp, _), (_, k) in zip(lm.score_tokens(pairs), pairs)]
    assert nll["16"]["truncate_0.3"] == want
    assert nll["16"]["truncate_0.3"] != nll["16"]["target"]


def test_a_target_only_evaluation_needs_no_calibration(tiny_pair_dirs, tmp_path):  # noqa: F811
    """Every mode a baseline (the target alone, truncation) and no fidelity: no map is built, so nothing calibrates
    (the cache holds no moments or mapper), and the source model is never loaded."""
    from kvtransfer.runner.pipeline import execute

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[eval]", "eval.tasks=[]", "eval.ppl.prefixes=[16]",
                    "eval.ppl.continuation=8", "eval.ppl.windows=4", "eval.coqa.enabled=false",
                    "eval.fidelity.enabled=false", "eval.bootstrap=20", "eval.controls=[]",
                    "eval.modes=[target,no_context,truncate_tokens_4]")
    summary = execute(cfg, tmp_path / "eval")
    row = summary["ppl"][0]
    assert row["truncate_tokens_4"] > 0 and row["truncate_tokens_4_seconds"] > 0
    assert "transfer" not in row and "path" not in summary["mapper"]
    cache = tmp_path / "artifacts"
    assert not (cache / "moments").exists() and not (cache / "mappers").exists()


def test_coqa_twin_is_the_target_reading_the_last_tokens(tiny_pair_dirs, tmp_path):  # noqa: F811
    """CoQA's equal-cost twin (eval.coqa.truncate): every turn, the target answers from the start ids + the last m
    tokens of the turn's prompt (predicted here by the target generating on prompts cut by hand); with the story cached
    once, m beyond every story is exactly the target; the summary pairs each twin with the map over conversations."""
    from kvtransfer.eval.coqa import UNTIL, coqa_f1, encode_segments, turn_golds, turn_segments, _answer
    from kvtransfer.eval.sources import coqa_docs
    from kvtransfer.runner.pipeline import Run, execute

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[calibrate,fit,eval]", "eval.tasks=[]", "eval.ppl.enabled=false",
                    "eval.fidelity.enabled=false", "eval.bootstrap=50", "eval.controls=[]",
                    "eval.modes=[target,transfer]", "eval.coqa.conversations=3", "eval.coqa.turns=3",
                    "eval.coqa.truncate=[8,100000]")
    summary = execute(cfg, tmp_path / "eval")
    scores = json.loads((tmp_path / "eval" / summary["scores_file"]).read_text())["coqa"]
    rows = {(r["protocol"], r["tokens"]): r for r in summary["coqa_twins"]}
    assert set(rows) == {(p, m) for p in ("every_turn", "once") for m in (8, 100000)}
    assert {r["series"] for r in summary["drift"]} >= {"truncate_tokens_8 (every_turn)", "truncate_tokens_8 (once)"}

    def answers(mode):  # {protocol: [[answer per turn] per conversation]} from the mode's cached CoQA file
        [path] = (tmp_path / "artifacts" / "eval").rglob(f"{mode}.coqa.json")
        return {p: [[t["pred"] for t in conv] for conv in convs]
                for p, convs in json.loads(path.read_text())["value"].items()}

    eight, everything, target = answers("truncate_tokens_8"), answers("truncate_tokens_100000"), answers("target")
    # the story cached once, a twin longer than any story reads it all: the target's own answers
    assert everything["once"] == target["once"] and scores["once"]["truncate_tokens_100000"] == scores["once"]["target"]
    assert eight["once"] != target["once"]  # the story's last 8 tokens are not the story
    # every turn, m = 8: the target generating on each turn's prompt cut to the start ids + its last 8 tokens
    run = Run(cfg, tmp_path / "x")
    target_model, tokenizer = run.model("target")
    lm = KVTransferLM(target_model=target_model, tokenizer=tokenizer, mode="target", batch_size=16,
                      context_start=run.context_start)
    ecfg = run.cfg["eval"]
    docs = coqa_docs(ecfg)
    jobs = [(c, t) for c in range(len(docs)) for t in range(min(3, len(docs[c]["questions"]["input_text"])))]
    start = lm._start_ids
    cut = []
    for c, t in jobs:
        ids = encode_segments(lm, turn_segments(docs[c], t))
        body = ids[len(start):] if ids[:len(start)] == start else ids
        cut.append((start if ids[:len(start)] == start else []) + body[-8:])
    gens = lm.generate_tokens(cut, until=UNTIL, max_gen_toks=ecfg["coqa"]["max_gen_toks"])
    want, want_f1 = [[] for _ in docs], [[] for _ in docs]
    for (c, t), toks in zip(jobs, gens):
        want[c].append(_answer(lm, toks))
        want_f1[c].append(coqa_f1(want[c][-1], turn_golds(docs[c], t)))
    assert eight["every_turn"] == want and scores["every_turn"]["truncate_tokens_8"] == want_f1
    assert eight["every_turn"] != target["every_turn"]  # it read less
    r = rows[("every_turn", 8)]
    f1 = [x for conv in want_f1 for x in conv]
    # F1 is in [0, 1]: the means' scale is 1 (the tiny model's answers may all score 0)
    assert_close(r["twin_f1"], sum(f1) / len(f1), factor=10, magnitude=1, reason="float64 mean of a few F1s")
    mapped = [x for conv in scores["every_turn"]["transfer"] for x in conv]
    assert_close(r["transfer_minus_twin"], sum(mapped) / len(mapped) - sum(f1) / len(f1), factor=10, magnitude=1,
                 reason="float64 means of a few F1s")
