"""Mapper artifact, native sink, NaN detection, model loading, tokenizer check, diagnostics."""
import copy
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import kvtransfer as kt
from tiny_models import ministral3_config, random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, forward_factor

HEAD_DIM = 8


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen3", layers=2, seed=1, name="tiny-src")
    target = tiny_model("qwen3", layers=3, seed=2, hidden=48, heads=6, name="tiny-tgt")
    calib = kt.collect_moments(source, target, random_ids(32, 32, seed=3), stride=2, heldout_fraction=0.25)
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=HEAD_DIM)
    fit = kt.fit_ridge(calib.train, kt.select_topk(r2["train"], 2), heldout=calib.heldout, head_dim=HEAD_DIM)
    return source, target, kt.Mapper.from_ridge(fit, source, target, calibration=calib.train.info)


def test_mapper_save_load_roundtrip(pair, tmp_path):
    source, target, mapper = pair
    mapper.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "mapper.json").read_text())
    assert manifest["k"] == 2 and manifest["lambda"] == 0.01 and manifest["source"]["model_id"] == "tiny-src"
    assert manifest["n_parameters"] == 3 * 2 * (2 * 16) * 16 + 3 * 2 * 16
    assert set(manifest["r2"]) == {"train", "heldout"} and len(manifest["r2"]["heldout"]["k"]) == 3
    assert manifest["calibration"]["stride"] == 2 and manifest["calibration"]["observations"] > 0
    back = kt.Mapper.load(tmp_path / "m", source, target)
    assert torch.equal(back.weight, mapper.weight) and torch.equal(back.selected_layers, mapper.selected_layers)
    with pytest.raises(FileExistsError, match="already holds a mapper"):
        mapper.save(tmp_path / "m")


def test_corrupt_and_truncated_artifacts_are_refused(pair, tmp_path):
    _, _, mapper = pair
    mapper.save(tmp_path / "m")
    weights = tmp_path / "m" / "mapper.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="checksum"):
        kt.Mapper.load(tmp_path / "m")
    weights.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ValueError, match="checksum"):
        kt.Mapper.load(tmp_path / "m")
    weights.write_bytes(data)
    (tmp_path / "m" / "mapper.json").write_text('{"format": "kvtransfer.core.mapper", "vers')
    with pytest.raises(ValueError, match="not valid JSON"):
        kt.Mapper.load(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="not a saved mapper"):
        kt.Mapper.load(tmp_path / "nothing")


def test_wrong_pair_is_refused(pair, tmp_path):
    source, target, mapper = pair
    mapper.save(tmp_path / "m")
    other = tiny_model("llama", layers=3, hidden=48, heads=6, name="tiny-llama")
    with pytest.raises(ValueError, match="fitted for target tiny-tgt.*Fit a mapper for this pair"):
        kt.Mapper.load(tmp_path / "m", source, other)
    with pytest.raises(ValueError, match="fitted for source"):
        kt.transfer(kt.prefill(target, random_ids(1, 4)), mapper, target, target)


def test_native_sink_makes_first_positions_exact(pair):
    source, target, mapper = pair
    ids = random_ids(2, 20, seed=4)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # left padding on row 1
    ids[1, :5] = 0
    src = kt.prefill(source, ids, mask)
    native = kt.prefill(target, ids, mask)
    plain = kt.transfer(src, mapper, source, target, attention_mask=mask, as_layers=True)
    sunk = kt.transfer(src, mapper, source, target, attention_mask=mask, input_ids=ids, native_sink=2, as_layers=True)
    for (k, v), (nk, nv), (pk, _) in zip(sunk, native, plain):
        for got, want in ((k[0, :, :2], nk[0, :, :2]), (v[0, :, :2], nv[0, :, :2]), (k[1, :, 5:7], nk[1, :, 5:7])):
            assert_close(got, want, factor=forward_factor(target, 20), reason=FORWARD)  # [1, 5:7]: padded row
        assert torch.equal(k[:, :, 7:], pk[:, :, 7:])  # the rest stays mapped
        assert_far(pk[0, :, :2], nk[0, :, :2], atol=1e-3, reason="the sink really was mapped before: O(1) apart")
    with pytest.raises(ValueError, match="needs input_ids"):
        kt.transfer(src, mapper, source, target, native_sink=1)
    # a map that carries its sink is applied with it unless told otherwise
    carried = copy.copy(mapper)
    carried.native_sink = 2
    by_default = kt.transfer(src, carried, source, target, attention_mask=mask, input_ids=ids, as_layers=True)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(by_default, sunk))
    with pytest.raises(ValueError, match="needs input_ids"):
        kt.transfer(src, carried, source, target, attention_mask=mask)


