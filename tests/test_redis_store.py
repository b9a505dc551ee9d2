"""The Redis store's own behaviour on real redis-servers (the shared contract is tests/test_store_contract.py): the
same bytes as the directory store's files, the server's maxmemory LRU eviction (a shorter prefix, never an
exception), holes in a chain, TTL retention (staggered, refreshed on read), faults within the timeout (a killed and
a frozen server), credentials kept out of logs, errors and repr, and `open_store`'s choice of backend."""
from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import pytest
import torch

from kvtransfer.serve.blockstore import redact
from kvtransfer.serve.stores import open_store
from kvtransfer.serve.policy import MapSpec, safe_decide
from kvtransfer.serve.redis_store import RedisStore, StoreUnavailable
from kvtransfer.serve.store import BadEntry, KVStore
from kvtransfer.serve.writer import StoreWriter
from redis_server import RedisServer

KEY = "0123456789abcdef"
IDENT = {"key": KEY, "n_layers": 2, "n_kv": 1, "head_dim": 4, "model_id": "m", "config_hash": "c"}
BIG = {"key": KEY, "n_layers": 4, "n_kv": 2, "head_dim": 64, "model_id": "m", "config_hash": "c"}  # 64 KB blocks
NS = "a1" * 16


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 100000 + i for i in range(n)]


def _layers(n: int, ident=IDENT, value: float = 0.0):
    g = torch.Generator().manual_seed(int(value * 1000) + n)
    return [(torch.randn(ident["n_kv"], n, ident["head_dim"], generator=g),
             torch.randn(ident["n_kv"], n, ident["head_dim"], generator=g)) for _ in range(ident["n_layers"])]


def _store(server, **kw) -> RedisStore:
    return RedisStore(server.url, **({"block_size": 4, "deployment": f"t{uuid.uuid4().hex[:12]}"} | kw))


def test_a_block_is_the_same_bytes_as_the_directory_stores_file(redis_server, tmp_path):
    ids, layers = _ids(12), _layers(12)
    disk, remote = KVStore(tmp_path, block_size=4), _store(redis_server)
    assert disk.write(ids, layers, IDENT, ns=NS) == remote.write(ids, layers, IDENT, ns=NS) == 3
    client = redis_server.client()
    for h in disk.hashes(ids, KEY, NS):
        assert client.get(remote.key(KEY, h, NS)) == disk.block_path(KEY, h, NS).read_bytes()
    assert remote.key(KEY, h, NS) == f"kvt:v2:{remote.deployment}:{NS}:{KEY}:{h}"
    assert remote.key(KEY, h) == f"kvt:v2:{remote.deployment}:_:{KEY}:{h}"


def test_a_hole_in_a_chain_ends_the_prefix_and_a_read_of_it_is_evicted(redis_server):
    store = _store(redis_server)
    ids = _ids(20)
    store.write(ids, _layers(20), IDENT)
    prefix = store.lookup(ids, KEY)
    redis_server.client().delete(store.key(KEY, store.hashes(ids, KEY)[2]))  # LRU took a middle block
    assert store.lookup(ids, KEY).n_blocks == 2 and store.stored_blocks(ids, KEY) == 2
    with pytest.raises(BadEntry) as err:
        store.read(prefix, ids, 0, 16)  # the scheduler's lookup was before the eviction
    assert err.value.reason == "evicted"


