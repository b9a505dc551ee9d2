"""Exactness foundations: cache round-trips and the RoPE codec (PAPER.md "Pitfalls")."""
import pytest
import torch

from kvtransfer.core.cache import cache_to_layers, forward_on_cache, layers_to_cache, prefill
from kvtransfer.core.rope import RopeCodec, rotate_half
from tiny_models import CONFIGS, random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, forward_factor

FAMILIES = list(CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_cache_roundtrip_reproduces_one_pass_logits(family):
    model = tiny_model(family)
    ids = random_ids(3, 40)
    one_pass = model(input_ids=ids).logits
    layers = prefill(model, ids[:, :25])
    # tensors -> cache -> tensors keeps every value
    again = cache_to_layers(layers_to_cache(layers, model.config))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(layers, again))
    logits = forward_on_cache(model, layers, None, ids[:, 25:])
    assert_close(logits, one_pass[:, 25:], factor=forward_factor(model, 40), reason=FORWARD)
    # scoring twice from the same tensors gives the same answer: no cache is reused by accident
    assert torch.equal(forward_on_cache(model, layers, None, ids[:, 25:]), logits)


def test_left_padded_batch_matches_unpadded_rows():
    model = tiny_model("llama")
    rows = [random_ids(1, n, seed=n)[0] for n in (12, 20)]
    prefix_len, pad = 20, 0
    ids = torch.full((2, prefix_len), pad)
    mask = torch.zeros(2, prefix_len, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, prefix_len - len(r):], mask[i, prefix_len - len(r):] = r, 1
    cont = random_ids(2, 6, seed=99)
    batched = forward_on_cache(model, prefill(model, ids, mask), mask, cont)
    for i, r in enumerate(rows):
        single = forward_on_cache(model, prefill(model, r[None]), None, cont[i:i + 1])
        assert_close(batched[i], single[0], factor=forward_factor(model, prefix_len + 6), reason=FORWARD)


def test_prefix_mask_must_match_cache_length():
    model = tiny_model("qwen3")
    layers = prefill(model, random_ids(1, 8))
    with pytest.raises(ValueError, match="prefix_mask covers"):
        forward_on_cache(model, layers, torch.ones(1, 5, dtype=torch.long), random_ids(1, 2))


ROUND_TRIP = "float32 round trip (keys are rotated in float32): the cast (1), apply's 3 roundings and strip's 3, each " \
     "relative to |k|(|c|+|s|)^2 <= 2|k|(c^2+s^2), c^2+s^2 (3) and the division (1): 1 + 2 x 6 + 4 = 17 eps of |k|"


@pytest.mark.parametrize("family", FAMILIES)
def test_strip_apply_identity_at_long_positions(family):
    codec = RopeCodec(tiny_model(family))
    keys = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    positions = torch.tensor([0, 1, 4095, 4096, 65_537, 80_000])
    assert_close(codec.strip(codec.apply(keys, positions), positions), keys, dtype=torch.float32, factor=17,
                 reason=ROUND_TRIP)
    assert_close(codec.apply(codec.strip(keys, positions), positions), keys, dtype=torch.float32, factor=17,
                 reason=ROUND_TRIP)
    # per-row positions [batch, seq] are honoured
    per_row = torch.stack([positions, positions.flip(0)])
    rotated = codec.apply(keys, per_row)
    assert torch.equal(rotated[1], codec.apply(keys[1:], positions.flip(0))[0])  # elementwise: same bits per row


@pytest.mark.parametrize("family", FAMILIES)
def test_codec_matches_model_rotary_at_arbitrary_positions(family):
    model = tiny_model(family)
    codec = RopeCodec(model, initial_positions=16)  # forces the table to grow
    positions = torch.tensor([[3, 17, 900, 33_000]])
    cos, sin = model.model.rotary_emb(torch.zeros(1), positions)
    c, s = codec.cos_sin(positions)
    for got, want in ((c[:, 0], cos), (s[:, 0], sin)):  # |cos|, |sin| <= 1 (x attention_scaling)
        assert_close(got, want, factor=4, magnitude=1.0, reason=(
            "the same float32 angles (inv_freq x position) through cos/sin: the codec's table and the model's "
            "rotary may use different vectorised cos/sin kernels, each within ~1 ulp, then x attention_scaling"))


def test_yarn_inverse_needs_attention_scaling_division():
    codec = RopeCodec(tiny_model("ministral3"))
    assert_close(codec.attention_scaling, 1.25, factor=10 * 3, reason=(
        "YaRN's 0.1 ln(factor) + 1 in float64: a log, a product and a sum; x10 a few roundings"))
    keys, positions = torch.randn(1, 2, 5, 8), torch.arange(5) * 1000
    rotated = codec.apply(keys, positions)
    cos, sin = codec.cos_sin(positions)
    naive = rotated * cos - rotate_half(rotated) * sin  # inverse without dividing by cos²+sin²
    assert_far(naive, keys, atol=1e-2, reason="without the division each key comes back x 1.25^2: off by ~0.56|k|")
    assert_close(codec.strip(rotated, positions), keys, factor=17, reason=ROUND_TRIP)


def test_qwen3_cached_key_is_rope_of_k_norm_output():
    model = tiny_model("qwen3")
    codec = RopeCodec(model)
    captured = {}
    attn = model.model.layers[1].self_attn
    hooks = [attn.k_norm.register_forward_hook(lambda _m, _i, out: captured.update(k=out.detach())),
             attn.k_proj.register_forward_hook(lambda _m, _i, out: captured.update(proj=out.detach()))]
    ids = random_ids(2, 30)
    layers = prefill(model, ids)
    for h in hooks:
        h.remove()
    normed = captured["k"].transpose(1, 2)  # [batch, heads, seq, dim]
    positions = torch.arange(30)
    assert_close(layers[1][0], codec.apply(normed, positions), factor=10 * 9, reason=(
        "the model's and the codec's k cos + rotate_half(k) sin in float32: 3 roundings each side plus ~1 ulp "
        "between the two cos/sin tables, relative to |k|(|c|+|s|) <= 1.42|k|: worst case ~9 eps; x10 because a "
        "short elementwise chain lands near its worst case (observed ~0.8 eps), no averaging below it"))
    assert_close(codec.strip(layers[1][0], positions), normed, factor=17, reason=ROUND_TRIP)
    # the stripped key is the post-norm key, not k_proj's raw output
    raw = captured["proj"].view(2, 30, 2, 8).transpose(1, 2)
    assert_far(codec.strip(layers[1][0], positions), raw, atol=1e-2, reason="k_norm rescales each head: O(1) apart")


def test_length_dependent_rope_is_refused():
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="depends on sequence length"):
        RopeCodec(model)


def test_a_model_that_ignores_the_cache_argument_is_an_error():
    """transformers before 5.24 (5.19: the serving environment's pin) takes the cache only as `past_key_values`: a
    forward that drops `cache` would compute without the prefix and return numbers, so prefill / forward_on_cache
    refuse, naming the release that takes it."""
    from kvtransfer.core.models import decoder

    model = tiny_model("qwen3")
    ids = random_ids(1, 6)
    layers = prefill(model, ids)
    body, full = decoder(model), model.forward

    def drop_cache(forward):
        return lambda *a, cache=None, **k: forward(*a, **k)

    body.forward = drop_cache(body.forward)
    with pytest.raises(RuntimeError, match="does not take the decoder.s `cache` argument"):
        prefill(model, ids)
    model.forward = drop_cache(full)
    with pytest.raises(RuntimeError, match="does not take the decoder.s `cache` argument"):
        forward_on_cache(model, layers, None, ids[:, :2])
