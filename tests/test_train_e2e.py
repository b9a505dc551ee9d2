"""Issue 23 §1, end to end: the paper's map trained for the frozen target's next-token KL (kvtransfer.maps.train_e2e).

- what the loss reads is what `transfer` and the target compute: the mapped context cache is `transfer`'s, the
  native log-probs are the target's own on the whole sequence; the collection's bytes are the stated formula;
- the gradient autograd carries through the target, its cache and the RoPE re-application matches central
  finite differences in float64;
- the native solution (target -> target, identity map) has zero KL and zero gradient; a perturbed identity is
  trained back toward it; training that diverges keeps the starting weights bit for bit and says so;
- the per-step activation formula bounds what autograd actually saves.
"""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, assert_within, eps, forward_factor

from kvtransfer.core.cache import prefill
from kvtransfer.core.mapper import Mapper
from kvtransfer.core.models import model_identity
from kvtransfer.maps.train_e2e import (
    collect_e2e,
    e2e_nbytes,
    e2e_step_nbytes,
    frozen,
    kl_sum,
    mapped_layers,
    mapped_logprobs,
    mean_kl,
    native_logprobs,
    train_e2e,
)
from kvtransfer.maps.train_map import TrainSettings
from kvtransfer.core.transfer import transfer

# the target: 3 layers, 6 query heads, 3 KV heads of 8 dims (q = 24), hidden 48; the source: 2 layers, 2 KV heads
# of 8 dims; k = 2 source layers per target layer (p = 32)
SELECTED = [[1, 0], [0, 1], [1, 0]]
P, Q = 2 * 2 * 8, 3 * 8
IDENTITY_SELECTED = [[0], [1], [2]]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny problems: one thread runs their many small ops faster than a contended pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _source(**kw):
    return tiny_model("qwen3", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, seed=1, **kw)


def _target(**kw):
    return tiny_model("qwen3", layers=3, hidden=48, heads=6, kv_heads=3, head_dim=8, seed=2, **kw)


def _float64(model):
    """The model in float64 end to end: SDPA attention (HF's eager softmax runs in float32) and RMSNorms computed
    in the input's dtype (HF's upcast to float32 would put float32 rounding into a float64 check). The function
    differentiated is then this model's; any differentiable target checks the gradient path equally."""
    model = model.double()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = (lambda m: lambda x: m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                              + m.variance_epsilon)))(module)
    return model


def _random_map(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 2, P, Q, generator=g, dtype=dtype) / P ** 0.5,
            0.1 * torch.randn(3, 2, Q, generator=g, dtype=dtype))


def _identity(dtype=torch.float32):
    return torch.eye(Q, dtype=dtype).expand(3, 2, Q, Q).clone(), torch.zeros(3, 2, Q, dtype=dtype)


# -- the loss reads what transfer and the target compute -----------------------------------------------------
def test_the_mapped_cache_is_transfers_and_the_native_log_probs_are_the_targets_own():
    source, target = _source(), _target()
    weight, bias = _random_map()
    mapper = Mapper(weight=weight, bias=bias, selected_layers=torch.tensor(SELECTED), source=model_identity(source),
                    target=model_identity(target), native_sink=1)
    ids = random_ids(3, 14, seed=5)
    data = collect_e2e(source, target, ids, [0, 1], context=9, native_sink=1, batch_size=2)
    ctx = ids[:, :9]
    applied = transfer(prefill(source, ctx), mapper, source, target, input_ids=ctx, as_layers=True)
    for (k, v), (tk, tv) in zip(mapped_layers(data, [0, 1, 2], weight, bias, SELECTED), applied):
        for ours, theirs in ((k, tk), (v, tv)):
            assert_close(ours, theirs, factor=4 * (P + 8),
                         reason="float32 affine map (p = 32) + RoPE strip/apply (d = 8), two orderings")
    with torch.no_grad():
        own = target(input_ids=ids).logits[:, 9:].float().log_softmax(-1)
    # the native hidden states come from a cached prefill + the continuation, the reference from one whole pass
    assert_close(native_logprobs(target, data, [0, 1, 2]), own, factor=forward_factor(target, 14), reason=FORWARD)
    assert data.continuation.shape == (3, 5) and torch.equal(data.continuation, ids[:, 9:])


def test_the_collection_holds_the_stated_bytes():
    source, target = _source(), _target()
    data = collect_e2e(source, target, random_ids(3, 12, seed=7), [0, 1], context=8, native_sink=2, batch_size=2)
    assert data.nbytes == e2e_nbytes(3, 8, 4, 2, 2 * 8, 3, 3, 8, 48, 2)
    assert data.source_k.shape == (3, 8, 2 * 16) and data.native_hidden.shape == (3, 4, 48)
    assert data.sink_k[0].shape == (3, 3, 2, 8)
    with pytest.raises(ValueError, match="at least one continuation token"):
        collect_e2e(source, target, random_ids(1, 8, seed=7), [0], context=8)


