"""kvtransfer.serve's block store and the consumer's scheduler-side decisions (issue 31 §1-2), without vLLM:
chained block keys with the producer's weights identity, longest-prefix lookup, checksums, LRU eviction,
two processes on one directory, and decisions that never raise on a malformed block header or request field."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import random_ids, tiny_model

from kvtransfer.core.io import atomic_save_tensors
from kvtransfer.serve import policy
from kvtransfer.serve.ident import serving_identity
from kvtransfer.serve.policy import MAPPED, Counters, Decider, MapSpec, decide, parse_params, safe_decide
from kvtransfer.serve.store import VERSION, BadEntry, KVStore, checksum, save_prefill

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny source saved as an HF directory, and a second one of the same architecture with other weights."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("src", 1), ("twin", 7)):
        model = tiny_model("qwen3", seed=seed, name=name, layers=2, head_dim=8)
        model.save_pretrained(root / name)
        out[name], out[f"{name}_dir"] = model, root / name
        out[f"{name}_id"] = serving_identity(str(root / name))
    return out


def _prompt(n=40, seed=0):
    return [5] + random_ids(1, n - 1, seed=seed)[0].tolist()


def _spec(models, **kw):
    return MapSpec(source_hash=models["src_id"]["key"], start_ids=(5,), native_sink=1, **kw)


def _layers(ident, n, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (ident["n_kv"], n, ident["head_dim"])
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(ident["n_layers"])]


# ---------------------------------------------------------------- identity
def test_weights_identity_tells_same_architecture_models_apart(models):
    a, b = models["src_id"], models["twin_id"]
    assert a["config_hash"] == b["config_hash"]  # the same architecture ...
    assert a["weights"] != b["weights"] and a["key"] != b["key"]  # ... other weights: other store keys
    assert serving_identity(str(models["src_dir"]))["key"] == a["key"]  # stable


# ---------------------------------------------------------------- blocks
def test_blocks_round_trip_and_each_turn_stores_only_its_new_blocks(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    ident = models["src_id"]
    turn1 = _prompt(40)
    layers = _layers(ident, 40, 0)
    assert store.write(turn1, layers, ident) == 2  # 40 tokens: 2 full blocks; the last 8 are the target's
    assert store.write(turn1, layers, ident) == 0  # no block stored twice
    prefix = store.lookup(turn1, ident["key"])
    assert (prefix.n_blocks, prefix.n_tokens, prefix.detail) == (2, 32, "")
    back = store.read(prefix, turn1, 3, 32)
    assert all(torch.equal(k[:, 3:32], bk) and torch.equal(v[:, 3:32], bv) for (k, v), (bk, bv) in zip(layers, back))
    # turn 2 = turn 1 + a reply + a new user message: the shared 32 tokens are found, and only new blocks written
    turn2 = turn1 + _prompt(30, seed=1)[1:]
    layers2 = [(torch.cat([k, k2[:, 40:]], 1), torch.cat([v, v2[:, 40:]], 1))
               for (k, v), (k2, v2) in zip(layers, _layers(ident, 69, 1))]
    assert store.lookup(turn2, ident["key"]).n_tokens == 32  # longest stored prefix of a new prompt
    assert store.write(turn2, layers2, ident) == 2  # blocks 2 and 3 (tokens 32..63); 0 and 1 are shared
    assert store.lookup(turn2, ident["key"]).n_tokens == 64
    assert len(store.blocks()) == 4
    other = [7] + turn1[1:]  # another first block: nothing in common
    assert store.lookup(other, ident["key"]).n_blocks == 0
    assert store.lookup(turn1, models["twin_id"]["key"]).n_blocks == 0  # keyed by weights
    with pytest.raises(BadEntry) as err:
        store.read(prefix, [6] + turn1[1:], 0, 16)  # the worker checks ids against the request's prompt
    assert err.value.reason == "corrupt" and "differ from the prompt" in str(err.value)
    assert KVStore(tmp_path, block_size=32).block_size == 16  # the directory keeps its block size


def test_hf_prefill_blocks_are_the_models_cache(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    prompt = _prompt(33)
    assert save_prefill(store, models["src"], prompt, ref=models["src_dir"]) == 2
    from kvtransfer.serve.hf import prefill_layers

    want = prefill_layers(models["src"], prompt)
    got = store.read(store.lookup(prompt, models["src_id"]["key"]), prompt, 0, 32)
    assert all(torch.equal(w[0][:, :32], g[0]) and torch.equal(w[1][:, :32], g[1]) for w, g in zip(want, got))


def _flip_k_bytes(path: Path) -> None:
    """Flip bytes inside the block's K tensor, header intact (what the review did to an entry)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])
    start, end = meta["k"]["data_offsets"]
    for at in range(8 + n + start + 16, 8 + n + start + 16 + 64):
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_flipped_k_bytes_fail_the_checksum(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    ident = models["src_id"]
    prompt = _prompt(40)
    store.write(prompt, _layers(ident, 40, 0), ident)
    prefix = store.lookup(prompt, ident["key"])
    _flip_k_bytes(store.block_path(ident["key"], prefix.hashes[1]))
    assert store.lookup(prompt, ident["key"]).n_blocks == 2  # headers intact: the scheduler cannot see it ...
    store.read(prefix, prompt, 0, 16)  # block 0 is untouched
    with pytest.raises(BadEntry) as err:  # ... the worker does, before mapping: a load error -> recompute
        store.read(prefix, prompt, 0, 32)
    assert err.value.reason == "checksum"


def _raw_block(store, ident, prompt, *, header_fix=None, tensors_fix=None):
    """Block 0 of `prompt` written by hand with its header or tensors changed (a buggy or hostile producer)."""
    h = store.hashes(prompt, ident["key"])[0]
    parent = store.seed(ident["key"])
    B = store.block_size
    ids = torch.tensor(prompt[:B])
    k = torch.zeros(ident["n_layers"], ident["n_kv"], B, ident["head_dim"])
    tensors = {"token_ids": ids, "k": k, "v": k.clone()}
    if tensors_fix:
        tensors = tensors_fix(tensors)
    header = {"format": "kvtransfer.kv_block", "version": VERSION, "model": ident, "ns": "", "block": 0,
              "parent": parent, "hash": h, "block_size": B, "dtype": "float32", "checksum": checksum(ids, k, k)}
    if header_fix:
        header = header_fix(header)
    path = store.block_path(ident["key"], h)
    atomic_save_tensors(path, tensors, header)
    return path


MALFORMED = {  # name -> (header change, the reason the decision must give)
    "n_layers_two": (lambda h: h | {"model": h["model"] | {"n_layers": "two"}}, "corrupt"),
    "model_list": (lambda h: h | {"model": [1, 2]}, "corrupt"),
    "model_none": (lambda h: h | {"model": None}, "corrupt"),
    "block_str": (lambda h: h | {"block": "0"}, "corrupt"),
    "block_size_float": (lambda h: h | {"block_size": 16.0}, "mis-shaped"),
    "format": (lambda h: h | {"format": ["x"]}, "corrupt"),
    "not_a_dict": (lambda h: [h], "corrupt"),
    "dtype_list": (lambda h: h | {"dtype": ["float32"]}, "corrupt"),
    "foreign_key": (lambda h: h | {"model": h["model"] | {"key": "0" * 16}}, "wrong_pair"),
    "other_namespace": (lambda h: h | {"ns": "ab"}, "corrupt"),  # a block copied in from another namespace
    "ns_list": (lambda h: h | {"ns": [""]}, "corrupt"),
    "old_version": (lambda h: h | {"version": 2}, "corrupt"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_block_header_is_a_counted_fallback_never_an_exception(tmp_path, models, name):
    fix, reason = MALFORMED[name]
    store = KVStore(tmp_path, block_size=16)
    prompt = _prompt(40)
    good = _raw_block(store, models["src_id"], prompt)
    assert decide(prompt, 0, store, _spec(models)).reason == MAPPED  # the hand-written block itself is valid ...
    good.unlink()
    _raw_block(store, models["src_id"], prompt, header_fix=fix)
    d = decide(prompt, 0, store, _spec(models))  # decide itself does not raise
    assert (d.reason, d.matched) == (reason, 0), d.detail


def test_mis_shaped_and_truncated_blocks_fall_back(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    prompt = _prompt(40)
    path = _raw_block(store, models["src_id"], prompt, tensors_fix=lambda t: t | {"k": t["k"][:, :, :-1]})
    assert decide(prompt, 0, store, _spec(models)).reason == "mis-shaped"
    path.unlink()
    path = _raw_block(store, models["src_id"], prompt)
    assert decide(prompt, 0, store, _spec(models)).reason == MAPPED
    path.write_bytes(path.read_bytes()[:-100])
    assert decide(prompt, 0, store, _spec(models)).reason == "corrupt"


# ---------------------------------------------------------------- request fields
@pytest.mark.parametrize("params", [{"kvtransfer_source_len": "5"}, {"kvtransfer_source_len": 2.5},
                                    {"kvtransfer_source_len": True}, {"kvtransfer_source_len": -1},
                                    {"kvtransfer": ["off"]}, {"kvtransfer": 1}, ["off"], "off",
                                    {"kvtransfer_ns": "../x"}, {"kvtransfer_ns": "ABCD"}, {"kvtransfer_ns": 12},
                                    {"kvtransfer_ns": "a" * 65}, {"kvtransfer_ns": "_"}])
def test_a_malformed_request_field_is_a_bad_request_never_an_exception(tmp_path, models, params):
    store = KVStore(tmp_path, block_size=16)
    prompt = _prompt(40)
    store.write(prompt, _layers(models["src_id"], 40, 0), models["src_id"])
    with pytest.raises(policy.BadRequest, match="kv_transfer_params"):
        parse_params(params)
    d = safe_decide(prompt, 0, store, _spec(models), params=params)
    assert (d.reason, d.matched) == ("bad_request", 0)
    assert safe_decide(prompt, 0, store, _spec(models), params={"kvtransfer_source_len": 20}).hi == 16
    assert parse_params({"kvtransfer": "off", "other_connector": [1]}) == (True, None, "")
    assert parse_params({"kvtransfer_ns": "0a" * 32}) == (False, None, "0a" * 32)


def test_safe_decide_turns_any_fault_into_a_counted_error(tmp_path, models, monkeypatch):
    store = KVStore(tmp_path, block_size=16)
    monkeypatch.setattr(store, "lookup", lambda *a, **k: 1 / 0)
    d = safe_decide(_prompt(40), 0, store, _spec(models))
    assert d.reason == "error" and "ZeroDivisionError" in d.detail
    assert safe_decide(None, 0, store, _spec(models)).reason == "bad_request"


# ---------------------------------------------------------------- decisions
def test_decide_maps_the_longest_stored_prefix_and_leaves_the_rest(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    ident = models["src_id"]
    prompt = _prompt(40)
    spec = _spec(models)
    assert decide(prompt, 0, store, spec).reason == "no_entry"
    store.write(prompt, _layers(ident, 40, 0), ident)
    d = decide(prompt, 0, store, spec)
    assert (d.reason, d.matched, d.lo, d.hi, d.tail) == (MAPPED, 32, 0, 32, 8)
    assert d.summary(40) | {"detail": ""} == {"reason": MAPPED, "mapped": 32, "cached": 0, "prefilled": 8,
                                              "prompt": 40, "detail": "", "matched": 32, "lo": 0, "tail": 8}
    d = decide(prompt[:32], 0, store, spec)  # the prompt is exactly the stored prefix: the tail stays native
    assert (d.matched, d.hi, d.tail) == (31, 31, 1)
    d = decide(prompt, 16, store, spec)  # 16 tokens already in vLLM's own cache: map the rest
    assert (d.matched, d.lo, d.summary(40)["cached"]) == (16, 16, 16)
    longer = prompt + [9] * 50
    assert decide(longer, 0, store, spec).hi == 32
    assert decide(longer, 0, store, spec, source_len=20).hi == 16
    d = decide(prompt, 32, store, spec)  # vLLM's own cache holds all the store has: nothing mapped, counted as cached
    assert (d.reason, d.lo, d.summary(40)["mapped"], d.summary(40)["cached"], d.summary(40)["prefilled"]) == \
        ("cached", 32, 0, 32, 8)
    assert decide(prompt[:20], 0, store, spec, source_len=0).reason == "no_entry"
    d = decide(_prompt(60)[:1] + [5] * 59, 48, store, spec)  # a later turn whose prefix the store never held
    assert (d.reason, d.summary(60)["cached"], d.summary(60)["prefilled"]) == ("cached", 48, 12)
    assert decide([6] + prompt[1:], 0, store, spec).reason == "context_start"
    assert decide(prompt, 0, store, spec, prefix_caching=True).reason == "unsalted"  # lossy blocks stay salted
    assert decide(prompt, 0, store, spec, prefix_caching=True, salted=True).reason == MAPPED
    assert decide(prompt, 0, store, spec, off=True).reason == "off"
    assert decide(prompt, 0, store, MapSpec(source_hash="", unusable="mapper for another target")).reason == "wrong_pair"


def test_blocks_of_a_same_architecture_model_with_other_weights_are_refused(tmp_path, models):
    store = KVStore(tmp_path, block_size=16)
    prompt = _prompt(40)
    save_prefill(store, models["twin"], prompt, ref=models["twin_dir"])  # same config, other weights
    d = decide(prompt, 0, store, _spec(models))
    assert (d.reason, d.matched) == ("wrong_pair", 0) and models["twin_id"]["key"] in d.detail
    save_prefill(store, models["src"], prompt, ref=models["src_dir"])
    assert decide(prompt, 0, store, _spec(models)).reason == MAPPED


def test_the_decider_computes_and_counts_each_request_once(tmp_path, models):
    store = KVStore(tmp_path / "store", block_size=16)
    prompt = _prompt(40)
    store.write(prompt, _layers(models["src_id"], 40, 0), models["src_id"])
    counters = Counters(tmp_path / "stats.json", flush_s=0.05)
    decider = Decider(store, _spec(models), counters)
    calls = []
    real = store.lookup
    store.lookup = lambda *a, **k: calls.append(1) or real(*a, **k)
    first = decider.get("r1", prompt, 0, {"kvtransfer_tag": "turn-3"})
    for _ in range(3):  # vLLM asks again while the request waits for blocks
        assert decider.get("r1", prompt, 0, {"kvtransfer_tag": "turn-3"}) is first
    assert len(calls) == 1 and counters.reasons == {MAPPED: 1}
    again = decider.get("r1", prompt, 16)  # re-queued with 16 tokens cached: recomputed, not recounted
    assert again.lo == 16 and counters.reasons == {MAPPED: 1}
    decider.get("r2", prompt, 0, {"kvtransfer_source_len": "5"})
    assert counters.reasons == {MAPPED: 1, "bad_request": 1}
    assert decider.forget("r1") is again and decider.forget("r1") is None
    got = Counters.load(tmp_path / "stats.json")
    deadline = __import__("time").monotonic() + 5
    while got["reasons"] != {MAPPED: 1, "bad_request": 1} and __import__("time").monotonic() < deadline:
        got = Counters.load(tmp_path / "stats.json")
    assert got["reasons"] == {MAPPED: 1, "bad_request": 1}
    assert got["tags"] == {"turn-3": "r1"} and got["requests"]["r1"]["tag"] == "turn-3"
    assert got["requests"]["r1"]["mapped"] == 16 and got["requests"]["r1"]["cached"] == 16


def test_counters_are_bounded_and_flushed_on_a_timer(tmp_path, monkeypatch):
    writes = []
    real = policy.atomic_write_json
    monkeypatch.setattr(policy, "atomic_write_json", lambda *a, **k: writes.append(1) or real(*a, **k))
    counters = Counters(tmp_path / "stats.json", keep=10, flush_s=0.2)
    for i in range(500):
        counters.record(f"r{i}", 40, policy.Decision("no_entry"))
    assert len(counters.requests) == 10 and list(counters.requests)[0] == "r490"
    assert len(writes) <= 1  # not one write per decision
    counters.flush()
    got = Counters.load(tmp_path / "stats.json")
    assert got["reasons"] == {"no_entry": 500} and len(got["requests"]) == 10
    timings = policy.Timings(tmp_path / "t.json", keep=5)
    for i in range(50):
        timings.add({"i": i})
    timings.flush()
    assert [r["i"] for r in json.loads((tmp_path / "t.json").read_text())["loads"]] == [45, 46, 47, 48, 49]


# ---------------------------------------------------------------- size cap, eviction, two processes
def test_a_size_cap_evicts_least_recently_used_blocks(tmp_path, models):
    ident = models["src_id"]
    store = KVStore(tmp_path, block_size=16)
    prompts = [_prompt(16, seed=s) for s in range(6)]
    store.write(prompts[0], _layers(ident, 16, 0), ident)
    one = store.usage()
    capped = KVStore(tmp_path, max_bytes=3 * one, evict_to=1.0)  # no hysteresis: the order of eviction is tested
    import os
    for s, p in enumerate(prompts[1:4], 1):
        capped.write(p, _layers(ident, 16, s), ident)
        for q in prompts[:s + 1]:  # make ages distinct and ordered
            path = capped.block_path(ident["key"], capped.hashes(q, ident["key"])[0])
            if path.exists():
                os.utime(path, (1000 + prompts.index(q), 1000 + prompts.index(q)))
    assert capped.usage() <= 3 * one and len(capped.blocks()) == 3
    assert capped.lookup(prompts[0], ident["key"]).n_blocks == 0  # the oldest went
    prefix1 = capped.lookup(prompts[1], ident["key"])
    capped.read(prefix1, prompts[1], 0, 16)  # reading refreshes prompt 1's block: it is now the newest
    capped.write(prompts[4], _layers(ident, 16, 4), ident)
    assert capped.lookup(prompts[1], ident["key"]).n_blocks == 1 and capped.lookup(prompts[2], ident["key"]).n_blocks == 0
    # a block evicted between the scheduler's lookup and the worker's read: a BadEntry, never another exception
    prefix3 = capped.lookup(prompts[3], ident["key"])
    capped.evict(0)
    with pytest.raises(BadEntry) as err:
        capped.read(prefix3, prompts[3], 0, 16)
    assert err.value.reason == "evicted" and capped.usage() == 0


_WRITER = textwrap.dedent('''
    import sys, torch
    from kvtransfer.serve.store import KVStore
    root, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ident = {"key": key, "n_layers": 2, "n_kv": 2, "head_dim": 8, "config_hash": "c", "model_id": "w"}
    store = KVStore(root, max_bytes=int(sys.argv[4]))
    for s in range(n):
        ids = [5] + [(s * 31 + 7 * i) % 900 + 1 for i in range(47)]
        g = torch.Generator().manual_seed(s)
        layers = [(torch.randn(2, 48, 8, generator=g), torch.randn(2, 48, 8, generator=g)) for _ in range(2)]
        store.write(ids, layers, ident)
    print("done")
''')


def test_two_processes_on_one_directory_a_writer_evicting_and_a_reader(tmp_path):
    """A producer process writes 60 prompts under a cap of ~6 blocks (evicting as it goes) while this process looks
    prompts up and reads them: every read returns exactly the writer's tensors or falls back with BadEntry
    (evicted) -- never a partial block, never another exception. (The same holds for two nodes on a shared
    filesystem with atomic rename: the store relies on nothing else.)"""
    key = "f" * 16
    probe = KVStore(tmp_path / "store", block_size=16)
    ident = {"key": key, "n_layers": 2, "n_kv": 2, "head_dim": 8, "config_hash": "c", "model_id": "w"}
    block_bytes = (probe.write([5] * 16, [(torch.zeros(2, 16, 8), torch.zeros(2, 16, 8))] * 2, ident),
                   probe.usage())[1]
    # the writer draws its tensors with torch.randn, whose vectorised path rounds by the CPU capability: the same
    # capability as this process, or its tensors differ in the last bits from the ones compared here
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k == "ATEN_CPU_CAPABILITY"}}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "store"), key, "60", str(6 * block_bytes)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reads = fell_back = 0
    while writer.poll() is None or reads + fell_back < 20:
        for s in range(60):
            ids = [5] + [(s * 31 + 7 * i) % 900 + 1 for i in range(47)]
            prefix = probe.lookup(ids, key)
            if not prefix.n_blocks:
                continue
            g = torch.Generator().manual_seed(s)
            want = [(torch.randn(2, 48, 8, generator=g), torch.randn(2, 48, 8, generator=g)) for _ in range(2)]
            try:
                got = probe.read(prefix, ids, 0, prefix.n_tokens)
            except BadEntry as err:
                assert err.reason == "evicted", err
                fell_back += 1
                continue
            n = prefix.n_tokens
            assert all(torch.equal(k[:, :n], gk) and torch.equal(v[:, :n], gv) for (k, v), (gk, gv) in zip(want, got))
            reads += 1
        if writer.poll() is not None and reads + fell_back == 0:
            break
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0 and "done" in out, err
    assert reads > 0
    assert probe.usage() <= 6 * block_bytes
    assert not list((tmp_path / "store").rglob("*.tmp"))  # no temporary file left behind


def test_a_failed_load_is_reclassified_and_stays_failed(tmp_path, models):
    store = KVStore(tmp_path / "store", block_size=16)
    prompt = _prompt(40)
    store.write(prompt, _layers(models["src_id"], 40, 0), models["src_id"])
    counters = Counters()
    decider = Decider(store, _spec(models), counters)
    assert decider.get("r", prompt, 0).reason == MAPPED
    decider.fail("r", "checksum")
    assert counters.reasons == {policy.LOAD_FAILED: 1} and counters.requests["r"]["mapped"] == 0
    assert counters.requests["r"]["prefilled"] == 40
    assert decider.get("r", prompt, 16).reason == policy.LOAD_FAILED  # never mapped again
    decider.fail("r", "again")
    assert counters.reasons == {policy.LOAD_FAILED: 1}
