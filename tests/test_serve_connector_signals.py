"""The connector's scheduler side never waits on the store, learns from its worker, and refuses inputs its store key
cannot name -- without vLLM (hooks driven as in tests/test_serve_connector_tenancy.py):

- the producer's scheduler plans saves from the chain hashes its writer reported stored, with no store call, so a
  hung store (a stuck network mount) never stalls it; the writer checks the store on its own thread and reports,
  and a stale view (blocks evicted or deleted, a dropped save) heals at the next request of the prompt;
- a request whose K/V depends on more than its token ids (a LoRA adapter, multimodal inputs, prompt embeddings) is
  neither stored nor mapped, with a counted reason;
- a worker that cannot map tells the scheduler, which stops promising mapped tokens ("worker_unusable")."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvtransfer.serve import connector as C
from kvtransfer.serve.policy import MAPPED, Decider, MapSpec
from kvtransfer.serve.specs import LoadSpec
from kvtransfer.serve.store import KVStore
from kvtransfer.serve.writer import StoreWriter
from test_serve_connector_tenancy import IDENT, KEY, LAYERS, _connector, _ids, _layers, _step

A = "a1" * 16


class HungStore(KVStore):
    """A directory store whose existence checks and writes wait for `release` (a stuck mount), at most hang_s
    seconds each; `calls` records each one with the thread that made it."""

    def __init__(self, root, hang_s: float):
        super().__init__(root, block_size=4)
        self.release, self.hang_s, self.calls = threading.Event(), hang_s, []

    def _hang(self, op: str) -> None:
        self.calls.append((op, threading.current_thread().name))
        self.release.wait(self.hang_s)

    def stored_blocks(self, *args, **kwargs):
        self._hang("stored_blocks")
        return super().stored_blocks(*args, **kwargs)

    def lookup(self, *args, **kwargs):
        self._hang("lookup")
        return super().lookup(*args, **kwargs)

    def tip(self, *args, **kwargs):
        self._hang("tip")
        return super().tip(*args, **kwargs)

    def write(self, *args, **kwargs):
        self._hang("write")
        return super().write(*args, **kwargs)


def _request(ids, ns=A, **fields):
    return SimpleNamespace(prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": ns}, **fields)


def _gathered(n: int, *req_ids):
    """What save_kv_layer leaves for the worker: each request's K/V of tokens 0..n-1, per layer."""
    return {r: {i: (k[:, :n], v[:, :n]) for i, (k, v) in enumerate(_layers(n))} for r in req_ids}


def _worker_step(conn, meta) -> None:
    """The worker's end of a step (wait_for_save), then its WorkerMeta handed to the scheduler side."""
    conn._get_connector_metadata = lambda: meta
    conn.has_connector_metadata = lambda: True
    conn.wait_for_save()
    conn.writer.flush(5.0)
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=conn.build_connector_worker_meta(),
                                                 invalid_block_ids=set()))


def _plan(conn, *req_ids, n: int) -> list[tuple]:
    meta = C.ServeMetadata()
    conn._saved -= set(req_ids)
    conn._plan_saves(_step(*req_ids, n=n), meta)
    return meta, [(s.req_id, s.first, s.end) for s in meta.saves]


# ---------------------------------------------------------------- a hung store
def test_a_hung_store_never_stalls_the_producers_scheduler(tmp_path):
    """Every store call hangs for HANG_S seconds: planning a save (vLLM's scheduler thread) and handing the gathered
    K/V to the writer (the forward step) both return at once; only the writer's thread waits, and once the store
    answers the writer's report reaches the scheduler."""
    HANG_S = 3.0
    store = HungStore(tmp_path, HANG_S)
    conn = _connector(store, producer=True)
    ids = _ids(18)
    conn._requests = {"a": _request(ids)}
    t0 = time.monotonic()
    meta, saves = _plan(conn, "a", n=18)
    assert time.monotonic() - t0 < HANG_S / 10  # not one store call's hang
    assert saves == [("a", 0, 16)] and store.calls == []  # nothing asked of the store on the scheduler thread
    conn.writer, conn._layout = StoreWriter(store), object()
    conn._layer_parts = _gathered(16, "a")
    conn._get_connector_metadata = lambda: meta
    conn.has_connector_metadata = lambda: True
    t0 = time.monotonic()
    conn.wait_for_save()
    assert time.monotonic() - t0 < HANG_S / 10  # the forward step does not wait either
    deadline = time.monotonic() + HANG_S
    while not store.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.calls == [("write", "kvtransfer-store-writer")]  # the writer's thread is the one that waits
    store.release.set()
    assert conn.writer.flush(HANG_S)
    assert [op for op, _ in store.calls] == ["write", "stored_blocks"]
    assert {thread for _, thread in store.calls} == {"kvtransfer-store-writer"}
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=conn.build_connector_worker_meta(),
                                                 invalid_block_ids=set()))
    assert list(conn._known) == store.hashes(ids[:16], KEY, A)  # the scheduler now knows them stored
    conn.writer.close(1.0)


