"""The KV store's contract, written against its public methods only and run over every store backend
(`store_factory`: the directory store, kvtransfer.serve.store.KVStore, and the Redis store,
kvtransfer.serve.redis_store.RedisStore, on a real redis-server started for the session): write / lookup / read /
tip / stored_blocks / others / delete_namespace, and two tenants on one store -- namespace A's blocks are never
found, mapped or deleted through namespace B, even for the same tokens of the same model, and no block's content
(a crafted header) can make a deletion reach anything outside the store. Eviction and retention are each backend's
own mechanism (the directory's scans here, Redis's maxmemory and TTLs in tests/test_redis_store.py).

A backend plugs in with a `Backend`: `make(**options)` opens a store (block size 4), `plant(store, ...)` writes one
block by hand as a buggy or hostile producer would, and `decoy()` puts something outside the store that nothing
may delete.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvtransfer.core.io import atomic_save_tensors
from kvtransfer.serve.policy import MAPPED, MapSpec, safe_decide
from kvtransfer.serve.blockformat import encode_block
from kvtransfer.serve.blockstore import BlockStore
from kvtransfer.serve.redis_store import RedisStore
from kvtransfer.serve.store import FORMAT, VERSION, KVStore, checksum

KEY, OTHER_KEY = "0123456789abcdef", "fedcba9876543210"
IDENT = {"key": KEY, "n_layers": 2, "n_kv": 1, "head_dim": 4, "model_id": "m", "config_hash": "c"}
A, B = "a1" * 16, "b2" * 16  # two tenants' session namespaces


@dataclass
class Backend:
    make: Callable[..., object]
    plant: Callable[..., None]  # (store, model_key, ns, h, tensors, header): one block written by hand
    decoy: Callable[[], tuple[Callable[[], bool], str]]  # something outside the store: ("does it still exist?",
    # a header `parent` that a store resolving parents as block names would take for it)


def _directory_backend(tmp_path) -> Backend:
    root = tmp_path / "store"

    def plant(store, model_key, ns, h, tensors, header):
        atomic_save_tensors(store.block_path(model_key, h, ns), tensors, header)

    def decoy():
        # beside the store; <root>/<key>/<ns>/<h[:2]>/<h>.safetensors with h = "../../victim/model" lands on it
        path = tmp_path / "victim" / "model.safetensors"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"weights")
        return path.exists, "../../victim/model"

    return Backend(lambda **kw: KVStore(root, **({"block_size": 4} | kw)), plant, decoy)


def _redis_backend(tmp_path, server) -> Backend:
    deployment = f"contract-{tmp_path.name[-40:]}".replace("_", "-")  # a fresh key prefix per test
    client = server.client()

    def plant(store, model_key, ns, h, tensors, header):
        client.set(store.key(model_key, h, ns), encode_block(tensors, header))

    def decoy():
        # another deployment's key, and a `parent` naming it
        victim = "kvt:v1:victim:model"
        client.set(victim, b"weights")
        return lambda: bool(client.exists(victim)), victim

    return Backend(lambda **kw: RedisStore(server.url, **({"block_size": 4, "deployment": deployment} | kw)),
                   plant, decoy)


BACKENDS = {"directory": _directory_backend, "redis": _redis_backend}


@pytest.fixture(params=sorted(BACKENDS))
def store_factory(request, tmp_path) -> Backend:
    if request.param == "redis":
        return _redis_backend(tmp_path, request.getfixturevalue("redis_server"))
    return BACKENDS[request.param](tmp_path)


@pytest.fixture
def directory_store_factory(tmp_path) -> Backend:
    """The directory store alone: its eviction is a scan the store runs (max_bytes, evict, expire); a Redis store's
    is the server's maxmemory policy and its TTLs (tests/test_redis_store.py)."""
    return _directory_backend(tmp_path)


def test_every_backend_is_a_block_store(store_factory):
    assert isinstance(store_factory.make(), BlockStore)


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 10000 + i for i in range(n)]


def _layers(n: int, value: float = 0.0, lo: int = 0):
    """Per-layer (K, V) [1, n - lo, 4] of tokens lo..n-1: position + 1000 * layer + `value` (a tenant's mark)."""
    out = []
    for layer in range(IDENT["n_layers"]):
        pos = torch.arange(lo, n, dtype=torch.float32) + 1000 * layer + value
        k = pos[None, :, None].expand(1, n - lo, 4).clone()
        out.append((k, -k))
    return out


