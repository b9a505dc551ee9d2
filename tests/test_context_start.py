"""Position-0 convention (kvtransfer.core.context), the no_context floor mode and shared-prefix scoring.

A tokenizer that adds nothing before text (like Qwen's) is the case where calibration text and
evaluation contexts used to disagree about position 0 (a word vs <|endoftext|>).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import make_model
from kvtransfer.core.cache import continuation_logprobs
from kvtransfer.core.context import ContextStartMismatch, check_mapper, describe, encode, start_ids
from kvtransfer.core.data import token_sequences
from kvtransfer.eval import KVTransferLM
from kvtransfer.eval.perplexity import prefix_pairs
from tolerance import FORWARD, assert_close, assert_far, forward_factor



def assert_logprob_close(model, got: float, want: float, ids: list[int], n_cont: int) -> None:
    """Two float32 routes to a continuation's summed log-prob (one pass vs prefix cache + continuation)."""
    with torch.no_grad():
        scale = float(model(torch.tensor([ids])).logits.abs().max())
    assert_close(got, want, dtype=torch.float32, factor=2 * n_cont * forward_factor(model, len(ids)), magnitude=scale,
                 reason=FORWARD + "; a log-prob is a logit minus a logsumexp (2x a logit's error), summed over n_cont")


@pytest.fixture(scope="module")
def plain_tokenizer(eval_tokenizer):
    """The test BPE without its BOS post-processor: adds nothing before text (Qwen-like)."""
    tok = copy.deepcopy(eval_tokenizer)
    tok._tokenizer.post_processor = None
    assert tok("hello world")["input_ids"][0] != tok.bos_token_id
    return tok


def test_start_ids_per_policy(eval_tokenizer, plain_tokenizer):
    bos = eval_tokenizer.bos_token_id
    assert start_ids(eval_tokenizer, "tokenizer") == [bos]          # Llama-like: the tokenizer adds BOS
    assert start_ids(plain_tokenizer, "tokenizer") == []            # Qwen-like: nothing
    assert start_ids(plain_tokenizer, "prefix_token") == [bos]
    assert encode(eval_tokenizer, "hello", "prefix_token")[:2] != [bos, bos]  # never twice
    assert describe(plain_tokenizer, "prefix_token")["start_tokens"] == ["<s>"]
    with pytest.raises(ValueError, match="context_start"):
        start_ids(plain_tokenizer, "bos")


def test_calibration_sequences_start_like_eval_contexts(plain_tokenizer):
    docs = ["The quick brown fox jumps over the lazy dog. " * 8, "A short one.", "Another short document here."]
    bos = plain_tokenizer.bos_token_id
    pref = token_sequences(iter(docs * 4), plain_tokenizer, 3, 16, context_start="prefix_token")
    assert (pref[:, 0] == bos).all() and (pref[:, 1:] != bos).all()
    plain = token_sequences(iter(docs * 4), plain_tokenizer, 3, 16, context_start="tokenizer")
    assert (plain[:, 0] != bos).all()
    # a long document: the same text after the start token
    assert pref[0, 1:].tolist() == plain[0, :15].tolist()


def test_ppl_contexts_use_the_start_ids():
    windows = [list(range(10, 30))]
    assert prefix_pairs(windows, 4, 8, 1, start=[])[0][0] == [14, 15, 16, 17]
    assert prefix_pairs(windows, 4, 8, 1, start=[1])[0][0] == [1, 14, 15, 16, 17]
    assert prefix_pairs(windows, 0, 8, 1, start=[])[0][0] == [1]    # empty context: lm-eval's prefix token
    assert prefix_pairs(windows, 0, 8, 1, start=[])[0][1] == prefix_pairs(windows, 4, 8, 1, start=[])[0][1]


