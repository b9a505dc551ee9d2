"""Leakage tests for the lm-eval adapter (issue 9 §3d): two *different* models and a planted mapper.

The other adapter tests use source == target with a near-identity mapper, so they cannot tell a
transferred cache from the target reading the context itself, nor source from target. Here:

* source: Ministral 3 text stack (YaRN, attention_scaling 1.25), 3 layers, 2 KV heads x 16;
* target: Qwen3 (k_norm, default RoPE), 4 layers, 4 KV heads x 8 -- other depth, width, KV
  geometry and RoPE, random weights (seeds 1 and 2), the committed tiny-family tokenizer;
* mapper: planted random affine maps (not fitted, far from any identity), k = 2 source layers per
  target layer in a scrambled order.

Every number the adapter reports is recomputed here by hand with plain `model(...)` calls and a
straightforward mapping written in this file (fp64: strip the source RoPE with the source's own
rotary cos/sin, divide by cos^2 + sin^2, affine map, re-apply the target's RoPE), nothing from
kvtransfer.core.transfer / kvtransfer.core.cache. Each test then asserts (1) adapter == hand within an fp32
tolerance and (2) the modes' hand numbers differ from one another by a margin far above it, so a
target that read the context natively, a swapped scorer, a mapped cache built from the wrong
positions or a wrong RoPE step would fail.

Tolerances (fp32 models; the adapter batches and left-pads, the hand path runs one row, maps in fp64):
    LL_TOL   1e-4 nats on a request's log-likelihood (sum over its continuation tokens); seen <= 1.3e-5
    NLL_TOL  1e-5 nats on a mean per-token NLL (perplexity curve); seen <= 1.1e-6
    GAP_MIN  5e-4: the best and second-best logits differ by more than this at every hand greedy
             step (seen >= 1.1e-3, fp32 logit error ~1e-5), so exact token-id equality is fair
Margins between modes (measured minimum over requests in brackets):
    loglikelihood  every pair of target / source / transfer / no_context (and native_sink vs
                   transfer / target) differs by > MARGIN = 0.02 nats per request = 200 x LL_TOL
                   [0.040 transfer vs no_context, 0.15 sink vs transfer, every other pair >= 0.42]
    perplexity     mean NLL per token at every P that caches something differs by > 0.004 nats
                   [0.068]; a 1-token context caches nothing, so there split modes == target
    generation     the modes' greedy ids differ in their first 3 tokens (GSM8K-style), in >= 5 of
                   6 CoQA turns per pair of modes, and the two CoQA protocols differ in >= 5 of 6
                   turns in transfer mode
    RoPE mistakes  the hand map without strip / without 1/a^2 / without re-rotation lands >= 0.30
                   nats from the adapter
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from transformers import AutoTokenizer, DynamicCache

from conftest import make_model
from tolerance import FORWARD, assert_close, forward_factor
from kvtransfer.eval import KVTransferLM
from kvtransfer.eval.coqa import per_turn_transfer, transfer_once
from kvtransfer.eval.perplexity import prefix_conditioned_ppl
from kvtransfer.core.mapper import Mapper
from kvtransfer.core.models import kv_shape, model_identity

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "models" / "tiny" / "qwen3-tiny-1m"  # committed, shared by the tiny family; no BOS added

LL_TOL = 1e-4
NLL_TOL = 1e-5
GAP_MIN = 5e-4
MARGIN = 0.02
SINK = 2
SELECTION = [[2, 0], [1, 2], [0, 1], [2, 1]]  # per target layer: source layers in feature order
K_GAIN, V_GAIN, B_STD = 0.4, 0.8, 0.3  # mapped K/V of roughly the target's own scale (K rms ~1.5, V ~3)
MODES = ("target", "source", "transfer", "native_injected")  # + no_context in the loglikelihood test

MC = [  # (context, choices): ARC-style multiple choice, contexts of different lengths (left padding)
    ("Question: Which gas do plants take in from the air to make their food?\nAnswer:",
     [" carbon dioxide", " oxygen", " nitrogen", " helium"]),
    ("Question: What is frozen water called?\nAnswer:", [" ice", " steam", " sand"]),
    ("The shepherd counted his sheep at dusk and found that one was missing, so he",
     [" went back to look for it.", " sat down to eat.", " sold the flock."]),
]
GSM_PROMPTS = [
    "Question: Janet has 3 apples and buys 2 more. How many apples does she have?\n"
    "Answer: Janet has 3 + 2 = 5 apples. The answer is 5.\n\n"
    "Question: A farmer has 12 cows and sells 4 of them. How many cows are left?\nAnswer:",
    "Question: Tom reads 6 pages a day. How many pages does he read in 3 days?\nAnswer:",
]
GSM_KWARGS = {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0,
              "max_gen_toks": 10}
COQA_DOCS = [
    {"story": "In the beginning the king built a great house of cedar by the river. His daughter kept "
              "the sheep of her father, and every evening she led them to the water to drink.",
     "questions": {"input_text": ["Who built the house?", "What was it made of?", "Who kept the sheep?"]},
     "answers": {"input_text": ["the king", "cedar", "his daughter"]}},
    {"story": "A small boat sailed from the island at dawn with seven men and a dog. The wind was strong, "
              "and by noon they saw the white cliffs of the mainland.",
     "questions": {"input_text": ["When did the boat leave?", "How many men were on it?", "What did they see?"]},
     "answers": {"input_text": ["at dawn", "seven", "white cliffs"]}},
]
COQA_UNTIL = ["\nQ:"]
PPL_TEXT = ("And God said, Let there be light: and there was light. And God saw the light, that it was "
            "good: and God divided the light from the darkness. And God called the light Day, and the "
            "darkness he called Night. And the evening and the morning were the first day.")


# --------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    # no BOS added: under context_start="tokenizer" nothing extra sits at position 0
    assert tok.encode("hello world") == tok.encode("hello world", add_special_tokens=False)
    assert tok.bos_token_id == tok.eos_token_id == 0
    return tok


@pytest.fixture(scope="module")
def pair(tok):
    """(source, target): different family, depth, width, KV heads, head size and RoPE."""
    src = make_model(tok, "ministral3", seed=1, name="leak-src", layers=3, hidden=48, heads=4, kv_heads=2, head_dim=16)
    tgt = make_model(tok, "qwen3", seed=2, name="leak-tgt", layers=4, hidden=32, heads=4, kv_heads=4, head_dim=8)
    return src, tgt


@pytest.fixture(scope="module")
def mapper(pair):
    """Planted random affine maps [L_t, 2, k * 2 * 16, 4 * 8]: nothing like an identity."""
    src, tgt = pair
    s, t = kv_shape(src), kv_shape(tgt)
    p, q = len(SELECTION[0]) * s.width, t.width
    g = torch.Generator().manual_seed(7)
    gain = torch.tensor([K_GAIN, V_GAIN])[None, :, None, None]
    weight = torch.randn(t.n_layers, 2, p, q, generator=g) * gain / p ** 0.5
    bias = B_STD * torch.randn(t.n_layers, 2, q, generator=g)
    return Mapper(weight=weight, bias=bias, selected_layers=torch.tensor(SELECTION), source=model_identity(src),
                  target=model_identity(tgt), lam=0.0, calibration={"context_start": "tokenizer"})


@pytest.fixture(scope="module")
def lm(pair, tok, mapper):
    src, tgt = pair
    return KVTransferLM(source_model=src, target_model=tgt, tokenizer=tok, mapper=mapper, mode="transfer",
                        batch_size=3)


@pytest.fixture(scope="module")
def hand(pair, tok, mapper):
    return Hand(*pair, tok, mapper)


# ----------------------------------------------------------------------- the hand-built reference
def rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def cos_sin(model, n: int):
    """The model's own rotary cos/sin [n, d] (attention_scaling included) for positions 0..n-1, fp64."""
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n)[None])
    return cos[0].double(), sin[0].double()


