"""Selective recompute (kvtransfer.core.recompute, issue 30): r = 0 is the map, r = 1 the target's own prefill,
the chosen tokens are recomputed on the mapped rest, the native sink is never chosen, the cost is counted."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.core.cache import prefill
from kvtransfer.core.recompute import (choose_tokens, first_layer_kv, prefill_flops, recompute_cost, recompute_row,
                                  selective_recompute,
                                  token_deviation, token_flops)
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, forward_factor


def _model():
    return tiny_model("qwen3", layers=3, hidden=48, heads=6, seed=1)


def _noisy(layers, sink=0, scale=0.3, seed=0, first=None):
    """A stand-in for a mapped cache: the native one plus noise, the first `sink` real positions of each row
    (row b's real tokens start at slot first[b], default 0) left native."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, v in layers:
        k2 = k + scale * torch.randn(k.shape, generator=g)
        v2 = v + scale * torch.randn(v.shape, generator=g)
        for b, f in enumerate(first or [0] * k.shape[0]):
            k2[b, :, f:f + sink], v2[b, :, f:f + sink] = k[b, :, f:f + sink], v[b, :, f:f + sink]
        out.append((k2, v2))
    return out


def test_r0_returns_the_mapped_cache_itself():
    model, ids = _model(), random_ids(2, 16, seed=2)
    mapped = _noisy(prefill(model, ids))
    out, rec = selective_recompute(model, ids, mapped, 0.0, select="deviation", native_sink=1)
    assert all(a is b and c is d for (a, c), (b, d) in zip(out, mapped))
    assert [r["recomputed"] for r in rec] == [0, 0]


@pytest.mark.parametrize("select", ["deviation", "random", "recent"])
@pytest.mark.parametrize("sink", [0, 1])
def test_r1_is_the_targets_own_prefill(select, sink):
    model = _model()
    ids = random_ids(2, 24, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # a left-padded row: recomputed unpadded, compared on its real positions
    native = prefill(model, ids, mask)
    row1 = prefill(model, ids[1:, 6:])  # row 1's own cache without padding
    mapped = _noisy(native, sink=sink, first=[0, 6])
    out, rec = selective_recompute(model, ids, mapped, 1.0, select=select, attention_mask=mask, native_sink=sink)
    assert [r["recomputed"] for r in rec] == [24 - sink, 18 - sink]
    for (k, v), (nk, nv), (rk, rv) in zip(out, native, row1):
        assert torch.equal(k[:1], nk[:1]) and torch.equal(v[:1], nv[:1])  # unpadded row: the same kernels and shapes
        for a, e in ((k[1:, :, 6:], rk), (v[1:, :, 6:], rv)):
            assert_close(a, e, factor=forward_factor(model, 24), reason=FORWARD)


def test_recomputed_tokens_read_the_mapped_rest_and_others_stay_mapped():
    model, ids = _model(), random_ids(1, 20, seed=4)
    native = prefill(model, ids)
    mapped = _noisy(native, sink=1)
    out, rec = selective_recompute(model, ids, mapped, 0.3, select="recent", native_sink=1)
    chosen = rec[0]["positions"]
    assert chosen == list(range(20 - round(0.3 * 19), 20))
    others = [p for p in range(20) if p not in chosen]
    for (k, v), (mk, mv) in zip(out, mapped):
        assert torch.equal(k[:, :, others], mk[:, :, others]) and torch.equal(v[:, :, others], mv[:, :, others])
    # layer 0's K/V of a token depend on the token alone: recomputed ones are the target's own
    assert_close(out[0][0][:, :, chosen], native[0][0][:, :, chosen], factor=2 * 48, reason="one projection (hidden "
                 "48) + norm, the same op on a shorter row: eps x reduction length, x2 for the norm")
    # deeper layers read the mapped (noisy) rest, so they are not the native values
    assert_far(out[-1][0][:, :, chosen], native[-1][0][:, :, chosen], atol=1e-3,
               reason="the noise (0.3 per entry) on the kept tokens reaches the chosen tokens' deeper layers")
    # with an exact map, recomputing anything gives the native cache
    same, _ = selective_recompute(model, ids, native, 0.5, select="random", native_sink=1, seed=5)
    for (k, v), (nk, nv) in zip(same, native):
        assert_close(k, nk, factor=forward_factor(model, 20), reason=FORWARD)
        assert_close(v, nv, factor=forward_factor(model, 20), reason=FORWARD)


def test_choice_rules():
    assert choose_tokens(10, 0.0, "random").tolist() == []
    assert choose_tokens(10, 1.0, "random", native_sink=1).tolist() == list(range(1, 10))
    assert choose_tokens(10, 1.0, "deviation", native_sink=1).tolist() == list(range(1, 10))  # nothing to rank
    assert choose_tokens(11, 0.3, "recent", native_sink=1).tolist() == [8, 9, 10]
    r = choose_tokens(101, 0.2, "random", native_sink=1, seed=3)
    assert len(r) == 20 and 0 not in r.tolist() and r.tolist() == sorted(r.tolist())
    assert r.tolist() == choose_tokens(101, 0.2, "random", native_sink=1, seed=3).tolist()
    assert r.tolist() != choose_tokens(101, 0.2, "random", native_sink=1, seed=4).tolist()
    dev = torch.tensor([100.0, 1, 5, 2, 9, 0])
    assert choose_tokens(6, 0.4, "deviation", native_sink=1, deviation=dev).tolist() == [2, 4]  # never the sink
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"in \[0, 1\]"):
            choose_tokens(10, bad, "random")
    with pytest.raises(ValueError, match="use one of"):
        choose_tokens(10, 0.5, "largest")
    with pytest.raises(ValueError, match="needs a deviation"):
        choose_tokens(10, 0.5, "deviation")


def test_deviation_picks_the_tokens_whose_first_layer_is_wrong():
    model, ids = _model(), random_ids(1, 16, seed=6)
    native = prefill(model, ids)
    k0, v0 = first_layer_kv(model, ids)
    assert torch.equal(k0, native[0][0]) and torch.equal(v0, native[0][1])  # one layer of the same prefill
    mapped = [(k.clone(), v.clone()) for k, v in native]
    bad = [3, 7, 12]
    for k, v in mapped:
        k[:, :, bad] += 1.0
    dev = token_deviation((mapped[0][0][0], mapped[0][1][0]), (k0[0], v0[0]))
    assert sorted(torch.topk(dev, 3).indices.tolist()) == bad
    _, rec = selective_recompute(model, ids, mapped, 3 / 15, select="deviation", native_sink=1)
    assert rec[0]["positions"] == bad


def test_cost_counts_flops_against_a_re_prefill():
    cfg = _model().config
    h, heads, d, kv, inter, layers = 48, 6, 8, 2, 96, 3
    linear = 2 * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter)
    assert token_flops(cfg, 10) == layers * (linear + 4 * heads * d * 10)
    assert prefill_flops(cfg, 4) == sum(token_flops(cfg, i + 1) for i in range(4))
    full = recompute_cost(cfg, 20, list(range(20)), "random")
    assert full["fraction"] == 1.0 and full["flops"] == prefill_flops(cfg, 20)
    dev = recompute_cost(cfg, 20, [5, 19], "deviation")
    assert dev["flops"] == token_flops(cfg, 6) + token_flops(cfg, 20) + prefill_flops(cfg, 20, layers=1)
    assert recompute_cost(cfg, 20, [], "deviation")["flops"] == 0


