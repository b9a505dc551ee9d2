"""The connector on a Redis store, without vLLM (hooks driven as in tests/test_serve_connector_tenancy.py): the extra
config opens either store from one `store` setting, the consumer maps from Redis, and a dead Redis is a counted
normal prefill on the scheduler and a counted failed save on the producer -- never an exception out of a hook --
with the store tier's counters in both stats files."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import torch

from kvtransfer.serve import connector as C
from kvtransfer.serve.policy import MAPPED, Counters, Decider, MapSpec, Timings
from kvtransfer.serve.redis_store import RedisStore
from kvtransfer.serve.store import KVStore
from kvtransfer.serve.writer import StoreWriter
from redis_server import RedisServer
from test_serve_connector_tenancy import IDENT, KEY, _connector, _ids, _layers, _step

A = "a1" * 16


def test_one_store_setting_opens_a_directory_or_redis_and_sinks_go_beside_or_to_a_cache(tmp_path, redis_server,
                                                                                         monkeypatch):
    disk = C.store_from_config({"store": str(tmp_path / "s"), "block_size": "4", "store_max_bytes": "1000"})
    assert isinstance(disk, KVStore) and disk.max_bytes == 1000 and disk.block_size == 4
    assert C.sink_dir(disk, {}) == tmp_path / "s" / "sinks"
    remote = C.store_from_config({"store": redis_server.url, "store_max_bytes": "1000", "store_retention_s": "60",
                                  "store_timeout_s": "0.5", "store_deployment": "cfg"})
    assert isinstance(remote, RedisStore) and (remote.retention_s, remote.timeout_s, remote.deployment) == \
        (60.0, 0.5, "cfg")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert C.sink_dir(remote, {}) == tmp_path / "cache" / "kvtransfer" / "sinks"  # a URL store has no directory
    assert C.sink_dir(remote, {"sink_dir": str(tmp_path / "state" / "sinks")}) == tmp_path / "state" / "sinks"


def _consumer(store, stats_path=None):
    conn = _connector(store, producer=False)
    conn.counters, conn.timings = Counters(stats_path, flush_s=0.05), Timings()
    conn.counters.store_stats = store.tier_stats
    conn.spec = MapSpec(KEY)
    conn.decider = Decider(store, conn.spec, conn.counters)
    return conn


def _request(rid, ids):
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": A},
                           cache_salt=None)


def test_the_consumer_maps_from_redis_and_a_dead_redis_is_a_counted_normal_prefill(tmp_path):
    server = RedisServer()
    try:
        store = RedisStore(server.url, block_size=4, timeout_s=0.5)
        ids = _ids(18)
        store.write(ids, _layers(18, value=0.25), IDENT, ns=A)
        conn = _consumer(store, tmp_path / "stats.json")
        assert conn.get_num_new_matched_tokens(_request("up", ids), 0) == (16, False)
        assert conn.decider.get("up", ids, 0, {"kvtransfer_ns": A}).reason == MAPPED
        meta = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"up": 18}))
        scattered = {}
        conn._smap = SimpleNamespace(map_range=lambda source, lo, hi: source)
        conn._layout = SimpleNamespace(scatter=lambda layer, k, v, slots: scattered.setdefault(layer, k))
        conn._kv_caches = {f"model.layers.{i}.self_attn.attn": f"model.layers.{i}.self_attn.attn" for i in (0, 1)}
        conn._load(meta.loads[0])
        k = scattered["model.layers.0.self_attn.attn"]
        assert torch.equal(k[0, :, 0], torch.arange(16, dtype=torch.float32) + 0.25)
        server.stop()
        t0 = time.monotonic()
        assert conn.get_num_new_matched_tokens(_request("down", ids), 0) == (0, False)
        assert time.monotonic() - t0 < 3 * store.timeout_s  # the store's timeout, not a hang
        assert conn.counters.reasons == {MAPPED: 1, "store_unavailable": 1}
        # a load planned before the outage: a load error (vLLM recomputes), not an exception
        conn._failed_blocks = set()
        conn._get_connector_metadata = lambda: meta
        conn.start_load_kv(None)
        assert conn._failed_blocks and "read failed" in conn.timings.loads[-1]["failed"]
        conn.counters.flush()
        written = json.loads((tmp_path / "stats.json").read_text())
        assert written["reasons"]["store_unavailable"] == 1
        assert written["store"]["backend"] == "redis" and written["store"]["hits"] == {"lookup": 1}
        assert written["store"]["errors"] == {"lookup:ConnectionError": 1, "read:ConnectionError": 1}
    finally:
        server.stop()


def test_a_dead_redis_costs_the_producer_a_counted_failed_save_never_a_raised_hook():
    server = RedisServer()
    try:
        store = RedisStore(server.url, block_size=4, timeout_s=0.5)
        conn = _connector(store, producer=True)
        ids = _ids(18)
        conn._requests = {"a": SimpleNamespace(prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": A})}
        server.stop()
        meta = C.ServeMetadata()
        conn._plan_saves(_step("a", n=18), meta)  # the scheduler knows nothing stored: all is gathered
        assert [(s.req_id, s.first, s.end) for s in meta.saves] == [("a", 0, 16)]
        conn.writer, conn._layout = StoreWriter(store, background=False), object()
        conn._layer_parts = {"a": {i: (k[:, :16], v[:, :16]) for i, (k, v) in enumerate(_layers(18))}}
        conn._get_connector_metadata = lambda: meta
        conn.has_connector_metadata = lambda: True
        conn.wait_for_save()
        assert conn.writer.stats["failed"] == 1 and conn.writer.stats["written_blocks"] == 0
        # the write failed, and so did the writer's check of what is stored (on its thread): all reported missing
        assert set(store.tier_stats()["errors"]) == {"stored_blocks:ConnectionError", "write:ConnectionError"}
        assert conn.writer.take_reports() == ([], store.hashes(ids, KEY, A))
    finally:
        server.stop()