def own_cache(model, layers) -> DynamicCache:
    """A fresh DynamicCache holding per-layer (K, V) [1, n_kv, n, d] (copies: forwards append in place)."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k.clone(), v.clone(), i)
    return cache


@torch.no_grad()
def run(model, ids: list[int], past=None):
    """Plain forward of `ids` after `past` (per-layer K/V of positions 0..n-1, or None): (logits [T, V], layers)."""
    n = 0 if past is None else past[0][0].shape[2]
    cache = DynamicCache(config=model.config) if past is None else own_cache(model, past)
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(n, n + len(ids))[None],
                attention_mask=torch.ones(1, n + len(ids), dtype=torch.long), cache=cache, use_cache=True)
    return out.logits[0], [(layer.keys, layer.values) for layer in cache.layers]


class Hand:
    """Every mode computed the obvious way, one request at a time."""

    def __init__(self, src, tgt, tok, mapper):
        self.src, self.tgt, self.tok, self.mapper = src, tgt, tok, mapper
        self.eos = {tok.eos_token_id, tgt.generation_config.eos_token_id}
        self.min_gap = float("inf")

    def scorer(self, mode):
        return self.src if mode == "source" else self.tgt

    def mapped(self, ids: list[int], sink: int = 0, mistake: str | None = None):
        """Target-format cache of `ids` from the source's prefill through the planted mapper (fp64 maths).

        sink > 0: the first `sink` positions are the target's own prefill of ids[:sink].
        mistake (only to show the test is sharp): "no strip", "no 1/a^2" or "no re-rotation".
        """
        _, src_layers = run(self.src, ids)
        n = len(ids)
        cs, ss = cos_sin(self.src, n)
        ct, st = cos_sin(self.tgt, n)
        n_kv_t, d_t = kv_shape(self.tgt).n_kv, kv_shape(self.tgt).head_dim
        w, b = self.mapper.weight.double(), self.mapper.bias.double()

        def feats(layer, kind):  # [n, n_kv_s * d_s], (head, dim) order
            x = src_layers[layer][kind][0].double()  # [n_kv_s, n, d_s]
            if kind == 0 and mistake != "no strip":  # strip the rotation: (k cos - rot(k) sin) / (cos^2 + sin^2)
                x = (x * cs - rot_half(x) * ss) / (1.0 if mistake == "no 1/a^2" else cs * cs + ss * ss)
            return x.transpose(0, 1).reshape(n, -1)

        out = []
        for t, sel in enumerate(self.mapper.selected_layers.tolist()):
            kv = []
            for kind in (0, 1):
                x = torch.cat([feats(s, kind) for s in sel], dim=-1)  # [n, k * n_kv_s * d_s]
                y = (x @ w[t, kind] + b[t, kind]).view(n, n_kv_t, d_t).transpose(0, 1)  # [n_kv_t, n, d_t]
                if kind == 0 and mistake != "no re-rotation":  # re-apply the target's rotation
                    y = y * ct + rot_half(y) * st
                kv.append(y[None].float())
            out.append(tuple(kv))
        if sink:
            _, native = run(self.tgt, ids[:sink])
            m = min(sink, n)
            out = [(torch.cat([nk[:, :, :m], k[:, :, m:]], 2), torch.cat([nv[:, :, :m], v[:, :, m:]], 2))
                   for (k, v), (nk, nv) in zip(out, native)]
        return out

    def prefix(self, mode, ids: list[int], sink: int = 0, mistake: str | None = None):
        """The cache the target reads in a split mode: mapped (transfer) or its own prefill (native_injected)."""
        if mode == "transfer":
            return self.mapped(ids, sink, mistake)
        assert mode == "native_injected"
        return run(self.tgt, ids)[1]

    def logprobs(self, mode, ctx: list[int], cont: list[int], sink: int = 0, mistake=None, tail: int = 1) -> torch.Tensor:
        """Per-token log-probs [len(cont)] of `cont` after `ctx` in `mode` (split modes: ctx[:-tail] cached,
        the target runs the last `tail` context tokens itself)."""
        if mode == "no_context":  # the floor: the target reads only the last context token (start ids: none)
            logits = run(self.tgt, ctx[-1:] + cont[:-1])[0]
        elif mode in ("target", "source") or len(ctx) == 1:  # one pass (a 1-token context caches nothing)
            logits = run(self.scorer(mode), ctx + cont[:-1])[0]
        else:
            logits = run(self.tgt, ctx[-tail:] + cont[:-1], self.prefix(mode, ctx[:-tail], sink, mistake))[0]
        lp = torch.log_softmax(logits[-len(cont):].double(), -1)
        return lp.gather(-1, torch.tensor(cont)[:, None])[:, 0]

    def greedy(self, mode, ctx: list[int], n_cached: int, until: list[str], max_gen: int) -> list[int]:
        """Greedy ids after `ctx`: in split modes ctx[:n_cached] is the cache and the rest the target runs.

        Every step re-runs the model from the (copied) prefix cache: no incremental cache reuse.
        Stops at EOS (not kept), once the decoded text holds a stop string, or after max_gen tokens.
        """
        split = mode not in ("target", "source") and n_cached > 0
        past = self.prefix(mode, ctx[:n_cached]) if split else None
        gen: list[int] = []
        for _ in range(max_gen):
            logits = (run(self.tgt, ctx[n_cached:] + gen, past) if split else run(self.scorer(mode), ctx + gen))[0][-1]
            top = logits.topk(2).values
            self.min_gap = min(self.min_gap, float(top[0] - top[1]))
            nxt = int(logits.argmax())
            if nxt in self.eos:
                break
            gen.append(nxt)
            if any(s and s in self.tok.decode(gen) for s in until):
                break
        return gen


def encode_pair(tok, context: str, continuation: str):
    """lm-eval's causal split (no trailing spaces here): whole encoded, split on the context's length."""
    assert context == context.rstrip()
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    assert whole[:len(ctx)] == ctx, "tokenization merges across the boundary: pick another string"
    return ctx, whole[len(ctx):]


def min_pairwise_gap(values: dict[str, list[float]], names) -> dict[tuple, float]:
    """{(a, b): min over requests of |a - b|} for every pair of the named modes."""
    names = list(names)
    return {(a, b): min(abs(x - y) for x, y in zip(values[a], values[b]))
            for i, a in enumerate(names) for b in names[i + 1:]}


def assert_distinct(values: dict[str, list[float]], names, margin=MARGIN):
    for (a, b), gap in min_pairwise_gap(values, names).items():
        assert gap > margin, f"modes {a} and {b} give numbers only {gap:.3g} apart (margin {margin})"


# ------------------------------------------------------------------------------------------ tests
def test_hand_reference_is_sound(pair, hand, tok):
    """The hand path itself: cached split == one pass, and the RoPE helpers match transformers'."""
    from transformers.models.ministral3.modeling_ministral3 import apply_rotary_pos_emb

    src, tgt = pair
    ids = tok.encode(MC[0][0] + MC[0][1][0])
    for model in (src, tgt):  # own prefill of ids[:-4] + the last 4 tokens == one forward over all
        full = run(model, ids)[0]
        split = run(model, ids[-4:], run(model, ids[:-4])[1])[0]
        # Both float32 paths against the float64 forward, not against each other: whether split and full
        # agree bit for bit depends on the CPU's kernels (0 here, 1.1e-5 on an AVX-512 Xeon), while their
        # rounding error against float64 is there on every machine, so the headroom guard sees it.
        ref = run(copy.deepcopy(model).double(), ids)[0][-4:]
        for got in (full[-4:], split):
            assert_close(got, ref, dtype=torch.float32, factor=forward_factor(model, len(ids)), reason=FORWARD)
    for model in (src, tgt):  # apply == transformers' apply_rotary_pos_emb; strip undoes it (YaRN: / a^2)
        d = kv_shape(model).head_dim
        k = torch.randn(1, 2, 9, d, dtype=torch.float64)
        cs, ss = cos_sin(model, 9)
        _, ref = apply_rotary_pos_emb(k, k, cs[None], ss[None])
        # float64 throughout; cs, ss carry float32 rounding but enter both sides identically
        assert_close(k * cs + rot_half(k) * ss, ref, factor=4, magnitude=float((k.abs() * (cs.abs() + ss.abs())).max()),
                     reason="two products and a sum per element, 3 roundings (transformers may order them differently)")
        assert_close((ref * cs - rot_half(ref) * ss) / (cs * cs + ss * ss), k, factor=16, reason=(
            "worst case: ref's 3 roundings and the inverse rotation's 3, each relative to |k|(|cs|+|ss|)^2 <= "
            "2|k|(cs^2+ss^2), then cs^2+ss^2 (3) and the division (1): 2 x 6 + 4 = 16 eps of |k|"))
    assert_close(cos_sin(src, 2)[0][0, 0], 1.25, dtype=torch.float32, factor=2, reason=(
        "cos(0) x attention_scaling 1.25, computed in float32: the scale rounded once, the product once"))