def test_mapper_calibrated_under_another_convention_is_refused(plain_tokenizer, eval_mapper):
    check_mapper({"context_start": "prefix_token"}, "prefix_token")
    with pytest.raises(ContextStartMismatch, match="context_start='tokenizer'"):
        check_mapper({"context_start": "tokenizer"}, "prefix_token")
    with pytest.warns(UserWarning, match="calibrated with"):
        check_mapper({"context_start": "tokenizer"}, "prefix_token", strict=False)
    with pytest.warns(UserWarning, match="does not record"):
        check_mapper({}, "tokenizer")
    model = make_model(plain_tokenizer)
    mapper = copy.copy(eval_mapper)
    mapper.calibration = dict(eval_mapper.calibration, context_start="tokenizer")
    with pytest.raises(ContextStartMismatch):
        KVTransferLM(source_model=model, target_model=model, tokenizer=plain_tokenizer, mapper=mapper,
                     mode="transfer", context_start="prefix_token")


def test_prefix_token_contexts_in_the_adapter(plain_tokenizer):
    model = make_model(plain_tokenizer)
    bos = plain_tokenizer.bos_token_id
    lm = KVTransferLM(source_model=model, target_model=model, tokenizer=plain_tokenizer, mode="target",
                      context_start="prefix_token")
    ctx, cont = lm._encode_pair("The cat sat on", " the mat")
    assert ctx[0] == bos and ctx.count(bos) == 1 and bos not in cont
    assert lm.tok_encode("x y", add_special_tokens=False)[0] != bos
    stock = lm.with_mode("target", context_start="tokenizer")
    assert stock._encode_pair("The cat sat on", " the mat")[0] == ctx[1:]


def _hand_logprob(model, ids: list[int], n_cont: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits
    return float(continuation_logprobs(logits[:, -n_cont:], torch.tensor([ids[-n_cont:]])).sum())


def test_no_context_floor_is_the_target_on_the_last_token_only(eval_tokenizer):
    target = make_model(eval_tokenizer, seed=3)
    source = make_model(eval_tokenizer, seed=4)
    lm = KVTransferLM(source_model=source, target_model=target, tokenizer=eval_tokenizer, mode="no_context")
    ctx = lm.tok_encode("Question: what colour is the sky on a clear day? Answer:")
    cont = lm.tok_encode(" blue", add_special_tokens=False)
    (lp, _), = lm.score_tokens([(ctx, cont)])
    start = start_ids(eval_tokenizer, "tokenizer")
    expected = _hand_logprob(target, start + ctx[-1:] + cont, len(cont))
    assert_logprob_close(target, float(lp.sum()), expected, start + ctx[-1:] + cont, len(cont))
    (full, _), = lm.with_mode("target").score_tokens([(ctx, cont)])
    assert_logprob_close(target, float(full.sum()), _hand_logprob(target, ctx + cont, len(cont)), ctx + cont, len(cont))
    assert_far(float(full.sum()), expected, atol=1e-2, reason="the floor really drops the context: nats apart")
    gen_floor = lm.generate_tokens([ctx], until=[], max_gen_toks=4)[0]
    with torch.no_grad():  # greedy by hand on the floor context
        ids = start + ctx[-1:]
        for _ in range(4):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    assert gen_floor == ids[-4:] or eval_tokenizer.eos_token_id in ids[-4:]


def test_shared_prefix_scoring_equals_one_pass(eval_tokenizer):
    model = make_model(eval_tokenizer, seed=5)
    lm = KVTransferLM(source_model=model, target_model=model, tokenizer=eval_tokenizer, mode="target", batch_size=3)
    shared = lm.with_mode("target", share_prefix=True)
    ctx = lm.tok_encode("The weather today is mostly")
    pairs = [(ctx, lm.tok_encode(c, add_special_tokens=False)) for c in (" sunny", " cloudy with rain", " cold")]
    pairs.append((lm.tok_encode("Another context entirely"), lm.tok_encode(" here", add_special_tokens=False)))
    one = [float(lp.sum()) for lp, _ in lm.score_tokens(pairs)]
    grouped = [float(lp.sum()) for lp, _ in shared.score_tokens(pairs)]
    for a, b in zip(one, grouped):
        assert math.isfinite(a)
    for (c, k), a, b in zip(pairs, one, grouped):
        assert_logprob_close(model, a, b, c + k, len(k))
    assert shared.split(ctx, pairs[0][1])[0] == ctx[:-1] and lm.split(ctx, pairs[0][1])[0] == []
