"""Weight offload (`pair.<side>.max_memory`, issue 10 §2): Llama 3.1 70B's bf16 weights (131.4 GiB) fill a
141 GB H200 by themselves, so the planned way to calibrate 8B -> 70B on one H200 keeps part of the target's
layers on the host and lets accelerate stream them to the GPU on every forward pass.

On this CPU machine accelerate's disk offload stands in for host offload: the offloaded layers' weights
become `meta` in the module and an accelerate hook runs them on its `execution_device` -- the case a
mapped cache must follow (it used to be moved to `meta`, where the layer's k_proj weight seemed to live).
"""
import shlex
from pathlib import Path
from unittest import mock

import pytest
import torch

import kvtransfer as kt
from kvtransfer import plan as P
from kvtransfer.core.cache import forward_on_cache
from kvtransfer.core.models import device_map_for, layer_devices, load_model, max_memory_for, size_bytes
from tiny_models import random_ids, tiny_model
from run_configs import FIXED_RATES
from run_configs import compose_config as _compose
from tolerance import assert_rounded, assert_within

ROOT = Path(__file__).resolve().parents[1]
H200 = P.Node(**P.NODES["h200"])


# -- configuration ---------------------------------------------------------------------------------
def test_max_memory_key_is_normalised_follows_the_model_and_implies_device_map():
    cfg = _compose("pair=llama31_8b_70b", "pair.target.max_memory={0:87GiB,cpu:121GiB}")
    assert max_memory_for(cfg, "target") == {0: "87GiB", "cpu": "121GiB"}
    assert max_memory_for(cfg, "source") is None
    # a memory cap places layers, so the target loads with device_map=auto; the source as before
    assert device_map_for(cfg, "target") == "auto" and device_map_for(cfg, "source") is None
    rev = dict(cfg, pair=dict(cfg["pair"], direction="reverse"))   # the 70B now plays the source
    assert max_memory_for(rev, "source") == {0: "87GiB", "cpu": "121GiB"} and max_memory_for(rev, "target") is None
    odd = dict(cfg, pair=dict(cfg["pair"], target=dict(cfg["pair"]["target"], max_memory={"cuda:1": 2**30, "0": "1GB"})))
    assert max_memory_for(odd, "target") == {1: 2**30, 0: "1GB"}
    for bad, match in (({"gpu0": "1GiB"}, "unknown device"), ({0: "lots"}, "not a memory size"), ("80GiB", "mapping")):
        broken = dict(cfg, pair=dict(cfg["pair"], target=dict(cfg["pair"]["target"], max_memory=bad)))
        with pytest.raises(ValueError, match=match):
            max_memory_for(broken, "target")


def test_size_bytes_reads_transformers_units():
    assert size_bytes("87GiB") == 87 * 2**30 and size_bytes("90GB") == 90 * 10**9
    assert size_bytes("512MiB") == 512 * 2**20 and size_bytes(12345) == 12345 and size_bytes("1.5GiB") == 3 * 2**29


# -- the offloaded target reads the mapped cache where its layers run --------------------------------
@pytest.fixture(scope="module")
def offloaded_pair(tmp_path_factory):
    """A fitted tiny pair, and the target reloaded with its last two layers offloaded to disk."""
    source = tiny_model("llama", layers=2, seed=1, name="tiny-src")
    target = tiny_model("llama", layers=4, seed=2, hidden=48, heads=6, name="tiny-tgt")
    calib = kt.collect_moments(source, target, random_ids(16, 24, seed=3), stride=2, heldout_fraction=0.25)
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=8)
    fit = kt.fit_ridge(calib.train, kt.select_topk(r2["train"], 2), heldout=calib.heldout, head_dim=8)
    mapper = kt.Mapper.from_ridge(fit, source, target, calibration=calib.train.info)
    root = tmp_path_factory.mktemp("offload")
    target.save_pretrained(root / "target")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    loaded, _ = _load(root / "target", device_map=device_map, offload_folder=str(root / "offload"))
    return source, target, loaded, mapper


def _load(path, **kw):
    """load_model on a saved tiny model (no tokenizer files there: the tokenizer load is stubbed)."""
    with mock.patch("transformers.AutoTokenizer.from_pretrained", return_value=None):
        return load_model(str(path), dtype="float32", attn_implementation="eager", **kw)


def test_offloaded_layers_report_their_execution_device(offloaded_pair):
    _, _, loaded, _ = offloaded_pair
    attn = loaded.model.layers[3].self_attn.k_proj
    assert attn.weight.device.type == "meta"       # the weights are not in the module: accelerate streams them
    assert layer_devices(loaded) == [torch.device("cpu")] * 4


@pytest.mark.parametrize("native_sink", [0, 2])
def test_transfer_into_an_offloaded_target_equals_the_whole_target(offloaded_pair, native_sink):
    # the same fp32 kernels on the same shapes: the offloaded model streams its stored weights back
    # unchanged, so its logits on the mapped cache are bit-identical to the model loaded whole
    source, whole, loaded, mapper = offloaded_pair
    ids = random_ids(2, 12, seed=5)
    src = kt.prefill(source, ids)
    kw = {"input_ids": ids, "native_sink": native_sink, "as_layers": True}
    a = kt.transfer(src, mapper, source, whole, **kw)
    b = kt.transfer(src, mapper, source, loaded, **kw)
    assert all(k.device.type == "cpu" and torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(a, b))
    nxt = random_ids(2, 3, seed=6)
    assert torch.equal(forward_on_cache(whole, a, None, nxt), forward_on_cache(loaded, b, None, nxt))