def test_non_finite_mapping_is_detected(pair):
    source, target, mapper = pair
    broken = kt.Mapper(weight=mapper.weight.clone(), bias=mapper.bias.clone(), selected_layers=mapper.selected_layers,
                       source=mapper.source, target=mapper.target)
    broken.weight[1, 0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        kt.transfer(kt.prefill(source, random_ids(1, 6)), broken, source, target)


def test_diagnostics_separate_good_and_bad_maps(pair):
    source, target, mapper = pair
    ids = random_ids(2, 40, seed=12)
    native = kt.prefill(target, ids[:, :30])
    same = kt.compare_caches(target, native, native, ids[:, 30:])
    assert same["kl"] == 0.0 and same["top1_agreement"] == 1.0  # one cache against itself: the same forward twice
    assert min(same["attn_cosine"]) > 0.9999
    assert_close(min(same["key_r2"]), 1.0, dtype=torch.float32, factor=10 * 2, reason=(
        "1 - SSE / SST with SSE = 0: SST's own rounding cannot move it; x10 a few float32 roundings"))
    mapped = kt.transfer(kt.prefill(source, ids[:, :30]), mapper, source, target, as_layers=True)
    diag = kt.compare_caches(target, native, mapped, ids[:, 30:])
    assert len(diag["key_r2"]) == 3 and diag["kl"] > 1e-4 and min(diag["attn_cosine"]) < 0.9999


def _word_tokenizer(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def test_tokenizer_mismatch_is_refused():
    a = _word_tokenizer(["<unk>", "the", "cat", "sat"])
    kt.check_same_tokenizer(a, _word_tokenizer(["<unk>", "the", "cat", "sat"]))
    with pytest.raises(ValueError, match="tokenizers differ.*same model family"):
        kt.check_same_tokenizer(a, _word_tokenizer(["<unk>", "cat", "the", "sat"]))


def test_load_model_from_local_dir(tmp_path):
    model = tiny_model("llama", name="x")
    model.save_pretrained(tmp_path / "llama")
    _word_tokenizer(["<unk>", "a", "b"]).save_pretrained(tmp_path / "llama")
    loaded, tok = kt.load_model(str(tmp_path / "llama"), dtype="float32", device="cpu")
    ids = random_ids(1, 9)
    assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, factor=forward_factor(model, 9),
                 reason=FORWARD + " (the loaded model may pick another attention kernel)")
    assert loaded.name_or_path == str(tmp_path / "llama") and tok.get_vocab()["b"] == 2
    assert kt.model_identity(loaded)["rope_type"] == "llama3"


def test_load_model_takes_text_stack_of_mistral3_vlm(tmp_path):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=32, patch_size=16)
    config = Mistral3Config(vision_config=vision, text_config=ministral3_config(), image_token_index=95)
    torch.manual_seed(0)
    vlm = Mistral3ForConditionalGeneration(config).float().eval()
    vlm.save_pretrained(tmp_path / "vlm")
    _word_tokenizer(["<unk>", "a"]).save_pretrained(tmp_path / "vlm")
    lm, _ = kt.load_model(str(tmp_path / "vlm"), dtype="float32", device="cpu")
    assert type(lm).__name__ == "Ministral3ForCausalLM" and not hasattr(lm, "vision_tower")
    ids = random_ids(1, 12)
    assert_close(lm(input_ids=ids).logits, vlm(input_ids=ids).logits, factor=forward_factor(lm, 12), reason=FORWARD)
    assert kt.kv_shape(lm) == kt.kv_shape(vlm.config) and kt.model_identity(lm)["rope_type"] == "yarn"
    # the text stack runs through the cache path and the RoPE codec (YaRN, attention_scaling != 1)
    assert_close(kt.RopeCodec(lm).attention_scaling, 1.25, factor=10 * 3, reason=(
        "YaRN's 0.1 ln(factor) + 1 in float64: a log, a product and a sum; x10 a few roundings"))
    one_pass = lm(input_ids=ids).logits[:, 8:]
    assert_close(kt.forward_on_cache(lm, kt.prefill(lm, ids[:, :8]), None, ids[:, 8:]), one_pass,
                 factor=forward_factor(lm, 12), reason=FORWARD)
