"""Content controls (kvtransfer.maps.controls, issue 29): wrong contexts, the mean map, the random map, the content
share, and perplexity windows drawn one per document."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from kvtransfer.maps.controls import calibration_means, mean_map, random_map, wrong_contexts
from kvtransfer.eval.metrics import content_share, control_statistics, paired_difference
from kvtransfer.eval.perplexity import draw_windows
from kvtransfer.runner.pipeline import execute
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 (the module fixture)
from tolerance import assert_close


# ---------------------------------------------------------------- wrong contexts
def _items(n: int, lengths: list[int], start: list[int]) -> list[list[int]]:
    """Contexts whose bodies use disjoint token ranges (item i: 1000 * (i + 1) + j), so a token tells its item."""
    return [start + [1000 * (i + 1) + j for j in range(lengths[i])] for i in range(n)]


@pytest.mark.parametrize("start", [[], [7]])
def test_wrong_contexts_keep_length_start_and_last_token_and_never_take_from_the_item(start):
    ctxs = _items(6, [5, 1, 9, 3, 12, 4], start)
    swap = wrong_contexts(ctxs + ctxs[:2], start, seed=3)  # duplicates: one wrong context per distinct context
    assert set(swap) == {tuple(c) for c in ctxs}
    for c in ctxs:
        w = swap[tuple(c)]
        assert len(w) == len(c) and w[:len(start)] == start and w[-1] == c[-1]
        body = w[len(start):-1]
        if len(c) - len(start) <= 1:
            assert w == c  # nothing to replace but the kept last token
            continue
        own = c[len(start)] // 1000
        assert body and all(t // 1000 != own for t in body), "a wrong context took tokens from its own item"
    assert swap == wrong_contexts(list(reversed(ctxs)), start, seed=3)  # order of requests does not matter
    assert swap != wrong_contexts(ctxs, start, seed=4)


def test_wrong_context_is_the_next_donors_tail_in_the_seeded_cycle():
    # two items: each is the other's only donor, so the wrong context is predictable by hand
    a, b = [9, 1, 2, 3, 4, 5, 6], [9, 11, 12, 13]
    swap = wrong_contexts([a, b], [9], seed=0)
    assert swap[tuple(a)] == [9] + [12, 13, 11, 12, 13] + [6]  # b's body (11 12 13) cycled to 5 tokens, a's last token
    assert swap[tuple(b)] == [9, 5, 6, 13]                      # a's last two body tokens, b's last token


def test_wrong_contexts_refuse_a_single_context():
    with pytest.raises(ValueError, match="eval.controls"):
        wrong_contexts([[1, 2, 3], [1, 2, 3]], [], seed=0)


# ---------------------------------------------------------------- metrics
def test_content_share_definition_and_its_limits():
    assert content_share(0.6, 0.6, 0.8, 0.5) == 0.0      # the map gains nothing from the right context
    assert content_share(0.8, 0.5, 0.8, 0.5) == 1.0      # it carries all of the target's content gain
    assert content_share(2.0, 2.5, 1.5, 2.5) == 0.5      # NLL: same formula, both differences negative
    assert np.isnan(content_share(0.7, 0.6, 0.5, 0.5))   # the target gains nothing from its context


def test_control_statistics_point_values_and_the_difference_se_match_their_definitions():
    rng = np.random.default_rng(0)
    n = 400
    target = rng.normal(2.0, 0.3, n)
    target_wrong = target + 0.4 + rng.normal(0, 0.1, n)
    transfer = target + 0.1 + rng.normal(0, 0.1, n)
    transfer_wrong = target_wrong + 0.05 + rng.normal(0, 0.1, n)
    mean = target + 0.6 + rng.normal(0, 0.1, n)
    items = {"target": target, "transfer": transfer, "target_wrong": target_wrong, "transfer_wrong": transfer_wrong,
             "mean_map": mean}
    stats = control_statistics(items, n_boot=400, seed=1)
    want = (transfer.mean() - transfer_wrong.mean()) / (target.mean() - target_wrong.mean())
    assert_close(stats["content_share"], want, factor=10 * 4 * n, magnitude=abs(want) + 1,
                 reason="means of 400 float64 values and one quotient, two ways: ~4n roundings, x10")
    gap = (transfer.mean() - mean.mean()) / (target.mean() - mean.mean())
    assert_close(stats["gap_closed_above_mean_map"], gap, factor=10 * 4 * n, magnitude=abs(gap) + 1,
                 reason="means of 400 float64 values and one quotient, two ways: ~4n roundings, x10")
    d = target - target_wrong
    assert stats["target_content_gain"] == paired_difference(target, target_wrong)["difference"]
    analytic = d.std(ddof=1) / np.sqrt(n)
    assert_close(stats["target_content_gain_se"], analytic, factor=10 * 4 * n, magnitude=analytic,
                 reason="the same std(ddof=1)/sqrt(n) of the same float64 differences, two ways: ~4n roundings, x10")
    # the bootstrap SE of the share against the delta method's first-order SE (independent errors here)
    num, den = transfer - transfer_wrong, target - target_wrong
    r = num.mean() / den.mean()
    delta = np.sqrt(np.var(num - r * den, ddof=1) / n) / abs(den.mean())
    assert 0.7 * delta < stats["content_share_se"] < 1.4 * delta  # bootstrap noise at 400 resamples: ~±5 %
    assert "gap_closed_above_random_map" not in stats


# ---------------------------------------------------------------- perplexity windows
class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_windows_are_drawn_one_per_document_and_the_old_draw_is_kept():
    pages = [chr(65 + i) * (40 + 7 * i) for i in range(12)] + ["short"]
    tok = _CharTokenizer()
    windows, docs = draw_windows(tok, pages, max_prefix=20, cont_len=10, n_windows=8, seed=5, return_docs=True)
    assert len(windows) == 8 and len(set(docs)) == 8 and 12 not in docs
    assert all(len(w) == 30 and set(w) == {65 + d} for w, d in zip(windows, docs))
    with pytest.warns(UserWarning, match="one per page"):
        every = draw_windows(tok, pages, max_prefix=20, cont_len=10, n_windows=40, seed=5)
    assert len(every) == 12
    # with_replacement: the historical draw (page, then offset, per window), reproduced independently
    rng = random.Random(5)
    spans = [(i, len(p) - 30) for i, p in enumerate(pages) if len(p) >= 30]
    want = []
    for _ in range(8):
        i, last = rng.choice(spans)
        s = rng.randint(0, last)
        want.append([ord(c) for c in pages[i][s:s + 30]])
    assert draw_windows(tok, pages, max_prefix=20, cont_len=10, n_windows=8, seed=5, draw="with_replacement") == want
    with pytest.raises(ValueError, match="eval.ppl.draw"):
        draw_windows(tok, pages, max_prefix=20, cont_len=10, n_windows=8, draw="sometimes")


def test_shipped_perplexity_sets_have_enough_documents():
    from kvtransfer.eval.sources import BUNDLED_DIR

    wiki = [json.loads(line) for line in (BUNDLED_DIR / "wikitext2.jsonl").open()]
    code = [json.loads(line) for line in (BUNDLED_DIR / "python_stdlib.jsonl").open()]
    assert len(wiki) == 62 and wiki[0]["page"].lstrip().startswith("= Robert Boulter =")
    assert len(code) >= 60 and len({r["module"] for r in code}) == len(code)
    assert all(r["python"] == "3.11.7" and len(r["text"]) >= 8000 for r in code)


# ---------------------------------------------------------------- control maps on the tiny pair
@pytest.fixture(scope="module")
def fitted(tiny_pair_dirs, tmp_path_factory):  # noqa: F811
    from kvtransfer.runner.pipeline import Run

    tmp = tmp_path_factory.mktemp("controls")
    cfg = _tiny_cfg(tiny_pair_dirs, tmp, "stage=[calibrate,fit]")
    execute(cfg, tmp / "fit")
    run = Run(cfg, tmp / "run")
    moments, _, _ = run.moments()
    return run, run.mapper(), moments


def test_mean_map_gives_every_mapped_position_the_calibration_mean(fitted):
    from kvtransfer.core.cache import prefill
    from kvtransfer.core.transfer import transfer

    run, mapper, moments = fitted
    mean_x, mean_y = calibration_means(moments, mapper)
    control = mean_map(mapper, mean_y)
    assert control.native_sink == mapper.native_sink and control.source == mapper.source
    x = torch.randn(2, 5, control.weight.shape[2])
    for t in range(len(control.weight)):
        assert torch.equal(control.map_features(t, x), mean_y[t][:, None, :].expand(2, 5, -1))
    # through the whole apply path: V carries no RoPE, so every mapped position holds the mean V exactly
    source, tok = run.model("source")
    target, _ = run.model("target")
    ids = torch.tensor([tok.encode("the cat sat on the mat and then it ran far away")])
    src = prefill(source, ids, torch.ones_like(ids))
    layers = transfer(src, control, source, target, input_ids=ids, native_sink=0, as_layers=True)
    d = target.config.head_dim
    for t, (_, v) in enumerate(layers):
        want = mean_y[t, 1].reshape(-1, d)  # [n_kv, d]
        assert torch.equal(v[0], want[:, None, :].expand(-1, ids.shape[1], -1).to(v.dtype))


def test_random_map_keeps_per_head_norms_and_the_mean_but_not_the_directions(fitted):
    _, mapper, moments = fitted
    mean_x, mean_y = calibration_means(moments, mapper)
    control = random_map(mapper, mean_x, mean_y, seed=0)
    w, r = mapper.weight.double(), control.weight.double()
    d = mapper.target["head_dim"]
    L, kinds, p, q = w.shape
    fit_norm = w.reshape(L, kinds, p, q // d, d).pow(2).sum(dim=(2, 4)).sqrt()
    rand_norm = r.reshape(L, kinds, p, q // d, d).pow(2).sum(dim=(2, 4)).sqrt()
    assert_close(rand_norm, fit_norm, dtype=torch.float32, factor=10 * p * d, magnitude=fit_norm.max().item(),
                 reason="a float32 rescale of a p x d block and its norm in float64: ~p*d roundings, x10")
    cos = (w * r).sum(dim=(2, 3)) / (w.norm(dim=(2, 3)) * r.norm(dim=(2, 3)))
    assert -0.5 < cos.min() and cos.max() < 0.5  # random directions: |cos| ~ 1/sqrt(p*q) for unrelated matrices
    for t in range(L):
        y = control.map_features(t, mean_x[t][:, None, :].float())[:, 0]
        assert_close(y, mean_y[t], dtype=torch.float32, factor=10 * p, magnitude=(mean_x[t].abs() @ r[t].abs().float()).max().item() + mean_y[t].abs().max().item(),
                     reason="x @ W + b with b = mean_y - mean_x @ W: two p-term float32 dot products, x10")
    again = random_map(mapper, mean_x, mean_y, seed=0)
    assert torch.equal(again.weight, control.weight) and not torch.equal(random_map(mapper, mean_x, mean_y, seed=1).weight,
                                                                         control.weight)


# ---------------------------------------------------------------- through the eval stage
def test_eval_stage_writes_the_control_rows_and_content_share(tiny_pair_dirs, tmp_path):  # noqa: F811
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[eval]", "eval.limit=6", "eval.tasks=[tiny_cloze]",
                    "eval.ppl.prefixes=[0,16]", "eval.ppl.continuation=8", "eval.ppl.windows=5",
                    "eval.coqa.enabled=false", "eval.fidelity.enabled=false", "eval.bootstrap=50",
                    "eval.modes=[target,transfer,no_context]")
    summary = execute(cfg, tmp_path / "eval")
    row = summary["tasks"]["tiny_cloze"]
    for mode in ("target_wrong", "transfer_wrong", "mean_map", "random_map"):
        assert 0 <= row[mode] <= 1
        assert f"gap_closed_above_{mode}" in row
    assert "content_share" in row and "content_share_se" in row and "target_content_gain_se" in row
    ppl = {r["prefix"]: r for r in summary["ppl"]}
    assert ppl[16]["documents"] == ppl[16]["windows"] == 5
    assert ppl[16]["content_share_se"] is not None and ppl[16]["content_share_se"] > 0
    for mode in ("target_wrong", "transfer_wrong", "mean_map", "random_map"):
        assert ppl[16][mode] > 0
    # at P = 0 the context is the start ids alone: a wrong context is the same context
    assert ppl[0]["target_wrong"] == ppl[0]["target"]
    scores = json.loads((tmp_path / "eval" / summary["scores_file"]).read_text())
    nll = scores["ppl_sets"]["wikitext2"]["window_nll"]["16"]
    assert len(set(scores["ppl_sets"]["wikitext2"]["window_doc"])) == 5
    # independent prediction of the content share from the per-window NLLs
    m = {k: np.mean(v) for k, v in nll.items()}
    want = (m["transfer"] - m["transfer_wrong"]) / (m["target"] - m["target_wrong"])
    assert_close(ppl[16]["content_share"], want, factor=10 * 20, magnitude=abs(want) + 1,
                 reason="means of 5 float64 NLLs and one quotient, two ways: ~20 roundings, x10")
    # target_wrong reads no map, so a sweep computes it once (the baseline cache); the mapped controls do not
    import kvtransfer.runner.eval_stage as stage
    assert "target_wrong" in stage.BASELINE_MODES and "transfer_wrong" not in stage.BASELINE_MODES


def test_wrong_context_mode_scores_the_swapped_contexts(fitted):
    from kvtransfer.eval.adapter import KVTransferLM

    run, mapper, _ = fitted
    source, tok = run.model("source")
    target, _ = run.model("target")
    lm = KVTransferLM(source_model=source, target_model=target, tokenizer=tok, mapper=mapper, mode="transfer",
                      batch_size=1)
    a = tok.encode("the dog ran to the park and the sun was warm on the grass")
    b = tok.encode("a bird flew over the sea")
    cont = tok.encode(" and then")
    swap = wrong_contexts([a, b], lm._start_ids, seed=0)
    for mode in ("target", "transfer"):
        plain = lm.with_mode(mode)
        wrong = lm.with_mode(mode, wrong_context=True, wrong_context_seed=0)
        got = wrong.score_tokens([(a, cont), (b, cont)])
        want = plain.score_tokens([(swap[tuple(a)], cont), (swap[tuple(b)], cont)])
        for (lp, _), (lq, _) in zip(got, want):
            assert torch.equal(lp, lq)  # batch size 1: the same forward on the same tokens
        assert not torch.equal(got[0][0], plain.score_tokens([(a, cont)])[0][0])


def test_run_ends_with_one_table_and_says_when_a_ratio_is_not_measurable():
    import importlib.util

    from test_runner import ROOT

    spec = importlib.util.spec_from_file_location("run_entry", ROOT / "run.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    summary = {"tasks": {"a": {"n": 10, "target": 0.5, "transfer": 0.45, "no_context": 0.4, "gap_closed": 0.5,
                               "stderr_gap_closed": 0.6, "content_share": 0.8, "content_share_se": 0.1}},
               "ppl_sets": {"wikitext2": [{"prefix": 256, "windows": 62, "target": 10.0, "transfer": 12.0,
                                           "no_context": 20.0, "transfer_gap_closed": 0.74, "transfer_gap_closed_se": 0.03}]}}
    lines = entry.summary_lines(summary)
    assert len(lines) == 3 and all(len(line) <= len(lines[0]) + 40 for line in lines)
    assert "not measurable at this n" in lines[1] and "80 ± 10 %" in lines[1]
    assert "ppl wikitext2 @256 (62 docs)" in lines[2] and "74.0 ± 3.0 %" in lines[2]


def test_map_dtype_applies_the_map_and_its_controls_in_that_dtype(fitted):
    """eval.map_dtype=bfloat16: the transfer LM and the control maps handed to it (with_mode) map in bfloat16 on
    copies, the run's fitted map stays float32, and the scores move; float32 is the map as given (no copy)."""
    from kvtransfer.eval.adapter import KVTransferLM
    from kvtransfer.runner.eval_stage import control_lm

    run, mapper, _ = fitted
    source, tok = run.model("source")
    target, _ = run.model("target")
    kw = dict(source_model=source, target_model=target, tokenizer=tok, mode="transfer", batch_size=1)
    f32 = KVTransferLM(mapper=mapper, map_dtype="float32", **kw)
    b16 = KVTransferLM(mapper=mapper, map_dtype="bfloat16", **kw)
    assert f32.mapper is mapper and b16.mapper is not mapper
    assert b16.mapper.weight.dtype == torch.bfloat16 and mapper.weight.dtype == torch.float32
    for mode in ("mean_map", "random_map"):
        lm, base = control_lm(b16, mode, run, seed=0)
        assert base == "transfer" and lm.mapper.weight.dtype == torch.bfloat16, mode
    request = [(tok.encode("the dog ran to the park and the sun was warm"), tok.encode(" on the grass"))]
    assert not torch.equal(f32.score_tokens(request)[0][0], b16.score_tokens(request)[0][0])
    with pytest.raises(ValueError, match=r"not one of \['bfloat16', 'float32'\]"):
        KVTransferLM(mapper=mapper, map_dtype="float16", **kw)