def test_loglikelihood_every_mode_by_hand(lm, hand, tok):
    """MC loglikelihood through lm-eval Instances (batch 3, left-padded prefixes) == hand, per mode;
    and every pair of modes differs per request by > MARGIN."""
    reqs = [Instance("loglikelihood", {}, (ctx, ch), i) for i, (ctx, chs) in enumerate(MC) for ch in chs]
    pairs = [encode_pair(tok, *r.args) for r in reqs]
    want, got = {}, {}
    for mode in MODES + ("no_context",):
        want[mode] = [float(hand.logprobs(mode, c, k).sum()) for c, k in pairs]
        got[mode] = [ll for ll, _ in lm.with_mode(mode).loglikelihood(reqs)]
        err = max(abs(a - b) for a, b in zip(got[mode], want[mode]))
        assert err <= LL_TOL, f"{mode}: adapter vs hand {err:.3g}"
    # native_injected is the plumbing check: the target's own prefill through the split path == target
    assert max(abs(a - b) for a, b in zip(want["native_injected"], want["target"])) <= LL_TOL
    assert_distinct(want, ("target", "source", "transfer", "no_context"))


def test_native_sink_by_hand(lm, hand, tok):
    """native_sink=2: positions 0..1 of the cache are the target's own prefill, the rest mapped."""
    pairs = [encode_pair(tok, ctx, chs[0]) for ctx, chs in MC] + [(tok.encode(MC[1][0])[:SINK + 1], tok.encode(" ice"))]
    assert len(pairs[-1][0]) - 1 == SINK  # a prefix of exactly SINK tokens: all native, so == target
    assert all(len(c) - 1 >= SINK for c, _ in pairs)  # rows shorter than the sink: see the §3a test below
    sink = lm.with_mode("transfer", native_sink=SINK)
    want = {"sink": [float(hand.logprobs("transfer", c, k, sink=SINK).sum()) for c, k in pairs],
            "transfer": [float(hand.logprobs("transfer", c, k).sum()) for c, k in pairs],
            "target": [float(hand.logprobs("target", c, k).sum()) for c, k in pairs]}
    got = [float(lp.sum()) for lp, _ in sink.score_tokens(pairs)]
    err = max(abs(a - b) for a, b in zip(got, want["sink"]))
    assert err <= LL_TOL, f"native_sink: adapter vs hand {err:.3g}"
    assert abs(want["sink"][-1] - want["target"][-1]) <= LL_TOL
    longer = {k: v[:-1] for k, v in want.items()}  # rows with mapped positions left after the sink
    assert_distinct(longer, ("sink", "transfer", "target"))


