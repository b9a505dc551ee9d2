"""The served gate's pure logic (kvtransfer.serve.gating, policy's gate bookkeeping): default suite, no vLLM."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from tolerance import assert_within

from kvtransfer.core.gate import Decision, save_gate, tail_score_kv
from kvtransfer.core.recompute import choose_tokens
from kvtransfer.serve import gating
from kvtransfer.serve.policy import Counters, Decider, Decision as PDecision, MapSpec

T = {"recompute": 0.1, "full": 0.5, "fraction": 0.15}


def test_plan_leaves_the_gate_tail_to_the_target_or_refuses_a_context_too_short():
    assert gating.plan(0, 300, 8, 1) == 292
    assert gating.plan(0, 9, 8, 1) is None  # only the sink before the tail
    assert gating.plan(288, 296, 8, 1) is None  # nothing beyond the cached tokens


@pytest.mark.parametrize("hi,fraction", [(300, 0.15), (299, 0.5), (77, 0.3), (150, 0.05)])
def test_recompute_start_is_the_recent_rule_rounded_down_to_a_block(hi, fraction):
    """The served recompute = core.recompute's `recent` choice, extended to the start of its first block."""
    d = Decision("recompute", fraction, 0.2, "")
    start = gating.recompute_start(d, lo=0, head_end=hi - 8, hi=hi, native_sink=1, block_size=16)
    chosen = choose_tokens(hi, fraction, "recent", native_sink=1)
    assert start == min(hi - 8, int(chosen[0]) // 16 * 16)
    assert start % 16 == 0 or start == hi - 8


def test_recompute_start_for_map_and_full():
    kw = dict(lo=0, head_end=292, hi=300, native_sink=1, block_size=16)
    assert gating.recompute_start(Decision("map", 0.0, 0.0, ""), **kw) == 292
    assert gating.recompute_start(Decision("full", 1.0, 9.0, ""), **kw) == 0
    assert gating.recompute_start(Decision("full", 1.0, 9.0, ""), **(kw | {"lo": 32})) == 32
    # a recompute smaller than the gate's tail: those tokens are native already, nothing to invalidate
    small = gating.recompute_start(Decision("recompute", 0.01, 0.2, ""), **(kw | {"head_end": 304, "hi": 312}))
    assert small == 304 and gating.invalid_blocks(list(range(20)), small, 304, 16) == []
    # ... but a block that holds a mapped token is recomputed whole
    assert gating.recompute_start(Decision("recompute", 0.01, 0.2, ""), **kw) == 288


def test_invalid_blocks_cover_start_to_the_last_mapped_block():
    blocks = list(range(100, 120))
    assert gating.invalid_blocks(blocks, 0, 292, 16) == blocks[:19]  # 292 tokens: blocks 0..18
    assert gating.invalid_blocks(blocks, 144, 292, 16) == blocks[9:19]
    assert gating.invalid_blocks(blocks, 292, 292, 16) == []


def test_load_served_gate_never_raises(tmp_path):
    assert gating.load_served_gate(None) is None
    missing = gating.load_served_gate(tmp_path / "nope.json")
    assert missing.thresholds is None and "No such file" in missing.error and missing.tail == gating.DEFAULT_TAIL
    (tmp_path / "bad.json").write_text(json.dumps({"format": "kvtransfer-gate/1", "thresholds": {"recompute": "x"}}))
    bad = gating.load_served_gate(tmp_path / "bad.json")
    assert bad.thresholds is None and "lack" in bad.error
    (tmp_path / "junk.json").write_text("{not json")
    assert gating.load_served_gate(tmp_path / "junk.json").error
    save_gate(tmp_path / "g.json", T, {"tail": 5})
    good = gating.load_served_gate(tmp_path / "g.json")
    assert good.error == "" and good.tail == 5 and good.thresholds["full"] == T["full"]
    assert gating.load_served_gate(tmp_path / "g.json", tail=3).tail == 3
    assert gating.load_served_gate(tmp_path / "g.json", tail=0).error  # a tail of 0 cannot score


def _kv(seed, layers=3, n_kv=2, m=8, d=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n_kv, m, d, generator=g), torch.randn(n_kv, m, d, generator=g)) for _ in range(layers)]


