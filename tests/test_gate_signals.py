"""Per-request signals beside the gate's score (kvtransfer.core.signals, issue 30 §1): each checked against an
independent computation (separate unbatched forwards, torch.nn.functional), their costs, the names' validation,
and the harness (events, per-item records, a gate artifact that decides by another signal)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvtransfer.core.cache import prefill
from kvtransfer.core.gate import tail_score
from kvtransfer.core.recompute import prefill_flops, token_flops
from kvtransfer.core.signals import (DEFAULT_SCORE, ENTROPIES, SIGNALS, check_score, check_signals,
                                     first_layer_error, request_signals, signal_costs)
from tiny_models import random_ids, tiny_model
from tolerance import assert_close, assert_far, assert_within, eps, forward_factor

TAIL, START = 5, [1]


def _model():
    """Peaky logits (initializer_range 0.3): distributions far from uniform, so the KL's variants differ."""
    return tiny_model("qwen3", layers=3, hidden=48, heads=6, seed=1, initializer_range=0.3)


def _batch():
    """Two rows of 24 slots, row 1 left-padded by 6; every row's real tokens start with START (a BOS)."""
    ids = random_ids(2, 24, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[0, 0], ids[1, 6] = START[0], START[0]
    return ids, mask


def _noisy(layers, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(k + scale * torch.randn(k.shape, generator=g), v + scale * torch.randn(v.shape, generator=g))
            for k, v in layers]


def _hand_logits(model, ids, mask, mapped, b):
    """Row b alone, unpadded, batch 1, straight through the HF model (no kvtransfer forward helper): the tail's
    logits on the mapped cache of the rest, and the no-context logits of START + the tail."""
    n, seq = int(mask[b].sum()), ids.shape[1]
    first = seq - n
    row = ids[b, first:]
    head = DynamicCache(ddp_cache_data=[(k[b:b + 1, :, first:seq - TAIL], v[b:b + 1, :, first:seq - TAIL])
                                        for k, v in mapped], config=model.config)
    with torch.no_grad():
        on_map = model(input_ids=row[None, -TAIL:], position_ids=torch.arange(n - TAIL, n)[None], cache=head,
                       use_cache=True).logits[0]
        free = model(input_ids=torch.tensor([START + row[-TAIL:].tolist()])).logits[0, len(START):]
    return on_map, free, row[-TAIL:]


def _rounding(model, logits):
    """|delta logits| bound of one float32 forward (tests/tolerance.FORWARD): eps x forward_factor x max |logit|."""
    return eps(torch.float32) * forward_factor(model, 24) * float(max(x.abs().max() for x in logits))


def test_tail_kl_entropies_and_nll_gain_equal_two_separate_forwards_by_hand():
    model = _model()
    ids, mask = _batch()
    mapped = _noisy(prefill(model, ids, mask), 2.0)
    got = request_signals(model, mapped, ids, mask, tail=TAIL, start_ids=START, native_sink=1, names=list(SIGNALS))
    assert list(got) == [*SIGNALS, *ENTROPIES] and all(v.dtype == torch.float64 and v.shape == (2,) for v in got.values())
    assert torch.equal(got["tail_kv"], tail_score(model, mapped, ids, mask, TAIL)[0])  # the gate's score exactly
    for b in range(2):
        on_map, free, tail = _hand_logits(model, ids, mask, mapped, b)
        lp, lq = F.log_softmax(on_map.double(), -1), F.log_softmax(free.double(), -1)
        kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1).mean()  # KL(p_mapped || p_nocontext)
        ent = [-(x[-1].exp() * x[-1]).sum() for x in (lp, lq)]
        gain = F.cross_entropy(on_map[:-1].double(), tail[1:]) - F.cross_entropy(free[:-1].double(), tail[1:])
        delta = 2 * _rounding(model, [on_map, free])  # both paths' logits each within the FORWARD bound
        ratio = float((lp - lq).abs().max())
        why = ("first order in the logits' rounding delta (FORWARD bound of each float32 path, batched/padded vs "
               "unbatched): a log-softmax moves by <= 2 delta, so KL by <= delta (2 + 2 max|log p/q|), an entropy by "
               "<= 2 delta (1 + max|log p|), a mean NLL difference by <= 2 delta")
        assert_within(got["tail_kl"][b], kl, atol=delta * (2 + 2 * ratio), reason=why)
        assert_within(got["tail_nll_gain"][b], gain, atol=2 * delta, reason=why)
        for name, e, lx in zip(ENTROPIES, ent, (lp, lq)):
            assert_within(got[name][b], e, atol=2 * delta * (1 + float(lx[-1].abs().max())), reason=why)
        # the comparison can fail: the reversed KL, a no-context run without the start ids, and an NLL read one
        # position off all lie outside the bounds above
        with torch.no_grad():
            bare = F.log_softmax(model(input_ids=tail[None]).logits[0].double(), -1)
        far = "the variant differs from the definition by more than the rounding bound"
        gap = ("the gap between two definitions on fixed weights is a property of the model, not rounding: it moves "
               "across machines only by the rounding the checks above see (<= 2e-6, vs a gap > 0.05)")
        assert_far(got["tail_kl"][b], F.kl_div(lp, lq, log_target=True, reduction="none").sum(-1).mean(),
                   atol=delta * (2 + 2 * ratio), reason=far, headroom_exempt=gap)
        assert_far(got["tail_kl"][b], F.kl_div(bare, lp, log_target=True, reduction="none").sum(-1).mean(),
                   atol=delta * (2 + 2 * ratio), reason=far, headroom_exempt=gap)
        shifted = F.cross_entropy(on_map[1:].double(), tail[1:]) - F.cross_entropy(free[1:].double(), tail[1:])
        assert_far(got["tail_nll_gain"][b], shifted, atol=2 * delta, reason=far)
        assert_far(got["tail_kl"][b], 0.0, atol=delta * (2 + 2 * ratio), reason="noise of scale 2 on every K/V")