# Issue 9 §3a: in a left-padded batch, a row with fewer real prefix tokens than native_sink gets its
# sink indices clamped to seq-1 (several sink positions scattered into one slot, and the target's
# sink prefill run on repeated tokens). The row must be all native (== target). Fails on the code
# as of c909e7c.
def test_native_sink_short_row_in_padded_batch(lm, hand, tok):
    n = 4
    pairs = [encode_pair(tok, MC[0][0], MC[0][1][0]), (tok.encode(MC[1][0])[:n - 1], tok.encode(" ice"))]
    assert len(pairs[1][0]) - 1 < n < len(pairs[0][0]) - 1
    got = lm.with_mode("transfer", native_sink=n, batch_size_per_gpu=2).score_tokens(pairs)
    want = [float(hand.logprobs("transfer", c, k, sink=n).sum()) for c, k in pairs]
    assert abs(want[1] - float(hand.logprobs("target", *pairs[1]).sum())) <= LL_TOL  # the short row is all native
    for (lp, _), w, row in zip(got, want, ("long", "short")):
        assert abs(float(lp.sum()) - w) <= LL_TOL, f"{row} row: adapter {float(lp.sum())} vs hand {w}"


TAIL = 3


def test_native_tail_by_hand(lm, hand, tok):
    """native_tail=3: the target runs the last 3 context tokens itself on the mapped cache of the rest, in a
    left-padded batch whose contexts leave different tails (a 3-token context keeps a 1-token prefix: the
    tail is clamped to len - 1, so its prefix tail is padded in the middle). Scores and greedy ids == hand;
    the tail differs from transfer and from target."""
    pairs = [encode_pair(tok, ctx, chs[0]) for ctx, chs in MC] + [(tok.encode(MC[1][0])[:3], tok.encode(" ice"))]
    tails = [min(TAIL, len(c) - 1) for c, _ in pairs]
    assert tails[-1] == 2 and tails[0] == TAIL
    tail_lm = lm.with_mode("transfer", native_tail=TAIL)
    assert tail_lm.cut(pairs[0][0]) == (pairs[0][0][:-TAIL], pairs[0][0][-TAIL:])
    want = {"tail": [float(hand.logprobs("transfer", c, k, tail=m).sum()) for (c, k), m in zip(pairs, tails)],
            "transfer": [float(hand.logprobs("transfer", c, k).sum()) for c, k in pairs],
            "target": [float(hand.logprobs("target", c, k).sum()) for c, k in pairs]}
    got = [float(lp.sum()) for lp, _ in tail_lm.score_tokens(pairs)]
    err = max(abs(a - b) for a, b in zip(got, want["tail"]))
    assert err <= LL_TOL, f"native_tail: adapter vs hand {err:.3g}"
    assert_distinct(want, ("tail", "transfer", "target"))
    # target mode ignores the knob: its cache is its own prefill whatever the cut
    base = [float(lp.sum()) for lp, _ in lm.with_mode("target", native_tail=TAIL).score_tokens(pairs)]
    assert max(abs(a - b) for a, b in zip(base, want["target"])) <= LL_TOL
    # greedy generation through the same cut: one batch, contexts of different lengths
    ctxs = [tok.encode(p) for p in GSM_PROMPTS]
    gen = tail_lm.with_mode("transfer", batch_size_per_gpu=2).generate_tokens(ctxs, until=GSM_KWARGS["until"],
                                                                             max_gen_toks=GSM_KWARGS["max_gen_toks"])
    assert gen == [hand.greedy("transfer", c, len(c) - TAIL, GSM_KWARGS["until"], GSM_KWARGS["max_gen_toks"])
                   for c in ctxs]
    with pytest.raises(ValueError, match="native_tail"):
        KVTransferLM(source_model=hand.src, target_model=hand.tgt, tokenizer=tok, mapper=hand.mapper, native_tail=0)