def test_score_and_decide_uses_the_cores_score():
    a, b = _kv(0), _kv(1)
    batch = lambda kv: [(k[None], v[None]) for k, v in kv]  # noqa: E731
    same = gating.score_and_decide(T, batch(a), batch(a))
    assert same.action == "map" and same.score == 0.0
    other = gating.score_and_decide(T, batch(a), batch(b))
    assert other.score == float(tail_score_kv(batch(a), batch(b))[0]) and other.action == "full"
    broken = gating.score_and_decide(T, batch(a), batch(a)[:1])  # layer counts differ
    assert broken.action == "full" and broken.score is None and "gate error" in broken.reason
    assert gating.score_and_decide(None, batch(a), batch(a)).action == "full"  # unreadable thresholds


class _Layout:
    """A paged layout stand-in: a layer is (K, V) [n_kv, slots, d]; gather reads the slots."""

    def gather(self, layer, slots):
        return layer[0][:, slots], layer[1][:, slots]


def _spec(lo=0, hi=40, gate_hi=48, prompt_len=49):
    return SimpleNamespace(req_id="r", lo=lo, hi=hi, gate_hi=gate_hi, block_ids=list(range(10, 14)),
                           native_sink=1, prompt_len=prompt_len)


def test_after_forward_scores_the_native_tail_and_reports_the_blocks_to_recompute():
    spec = _spec()
    native = _kv(2, m=64)
    slots = torch.arange(40, 48) + 0  # block ids 10..13 of 16 tokens: slots 160.. ; the stand-in indexes them
    paged_layers = [(k.new_zeros(k.shape[0], 16 * 14, k.shape[2]), v.new_zeros(v.shape[0], 16 * 14, v.shape[2]))
                    for k, v in native]
    for (pk, pv), (k, v) in zip(paged_layers, native):
        pk[:, 160 + slots], pv[:, 160 + slots] = k[:, slots], v[:, slots]
    tail = [(k[:, slots], v[:, slots]) for k, v in native]
    layers = list(enumerate(paged_layers))
    records, failed = gating.after_forward({"r": (spec, tail)}, layers, _Layout(), T, 16)
    assert records["r"]["action"] == "map" and failed == set() and records["r"]["start"] == 40
    assert records["r"]["mapped"] == 40 and records["r"]["prefilled"] == 9
    off = [(k + 1.0, v + 1.0) for k, v in tail]
    records, failed = gating.after_forward({"r": (spec, off)}, layers, _Layout(), T, 16)
    assert records["r"]["action"] == "full" and failed == {10, 11, 12} and records["r"]["prefilled"] == 49
    rec_t = T | {"full": 1e9, "fraction": 0.5}
    records, failed = gating.after_forward({"r": (spec, off)}, layers, _Layout(), rec_t, 16)
    # recent 0.5 of the 47 candidates 1..47: from 24 -> the block at 16
    assert records["r"]["action"] == "recompute" and records["r"]["start"] == 16 and failed == {11, 12}
    records, failed = gating.after_forward({"r": (spec, off[:1])}, layers, _Layout(), T, 16)
    assert records["r"]["action"] == "full" and records["r"]["score"] is None and failed == {10, 11, 12}


def test_load_served_gate_refuses_thresholds_fitted_on_another_score(tmp_path):
    """The worker computes tail_kv only: a gate fitted on another signal would be read on the wrong scale, so it is
    unusable (every request prefilled normally), and the error names the fix."""
    save_gate(tmp_path / "other.json", T, {"tail": 8, "score": "first_layer"})
    other = gating.load_served_gate(tmp_path / "other.json")
    assert other.thresholds is None and "tail_kv" in other.error and "first_layer" in other.error
    save_gate(tmp_path / "kv.json", T, {"tail": 8, "score": "tail_kv"})
    assert gating.load_served_gate(tmp_path / "kv.json").error == ""


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100)