# -- the gradient -------------------------------------------------------------------------------------------
def test_the_gradient_matches_central_differences_in_float64():
    source, target = _float64(_source(attn_implementation="sdpa")), _float64(_target(attn_implementation="sdpa"))
    ids = random_ids(2, 14, seed=3)
    data = collect_e2e(source, target, ids, [0, 1], context=8, native_sink=1, dtype=torch.float64)
    weight, bias = _random_map(dtype=torch.float64)
    rows = [0, 1]

    def f(w, b) -> float:
        with torch.no_grad():
            s, count = kl_sum(target, data, rows, w, b, SELECTED)
        return float(s) / count

    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    with frozen(target):
        s, count = kl_sum(target, data, rows, w, b, SELECTED)
        (s / count).backward()
        logq_scale = float(mapped_logprobs(target, data, rows, weight, bias, SELECTED).abs().max())
    f0 = f(weight, bias)
    assert f0 > 0
    # entries: a key weight of layer 1 (its gradient passes the RoPE re-application), a value weight of layer 2,
    # a key bias of layer 0 (positions 1.. only: position 0 is the native sink)
    for name, index in (("weight", (1, 0, 3, 5)), ("weight", (2, 1, 7, 2)), ("bias", (0, 0, 4))):
        grad = float((w.grad if name == "weight" else b.grad)[index])

        def at(delta: float) -> float:
            w2, b2 = weight.clone(), bias.clone()
            (w2 if name == "weight" else b2)[index] += delta
            return f(w2, b2)

        h, big = 1e-4, 1e-2
        fd = (at(h) - at(-h)) / (2 * h)
        # |fd - f'| <= h^2 / 6 |f'''| (truncation) + max rounding of f / h. f''' from a 5-point stencil at a step
        # 100x larger (x2: it varies over the stencil); f's rounding: KL = sum p (log p - log q), each log q off
        # by at most eps64 x forward_factor x its scale (the FORWARD bound), p summing to 1 per position
        third = (at(2 * big) - 2 * at(big) + 2 * at(-big) - at(-2 * big)) / (2 * big ** 3)
        rounding = eps(torch.float64) * forward_factor(target, 14) * logq_scale
        atol = 2 * h * h / 6 * abs(third) + 2 * rounding / (2 * h)
        assert_within(grad, fd, atol=atol, reason="central difference at h = 1e-4: truncation h^2 f'''/6 "
                      "(f''' by a stencil at 1e-2, x2) + float64 rounding of f (eps64 x forward_factor x |log q|) / h")
        # and the check can fail: the gradient is far above that bound
        assert_far(grad, 0.0, atol=atol, reason="the gradient exceeds the finite-difference bound, so the "
                   "comparison above tells a right gradient from a wrong or missing one")


# -- the native solution, a perturbed start, a diverging one -------------------------------------------------
def test_at_the_native_solution_the_kl_and_its_gradient_are_zero():
    target = _float64(_target(attn_implementation="sdpa"))
    ids = random_ids(3, 14, seed=4)
    data = collect_e2e(target, target, ids, [0, 1, 2], context=9, native_sink=1, dtype=torch.float64)
    weight, bias = _identity(torch.float64)
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rows = [0, 1, 2]
    with frozen(target):
        s, count = kl_sum(target, data, rows, w, b, IDENTITY_SELECTED)
        (s / count).backward()
        logq = mapped_logprobs(target, data, rows, weight, bias, IDENTITY_SELECTED)
        # the gradient's scale: the mean NLL of the continuation's next tokens under the mapped model has the
        # gradient J^T (q - onehot) / n, the KL J^T (q - p) / n; |q - onehot| is O(1), |q - p| rounding
        nll = mapped_logprobs(target, data, rows, w, b, IDENTITY_SELECTED)[:, :-1]
        nll = -nll.gather(-1, data.continuation[:, 1:, None]).mean()
        scale_w, scale_b = torch.autograd.grad(nll, (w, b))
    logp = native_logprobs(target, data, rows, torch.float64)
    factor = forward_factor(target, 14)
    reason = ("float64: the identity map strips and re-applies RoPE with the same tables, then the same forward; "
              "KL and log-prob differences are rounding (eps64 x forward_factor x |log p|)")
    magnitude = float(logp.abs().max())
    assert_close(float(s.detach()) / count, 0.0, dtype=torch.float64, factor=factor, magnitude=magnitude, reason=reason)
    assert_close(logq, logp, dtype=torch.float64, factor=factor, reason=reason)
    grad_reason = ("the KL gradient is the NLL gradient with (q - p) ~ eps64 x forward_factor in place of "
                   "(q - onehot) ~ 1: rounding relative to the NLL gradient's scale")
    assert_close(w.grad, torch.zeros_like(w.grad), dtype=torch.float64, factor=factor,
                 magnitude=float(scale_w.abs().max()), reason=grad_reason)
    assert_close(b.grad, torch.zeros_like(b.grad), dtype=torch.float64, factor=factor,
                 magnitude=float(scale_b.abs().max()), reason=grad_reason)


