"""kvtransfer.serve without vLLM (the default suite): the store format, the
consumer's fallback decisions, and the map as served == the harness's `transfer` (issue 22).
The end-to-end tests through vLLM are in test_serve_vllm.py (slow, serving environment)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, forward_factor

from kvtransfer import Mapper, model_identity, transfer
from kvtransfer.core.cache import prefill
from kvtransfer.serve.mapping import ServeMap, codec_from_config, identity_mapper
from kvtransfer.serve.policy import MAPPED, Counters, MapSpec, decide
from kvtransfer.serve.store import BadEntry, KVStore, identity_from_config, prompt_key, save_prefill
from kvtransfer.core.transfer import codec_for


# the paged layouts (slot mapping, GPU and CPU packings): tests/test_serve_paged.py


# ---------------------------------------------------------------- store
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny source/target pair with different KV geometry, saved as HF directories, and a random ridge map."""
    root = tmp_path_factory.mktemp("pair")
    src = tiny_model("qwen3", seed=1, name="src", layers=2, head_dim=8)
    tgt = tiny_model("qwen3", seed=2, name="tgt", layers=3, head_dim=16, hidden=48)
    src.save_pretrained(root / "src")
    tgt.save_pretrained(root / "tgt")
    p, q = 2 * 2 * 8, 2 * 16  # k = 2 source layers x n_kv x d_s -> n_kv_t x d_t
    g = torch.Generator().manual_seed(3)
    mapper = Mapper(weight=0.3 * torch.randn(3, 2, p, q, generator=g), bias=0.1 * torch.randn(3, 2, q, generator=g),
                    selected_layers=torch.tensor([[0, 1], [1, 0], [1, 1]]), source=model_identity(src),
                    target=model_identity(tgt), native_sink=1,
                    calibration={"context_start": "prefix_token", "start_ids": [5]})
    mapper.save(root / "mapper")
    return {"root": root, "src": src, "tgt": tgt, "mapper": mapper}


def _prompt(n=20, seed=0):
    return [5] + random_ids(1, n - 1, seed=seed)[0].tolist()


def test_store_round_trip_keeps_tensors_header_and_extras(tmp_path, pair):
    store = KVStore(tmp_path / "store")
    prompt = _prompt()
    layers = [(k[0], v[0]) for k, v in prefill(pair["src"], torch.tensor([prompt]))]
    ident = model_identity(pair["src"])
    path = store.write(prompt, layers, ident, extras={"hidden": torch.ones(20, 4)})
    assert path == store.path(prompt, ident["config_hash"]) and path.name.startswith(prompt_key(prompt))
    entry = store.read_header(path, prompt)
    assert entry.n_tokens == 20 and entry.model == ident and entry.header["positions"] == [0, 20]
    assert entry.header["dtype"] == "float32" and entry.header["extras"] == ["hidden"]
    back = store.read(entry, 3, 20)
    assert all(torch.equal(k[:, 3:], bk) and torch.equal(v[:, 3:], bv) for (k, v), (bk, bv) in zip(layers, back))
    assert store.write(prompt, layers, ident) is None  # never overwritten
    assert save_prefill(store, pair["src"], prompt) is None  # the HF prefill writes the same entry (same path)


def test_store_refuses_bad_entries_with_a_reason(tmp_path, pair):
    store = KVStore(tmp_path / "store")
    prompt = _prompt()
    path = save_prefill(store, pair["src"], prompt)
    data = path.read_bytes()
    with pytest.raises(BadEntry, match="stored token ids differ") as err:
        store.read_header(path, [6] + prompt[1:])
    assert err.value.reason == "corrupt"
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(BadEntry) as err:
        store.read_header(path, prompt)
    assert err.value.reason == "corrupt"
    with pytest.raises(ValueError, match="do not match the model's"):
        store.write(prompt[:5], [(torch.zeros(2, 5, 8), torch.zeros(2, 5, 8))], model_identity(pair["src"]))


def _write_raw(store, prompt, ident, *, positions=None, k_shape=None):
    """An entry written by hand (what a buggy producer could leave): header fields or shapes wrong."""
    from kvtransfer.core.io import atomic_save_tensors

    n = len(prompt)
    tensors = {"token_ids": torch.tensor(prompt)}
    for i in range(ident["n_layers"]):
        tensors[f"layers.{i}.k"] = torch.zeros(k_shape or (ident["n_kv"], n, ident["head_dim"]))
        tensors[f"layers.{i}.v"] = torch.zeros(ident["n_kv"], n, ident["head_dim"])
    header = {"format": "kvtransfer.kv_entry", "version": 1, "model": ident, "n_tokens": n,
              "positions": positions or [0, n], "dtype": "float32", "extras": []}
    path = store.path(prompt, ident["config_hash"])
    atomic_save_tensors(path, tensors, header)
    return path