def test_tail_signals_are_nan_where_the_row_is_too_short_and_nll_gain_needs_two_tail_tokens():
    model = _model()
    ids, mask = _batch()
    short = mask.clone()
    short[1, :24 - TAIL] = 0  # TAIL real tokens: no head left, tail_kv NaN
    got = request_signals(model, prefill(model, ids, short), ids, short, tail=TAIL, start_ids=START, native_sink=1,
                          names=["tail_kl", "tail_nll_gain"])
    assert all(math.isfinite(v[0]) and math.isnan(v[1]) for v in got.values())
    # the tail reaching into the start ids (TAIL + 1 real tokens, two start ids): NaN, not a wrong no-context
    edge = mask.clone()
    edge[1, :24 - TAIL - 1] = 0
    got = request_signals(model, prefill(model, ids, edge), ids, edge, tail=TAIL, start_ids=START * 2, native_sink=1,
                          names=["tail_kl"])
    assert math.isfinite(got["tail_kl"][0]) and math.isnan(got["tail_kl"][1])
    whole = request_signals(model, prefill(model, ids, mask), ids, mask, tail=24, start_ids=START, native_sink=1,
                            names=["tail_nll_gain", "tail_kv"])  # no head at all: NaN, and no entropies without tail_kl
    assert list(whole) == ["tail_nll_gain", "tail_kv"] and all(torch.isnan(v).all() for v in whole.values())
    one = request_signals(model, prefill(model, ids, mask), ids, mask, tail=1, start_ids=START, native_sink=1,
                          names=["tail_nll_gain", "tail_kl"])
    assert torch.isnan(one["tail_nll_gain"]).all() and torch.isfinite(one["tail_kl"]).all()