def test_maxmemory_lru_eviction_gives_shorter_prefixes_and_never_raises():
    # Redis's LRU is approximate (it evicts the oldest of a sample of keys): a larger sample keeps it from evicting
    # every chain's recent first block, which once left no prefix at all (max(got) == 0)
    server = RedisServer("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10")
    try:
        store = RedisStore(server.url, block_size=16, deployment="lru")
        prompts = [_ids(128, seed) for seed in range(16)]  # 16 x 8 blocks x 64 KB = 8 MB into a 3 MB server
        for seed, ids in enumerate(prompts):
            store.write(ids, _layers(128, BIG, seed), BIG)
        got = [store.lookup(ids, KEY).n_blocks for ids in prompts]
        assert all(0 <= n <= 8 for n in got) and sum(got) < 16 * 8  # evicted: shorter prefixes, no exception
        assert max(got) > 0  # and what is left is found
        assert store.usage() <= 3 * 2 ** 20 * 1.1
        for seed, ids in enumerate(prompts):  # whatever a lookup finds reads back whole and verified
            prefix = store.lookup(ids, KEY)
            if prefix.n_blocks:
                try:
                    k, _ = store.read(prefix, ids, 0, prefix.n_tokens)[0]
                except BadEntry as err:  # evicted between the lookup and the read: a recompute, never wrong data
                    assert err.reason == "evicted"
                    continue
                assert torch.equal(k, _layers(128, BIG, seed)[0][0][:, :prefix.n_tokens])
        assert set(store.tier_stats()["errors"]) <= {"read:evicted"}  # no fault: only LRU racing a read
    finally:
        server.stop()


def test_retention_is_a_ttl_staggered_down_the_chain_and_refreshed_by_a_read(redis_server):
    store = _store(redis_server, retention_s=100.0)
    ids = _ids(16)
    store.write(ids, _layers(16), IDENT)
    client = redis_server.client()
    keys = [store.key(KEY, h) for h in store.hashes(ids, KEY)]
    ttls = [client.pttl(k) for k in keys]
    assert all(90_000 < t <= 100_000 for t in ttls) and ttls == sorted(ttls, reverse=True) and ttls[0] > ttls[-1]
    for k in keys:
        client.pexpire(k, 5_000)  # time passed
    store.read(store.lookup(ids, KEY), ids, 0, 8)  # blocks 0 and 1 are read: their TTLs are refreshed
    assert [client.pttl(k) > 90_000 for k in keys] == [True, True, False, False]
    short = _store(redis_server, retention_s=0.3)
    short.write(ids, _layers(16), IDENT)
    time.sleep(0.6)
    assert short.lookup(ids, KEY).n_blocks == 0  # expired


def _check_outage(store: RedisStore, ids, prefix, budget_s: float) -> None:
    """Every call of a store whose server is down returns (or raises its documented error) within budget_s each."""
    calls = {
        "lookup": lambda: store.lookup(ids, KEY, NS),
        "stored_blocks": lambda: store.stored_blocks(ids, KEY, NS),
        "others": lambda: store.others(ids, "fedcba9876543210", NS),
        "decide": lambda: safe_decide(ids, 0, store, MapSpec(KEY), params={"kvtransfer_ns": NS}),
    }
    out = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        out[name] = call()
        assert time.monotonic() - t0 < budget_s, name
    assert out["lookup"].n_blocks == 0 and out["lookup"].detail.startswith("store_unavailable: ")
    assert out["stored_blocks"] == 0 and out["others"] == []
    assert out["decide"].reason == "store_unavailable"
    for name, call, err in (("write", lambda: store.write(ids, _layers(16), IDENT, ns=NS), StoreUnavailable),
                            ("tip", lambda: store.tip(ids, ns=NS), StoreUnavailable),
                            ("delete", lambda: store.delete_namespace(NS), StoreUnavailable),
                            ("read", lambda: store.read(prefix, ids, 0, 8), BadEntry)):
        t0 = time.monotonic()
        with pytest.raises(err) as caught:
            call()
        assert time.monotonic() - t0 < budget_s, name
        if err is BadEntry:
            assert caught.value.reason == "store_unavailable"
    writer = StoreWriter(store, background=False)  # the producer's path: a failed save, counted
    writer.submit("r1", ids, _layers(16), IDENT, 0, NS)
    assert writer.stats["failed"] == 1
    errors = store.tier_stats()["errors"]
    assert {op.split(":")[0] for op in errors} >= {"lookup", "stored_blocks", "others", "write", "tip",
                                                   "delete_namespace", "read"}