def test_store_refuses_shifted_positions_and_mis_shaped_layers(tmp_path, pair):
    store = KVStore(tmp_path / "store")
    ident = model_identity(pair["src"])
    prompt = _prompt()
    for kwargs, reason in (({"positions": [3, 23]}, "positions"), ({"k_shape": (2, 20, 4)}, "mis-shaped")):
        path = _write_raw(store, prompt, ident, **kwargs)
        with pytest.raises(BadEntry) as err:
            store.read_header(path, prompt)
        assert err.value.reason == reason
        path.unlink()


# ---------------------------------------------------------------- decisions (scheduler side)
def _spec(pair, **kw):
    return MapSpec(source_hash=model_identity(pair["src"])["config_hash"], start_ids=(5,), native_sink=1, **kw)


def test_decide_maps_all_but_the_native_tail(tmp_path, pair):
    store = KVStore(tmp_path)
    prompt = _prompt()
    save_prefill(store, pair["src"], prompt)
    d = decide(prompt, 0, store, _spec(pair))
    assert (d.reason, d.matched, d.lo, d.hi, d.tail) == (MAPPED, 19, 0, 19, 1)
    d = decide(prompt, 0, store, _spec(pair, native_tail=3))
    assert (d.matched, d.tail) == (17, 3)
    d = decide(prompt, 8, store, _spec(pair))  # 8 tokens already cached locally: map the rest
    assert (d.matched, d.lo, d.hi) == (11, 8, 19)
    longer = prompt + [7, 8, 9]  # the source read a prefix of this prompt
    assert decide(longer, 0, store, _spec(pair)).reason == "no_entry"
    d = decide(longer, 0, store, _spec(pair), source_len=20)
    assert (d.reason, d.matched, d.tail) == (MAPPED, 20, 3)


def test_decide_falls_back_with_a_reason_for_every_bad_case(tmp_path, pair):
    store = KVStore(tmp_path)
    prompt = _prompt()
    spec = _spec(pair)
    assert decide(prompt, 0, store, spec).reason == "no_entry"
    save_prefill(store, pair["tgt"], prompt)  # an entry from another model (the mapper's target, not source)
    assert decide(prompt, 0, store, spec).reason == "wrong_pair"
    path = save_prefill(store, pair["src"], prompt)
    assert decide(prompt, 0, store, MapSpec(source_hash="", unusable="mapper for another target")).reason == "wrong_pair"
    assert decide([6] + prompt[1:], 0, store, spec).reason == "context_start"
    assert decide(prompt, 0, store, spec, prefix_caching=True).reason == "unsalted"
    assert decide(prompt, 0, store, spec, off=True).reason == "off"
    assert decide(prompt, 0, store, spec, prefix_caching=True, salted=True).reason == MAPPED
    assert decide(prompt, 19, store, spec).reason == "too_short"
    assert decide(prompt[:1] + prompt[1:2], 0, store, spec).reason in ("no_entry", "too_short")
    path.write_bytes(path.read_bytes()[:-100])
    assert decide(prompt, 0, store, spec).reason == "corrupt"


def test_counters_log_and_write_every_decision(tmp_path, pair):
    counters = Counters(tmp_path / "stats.json")
    store = KVStore(tmp_path / "store")
    prompt = _prompt()
    counters.record("a", len(prompt), decide(prompt, 0, store, _spec(pair)))
    save_prefill(store, pair["src"], prompt)
    counters.record("b", len(prompt), decide(prompt, 0, store, _spec(pair)))
    got = Counters.load(tmp_path / "stats.json")
    assert got["reasons"] == {"no_entry": 1, MAPPED: 1}
    assert got["requests"]["a"]["tail"] == 20 and got["requests"]["b"] | {"detail": ""} == {
        "prompt": 20, "reason": MAPPED, "matched": 19, "lo": 0, "tail": 1, "detail": ""}


# ---------------------------------------------------------------- the map as served == the harness's transfer
def test_codec_from_config_is_the_models_own_rope(pair):
    for side in ("src", "tgt"):
        model = pair[side]
        pos = torch.arange(0, 300, 7)
        built, own = codec_from_config(model.config).cos_sin(pos), codec_for(model).cos_sin(pos)
        assert torch.equal(built[0], own[0]) and torch.equal(built[1], own[1])
    keys = torch.randn(1, 2, 43, 16)
    codec = codec_from_config(pair["tgt"].config)
    pos = torch.arange(43)
    assert_close(codec.strip(codec.apply(keys, pos), pos), keys, factor=10 * 6, reason=(
        "strip(apply(k)): two float32 rotations (a product pair and a sum each, 3 roundings) of |k|, x10 few ops"))
    assert float((codec.apply(keys, pos) - keys).abs().max()) > 0.1  # the rotation itself is not the identity