# ---------------------------------------------------------------- one tenant
def test_write_lookup_read_round_trip_in_a_namespace(store_factory):
    store = store_factory.make()
    ids = _ids(18)
    assert store.write(ids, _layers(18), IDENT, ns=A) == 4  # 4 full blocks; the last 2 tokens are not stored
    assert store.write(ids, _layers(18), IDENT, ns=A) == 0  # nothing stored twice
    prefix = store.lookup(ids, KEY, ns=A)
    assert (prefix.n_blocks, prefix.n_tokens, prefix.ns, prefix.detail) == (4, 16, A, "")
    got = store.read(prefix, ids, 3, 16)
    want = _layers(18)
    assert all(torch.equal(k[:, 3:16], gk) and torch.equal(v[:, 3:16], gv) for (k, v), (gk, gv) in zip(want, got))
    assert store.stored_blocks(ids, KEY, ns=A) == 4 and store.stored_blocks(ids[:9], KEY, ns=A) == 2
    assert store.tip(ids, ns=A) == (KEY, store.hashes(ids, KEY, A)[-1], 16)
    assert store.tip(ids, KEY, ns=A) == store.tip(ids, ns=A)
    assert store.tip(_ids(18, 5), ns=A) is None


def test_a_later_turn_adds_only_its_new_blocks(store_factory):
    store = store_factory.make()
    turn1, turn2 = _ids(10), _ids(21)
    assert store.write(turn1, _layers(10), IDENT, ns=A) == 2
    first = store.stored_blocks(turn2, KEY, ns=A) * 4
    assert first == 8 and store.write(turn2, _layers(21, lo=first), IDENT, first=first, ns=A) == 3
    assert store.lookup(turn2, KEY, ns=A).n_tokens == 20


def test_eviction_takes_least_recently_used_chain_tails_and_expiry_takes_old_blocks(directory_store_factory):
    store = directory_store_factory.make()
    old, new = _ids(16, 1), _ids(16, 2)
    store.write(old, _layers(16), IDENT, ns=A)
    time.sleep(0.01)  # distinct write times: `old` is the least recently used chain
    store.write(new, _layers(16), IDENT, ns=B)
    block = store.usage() // 8
    assert store.evict(6 * block) == 2
    assert store.lookup(old, KEY, ns=A).n_blocks == 2  # its tail went first: what is left is still a prefix
    assert store.lookup(new, KEY, ns=B).n_blocks == 4
    assert store.expire(retention_s=3600) == 0  # everything was used within the hour
    assert store.expire(retention_s=3600, now=time.time() + 7200) == 6 and store.usage() == 0
    assert store.evict(0) == 0


def test_a_capped_store_stays_under_its_cap(directory_store_factory):
    store_factory = directory_store_factory
    probe = store_factory.make()
    probe.write(_ids(4, 99), _layers(4), IDENT)
    block = probe.usage()
    probe.evict(0)
    store = store_factory.make(max_bytes=10 * block)
    for seed in range(8):
        store.write(_ids(16, seed), _layers(16), IDENT, ns=A if seed % 2 else B)
        assert store.usage() <= 10 * block
    assert store.lookup(_ids(16, 7), KEY, ns=A).n_blocks == 4  # the newest prompt is whole


def test_bad_namespaces_and_keys_are_refused_by_name(store_factory):
    store = store_factory.make()
    for bad in ("../x", "AB", "a" * 65, "_", " ab", 7, None):
        with pytest.raises(ValueError, match="lowercase hex"):
            store.lookup(_ids(8), KEY, ns=bad)
        with pytest.raises(ValueError, match="lowercase hex"):
            store.write(_ids(8), _layers(8), IDENT, ns=bad)
    with pytest.raises(ValueError, match="16 lowercase hex"):
        store.lookup(_ids(8), "../../etc")
    with pytest.raises(ValueError, match="shared namespace"):
        store.delete_namespace("")