def test_a_killed_server_is_a_counted_miss_or_failed_save_never_a_hang():
    server = RedisServer()
    try:
        store = RedisStore(server.url, block_size=4, timeout_s=0.5)
        ids = _ids(16)
        store.write(ids, _layers(16), IDENT, ns=NS)
        prefix = store.lookup(ids, KEY, NS)
        assert prefix.n_blocks == 4
        server.stop()
        _check_outage(store, ids, prefix, budget_s=1.5)
    finally:
        server.stop()


def test_a_frozen_server_times_out_within_the_calls_timeout():
    """A server that accepts but never answers (SIGSTOP: a stuck host) costs each call its timeout, no more."""
    server = RedisServer()
    try:
        store = RedisStore(server.url, block_size=4, timeout_s=0.3)
        ids = _ids(16)
        store.write(ids, _layers(16), IDENT, ns=NS)
        prefix = store.lookup(ids, KEY, NS)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            _check_outage(store, ids, prefix, budget_s=1.0)
            assert any(k.endswith("TimeoutError") for k in store.tier_stats()["errors"])
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        server.stop()


def test_credentials_never_reach_a_log_an_error_or_repr(caplog, monkeypatch):
    server = RedisServer(password="right-pass-4d2f")
    try:
        wrong = server.url.replace("right-pass-4d2f", "s3cret-wrong-9c1e")
        with pytest.raises(ValueError) as err:
            RedisStore(wrong)
        assert "s3cret-wrong-9c1e" not in str(err.value) and "KVTRANSFER_REDIS_PASSWORD" in str(err.value)
        caplog.set_level(logging.DEBUG)
        store = RedisStore(server.url, block_size=4, timeout_s=0.5)
        ids = _ids(8)
        store.write(ids, _layers(8), IDENT)
        assert store.lookup(ids, KEY).n_blocks == 2
        assert "right-pass-4d2f" not in repr(store) and ":***@" in repr(store)
        monkeypatch.setenv("KVTRANSFER_REDIS_PASSWORD", "right-pass-4d2f")  # the password from the environment
        bare = RedisStore(server.url.replace(":right-pass-4d2f@", ""), block_size=4, timeout_s=0.5)
        assert bare.lookup(ids, KEY).n_blocks == 2
        server.stop()
        texts = [store.lookup(ids, KEY).detail, bare.lookup(ids, KEY).detail]
        for call in (lambda: store.write(ids, _layers(8), IDENT), lambda: bare.tip(ids)):
            with pytest.raises(StoreUnavailable) as caught:
                call()
            texts.append(str(caught.value))
        texts += [r.getMessage() for r in caplog.records]
        assert texts and not [t for t in texts if "right-pass-4d2f" in t or "s3cret-wrong-9c1e" in t]
    finally:
        server.stop()
    assert redact("rediss://user:pw@h:6380/1?password=pw2&deployment=x") == \
        "rediss://user:***@h:6380/1?password=***&deployment=x"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_open_store_picks_the_backend_and_names_the_fix_for_a_bad_spec(tmp_path, redis_server):
    assert isinstance(open_store(tmp_path / "s", block_size=4, timeout_s=1.0), KVStore)  # Redis-only options dropped
    remote = open_store(redis_server.url + "?deployment=pick&timeout=0.5", max_bytes=10)
    assert isinstance(remote, RedisStore) and (remote.deployment, remote.timeout_s) == ("pick", 0.5)
    for bad, fix in (("", "directory path or a redis"), ("http://:pw@h/x", "only redis:// and rediss://"),
                     (redis_server.url + "?deployment=a/b", "deployment"),
                     (redis_server.url + "?timeout=soon", "number of seconds")):
        with pytest.raises(ValueError, match=fix) as err:
            open_store(bad)
        assert ":pw@" not in str(err.value)


def test_a_missing_redis_server_fails_naming_the_install(monkeypatch):
    import redis_server

    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"apt-get install -y redis-server"):
        redis_server.RedisServer()