def test_served_cost_counts_the_scored_step_and_the_recompute_after_it():
    """Against core.recompute.prefill_flops's closed form (a prefill of n tokens = the sum of its tokens' FLOPs): map
    = the positions vLLM computed (0..lo-1 and head_end..P-1); recompute / full add start..P-1 again."""
    from kvtransfer.core.recompute import prefill_flops

    cfg, n, head, lo = _qwen2_config(), 200, 192, 1
    full = prefill_flops(cfg, n)
    scored = prefill_flops(cfg, lo) + full - prefill_flops(cfg, head)
    why = ("float64 sums of <= 2 x 200 token counts of ~1e6 FLOPs against closed forms: relative error <= ~400 eps64 "
           "~ 5e-14 of a ratio <= 2")
    assert_within(gating.served_cost(cfg, lo=lo, head_end=head, start=head, prompt_len=n), scored / full, atol=1e-12,
                  reason=why)
    for start in (0, 1, 128):
        again = full - prefill_flops(cfg, start)
        assert_within(gating.served_cost(cfg, lo=lo, head_end=head, start=start, prompt_len=n), (scored + again) / full,
                      atol=1e-12, reason=why)
    assert gating.served_cost(cfg, lo=0, head_end=head, start=0, prompt_len=n) > 1  # a fallback: dearer than a prefill
    spec, native = _spec(), _kv(2, m=64)
    slots = torch.arange(40, 48)
    layers = list(enumerate([(k.new_zeros(k.shape[0], 16 * 14, k.shape[2]), v.new_zeros(v.shape[0], 16 * 14, v.shape[2]))
                             for k, v in native]))
    for (pk, pv), (k, v) in zip([x for _, x in layers], native):
        pk[:, 160 + slots], pv[:, 160 + slots] = k[:, slots], v[:, slots]
    tail = [(k[:, slots], v[:, slots]) for k, v in native]
    records, _ = gating.after_forward({"r": (spec, tail)}, layers, _Layout(), T, 16, config=cfg)
    assert records["r"]["cost"] == gating.served_cost(cfg, lo=0, head_end=40, start=40, prompt_len=49)
    assert gating.after_forward({"r": (spec, tail)}, layers, _Layout(), T, 16)[0]["r"]["cost"] is None


def test_response_carries_the_gate_and_the_tokens_it_left_mapped():
    summary = {"reason": "mapped", "mapped": 40, "matched": 40, "prefilled": 9, "tail": 9, "prompt": 49}
    rec = gating.record(Decision("full", 1.0, 2.0, "x"), start=0, lo=0, hi=48, prompt_len=49, tail=8)
    out = gating.response(summary, rec)
    assert out["gate"] == rec and out["mapped"] == 0 and out["prefilled"] == 49 and rec["recomputed"] == 1.0
    assert gating.response(summary, None) == summary
    from kvtransfer.serve.connector import WorkerMeta

    meta = WorkerMeta({"a": rec}, stored=["h1"]).aggregate(WorkerMeta({"b": rec}, missing=["h2"], unusable="x"))
    assert set(meta.gates) == {"a", "b"} and (meta.stored, meta.missing, meta.unusable) == (["h1"], ["h2"], "x")


def test_decider_keeps_a_gate_fallback_and_counters_count_each_gate_once(tmp_path):
    counters = Counters()
    store = SimpleNamespace()
    decider = Decider(store, MapSpec("h"), counters)
    mapped = PDecision("mapped", 10, 0, 10, 1)
    decider._memo["r"] = (11, 0, mapped)
    counters.record("r", 11, mapped)
    decider.fail("r", "gate file unusable", reason="gate_unusable")
    assert counters.reasons == {"gate_unusable": 1}
    assert decider.get("r", list(range(11)), 3).reason == "gate_unusable"  # final: not re-decided
    rec = gating.record(gating.unscored("gate_unusable: x"), start=0, lo=0, hi=10, prompt_len=11, tail=8)
    counters.annotate("r", rec)
    counters.annotate("r", rec)
    counters.record("r", 11, PDecision("gate_unusable"), count=False)  # a re-record keeps the gate
    snap = counters.snapshot()
    assert snap["gates"] == {"full": 1} and snap["requests"]["r"]["gate"] == rec
    assert math.isnan(float("nan")) and rec["score"] is None
