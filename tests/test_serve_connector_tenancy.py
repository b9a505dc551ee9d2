"""The connector's side of store namespaces and its start-up refusals, without vLLM: the producer stores a request's
blocks in the namespace its kv_transfer_params name (`kvtransfer_ns`), the consumer looks up and loads under the
request's namespace only, a malformed namespace is a bad request (never an exception out of a hook), and an engine
that splits its KV over ranks (tensor or pipeline parallelism) is refused at start with the fix named.

The connector's hooks are driven on an instance made without vLLM's base class (object.__new__), with the few
attributes each hook reads set by hand and vLLM's scheduler output / request objects as SimpleNamespaces."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from kvtransfer.serve import connector as C
from kvtransfer.serve.policy import MAPPED, Counters, Decider, MapSpec, Timings
from kvtransfer.serve.store import KVStore
from kvtransfer.serve.writer import StoreWriter

IDENT = {"key": "0123456789abcdef", "n_layers": 2, "n_kv": 1, "head_dim": 4, "model_id": "m", "config_hash": "c"}
KEY = IDENT["key"]
A, B = "a1" * 16, "b2" * 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 10000 + i for i in range(n)]


def _layers(n: int, value: float = 0.0):
    return [(torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, 4) + 1000 * i + value,) * 2
            for i in range(IDENT["n_layers"])]


def _connector(store: KVStore, *, producer: bool) -> C.KVTransferConnector:
    conn = object.__new__(C.KVTransferConnector)
    conn.store, conn.producer, conn.block_size = store, producer, 4
    conn.counters, conn.timings = Counters(), Timings()
    conn._model_identity = IDENT
    conn._requests, conn._saved, conn._pending, conn._loading, conn._alloc, conn._gate_hi = {}, set(), {}, {}, {}, {}
    conn._gate_kept, conn._layer_parts, conn._failed_blocks = {}, {}, set()
    conn.gate, conn._gates, conn._gate_out = None, {}, {}
    conn._known, conn.writer, conn.decider = OrderedDict(), None, None
    conn._smap, conn._smap_error, conn._report_unusable = None, "", False
    conn._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (list(range(10, 16)),))
    return conn


def _step(*req_ids, n: int):
    """vLLM's scheduler output for one step that prefills the whole prompt of each new request."""
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=0) for r in req_ids],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           num_scheduled_tokens={r: n for r in req_ids})


# ---------------------------------------------------------------- start-up
@pytest.mark.parametrize("knob,flag", [("tensor_parallel_size", "--tensor-parallel-size 1"),
                                       ("pipeline_parallel_size", "--pipeline-parallel-size 1")])
def test_an_engine_that_splits_its_kv_over_ranks_is_refused_at_start_naming_the_fix(knob, flag):
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    C.check_parallelism(config)  # one rank: fine
    setattr(config.parallel_config, knob, 2)
    with pytest.raises(ValueError, match=f"{knob}=2.*run the engines with {flag}"):
        C.check_parallelism(config)
    with pytest.raises(ValueError, match=flag):  # the connector itself refuses before opening anything
        C.KVTransferConnector(config, None)