def _perturbed_identity_problem(n_fit=32, n_stop=8):
    """target -> target at sharper logits than the default init (initializer_range 0.1: the map's errors show in
    the outputs), 16-token sequences (10 context, 6 continuation), the identity map perturbed by 30 % noise."""
    target = _target(initializer_range=0.1)
    data = collect_e2e(target, target, random_ids(n_fit + n_stop, 16, seed=3), [0, 1, 2], context=10, native_sink=1)
    eye, zero = _identity()
    g = torch.Generator().manual_seed(1)
    start_w = eye + 0.3 * torch.randn(eye.shape, generator=g) / Q ** 0.5
    start_b = 0.3 * torch.randn(zero.shape, generator=g) / Q ** 0.5
    return target, data, (eye, zero), (start_w, start_b), list(range(n_fit)), list(range(n_fit, n_fit + n_stop))


def test_a_perturbed_identity_is_trained_back_toward_it():
    target, data, (eye, zero), (start_w, start_b), fit, stop = _perturbed_identity_problem()
    settings = TrainSettings(lr=3e-3, steps=100, batch_sequences=8, eval_every=10, patience=100)
    w, b, record = train_e2e(target, data, start_w, start_b, IDENTITY_SELECTED, fit, stop, settings)
    assert record["stop_kl_start"] == mean_kl(target, data, stop, start_w, start_b, IDENTITY_SELECTED, chunk=8)
    assert record["stop_kl_final"] == mean_kl(target, data, stop, w, b, IDENTITY_SELECTED, chunk=8)
    assert not record["worse_than_start"] and not record["kept_start"] and record["best_step"] > 0
    # the stop KL falls by more than its own evaluation's rounding (float32 forward, log-probs up to ~log 96)
    rounding = eps(torch.float32) * forward_factor(target, 16) * 5.0
    assert record["stop_kl_final"] < record["stop_kl_start"]
    assert_far(record["stop_kl_final"], record["stop_kl_start"], atol=rounding,
               reason="a decrease larger than the float32 rounding of the KL (eps32 x forward_factor x log 96)")
    # toward the identity: in weights, and in what the map produces on the stop sequences (content-space K/V)
    dist = [float(torch.cat([(x - eye).flatten(), y.flatten()]).norm()) for x, y in ((start_w, start_b), (w, b))]
    assert dist[1] < dist[0]

    def kv_error(x, y):
        with torch.no_grad():
            mapped = mapped_layers(data, stop, x, y, IDENTITY_SELECTED)
            native = mapped_layers(data, stop, eye, zero, IDENTITY_SELECTED)
        return sum(float(((m - n) ** 2).sum()) for a, c in zip(mapped, native) for m, n in zip(a, c))
    assert kv_error(w, b) < kv_error(start_w, start_b)
    assert all(e["stop_kl"] is not None for e in record["evaluations"]) and len(record["train_kl"]) == 100
    json.dumps(record, allow_nan=False)


def test_training_that_diverges_keeps_the_start_bit_for_bit_and_says_so():
    target, data, _, (start_w, start_b), fit, stop = _perturbed_identity_problem(n_fit=4, n_stop=4)
    # a step size ~1,000x the map's entries: every evaluated point is far worse than the start (or not finite)
    w, b, record = train_e2e(target, data, start_w, start_b, IDENTITY_SELECTED, fit, stop,
                             TrainSettings(lr=100.0, steps=6, batch_sequences=2, eval_every=2, patience=2))
    assert record["worse_than_start"] is True and record["worse_than_ridge"] is True and record["kept_start"]
    assert torch.equal(w, start_w) and torch.equal(b, start_b)
    assert record["stop_kl_trained"] is None or record["stop_kl_trained"] > record["stop_kl_start"]
    assert record["stop_kl_final"] == record["stop_kl_start"]
    json.dumps(record, allow_nan=False)  # the manifest's JSON stays strict for a diverged run
    # no step: the start, as it is, nothing worse
    w, b, record = train_e2e(target, data, start_w, start_b, IDENTITY_SELECTED, fit, stop, TrainSettings(steps=0))
    assert torch.equal(w, start_w) and torch.equal(b, start_b)
    assert (record["worse_than_start"], record["stop_kl_trained"], record["steps"]) == (False, None, 0)
    with pytest.raises(ValueError, match="both the fit and the stop split"):
        train_e2e(target, data, start_w, start_b, IDENTITY_SELECTED, [0, 1], [1, 2], TrainSettings(steps=1))
    # the target's own flags are untouched by training (frozen() restores them)
    assert all(p.requires_grad for p in target.parameters())