def test_map_dtype_through_the_pipeline_keys_its_own_results(tiny_pair_dirs, tmp_path):  # noqa: F811
    """eval.map_dtype=bfloat16 through `execute`: the mapped results go to their own cached files (the float32 run's
    are not read), the baselines are the float32 run's own files, and the bf16 transfer's perplexity is another
    number; the bench times the dtype the evaluation used."""
    from kvtransfer.runner.eval_stage import result_dirs
    from kvtransfer.runner.pipeline import Run

    base = ("stage=[calibrate,fit,eval,bench]", "eval.tasks=[]", "eval.coqa.enabled=false", "eval.bootstrap=10",
            "eval.fidelity.enabled=false", "eval.controls=[]", "eval.modes=[no_context,transfer,target]",
            "eval.ppl.prefixes=[0,16]", "eval.ppl.windows=3", "eval.ppl.continuation=8", "bench.tokens=[16]",
            "bench.warmup=0", "bench.repeats=1")
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, *base, f"eval.map_dtype={dtype}")
        runs[dtype] = (execute(cfg, tmp_path / dtype), result_dirs(Run(cfg, tmp_path / dtype), "ppl"))
    (s32, d32), (s16, d16) = runs["float32"], runs["bfloat16"]
    assert d32["baseline"] == d16["baseline"] and d32["mapped"] != d16["mapped"]
    assert (d16["mapped"] / "transfer.ppl.wikitext2.json").is_file()
    p32, p16 = ({r["prefix"]: r for r in s["ppl"]} for s in (s32, s16))
    assert p32[16]["target"] == p16[16]["target"] and p32[16]["transfer"] != p16[16]["transfer"]
    assert [r["mapper_dtype"] for r in s16["speed"]] == ["bfloat16"] and all(r["eval_dtype"] for r in s16["speed"])