def test_serve_map_equals_the_harness_transfer_on_any_token_range(pair):
    """ServeMap.map_range (configs only, sink precomputed) == kvtransfer.core.transfer (models loaded, native_sink=1),
    for the whole prompt and for a later range (positions lo..hi-1 strip and re-rotate at their own angles):
    bit for bit on the mapped positions; the sink (position 0) is the target's own 1-token prefill on both sides,
    run by a reloaded model (sdpa, not the in-memory model's eager attention), so equal to float32 rounding."""
    root = pair["root"]
    smap = ServeMap(root / "mapper", pair["src"].config, pair["tgt"].config, target_path=str(root / "tgt"))
    prompt = torch.tensor([_prompt(30, seed=4)])
    src_layers = prefill(pair["src"], prompt)
    want = transfer(src_layers, pair["mapper"], pair["src"], pair["tgt"], input_ids=prompt, as_layers=True)
    for lo, hi in ((0, 30), (11, 30), (0, 1)):
        got = smap.map_range([(k[0, :, lo:hi], v[0, :, lo:hi]) for k, v in src_layers], lo, hi)
        for (gk, gv), (wk, wv) in zip(got, want):
            wk, wv, m = wk[0, :, lo:hi], wv[0, :, lo:hi], max(0, 1 - lo)
            assert torch.equal(gk[:, m:], wk[:, m:]) and torch.equal(gv[:, m:], wv[:, m:])
            # the sink: a 1-token float32 forward on two attention kernels (sdpa vs eager)
            for got_, want_ in ((gk, wk), (gv, wv)):  # scale: the layer's K / V over the whole range
                assert_close(got_[:, :m], want_[:, :m], factor=forward_factor(pair["tgt"], 1), reason=FORWARD,
                             magnitude=float(want_.abs().max()))
    with pytest.raises(ValueError, match="fitted for target"):
        ServeMap(root / "mapper", pair["src"].config, pair["src"].config)
    with pytest.raises(ValueError, match="is not the mapper's source"):
        ServeMap(root / "mapper", pair["tgt"].config, pair["tgt"].config)


def test_identity_mapper_reproduces_the_models_own_cache(tmp_path, pair):
    """The plumbing check's map: target -> target through strip / identity / re-apply gives the target's cache."""
    tgt = pair["tgt"]
    identity_mapper(tgt.config, model_id="tgt", start_ids=[5]).save(tmp_path / "id")
    smap = ServeMap(tmp_path / "id", tgt.config, tgt.config, target_path=str(pair["root"] / "tgt"),
                    sink_cache=tmp_path / "sinks")
    again = ServeMap(tmp_path / "id", tgt.config, tgt.config, target_path=str(pair["root"] / "tgt"),
                     sink_cache=tmp_path / "sinks")  # reads the sink file the first one wrote
    assert len(list((tmp_path / "sinks").glob("sink.*.5.safetensors"))) == 1
    assert all(torch.equal(a, b) for kv, kv2 in zip(smap.sink, again.sink) for a, b in zip(kv, kv2))
    prompt = _prompt(25, seed=5)
    own = [(k[0], v[0]) for k, v in prefill(tgt, torch.tensor([prompt]))]
    got = smap.map_range(own, 0, 25)
    for (gk, gv), (ok, ov) in zip(got, own):
        # keys: strip and re-apply RoPE around an identity GEMM (exact: one nonzero product per output)
        assert_close(gk[:, 1:], ok[:, 1:], factor=10 * 6, reason=(
            "two float32 rotations (3 roundings each) of |k| around an exact identity GEMM, x10 few ops"))
        assert_close(gv[:, 1:], ov[:, 1:], factor=10 * 2, reason=(
            "values through an identity GEMM in float32: one nonzero product per output, x10 few ops"))
        # the sink is the target's own 1-token prefill of the start token (a reloaded model: sdpa vs eager)
        assert_close(gk[:, 0], ok[:, 0], factor=forward_factor(tgt, 1), reason=FORWARD)
    assert identity_from_config(tgt.config)["config_hash"] == model_identity(tgt)["config_hash"]


def test_the_connector_module_imports_without_vllm():
    """The default suite has no vLLM: the module imports, and only building the connector needs vLLM."""
    from kvtransfer.serve import connector

    assert connector.layer_index("model.layers.17.self_attn.attn") == 17
    if connector.HAVE_VLLM:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        assert issubclass(connector.KVTransferConnector, KVConnectorBase_V1)
    else:
        with pytest.raises(ImportError, match="setup_serve.sh"):
            connector.KVTransferConnector(None, None, None)
    meta = connector.ServeMetadata()
    assert meta.loads == [] and meta.saves == []