@pytest.mark.parametrize("context_start", ["tokenizer", "prefix_token"])
def test_prefix_conditioned_ppl_by_hand(pair, tok, hand, context_start):
    """PPL curve per mode == hand, under both position-0 conventions: the context is the start ids
    ([] for this tokenizer, or [<|endoftext|>]) + the P tokens before the fixed continuation, [BOS]
    when that is empty. A 1-token context transfers nothing (split modes == target there); longer
    prefixes separate the modes."""
    src, tgt = pair
    m = copy.copy(hand.mapper)
    m.calibration = {"context_start": context_start}
    lm = KVTransferLM(source_model=src, target_model=tgt, tokenizer=tok, mapper=m, mode="transfer", batch_size=3,
                      context_start=context_start)
    start = {"tokenizer": [], "prefix_token": [tok.eos_token_id]}[context_start]
    ids = tok.encode(PPL_TEXT)
    max_prefix, cont_len = 24, 10
    windows = [ids[s:s + max_prefix + cont_len] for s in (0, 9)]
    assert all(len(w) == max_prefix + cont_len for w in windows)
    ps = [0, 1, 2, 8, 24]
    nll = {}
    for mode in MODES:
        res = prefix_conditioned_ppl(lm.with_mode(mode), windows, ps)
        nll[mode] = []
        for p in ps:
            assert res[p]["continuation"] == [w[max_prefix:] for w in windows]
            ctxs = [(start + w[max_prefix - p:max_prefix]) or [tok.bos_token_id] for w in windows]
            lps = torch.cat([hand.logprobs(mode, c, w[max_prefix:]) for c, w in zip(ctxs, windows)])
            want = -float(lps.mean())
            assert abs(res[p]["nll"] - want) <= NLL_TOL, f"{mode} P={p}: {res[p]['nll']} vs hand {want}"
            nll[mode].append(want)
    one_token = [i for i, p in enumerate(ps) if len(start) + p <= 1]  # nothing cached at these P
    for mode in ("transfer", "native_injected"):
        for i in one_token:
            assert abs(nll[mode][i] - nll["target"][i]) <= NLL_TOL
    assert max(abs(a - b) for a, b in zip(nll["native_injected"], nll["target"])) <= NLL_TOL
    mapped = {m_: [v for i, v in enumerate(vals) if i not in one_token] for m_, vals in nll.items()}
    assert len(mapped["target"]) >= 3
    assert_distinct(mapped, ("target", "source", "transfer"), margin=MARGIN / 5)  # mean per-token NLL