# ---------------------------------------------------------------- producer
def test_the_producer_stores_each_request_in_its_namespace(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    ids = _ids(18)
    store.write(ids, _layers(18), IDENT)  # the same prompt in the shared namespace: tenant A must not reuse it
    conn = _connector(store, producer=True)
    conn._requests = {"a": SimpleNamespace(prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": A}),
                      "plain": SimpleNamespace(prompt_token_ids=ids, kv_transfer_params=None)}
    meta = C.ServeMetadata()
    conn._plan_saves(_step("a", "plain", n=18), meta)
    # the scheduler does not ask the store: "plain" (stored by another process) is gathered again, and skipped by
    # the writer, which checks the store on its own thread
    assert [(s.req_id, s.ns, s.first, s.end) for s in meta.saves] == [("a", A, 0, 16), ("plain", "", 0, 16)]
    # the worker: gathered K/V handed to the writer with the namespace
    conn.writer, conn._layout = StoreWriter(store, background=False), object()
    conn._layer_parts = {r: {i: (k[:, :16], v[:, :16]) for i, (k, v) in enumerate(_layers(18, value=0.5))}
                         for r in ("a", "plain")}
    conn._get_connector_metadata = lambda: meta
    conn.has_connector_metadata = lambda: True
    a_bytes = sum(t.numel() * t.element_size() for kv in conn._layer_parts["a"].values() for t in kv)
    conn.wait_for_save()
    assert conn.writer.stats["written_blocks"] == 4  # tenant A's four; none of the shared prompt's again
    assert conn.writer.stats["written_bytes"] == a_bytes  # the bytes written ...
    assert conn.writer.stats["gathered_bytes"] == 2 * a_bytes  # ... and the bytes gathered (the redundant copy)
    assert store.lookup(ids, KEY, A).n_blocks == 4 and store.lookup(ids, KEY, B).n_blocks == 0
    k = store.read(store.lookup(ids, KEY, A), ids, 0, 16)[0][0]
    assert torch.equal(k[0, :, 0], torch.arange(16, dtype=torch.float32) + 0.5)  # tenant A's values, not the shared


@pytest.mark.parametrize("ns", ["../x", "AB", 7, "a" * 65])
def test_a_malformed_namespace_is_not_stored_and_is_counted(tmp_path, ns):
    store = KVStore(tmp_path, block_size=4)
    conn = _connector(store, producer=True)
    conn._requests = {"r": SimpleNamespace(prompt_token_ids=_ids(16), kv_transfer_params={"kvtransfer_ns": ns})}
    meta = C.ServeMetadata()
    conn._plan_saves(_step("r", n=16), meta)
    assert meta.saves == [] and conn.counters.reasons == {"save_bad_request": 1}


# ---------------------------------------------------------------- consumer
def test_the_consumer_decides_and_loads_under_the_requests_namespace_only(tmp_path):
    """Tenants A and B stored the same prompt with different values: a request of B's maps B's blocks, one with no
    namespace or a namespace that stored nothing maps nothing, and a malformed one is a bad request."""
    store = KVStore(tmp_path, block_size=4)
    ids = _ids(18)
    store.write(ids, _layers(18, value=0.25), IDENT, ns=A)
    store.write(ids, _layers(18, value=0.75), IDENT, ns=B)
    conn = _connector(store, producer=False)
    conn.spec = MapSpec(KEY)
    conn.decider = Decider(store, conn.spec, conn.counters)
    for rid, params, reason in (("b", {"kvtransfer_ns": B}, MAPPED), ("none", None, "no_entry"),
                                ("c", {"kvtransfer_ns": "c" * 8}, "no_entry"),
                                ("bad", {"kvtransfer_ns": "../" + A}, "bad_request")):
        request = SimpleNamespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params=params, cache_salt=None)
        matched, _ = conn.get_num_new_matched_tokens(request, 0)
        assert conn.decider.get(rid, ids, 0, params).reason == reason
        assert matched == (16 if reason == MAPPED else 0)
    meta = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"b": 18}))
    (load,) = meta.loads
    assert (load.req_id, load.ns, load.hashes) == ("b", B, store.hashes(ids, KEY, B))
    scattered = {}
    conn._smap = SimpleNamespace(map_range=lambda source, lo, hi: source)  # the identity map
    conn._layout = SimpleNamespace(scatter=lambda layer, k, v, slots: scattered.setdefault(layer, k))
    conn._kv_caches = {name: name for name in LAYERS}
    conn._load(load)
    k = scattered[LAYERS[0]]
    assert torch.equal(k[0, :, 0], torch.arange(16, dtype=torch.float32) + 0.75)  # B's blocks, not A's