def test_the_step_memory_formula_is_what_autograd_saves():
    """Every tensor autograd saves for one step's backward (distinct storages; the target's weights, read in
    place, aside) against `e2e_step_nbytes`: at most the formula, and at least the formula less its stated
    slack (the first layer's pre-attention activations)."""
    source, target = _source(), _target()
    c = target.config
    for context, continuation in ((14, 6), (40, 20)):
        batch = 4
        data = collect_e2e(source, target, random_ids(batch, context + continuation, seed=9), [0, 1], context=context,
                           native_sink=1)
        weight, bias = _random_map()
        params = {x.untyped_storage().data_ptr() for x in target.parameters()}
        storages: dict = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        with frozen(target), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s, _ = kl_sum(target, data, list(range(batch)), w, b, SELECTED)
        s.backward()
        saved = sum(storages.values())
        bound = e2e_step_nbytes(batch, context, continuation, layers=c.num_hidden_layers, hidden=c.hidden_size,
                                intermediate=c.intermediate_size, heads=c.num_attention_heads,
                                kv_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab=c.vocab_size, p=P)
        qd = c.num_attention_heads * c.head_dim
        slack = 4 * batch * (continuation * (c.hidden_size + qd + c.num_key_value_heads * c.head_dim)
                             + (context + continuation) * qd)
        assert bound - slack <= saved <= bound, (saved, bound, slack)


def test_the_plan_counts_the_collection_the_map_state_and_a_step():
    from run_configs import FIXED_RATES, compose_config
    from tolerance import assert_rounded

    from kvtransfer import plan as P

    h200 = P.Node(**P.NODES["h200"])
    fits = {name: P.make_plan(compose_config("pair=qwen3_14b_32b", *extra), h200, rates=FIXED_RATES,
                              knobs=False)["stages"]["fit"]
            for name, extra in (("ridge", ()), ("layer_local", ("mapper=trained",)),
                                ("e2e", ("mapper=trained", "mapper.objective=end_to_end")))}
    # Qwen3-14B -> 32B, the paper's calibration (1,024 tokens) and the defaults: 64 + 16 sequences, C = 1024 - 64,
    # T = 64; all 40 source layers (K and V, 8 x 128 each); 64 target layers of 8 KV heads x 128, hidden 5120
    per_seq = 4 * (2 * 960 * 40 * 1024 + 64 * 5120) + 8 * 64
    assert e2e_nbytes(80, 960, 64, 40, 1024, 64, 8, 128, 5120, 0) == 80 * per_seq
    host = fits["e2e"]["parts"]["host"]
    assert_rounded(host["end-to-end collection (train + stop sequences, float32)"], 80 * per_seq / P.GiB, decimals=6,
                   reason="the plan reports parts in GiB rounded to 6 decimals")
    assert not any(k.startswith("layer-local") for k in host)
    gpu = fits["e2e"]["parts"]["gpu"]
    (name, value), = [(k, v) for k, v in gpu.items() if k.startswith("source + target weights (collection, training)")]
    # bf16 weights of both models + 4 float32 copies of the map (1,074 M parameters) + a 4-sequence step's activations
    step = e2e_step_nbytes(4, 960, 64, layers=64, hidden=5120, intermediate=25600, heads=64, kv_heads=8, head_dim=128,
                           vocab=151936, p=8 * 1024, act_bytes=2)
    map_values = 64 * 2 * (8 * 1024 * 1024 + 1024)
    assert value * P.GiB > 4 * 4 * map_values + step
    assert fits["e2e"]["seconds"] > fits["ridge"]["seconds"]


def test_the_dry_run_shrinks_the_context_and_continuation_into_its_sequences(tmp_path):
    from run_configs import compose_config

    from kvtransfer.dryrun.run import shrink

    cfg = compose_config("pair=qwen3_14b_32b", "mapper=trained", "mapper.objective=end_to_end",
                         "mapper.context_tokens=900")
    small = shrink(cfg, tmp_path)
    m, seq = small["mapper"], small["calib"]["seq_len"]
    assert seq < 900 + 64 and m["continuation_tokens"] <= seq // 2 and m["context_tokens"] + m["continuation_tokens"] <= seq
    assert shrink(compose_config("pair=qwen3_14b_32b", "mapper=trained", "mapper.objective=end_to_end"),
                  tmp_path)["mapper"]["context_tokens"] is None  # the default: seq_len - continuation