def test_generate_until_gsm8k_style_by_hand(lm, hand, tok):
    """Greedy GSM8K-style generation (batch 2, left-padded): ids and text == hand greedy loop, per mode;
    the three modes generate different token sequences."""
    reqs = [Instance("generate_until", {}, (p, dict(GSM_KWARGS)), i) for i, p in enumerate(GSM_PROMPTS)]
    until = GSM_KWARGS["until"] + [tok.eos_token]  # lm-eval adds the EOS string
    ctxs = [tok.encode(p) for p in GSM_PROMPTS]
    hand.min_gap = float("inf")
    gens = {}
    for mode in MODES:
        other = lm.with_mode(mode, batch_size_per_gpu=2)
        want = [hand.greedy(mode, c, len(c) - 1, until, GSM_KWARGS["max_gen_toks"]) for c in ctxs]
        assert other.generate_tokens(ctxs, until=until, max_gen_toks=GSM_KWARGS["max_gen_toks"]) == want, mode
        texts = other.generate_until(reqs)
        for text, ids in zip(texts, want):
            ref = tok.decode(ids, skip_special_tokens=True)
            for s in until:
                ref = ref.split(s)[0]
            assert text == ref, mode
        gens[mode] = want
    assert hand.min_gap > GAP_MIN, f"near-tie in greedy argmax ({hand.min_gap:.2g}): pick other prompts/seeds"
    assert gens["native_injected"] == gens["target"]
    for a, b in (("target", "source"), ("target", "transfer"), ("source", "transfer")):
        for ga, gb in zip(gens[a], gens[b]):
            assert ga[:3] != gb[:3], f"{a} and {b} generate the same start {ga[:3]}"