def test_load_model_passes_max_memory(tmp_path):
    model = tiny_model("qwen3", layers=2, seed=0)
    model.save_pretrained(tmp_path / "m")
    capped, _ = _load(tmp_path / "m", max_memory={"cpu": "1GiB"})   # device_map=auto implied; all fits the host
    ids = random_ids(1, 8, seed=1)
    assert torch.equal(capped(ids).logits, model(ids).logits)


# -- the plan --------------------------------------------------------------------------------------
def test_offloaded_bytes_of_llama_70b_by_hand():
    cfg = _compose("pair=llama31_8b_70b")
    tgt = P.load_shape(cfg["pair"]["target"])
    # Llama 3.1 70B layer: q,o 8192 x 8192; k,v 8192 x 1024; gate/up/down 8192 x 28672; two norms
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert tgt.layer_params == layer == 855_654_400
    total = 2 * tgt.params
    # accelerate keeps room for the largest offloaded layer on the GPU: resident = budget - one layer
    assert P.offloaded_bytes(tgt, 2, {0: "87GiB", "cpu": "121GiB"}, 1) == total - (87 * 2**30 - 2 * layer)
    assert P.offloaded_bytes(tgt, 2, {0: "200GiB"}, 1) == 0
    assert P.offloaded_bytes(tgt, 2, {0: "87GiB", 1: "87GiB"}, 1) == total - (87 * 2**30 - 2 * layer)  # one GPU


def test_plan_places_offloaded_weights_on_the_host_and_charges_the_stream():
    base = _compose("pair=llama31_8b_70b", "calib.dtype=float32")
    capped = _compose("pair=llama31_8b_70b", "calib.dtype=float32", "pair.target.max_memory={0:87GiB,cpu:121GiB}")
    tgt = P.load_shape(base["pair"]["target"])
    off = P.offloaded_bytes(tgt, 2, {0: "87GiB"}, 1)
    a = P.make_plan(base, H200, rates=FIXED_RATES, knobs=False)["stages"]["calibrate"]
    b = P.make_plan(capped, H200, rates=FIXED_RATES, knobs=False)["stages"]["calibrate"]
    gib = P.GiB
    # GPU: the offloaded bytes leave, one layer's buffer comes back
    assert_within(a["parts"]["gpu"]["source + target weights"] - b["parts"]["gpu"]["source + target weights"],
                  (off - 2 * tgt.layer_params) / gib, atol=1e-6, reason=(
                      "two parts the plan rounds to 1e-6 GiB, subtracted: at most 1e-6 GiB off"), headroom_exempt=(
                      "display rounding of integer byte counts: where the exact value falls between steps"))
    assert_rounded(b["parts"]["host"]["offloaded weights (max_memory; streamed to the GPU per forward)"], off / gib,
                   decimals=6, reason="the plan reports each part in GiB rounded to 6 decimals")
    # loaded by device_map one shard at a time, not whole on the host first
    load = "model loading (transient, before the moments)"
    assert b["parts"]["host"].get(load, 0) * gib <= P.LOAD_SHARD < a["parts"]["host"][load] * gib
    batches = -(-450 // 4) + -(-50 // 4)          # 500 sequences, 10 % held out, batch 4
    assert_rounded(b["parts"]["seconds"]["offloaded weights streamed"], batches * off / 1e10, decimals=1,
                   reason="the plan reports seconds rounded to 0.1 s")
    assert b["fits"] and not a["fits"]


def test_plan_applies_offload_for_llama_70b_on_one_h200_and_the_result_fits():
    h200 = P.Node(**P.NODES["1xh200-cloud"])   # one H200, 240 GiB host, 5 TiB disk
    cfg = _compose("pair=llama31_8b_70b")
    typed = P.make_plan(cfg, h200, rates=FIXED_RATES, auto=False)
    assert not typed["stages"]["calibrate"]["fits"]
    plan = P.make_plan(cfg, h200, rates=FIXED_RATES)
    keys = [e["key"] for e in plan["applied"] if e["key"] != "calib.checkpoint_every"]   # + the tuned cadence
    assert "pair.target.max_memory" in keys and "calib.dtype" not in plan["overrides"]
    assert keys[-1] == "pair.target.max_memory"   # the last resort comes last
    assert all(plan["stages"][stage]["fits"] for stage in ("calibrate", "fit", "bench", "report"))
    # the applied overrides are valid Hydra and, composed, give a plan whose calibrate fits
    overrides = shlex.split(plan["overrides"])
    applied = P.make_plan(_compose("pair=llama31_8b_70b", *overrides), h200, rates=FIXED_RATES, knobs=False)
    assert applied["stages"]["calibrate"]["fits"]
    # not needed where the weights fit: Qwen3 14B -> 32B runs without any offload
    qwen = P.make_plan(_compose("pair=qwen3_14b_32b"), h200, rates=FIXED_RATES)
    assert "max_memory" not in qwen["overrides"] and qwen["verdict"] == "fits, as typed"


def test_calibration_through_an_offloaded_target_equals_the_whole_target(offloaded_pair):
    # collect_moments reads every target layer's cache where that layer ran (kv_features): the offloaded
    # layers' K/V come back from the hook's execution device, so the moments are the same to the bit
    source, whole, loaded, _ = offloaded_pair
    ids = random_ids(8, 16, seed=7)
    a = kt.collect_moments(source, whole, ids, stride=2, heldout_fraction=0.25)
    b = kt.collect_moments(source, loaded, ids, stride=2, heldout_fraction=0.25)
    for kind in ("k", "v"):
        for name, t in a.train.stats[kind].items():
            assert torch.equal(t, b.train.stats[kind][name]), (kind, name)