# ---------------------------------------------------------------- two tenants
def test_the_same_tokens_in_two_namespaces_share_no_hash_and_no_block(store_factory):
    store = store_factory.make()
    doc = _ids(16)
    store.write(doc, _layers(16, value=0.5), IDENT, ns=A)
    assert not set(store.hashes(doc, KEY, A)) & set(store.hashes(doc, KEY, B))
    assert store.seed(KEY, A) != store.seed(KEY, B) != store.seed(KEY)
    for ns in (B, ""):  # another tenant, or a request that names no namespace
        assert store.lookup(doc, KEY, ns=ns).n_blocks == 0
        assert store.stored_blocks(doc, KEY, ns=ns) == 0 and store.tip(doc, ns=ns) is None
        assert store.others(doc, OTHER_KEY, ns=ns) == []  # not even "another model stored this" leaks
    assert store.others(doc, OTHER_KEY, ns=A) == [KEY]
    # tenant B stores the same document: its own blocks, its own values; each tenant reads back its own
    store.write(doc, _layers(16, value=0.25), IDENT, ns=B)
    for ns, value in ((A, 0.5), (B, 0.25)):
        k, _ = store.read(store.lookup(doc, KEY, ns=ns), doc, 0, 16)[0]
        assert torch.equal(k[0, :, 0], torch.arange(16, dtype=torch.float32) + value)


def test_a_tenants_decision_never_maps_another_tenants_blocks(store_factory):
    store = store_factory.make()
    doc = _ids(20)
    store.write(doc, _layers(20), IDENT, ns=A)
    spec = MapSpec(KEY)
    assert safe_decide(doc, 0, store, spec, params={"kvtransfer_ns": A}).reason == MAPPED
    for params in ({"kvtransfer_ns": B}, None, {}):
        d = safe_decide(doc, 0, store, spec, params=params)
        assert (d.reason, d.matched) == ("no_entry", 0), d
    assert safe_decide(doc, 0, store, spec, params={"kvtransfer_ns": "../a"}).reason == "bad_request"


def test_deleting_a_namespace_leaves_every_other_namespace_whole_even_on_shared_tokens(store_factory):
    """Tenants A and B (and the shared namespace) hold the same document's first 12 tokens, then diverge: deleting
    B removes B's 5 blocks -- including its copies of the shared tokens -- and nothing of A's or the shared ones."""
    store = store_factory.make()
    doc = _ids(12, 3)
    a_turn, b_turn = doc + _ids(8, 1), doc + _ids(8, 2)
    store.write(a_turn, _layers(20), IDENT, ns=A)
    store.write(b_turn, _layers(20), IDENT, ns=B)
    store.write(b_turn, _layers(20), IDENT)
    store.write(b_turn, _layers(20), {**IDENT, "key": OTHER_KEY}, ns=B)  # another model's blocks in B go too
    assert store.delete_namespace(B) == 10
    assert store.lookup(b_turn, KEY, ns=B).n_blocks == 0 and store.lookup(b_turn, OTHER_KEY, ns=B).n_blocks == 0
    assert store.lookup(a_turn, KEY, ns=A).n_blocks == 5 and store.lookup(b_turn, KEY).n_blocks == 5
    assert store.delete_namespace(B) == 0
    store.write(b_turn, _layers(20), IDENT, ns=B)  # a deleted namespace can be written again
    assert store.lookup(b_turn, KEY, ns=B).n_blocks == 5


def test_a_crafted_header_cannot_make_a_deletion_reach_outside_its_namespace(store_factory):
    """Tenant B's blocks are written by hand with headers whose `parent` names tenant A's block and a path out of
    the store: deleting B removes B's blocks only; A's block and the file outside the store survive."""
    store = store_factory.make()
    exists, outside = store_factory.decoy()
    doc = _ids(8)
    store.write(doc, _layers(8), IDENT, ns=A)
    a_block = store.hashes(doc, KEY, A)[0]
    for j, (h, parent) in enumerate(zip(store.hashes(doc, KEY, B), (a_block, outside))):
        ids = torch.tensor(doc[4 * j:4 * (j + 1)])
        k = torch.zeros(2, 1, 4, 4)
        header = {"format": FORMAT, "version": VERSION, "model": IDENT, "ns": B, "block": j, "parent": parent,
                  "hash": h, "block_size": 4, "dtype": "float32", "checksum": checksum(ids, k, k)}
        store_factory.plant(store, KEY, B, h, {"token_ids": ids, "k": k, "v": k.clone()}, header)
    assert store.stored_blocks(doc, KEY, ns=B) == 2
    assert store.lookup(doc, KEY, ns=B).n_blocks == 0  # the planted chain's parent is wrong: not mapped
    assert store.delete_namespace(B) == 2
    assert exists(), "a file outside the store was deleted"
    assert store.lookup(doc, KEY, ns=A).n_blocks == 2