def _coqa_streams(tok, doc, t):
    """(context ids of turn t, tokens of the story): segments tokenized one by one, as the protocol does."""
    qs, ans = doc["questions"]["input_text"], doc["answers"]["input_text"]
    story = tok.encode(doc["story"] + "\n\n")
    ids = list(story)
    for i in range(t):
        ids += tok.encode(f"Q: {qs[i]}\n\nA:", add_special_tokens=False)
        ids += tok.encode(f" {ans[i]}\n\n", add_special_tokens=False)
    ids += tok.encode(f"Q: {qs[t]}\n\nA:", add_special_tokens=False)
    return ids, story


def _pred(tok, ids):
    return tok.decode(ids, skip_special_tokens=True).split("\nQ:")[0].strip().split("\n")[0]


def test_coqa_both_protocols_by_hand(lm, hand, tok):
    """CoQA (a) per-turn transfer: the whole history context[:-1] is mapped each turn; (b) transfer-once:
    only story[:-1] is mapped, the target extends its cache natively. Token ids (a) and answers (a, b)
    == hand per mode; in transfer mode the two protocols differ, in target mode they coincide."""
    turns, max_gen = 3, 6
    jobs = [(d, t) for d in range(len(COQA_DOCS)) for t in range(turns)]
    streams = {(d, t): _coqa_streams(tok, COQA_DOCS[d], t) for d, t in jobs}
    hand.min_gap = float("inf")
    preds = {}
    for mode in MODES:
        other = lm.with_mode(mode)
        seen = []
        real = other.generate_tokens
        other.generate_tokens = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
        per_turn = per_turn_transfer(other, COQA_DOCS, max_turns=turns, max_gen_toks=max_gen)
        once = transfer_once(other, COQA_DOCS, max_turns=turns, max_gen_toks=max_gen)
        want_a = [hand.greedy(mode, streams[j][0], len(streams[j][0]) - 1, COQA_UNTIL, max_gen) for j in jobs]
        want_b = [hand.greedy(mode, streams[j][0], len(streams[j][1]) - 1, COQA_UNTIL, max_gen) for j in jobs]
        assert seen == [want_a], mode
        assert [t["pred"] for conv in per_turn for t in conv] == [_pred(tok, g) for g in want_a], mode
        assert [t["pred"] for conv in once for t in conv] == [_pred(tok, g) for g in want_b], mode
        preds[mode] = (want_a, want_b)
    assert hand.min_gap > GAP_MIN, f"near-tie in greedy argmax ({hand.min_gap:.2g}): pick other docs/seeds"
    assert preds["target"][0] == preds["target"][1] == preds["native_injected"][0] == preds["native_injected"][1]
    a, b = preds["transfer"]
    assert sum(x != y for x, y in zip(a, b)) >= len(jobs) - 1, "per-turn and transfer-once look alike"
    for m1, m2 in (("target", "source"), ("target", "transfer"), ("source", "transfer")):
        same = sum(x == y for x, y in zip(preds[m1][0], preds[m2][0]))
        assert same <= 1, f"{m1} and {m2} give {same} identical generations of {len(jobs)}"


def test_hand_reference_sees_rope_mistakes(lm, hand, tok):
    """The reference is sharp on RoPE: mapped caches built with a RoPE mistake (no strip, no 1/a^2
    division for the YaRN source, no re-rotation) score > MARGIN away from the adapter, which
    matches the correct hand map."""
    pairs = [encode_pair(tok, ctx, chs[0]) for ctx, chs in MC]
    got = [float(lp.sum()) for lp, _ in lm.score_tokens(pairs)]
    for mistake in (None, "no strip", "no 1/a^2", "no re-rotation"):
        want = [float(hand.logprobs("transfer", c, k, mistake=mistake).sum()) for c, k in pairs]
        gap = min(abs(a - b) for a, b in zip(got, want))
        if mistake is None:
            assert max(abs(a - b) for a, b in zip(got, want)) <= LL_TOL
        else:
            assert gap > MARGIN, f"{mistake}: only {gap:.3g} from the adapter"