def test_the_scheduler_gathers_only_what_its_writer_did_not_report_stored_and_a_stale_view_heals(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    conn = _connector(store, producer=True)
    conn.writer, conn._layout = StoreWriter(store, background=False), object()
    turn1, turn2 = _ids(18), _ids(26)
    conn._requests = {"t1": _request(turn1), "t2": _request(turn2), "again": _request(turn1)}
    meta, saves = _plan(conn, "t1", n=18)
    assert saves == [("t1", 0, 16)]
    conn._layer_parts = _gathered(16, "t1")
    _worker_step(conn, meta)
    assert store.stored_blocks(turn1, KEY, A) == 4 and len(conn._known) == 4
    # the next turn gathers only its new blocks; the same prompt again gathers nothing (the writer only checks)
    meta, saves = _plan(conn, "t2", "again", n=26)
    assert saves == [("t2", 16, 24), ("again", 16, 16)] and meta.saves[1].block_ids == []
    conn._layer_parts = {"t2": {i: (k[:, 16:24], v[:, 16:24]) for i, (k, v) in enumerate(_layers(24))}}
    _worker_step(conn, meta)
    assert store.stored_blocks(turn2, KEY, A) == 6 and store.lookup(turn2, KEY, A).n_tokens == 24
    # the store lost the blocks behind the scheduler's back (a session deleted, eviction): the next request of the
    # prompt only checks, the writer reports them missing, and the one after gathers them again
    assert store.delete_namespace(A) == 6
    meta, saves = _plan(conn, "again", n=18)
    assert saves == [("again", 16, 16)]
    _worker_step(conn, meta)
    assert not set(store.hashes(turn1, KEY, A)) & set(conn._known)
    meta, saves = _plan(conn, "again", n=18)
    assert saves == [("again", 0, 16)]
    # a save the writer drops (here: it is closed) is reported missing at once: gathered again next time
    conn.writer = StoreWriter(store)
    conn.writer.close(1.0)
    conn._layer_parts = _gathered(16, "again")
    _worker_step(conn, meta)
    assert conn.writer.stats["dropped"] == 1 and not set(store.hashes(turn1, KEY, A)) & set(conn._known)
    assert _plan(conn, "again", n=18)[1] == [("again", 0, 16)]


# ---------------------------------------------------------------- inputs the store key cannot name
UNKEYED = {"lora": {"lora_request": SimpleNamespace(lora_name="sql-adapter")},
           "multimodal": {"mm_features": [SimpleNamespace(identifier="img-hash")]},
           "prompt_embeds": {"prompt_embeds": torch.zeros(18, 8)}}


def test_lora_multimodal_and_embedding_requests_are_neither_stored_nor_mapped(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    ids = _ids(18)
    producer = _connector(store, producer=True)
    producer._requests = {"plain": _request(ids), **{kind: _request(ids, **f) for kind, f in UNKEYED.items()}}
    saves = _plan(producer, "plain", *UNKEYED, n=18)[1]
    assert saves == [("plain", 0, 16)]
    assert producer.counters.reasons == {f"save_{kind}": 1 for kind in UNKEYED}
    store.write(ids, _layers(18), IDENT, ns=A)  # the same token ids stored: only a plain request may map them
    consumer = _connector(store, producer=False)
    consumer.spec = MapSpec(KEY)
    consumer.decider = Decider(store, consumer.spec, consumer.counters)
    for rid, fields in {"plain": {}, **UNKEYED}.items():
        request = SimpleNamespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": A},
                                  cache_salt=None, lora_request=None, mm_features=[], prompt_embeds=None)
        for name, value in fields.items():
            setattr(request, name, value)
        assert consumer.get_num_new_matched_tokens(request, 0) == ((16, False) if rid == "plain" else (0, False))
    assert consumer.counters.reasons == {MAPPED: 1, "lora": 1, "multimodal": 1, "prompt_embeds": 1}
    assert "sql-adapter" in consumer.counters.requests["lora"]["detail"]


# ---------------------------------------------------------------- a worker that cannot map
def test_a_worker_that_cannot_map_tells_the_scheduler_which_stops_promising_tokens(tmp_path):
    store = KVStore(tmp_path, block_size=4)
    ids = _ids(18)
    store.write(ids, _layers(18), IDENT, ns=A)
    scheduler = _connector(store, producer=False)
    scheduler.spec = MapSpec(KEY)
    scheduler.decider = Decider(store, scheduler.spec, scheduler.counters)

    def request(rid):
        return SimpleNamespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params={"kvtransfer_ns": A},
                               cache_salt=None)

    assert scheduler.get_num_new_matched_tokens(request("before"), 0) == (16, False)
    worker = _connector(store, producer=False)
    worker._vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def no_map(**kwargs):
        raise ValueError("attention backend ROCM_ATTN: no layout implemented")

    worker._build_map = no_map
    worker.register_kv_caches({name: torch.zeros(2, 4) for name in LAYERS})
    assert worker._smap is None
    meta = worker.build_connector_worker_meta()
    assert "ROCM_ATTN" in meta.unusable
    assert worker.build_connector_worker_meta() is None  # said once ...
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta, invalid_block_ids=set()))
    assert scheduler.get_num_new_matched_tokens(request("after"), 0) == (0, False)
    assert scheduler.counters.reasons == {MAPPED: 1, "worker_unusable": 1}
    assert "ROCM_ATTN" in scheduler.counters.requests["after"]["detail"]
    # ... and again after a load it had to refuse (the scheduler promised before it heard)
    load = LoadSpec("before", KEY, store.hashes(ids, KEY, A), 0, 16, [0, 1, 2, 3], ids[:16], ns=A)
    worker._get_connector_metadata = lambda: C.ServeMetadata(loads=[load])
    worker.start_load_kv(None)
    assert worker._failed_blocks and "ROCM_ATTN" in worker.build_connector_worker_meta().unusable


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_worker_with_nothing_to_say_sends_no_metadata(tmp_path, role):
    conn = _connector(KVStore(tmp_path, block_size=4), producer=role == "producer")
    conn.writer = StoreWriter(conn.store, background=False) if role == "producer" else None
    assert conn.build_connector_worker_meta() is None
