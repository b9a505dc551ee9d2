"""The store under a handed-over session's life, without vLLM: incremental write-through (only new blocks), the
background writer (never blocking: over its byte cap a save is dropped), a store created by two processes at once,
eviction that shortens chains instead of breaking them, retention, and deleting a session's namespace."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer.serve.store import KVStore
from kvtransfer.serve.writer import StoreWriter

IDENT = {"key": "0123456789abcdef", "n_layers": 2, "n_kv": 1, "head_dim": 4, "model_id": "m", "config_hash": "c"}


def _layers(n: int, seed: int = 0, lo: int = 0):
    """Per-layer (K, V) [1, n - lo, 4] of tokens lo..n-1: a value that names its position, so slices can be checked."""
    out = []
    for layer in range(IDENT["n_layers"]):
        pos = torch.arange(lo, n, dtype=torch.float32)
        k = (pos + 1000 * layer + 10 ** 5 * seed)[None, :, None].expand(1, n - lo, 4).clone()
        out.append((k, -k))
    return out


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 10000 + i for i in range(n)]


def test_write_from_first_adds_only_the_new_blocks_and_reads_back_the_whole_prompt(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    turn1, turn2 = _ids(10), _ids(21)
    assert store.write(turn1, _layers(10), IDENT) == 2  # 2 full blocks; the last 2 tokens are not stored
    first = store.stored_blocks(turn2, IDENT["key"]) * 4
    assert first == 8
    assert store.write(turn2, _layers(21, lo=first), IDENT, first=first) == 3  # blocks 2, 3, 4 only
    prefix = store.lookup(turn2, IDENT["key"])
    assert prefix.n_tokens == 20
    k, v = store.read(prefix, turn2, 0, 20)[1]
    assert torch.equal(k[0, :, 0], torch.arange(20, dtype=torch.float32) + 1000) and torch.equal(v, -k)
    with pytest.raises(ValueError, match="multiple of the block size"):
        store.write(turn2, _layers(21, lo=3), IDENT, first=3)


def test_background_writer_returns_at_once_and_flushes(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    slow = threading.Event()
    real_write = store.write

    def write(*args, **kwargs):
        slow.wait(5)
        return real_write(*args, **kwargs)

    store.write = write
    writer = StoreWriter(store)
    writer.submit("r", _ids(16), _layers(16), IDENT)  # returns while the write waits (a synchronous one would hang)
    assert store.stored_blocks(_ids(16), IDENT["key"]) == 0
    assert not writer.flush(timeout_s=0.05)  # still in flight
    slow.set()
    assert writer.flush(timeout_s=10)
    assert store.stored_blocks(_ids(16), IDENT["key"]) == 4 and writer.stats["written_blocks"] == 4
    writer.submit("bad", _ids(16), _layers(15), IDENT)  # mis-shaped: logged and counted, never raised
    assert writer.flush(timeout_s=10) and writer.stats["failed"] == 1
    writer.close()


def test_background_writer_drops_a_save_over_its_byte_cap_instead_of_waiting(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    gate = threading.Event()
    real_write = store.write
    store.write = lambda *a, **k: (gate.wait(5), real_write(*a, **k))[1]
    size = sum(t.numel() * 4 for kv in _layers(16) for t in kv)
    writer = StoreWriter(store, max_pending_bytes=size)
    assert writer.submit("a", _ids(16, 1), _layers(16, 1), IDENT)
    done = threading.Event()
    threading.Thread(target=lambda: (writer.submit("b", _ids(16, 2), _layers(16, 2), IDENT), done.set())).start()
    assert done.wait(2)  # returned while "a" still waits on the gate: dropped, not queued behind it
    assert writer.stats["dropped"] == 1 and writer.stats["dropped_bytes"] == size
    gate.set()
    assert writer.flush(10) and writer.close(10)
    assert store.stored_blocks(_ids(16, 1), IDENT["key"]) == 4 and store.stored_blocks(_ids(16, 2), IDENT["key"]) == 0
    assert not writer.submit("c", _ids(16, 3), _layers(16, 3), IDENT) and writer.stats["dropped"] == 2  # closed


def test_two_processes_opening_a_fresh_store_agree_on_its_block_size(tmp_path):
    for trial in range(40):
        root, sizes, barrier = tmp_path / str(trial), {}, threading.Barrier(2)

        def open_store(asked):
            barrier.wait()
            sizes[asked] = KVStore(root, block_size=asked).block_size

        threads = [threading.Thread(target=open_store, args=(b,)) for b in (8, 16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sizes[8] == sizes[16], (trial, sizes)


def test_eviction_shortens_chains_from_the_tail_so_every_stored_block_stays_reachable(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    block = None
    prompts = [_ids(64, seed) for seed in range(12)]  # 12 prompts x 16 blocks
    for seed, ids in enumerate(prompts):
        store.write(ids, _layers(64, seed), IDENT)
        block = block or store.usage() // 16
        if seed % 3 == 2:  # some prompts are read again (their age refreshed)
            store.read(store.lookup(prompts[seed - 1], IDENT["key"]), prompts[seed - 1], 0, 64)
    store.evict(100 * block)
    files = {p.stem for _, _, p in store.blocks()}
    assert len(files) == 100
    for ids in prompts:
        on_disk = sum(h in files for h in store.hashes(ids, IDENT["key"]))
        assert store.lookup(ids, IDENT["key"]).n_blocks == on_disk  # no block stranded behind a missing one


def test_capped_writes_keep_the_store_under_its_cap(tmp_path):
    probe = KVStore(tmp_path / "probe", block_size=4)
    probe.write(_ids(4), _layers(4), IDENT)
    block = probe.usage()
    store = KVStore(tmp_path / "s", block_size=4, max_bytes=10 * block)
    for seed in range(6):
        store.write(_ids(16, seed), _layers(16, seed), IDENT)
        assert store.usage() <= 10 * block
    assert store.lookup(_ids(16, 5), IDENT["key"]).n_blocks == 4  # the newest prompt is whole


def test_retention_removes_blocks_nobody_used_for_that_long(tmp_path):
    store = KVStore(tmp_path, block_size=4, retention_s=3600)
    store.write(_ids(16), _layers(16), IDENT)
    assert store.expire(now=time.time() + 60) == 0
    assert store.expire(now=time.time() + 7200) == 4 and store.usage() == 0
    with pytest.raises(ValueError, match="positive number of seconds"):
        KVStore(tmp_path, retention_s=0)


def test_delete_namespace_removes_a_session_and_leaves_the_blocks_another_shares(tmp_path):
    """Two sessions on one document (their first 12 tokens equal): deleting one session's namespace removes its
    blocks only -- the other's copies of the same tokens, in its own namespace, stay whole."""
    store = KVStore(tmp_path, block_size=4)
    a, b = "a" * 32, "b" * 32
    doc = _ids(12, 7)
    mine, theirs = doc + _ids(4, 1), doc + _ids(8, 2)
    store.write(mine, _layers(16), IDENT, ns=b)
    store.write(theirs, _layers(20), IDENT, ns=a)
    assert store.tip(mine, ns=b)[1:] == (store.hashes(mine, IDENT["key"], b)[-1], 16)
    assert store.delete_namespace(b) == 4
    assert store.lookup(mine, IDENT["key"], ns=b).n_blocks == 0 and store.tip(mine, ns=b) is None
    assert store.lookup(theirs, IDENT["key"], ns=a).n_blocks == 5  # the shared document's blocks included
    assert store.delete_namespace(b) == 0
    with pytest.raises(ValueError, match="shared namespace"):
        store.delete_namespace("")
    with pytest.raises(ValueError, match="lowercase hex"):
        store.delete_namespace("../../etc")
    with pytest.raises(NotImplementedError, match="delete_namespace"):
        store.delete_chain(store.hashes(theirs, IDENT["key"], a)[-1])