def test_range_flops_is_the_closed_form_of_the_per_token_sum():
    from kvtransfer.core.recompute import range_flops, token_flops

    cfg = tiny_model("qwen3", layers=3).config
    for a, b in [(0, 0), (0, 1), (0, 37), (5, 37), (36, 37), (10, 5)]:
        loop = sum(token_flops(cfg, p + 1) for p in range(a, b))
        assert range_flops(cfg, a, b) == loop  # integers well inside float64's exact range
    assert range_flops(cfg, 0, 64) == prefill_flops(cfg, 64)


@pytest.mark.parametrize("select", ["deviation", "random", "recent"])
def test_rows_of_one_length_recompute_in_one_pass_as_each_row_alone(select):
    """Equal-length rows take one batched target pass (recompute_rows): each row's result is recompute_row's on that
    row alone, up to the kernels' rounding at another batch size; the tokens not chosen stay the mapped ones exactly."""
    model, ids = _model(), random_ids(3, 20, seed=6)
    native = prefill(model, ids)
    mapped = _noisy(native, sink=1, seed=2)
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    try:
        out, rec = selective_recompute(model, ids, mapped, 0.3, select=select, native_sink=1, seed=4)
    finally:
        hook.remove()
    first_layer_passes = 3 if select == "deviation" else 0  # the deviation rule's one-layer prefill, per row
    assert len(calls) == first_layer_passes + 1  # one recompute pass for the batch
    for b in range(3):
        chosen = torch.tensor(rec[b]["positions"])
        assert len(chosen) == round(0.3 * 19) and 0 not in rec[b]["positions"]
        alone = recompute_row(model, ids[b], [(k[b:b + 1], v[b:b + 1]) for k, v in mapped], chosen)
        others = [p for p in range(20) if p not in rec[b]["positions"]]
        for (k, v), (ak, av), (mk, mv) in zip(out, alone, mapped):
            assert torch.equal(k[b, :, others], mk[b, :, others]) and torch.equal(v[b, :, others], mv[b, :, others])
            assert_close(k[b:b + 1], ak, factor=forward_factor(model, 20), reason=FORWARD)
            assert_close(v[b:b + 1], av, factor=forward_factor(model, 20), reason=FORWARD)
        assert_far(out[-1][0][b, :, chosen], mapped[-1][0][b, :, chosen], atol=1e-3,
                   reason="recomputed: the target's values, not the map's noise (0.3 per entry)")
