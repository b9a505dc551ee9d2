"""The directory store and its writer under faults, without vLLM: a hung write, a torn block, a full disk, a producer
killed mid-save, the store directory deleted under a running store, a capped store's scans, an old store layout,
and directories in the store that are not models (sinks, logs, a symlink out of it)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time

import pytest
import torch

import kvtransfer.core.io as kio
from kvtransfer.serve.policy import MapSpec, safe_decide
from kvtransfer.serve.store import TMP_MAX_AGE_S, KVStore
from kvtransfer.serve.writer import StoreWriter

IDENT = {"key": "0123456789abcdef", "n_layers": 2, "n_kv": 1, "head_dim": 4, "model_id": "m", "config_hash": "c"}
KEY = IDENT["key"]
NS = "c3" * 16
# a submit that waited on the hung write would take the hang's full length (30 s): any bound far under it tells
SUBMIT_BUDGET_S = 0.1
# close(DRAIN_S) must return by its deadline; the slack covers a loaded 2-core machine's thread switches
DRAIN_S, CLOSE_SLACK_S = 0.5, 1.0


def _ids(n: int, seed: int = 0) -> list[int]:
    return [seed * 10000 + i for i in range(n)]


def _layers(n: int, seed: int = 0, lo: int = 0):
    out = []
    for layer in range(IDENT["n_layers"]):
        pos = torch.arange(lo, n, dtype=torch.float32) + 1000 * layer + 10 ** 5 * seed
        k = pos[None, :, None].expand(1, n - lo, 4).clone()
        out.append((k, -k))
    return out


def _read_k(store, ids, ns=""):
    prefix = store.lookup(ids, KEY, ns)
    return store.read(prefix, ids, 0, prefix.n_tokens)[1][0][0, :, 0]


def _tmp_files(root):
    return sorted(p for p in root.rglob(".*.tmp"))


# ---------------------------------------------------------------- (6) a hung write
def test_a_hung_store_write_never_blocks_a_submit_and_close_keeps_its_deadline(tmp_path):
    """The store's write blocks on an Event (a hung network mount): submits return at once, the saves over the byte
    cap are dropped and counted, and close gives up at its deadline, counting what it abandoned."""
    store = KVStore(tmp_path, block_size=4)
    hung = threading.Event()
    real = store.write
    store.write = lambda *a, **k: (hung.wait(30), real(*a, **k))[1]
    size = sum(t.numel() * t.element_size() for kv in _layers(16) for t in kv)
    writer = StoreWriter(store, max_pending_bytes=2 * size)
    took = []
    for seed in range(6):
        t0 = time.perf_counter()
        writer.submit(f"r{seed}", _ids(16, seed), _layers(16, seed), IDENT, ns=NS)
        took.append(time.perf_counter() - t0)
    assert max(took) < SUBMIT_BUDGET_S, took
    assert writer.stats["dropped"] == 4 and writer.stats["dropped_bytes"] == 4 * size  # 2 fit under the cap
    t0 = time.perf_counter()
    assert writer.close(DRAIN_S) is False
    assert time.perf_counter() - t0 < DRAIN_S + CLOSE_SLACK_S
    assert writer.stats["abandoned"] == 2 and writer.stats["failed"] == 0
    hung.set()  # the hang ends: the abandoned thread finishes in the background (a daemon: exit never waits on it)


def test_a_writer_that_drains_in_time_closes_clean(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    writer = StoreWriter(store)
    writer.submit("r", _ids(16), _layers(16), IDENT, ns=NS)
    assert writer.close(30) is True and writer.stats["abandoned"] == 0
    assert store.lookup(_ids(16), KEY, NS).n_blocks == 4


# ---------------------------------------------------------------- (7) torn blocks
TEARS = {
    "zero_length": lambda raw: b"",
    "header_cut": lambda raw: raw[:20],
    "data_cut": lambda raw: raw[:-100],
    "last_byte_cut": lambda raw: raw[:-1],
    "garbage_appended": lambda raw: raw + b"\0" * 8,
}


@pytest.mark.parametrize("tear", sorted(TEARS))
def test_a_torn_block_is_not_stored_and_the_next_write_replaces_it(tmp_path, tear):
    """A block file under its final name that is not whole (a rename that reached the disk before the data, before
    writes were fsynced) counts as missing: stored_blocks and lookup stop at it, and the next write replaces it,
    after which lookup and read see the whole chain."""
    ids = _ids(16)
    KVStore(tmp_path, block_size=4).write(ids, _layers(16), IDENT, ns=NS)
    store = KVStore(tmp_path)  # the next process: nothing remembered
    path = store.block_path(KEY, store.hashes(ids, KEY, NS)[1], NS)
    path.write_bytes(TEARS[tear](path.read_bytes()))
    assert store.stored_blocks(ids, KEY, NS) == 1
    prefix = store.lookup(ids, KEY, NS)
    assert prefix.n_blocks == 1 and prefix.detail.startswith("corrupt"), prefix
    first = store.stored_blocks(ids, KEY, NS) * 4
    assert store.write(ids, _layers(16, lo=first), IDENT, first=first, ns=NS) == 1  # block 1 only; 2, 3 are whole
    assert store.stats["torn_rewritten"] == 1
    assert store.stored_blocks(ids, KEY, NS) == 4
    assert torch.equal(_read_k(store, ids, NS), torch.arange(16, dtype=torch.float32) + 1000)


def test_block_writes_are_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", None)), real_replace(a, b))[1])
    store = KVStore(tmp_path, block_size=4)
    assert store.write(_ids(4), _layers(4), IDENT) == 1
    assert events == [("fsync", False), ("rename", None), ("fsync", True)]  # file, rename, directory


def test_a_directory_fsync_refused_is_not_an_error(tmp_path, monkeypatch):
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EINVAL, "refused"))
                        if os.path.isdir(f"/proc/self/fd/{fd}") else real(fd))
    store = KVStore(tmp_path, block_size=4)
    assert store.write(_ids(8), _layers(8), IDENT) == 2 and store.lookup(_ids(8), KEY).n_blocks == 2


# ---------------------------------------------------------------- a full disk
@pytest.mark.parametrize("where", ["save", "fsync"])
def test_a_full_disk_is_a_counted_failed_save_that_leaves_no_file_and_the_writer_keeps_serving(tmp_path,
                                                                                              monkeypatch, where):
    store = KVStore(tmp_path, block_size=4)
    writer = StoreWriter(store)
    calls = {"n": 0}
    real_write, real_fsync = kio.write_file, os.fsync

    def full(*args):
        calls["n"] += 1
        if calls["n"] >= 3:  # the third block: the disk fills up half-way through its temporary file
            raise OSError(errno.ENOSPC, "No space left on device")
        return (real_write if where == "save" else real_fsync)(*args)

    def write(tmp, data):
        if calls["n"] + 1 >= 3:
            with open(tmp, "wb") as f:
                f.write(b"\0" * 100)
        return full(tmp, data) if where == "save" else real_write(tmp, data)

    monkeypatch.setattr(kio, "write_file", write)
    if where == "fsync":
        monkeypatch.setattr(os, "fsync", lambda fd: full(fd) if not os.path.isdir(f"/proc/self/fd/{fd}")
                            else real_fsync(fd))
    ids = _ids(16)
    writer.submit("r", ids, _layers(16), IDENT, ns=NS)
    assert writer.flush(30) and writer.stats["failed"] == 1 and writer.stats["written_blocks"] == 0
    assert store.stored_blocks(ids, KEY, NS) == 2  # blocks 0, 1 are whole; block 2 never got its name
    assert not store.block_path(KEY, store.hashes(ids, KEY, NS)[2], NS).exists()
    assert _tmp_files(tmp_path) == []
    monkeypatch.setattr(kio, "write_file", real_write)
    monkeypatch.setattr(os, "fsync", real_fsync)
    writer.submit("r2", ids, _layers(16, lo=8), IDENT, first=8, ns=NS)  # space again: the next save completes
    assert writer.close(30) and writer.stats["written_blocks"] == 2
    assert torch.equal(_read_k(store, ids, NS), torch.arange(16, dtype=torch.float32) + 1000)


# ---------------------------------------------------------------- a producer killed mid-save
def test_after_a_producer_killed_mid_save_the_next_process_writes_and_reads_correctly(tmp_path):
    """What a killed producer leaves: its temporary file (an hour old by the time anyone looks, and one of a live
    writer, seconds old) and -- from a version that did not fsync -- a torn block under its final name. The next
    process repairs the chain with its writes, maps it whole, and expiry removes only the old temporary file."""
    ids = _ids(16)
    KVStore(tmp_path, block_size=4).write(ids[:8], _layers(8), IDENT, ns=NS)
    hashes = KVStore(tmp_path).hashes(ids, KEY, NS)
    torn = KVStore(tmp_path).block_path(KEY, hashes[1], NS)
    torn.write_bytes(torn.read_bytes()[: len(torn.read_bytes()) // 2])
    third = KVStore(tmp_path).block_path(KEY, hashes[2], NS)
    third.parent.mkdir(parents=True, exist_ok=True)
    dead = third.parent / f".{third.name}.k1ll3d.tmp"
    dead.write_bytes(b"\0" * 300)
    os.utime(dead, (time.time() - 2 * TMP_MAX_AGE_S,) * 2)
    live = third.parent / f".{third.name}.l1v3.tmp"
    live.write_bytes(b"\0" * 300)
    store = KVStore(tmp_path)  # the next process
    assert store.stored_blocks(ids, KEY, NS) == 1 and store.lookup(ids, KEY, NS).n_blocks == 1
    assert store.write(ids, _layers(16), IDENT, ns=NS) == 3  # the torn block 1, and 2, 3
    assert torch.equal(_read_k(store, ids, NS), torch.arange(16, dtype=torch.float32) + 1000)
    assert store.expire() == 0 and store.stats["tmp_removed"] == 1  # no retention: blocks stay; the dead tmp goes
    assert _tmp_files(tmp_path) == [live]
    assert len(store.blocks()) == 4  # temporary files are not blocks


# ---------------------------------------------------------------- the store directory deleted
def test_a_store_directory_deleted_under_a_running_store_recreates_itself(tmp_path):
    root = tmp_path / "store"
    store = KVStore(root, block_size=4, max_bytes=1 << 20, retention_s=3600)
    writer = StoreWriter(store)
    ids = _ids(16)
    store.write(ids, _layers(16), IDENT, ns=NS)
    shutil.rmtree(root)
    assert store.lookup(ids, KEY, NS).n_blocks == 0 and store.stored_blocks(ids, KEY, NS) == 0
    assert store.tip(ids, ns=NS) is None and store.others(ids, "f" * 16, NS) == [] and store.model_keys() == []
    assert (store.usage(), store.evict(0), store.expire(), store.delete_namespace(NS)) == (0, 0, 0, 0)
    d = safe_decide(ids, 0, store, MapSpec(KEY), params={"kvtransfer_ns": NS})
    assert d.reason == "no_entry", d
    writer.submit("r", ids, _layers(16), IDENT, ns=NS)
    assert writer.close(30) and writer.stats["failed"] == 0 and writer.stats["written_blocks"] == 4
    assert json.loads((root / "store.json").read_text())["block_size"] == 4  # the next process agrees on it
    assert KVStore(root, block_size=16).block_size == 4
    assert torch.equal(_read_k(store, ids, NS), torch.arange(16, dtype=torch.float32) + 1000)


# ---------------------------------------------------------------- (8) a capped store's scans
def test_a_capped_store_scans_itself_once_per_tenth_of_its_cap_not_on_every_write(tmp_path, monkeypatch):
    """300 one-block writes into a store capped at 100 blocks. Every stat the store makes goes through os.stat
    (pathlib's too); count them. Per write: the block's own (skip it if whole) and store.json's (re-create it if the
    directory was removed) = 2. Scans: the first write learns the usage (1), then each eviction leaves 10 % of the
    cap free, so the next scan comes after 10 more blocks: at most 1 + 300 / 10 scans of at most 101 files. The
    previous store evicted to exactly the cap and rescanned all 100 blocks on every write past it (about 20,000
    stats here; 90,301 for 301 writes in the report)."""
    probe = KVStore(tmp_path / "probe", block_size=4)
    probe.write(_ids(4, 999), _layers(4), IDENT)
    block = probe.usage()
    cap_blocks, writes = 100, 300
    store = KVStore(tmp_path / "s", block_size=4, max_bytes=cap_blocks * block)
    calls = {"n": 0}
    real_stat = os.stat

    def counting_stat(*a, **k):
        calls["n"] += 1
        return real_stat(*a, **k)

    monkeypatch.setattr(os, "stat", counting_stat)
    for seed in range(writes):
        store.write(_ids(4, seed), _layers(4, seed), IDENT, ns=NS)
    monkeypatch.setattr(os, "stat", real_stat)
    scans_bound = 1 + writes // int(cap_blocks * (1 - store.evict_to))
    bound = 2 * writes + scans_bound * (cap_blocks + 1)
    assert store.stats["scans"] <= scans_bound, store.stats
    assert calls["n"] <= bound < 20 * writes, (calls["n"], bound)
    assert cap_blocks * store.evict_to - 1 <= len(store.blocks()) <= cap_blocks  # evicted to the low watermark
    assert store.usage() <= cap_blocks * block
    assert store.lookup(_ids(4, writes - 1), KEY, NS).n_blocks == 1  # the newest block stays


def test_usage_is_tracked_through_deletes_and_expiry_without_rescans(tmp_path):
    probe = KVStore(tmp_path / "probe", block_size=4)
    probe.write(_ids(4), _layers(4), IDENT)
    block = probe.usage()
    store = KVStore(tmp_path / "s", block_size=4, max_bytes=100 * block)
    store.write(_ids(16), _layers(16), IDENT, ns=NS)
    store.write(_ids(16, 1), _layers(16, 1), IDENT)
    scans = store.stats["scans"]
    assert store.delete_namespace(NS) == 4
    store.write(_ids(16, 2), _layers(16, 2), IDENT)
    assert store.stats["scans"] == scans and store._usage == store.usage() == 8 * block


# ---------------------------------------------------------------- layout, foreign directories
def test_a_store_of_an_older_layout_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "store.json").write_text(json.dumps({"format": "kvtransfer.kv_store", "block_size": 16}))
    with pytest.raises(ValueError, match=r"older kvtransfer \(layout 1.*point the store at a new directory or remove"):
        KVStore(tmp_path)
    (tmp_path / "store.json").write_text(json.dumps({"format": "kvtransfer.kv_store", "layout": 99, "block_size": 16}))
    with pytest.raises(ValueError, match="another kvtransfer"):
        KVStore(tmp_path)
    # layout 2 held blocks with another checksum, which this version would refuse and never replace: refused
    (tmp_path / "store.json").write_text(json.dumps({"format": "kvtransfer.kv_store", "layout": 2, "block_size": 16}))
    with pytest.raises(ValueError, match=r"older kvtransfer \(layout 2"):
        KVStore(tmp_path)
    (tmp_path / "store.json").write_text(json.dumps({"format": "something else", "layout": 3, "block_size": 16}))
    with pytest.raises(ValueError, match="not a kvtransfer store"):
        KVStore(tmp_path)
    KVStore(tmp_path / "fresh", block_size=8)
    assert json.loads((tmp_path / "fresh" / "store.json").read_text()) == \
        {"format": "kvtransfer.kv_store", "layout": 3, "block_size": 8}


def test_only_model_key_directories_are_models_and_nothing_outside_the_store_is_touched(tmp_path):
    """The consumer's sinks/ and a launcher's logs/ live in the store directory, and model_keys() used to list them
    as models; now only 16-hex names are, and nothing under another name is taken for a block (not even a file
    shaped like one). A namespace directory that is a symlink out of the store is never followed, by eviction or
    deletion."""
    root = tmp_path / "store"
    store = KVStore(root, block_size=4)
    store.write(_ids(8), _layers(8), IDENT, ns=NS)
    keep = [root / "sinks" / "ab" / "x.safetensors", root / "logs" / "source.log",
            root / "ABCDEF0123456789" / "_" / "ab" / "y.safetensors"]
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a block")
    outside = tmp_path / "outside" / "ab"
    outside.mkdir(parents=True)
    (outside / "z.safetensors").write_bytes(b"someone else's")
    os.symlink(tmp_path / "outside", root / KEY / "dd")  # a namespace directory "dd" that leads out
    assert store.model_keys() == [KEY]
    assert len(store.blocks()) == 2
    assert store.delete_namespace("dd") == 0 and store.evict(0) == 2 and store.expire(1, now=time.time() + 10) == 0
    assert all(path.exists() for path in keep) and (outside / "z.safetensors").exists()