def test_first_layer_is_zero_on_the_targets_own_cache_and_a_hand_error_when_perturbed():
    model = _model()
    ids, mask = _batch()
    native = prefill(model, ids, mask)  # the target's own cache: batched, left-padded, every layer
    zero = first_layer_error(model, native[0], ids, mask, native_sink=1)
    c = model.config
    # layer-0 K/V pass one RMSNorm (hidden), one projection (hidden) and the k norm (head_dim) before RoPE: a
    # relative error <= eps x (2 hidden + head_dim + 4) per entry, squared in the relative squared error
    bound = (eps(torch.float32) * (2 * c.hidden_size + c.head_dim + 4)) ** 2
    assert_within(zero, torch.zeros(2, dtype=torch.float64), atol=bound,
                  reason="two float32 computations of the same layer-0 K/V (full batched prefill vs one unpadded layer): "
                         "a squared relative error of eps x (2 hidden + head_dim + 4)")
    g = torch.Generator().manual_seed(3)
    k, v = native[0]
    mk, mv = k + 0.3 * torch.randn(k.shape, generator=g), v + 0.1 * torch.randn(v.shape, generator=g)
    got = first_layer_error(model, (mk, mv), ids, mask, native_sink=1)
    for b, first in ((0, 0), (1, 6)):
        own = prefill(model, ids[b:b + 1, first:])[0]  # row b's own prefill, unpadded (not first_layer_kv)
        sl = slice(first + 1, None)  # real tokens after the native sink
        errs = []
        for m, n in ((mk, own[0]), (mv, own[1])):
            m, n = m[b, :, sl].double(), n[0, :, 1:].double()
            errs.append(((m - n) ** 2).sum() / (n ** 2).sum())
        want = (errs[0] + errs[1]) / 2
        assert_close(got[b], want, factor=8 * (2 * c.hidden_size + c.head_dim + 4) * 20, dtype=torch.float32,
                     reason="the hand error from a separate prefill: each native entry within eps x (2 hidden + "
                            "head_dim + 4); the squared-error ratio moves by 2x that relative to |N| / |M - N| (<= 20 "
                            "for noise 0.1 on V) for K and V, x4 for both terms and the denominators")
        assert_far(got[b], 0.0, atol=bound, reason="noise of scale 0.3 / 0.1 on the layer-0 K / V")
    # the native sink is never compared: noise on it leaves the signal exactly as it was
    sk, sv = k.clone(), v.clone()
    sk[0, :, 0], sk[1, :, 6] = 5.0, 5.0
    assert torch.equal(first_layer_error(model, (sk, sv), ids, mask, native_sink=1), zero)
    assert not torch.equal(first_layer_error(model, (sk, sv), ids, mask, native_sink=0), zero)


def test_signal_costs_follow_the_recompute_flop_conventions():
    c = _model().config
    n, m = 40, TAIL
    cost = signal_costs(c, n, tail=m, n_start=1, names=list(SIGNALS))
    full = prefill_flops(c, n)
    assert_close(cost["first_layer"], 1 / c.num_hidden_layers, factor=8,
                 reason="one layer of a prefill over the same tokens: the ratio of two float64 sums, 1/L exactly")
    assert_close(cost["tail_kv"], sum(token_flops(c, p + 1) for p in range(n - m, n)) / full, factor=4,
                 reason="the harness's gate FLOPs (tail tokens on the mapped cache) over a re-prefill, float64")
    head = 2 * c.hidden_size * c.vocab_size * m  # the LM head over the tail, once per forward
    want = cost["tail_kv"] + (2 * head + prefill_flops(c, 1 + m)) / full
    for name in ("tail_kl", "tail_nll_gain"):
        assert_close(cost[name], want, factor=16, reason="a float64 sum of four FLOP counts over the same denominator")
    assert signal_costs(c, 0, tail=m, n_start=1, names=["tail_kv"]) == {"tail_kv": 0.0}


def test_bad_signal_names_error_with_the_valid_names():
    from kvtransfer.eval.repair import repair_modes

    assert check_signals(None) == [] and check_signals(["tail_kl", "tail_kv", "tail_kl"]) == ["tail_kl", "tail_kv"]
    assert check_score(DEFAULT_SCORE) == "tail_kv"
    for call in (lambda: check_signals(["tail_kv", "kl"]), lambda: check_signals("tail_kv"), lambda: check_score("kl"),
                 lambda: repair_modes({"gate": {"enabled": True, "score": "kl"}}),
                 lambda: repair_modes({"gate": {"enabled": True, "signals": ["first_layer", "x"]}})):
        with pytest.raises(ValueError) as err:
            call()
        assert all(name in str(err.value) for name in SIGNALS)
    with pytest.raises(ValueError, match="tail_nll_gain"):
        request_signals(None, [], torch.ones(1, 3, dtype=torch.long), None, tail=1, start_ids=[], native_sink=0,
                        names=["bogus"])


def test_the_gates_key_holds_its_score_only_when_it_is_not_the_tail_score():
    from kvtransfer.runner.artifacts import ARTIFACTS, key_inputs
    from run_configs import compose_config

    cfg = compose_config("pair=qwen3_14b_32b")
    assert cfg["eval"]["gate"]["score"] == DEFAULT_SCORE and cfg["eval"]["gate"]["signals"] == list(SIGNALS)
    assert "eval.gate.score" not in key_inputs("gate", cfg)  # gates fitted before the key existed keep their keys
    for name in set(SIGNALS) - {DEFAULT_SCORE}:
        cfg["eval"]["gate"]["score"] = name
        assert key_inputs("gate", cfg)["eval.gate.score"] == name
    # the artifact table (a standard-library leaf) lists the non-default signals by hand: it must list all of them
    assert set(ARTIFACTS["gate"].when["eval.gate.score"][1]) == set(SIGNALS) - {DEFAULT_SCORE}


