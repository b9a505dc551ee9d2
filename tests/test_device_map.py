"""Issue 10 §5: a target spread over devices by `device_map` reads each layer's mapped cache on that
layer's device. CPU torch has one real device, so placement is asserted with `meta` standing in for a
second device (a layer whose k_proj sits there, or a patched per-layer device lookup), and the config
wiring is checked by really loading the shipped tiny models with `device_map=auto` (accelerate)."""
from pathlib import Path

import pytest
import torch

import importlib

import kvtransfer as kt
from kvtransfer.core.models import device_map_for, layer_devices, load_model
from kvtransfer.runner import Run
from kvtransfer.core.transfer import place_on_layers
from tiny_models import random_ids, tiny_model
from run_configs import compose_config as _compose

ROOT = Path(__file__).resolve().parents[1]
transfer_mod = importlib.import_module("kvtransfer.core.transfer")  # the package exports a function of that name
CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen3", layers=2, seed=1, name="tiny-src")
    target = tiny_model("qwen3", layers=3, seed=2, hidden=48, heads=6, name="tiny-tgt")
    calib = kt.collect_moments(source, target, random_ids(16, 24, seed=3), stride=2, heldout_fraction=0.25)
    r2 = kt.r2_matrix(calib.train, heldout=calib.heldout, head_dim=8)
    fit = kt.fit_ridge(calib.train, kt.select_topk(r2["train"], 2), heldout=calib.heldout, head_dim=8)
    return source, target, kt.Mapper.from_ridge(fit, source, target, calibration=calib.train.info)


def test_device_map_key_follows_the_model():
    base = {"device_map": None, "pair": {"direction": "forward", "source": {"device_map": None},
                                         "target": {"device_map": "auto"}}}
    assert device_map_for(base, "target") == "auto" and device_map_for(base, "source") is None
    # reverse: the model written as pair.target now plays the source, and its map goes with it
    rev = {**base, "pair": {**base["pair"], "direction": "reverse"}}
    assert device_map_for(rev, "source") == "auto" and device_map_for(rev, "target") is None
    # the run-wide key covers both models unless a model has its own
    explicit = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    glob = {"device_map": "balanced", "pair": {"source": {"device_map": None}, "target": {"device_map": explicit}}}
    assert device_map_for(glob, "source") == "balanced" and device_map_for(glob, "target") == explicit
    with pytest.raises(ValueError, match="source or target"):
        device_map_for(base, "both")
    # every shipped pair has the key, null by default, and the CLI sets it
    for pair_file in sorted((ROOT / "conf" / "pair").glob("*.yaml")):
        cfg = _compose(f"pair={pair_file.stem}")
        assert cfg["pair"]["source"]["device_map"] is None and cfg["pair"]["target"]["device_map"] is None, pair_file
    cfg = _compose("pair=llama31_8b_70b", "pair.target.device_map=auto")
    assert device_map_for(cfg, "target") == "auto" and device_map_for(cfg, "source") is None


def test_layer_devices_read_each_layers_k_proj():
    model = tiny_model("qwen3", layers=3, seed=0)
    assert layer_devices(model) == [CPU, CPU, CPU]
    model.model.layers[1].self_attn.k_proj.to(META)  # as if layer 1 sat on a second GPU
    assert layer_devices(model) == [CPU, META, CPU]


@pytest.mark.parametrize("native_sink", [0, 2])
def test_transfer_puts_each_layers_cache_on_that_layers_device(pair, monkeypatch, native_sink):
    source, target, mapper = pair
    ids = random_ids(2, 12, seed=5)
    src = kt.prefill(source, ids)
    kw = {"input_ids": ids, "native_sink": native_sink}
    whole = kt.transfer(src, mapper, source, target, as_layers=True, **kw)
    assert [k.device for k, _ in whole] == [CPU] * 3

    asked = [CPU, META, CPU]  # a target spread over two devices, layer 1 on the second
    seen = []
    monkeypatch.setattr(transfer_mod, "layer_devices", lambda model: seen.append(model) or list(asked))
    spread = kt.transfer(src, mapper, source, target, as_layers=True, **kw)
    assert seen == [target]  # the lookup asked about the target, not the source
    for (k, v), (wk, wv), dev in zip(spread, whole, asked):
        assert k.device == v.device == dev and k.shape == wk.shape and v.shape == wv.shape and k.dtype == wk.dtype
        if dev == CPU:  # placement moves tensors, it never changes them
            assert torch.equal(k, wk) and torch.equal(v, wv)
    cache = kt.transfer(src, mapper, source, target, **kw)  # the DynamicCache the target reads
    assert [layer.keys.device for layer in cache.layers] == asked
    assert [layer.values.device for layer in cache.layers] == asked


def test_transfer_uses_the_real_lookup_of_the_target(pair):
    source, _, mapper = pair
    target = tiny_model("qwen3", layers=3, seed=2, hidden=48, heads=6, name="tiny-tgt")
    target.model.layers[2].self_attn.k_proj.to(META)
    mapped = kt.transfer(kt.prefill(source, random_ids(1, 8, seed=6)), mapper, source, target, as_layers=True)
    assert [(k.device, v.device) for k, v in mapped] == [(CPU, CPU), (CPU, CPU), (META, META)]


def test_place_on_layers_leaves_placed_tensors_alone_and_checks_depth():
    model = tiny_model("qwen3", layers=2, seed=0)
    layers = [(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)) for _ in range(2)]
    placed = place_on_layers(layers, model)
    assert all(pk is k and pv is v for (pk, pv), (k, v) in zip(placed, layers))  # no copy when already there
    with pytest.raises(ValueError, match="3 cache layers for a model with 2"):
        place_on_layers(layers + layers[:1], model)


def test_pair_device_map_reaches_model_loading(tmp_path, monkeypatch):
    """pair.target.device_map=auto reaches load_model for the target only (the models really load with it,
    through accelerate); reversed, the map follows the model written next to it; an explicit map passes as given."""
    import kvtransfer.runner.run as run_module

    calls = {}

    def spy(ref, **kw):
        calls[Path(ref).name] = kw["device_map"]
        return load_model(ref, **kw)

    monkeypatch.setattr(run_module, "load_model", spy)
    run = Run(_compose("pair=tiny", "pair.target.device_map=auto", "device=cpu"), tmp_path)
    target, source = run.model("target")[0], run.model("source")[0]
    assert calls == {"qwen3-tiny-7m": "auto", "qwen3-tiny-1m": None}
    assert layer_devices(target) == [CPU] * target.config.num_hidden_layers  # one CPU: "auto" puts all there
    calls.clear()
    rev = Run(_compose("pair=tiny", "pair.target.device_map=auto", "pair.direction=reverse", "device=cpu"), tmp_path)
    rev.model("source"), rev.model("target")
    assert Path(rev.model_ref("source")).name == "qwen3-tiny-7m"
    assert calls == {"qwen3-tiny-7m": "auto", "qwen3-tiny-1m": None}
    calls.clear()
    Run(_compose("pair=tiny", "device_map=auto", "device=cpu"), tmp_path).model("source")
    assert calls == {"qwen3-tiny-1m": "auto"}  # the run-wide key still covers both models
    model, _ = load_model(str(ROOT / "models/tiny/qwen3-tiny-1m"), dtype="float32",
                          device_map={"": "cpu"})  # an explicit map, as transformers takes it
    assert model.device == CPU and layer_devices(model) == [CPU] * model.config.num_hidden_layers