def _prefixes(tokenizer, bench_dir):
    import json

    text = " ".join(json.loads(line)["page"] for line in (bench_dir / "wikitext2.jsonl").open())
    ids = tokenizer.encode(text)
    return [ids[i * 50:i * 50 + n] for i, n in enumerate((12, 30, 21, 40, 9, 33))]


def test_events_and_item_records_carry_the_signals_and_the_artifacts_score_decides(
        eval_model, eval_tokenizer, eval_mapper, bench_dir, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvtransfer.core.gate import decide, load_gate, save_gate
    from kvtransfer.eval.adapter import KVTransferLM
    from kvtransfer.eval.items import attach_events
    from kvtransfer.runner import eval_stage

    wide = {"recompute": 1e9, "full": 1e9, "fraction": 0.15}  # every row mapped: the cache stays the map
    lm = KVTransferLM(source_model=eval_model, target_model=eval_model, tokenizer=eval_tokenizer, mapper=eval_mapper,
                      mode="transfer", gate=wide, gate_tail=4, gate_signals=list(SIGNALS), batch_size=6)
    prefixes = _prefixes(eval_tokenizer, bench_dir)
    lm.prefix_cache(prefixes)
    events = list(lm.events)
    assert len(events) == len(prefixes)
    for e in events:
        assert list(e["signals"]) == [*SIGNALS, *ENTROPIES] and e["signals"]["tail_kv"] == e["score"]
        assert all(isinstance(x, float) and math.isfinite(x) for x in e["signals"].values())
        assert e["signal_costs"] == signal_costs(eval_model.config, e["tokens"], tail=4, n_start=len(lm._start_ids),
                                                 names=list(SIGNALS))
    # thresholds on first_layer that split the rows differently from the same thresholds on tail_kv
    fl = sorted(e["signals"]["first_layer"] for e in events)
    split = {"recompute": fl[2], "full": fl[2], "fraction": 0.15}
    by_fl = [decide(e["signals"]["first_layer"], split).action for e in events]
    assert by_fl.count("map") == 3 and by_fl != [decide(e["score"], split).action for e in events]
    save_gate(tmp_path / "gate.json", split, {"score": "first_layer", "tail": 4})
    artifact = load_gate(tmp_path / "gate.json")
    monkeypatch.setattr(eval_stage.gate_stage, "gate", lambda run: artifact)
    run = SimpleNamespace(cfg={"eval": {"gate": {"tail": 4, "signals": ["tail_kl"]}}})
    gated, mode = eval_stage.control_lm(lm, "gated", run, 0)
    assert mode == "transfer" and gated.gate_score == "first_layer" and gated.gate_signals == ["tail_kl"]
    gated.prefix_cache(prefixes)
    assert [e["action"] for e in gated.events] == by_fl
    assert [e["score"] for e in gated.events] == [e["signals"]["first_layer"] for e in events]  # same map, kernels
    assert all(list(e["signals"]) == ["tail_kl", *ENTROPIES] for e in gated.events)
    # per item: the record of the item's cached prefix carries its signals and their costs
    items = [{"task": "t", "doc_id": i, "prefixes": [e["key"]]} for i, e in enumerate(gated.events)]
    recs = attach_events(items, gated.events)
    assert [r["gate"]["signals"] for r in recs] == [e["signals"] for e in gated.events]
    assert [r["gate"]["signal_costs"] for r in recs] == [e["signal_costs"] for e in gated.events]
    # an artifact from before eval.gate.score decides by the tail score; an unknown score is refused by name
    artifact = {k: v for k, v in artifact.items() if k != "score"}
    assert eval_stage.control_lm(lm, "gated", run, 0)[0].gate_score == "tail_kv"
    artifact["score"] = "kl"
    with pytest.raises(ValueError, match="first_layer"):
        eval_stage.control_lm(lm, "gated", run, 0)
    # no signals asked for: the events are what they were before signals existed
    plain = lm.with_mode("transfer", gate_signals=[], events=[])
    plain.prefix_cache(prefixes)
    assert all("signals" not in e and "signal_costs" not in e for e in plain.events)
    assert [(e["score"], e["cost"]) for e in plain.events] == [(e["score"], e["cost"]) for e in events]
