"""The handoff proxy in front of two real vLLM engines (tiny family, loopback): slow, serving environment only.

    PYTHONPATH=$PWD .venv-serve/bin/python -m pytest -q -m slow tests/test_proxy_vllm.py

Runs experiments/handoff/load_tiny.py at a small size (4 sessions x 4 turns, then every fault) and checks
its report: nothing crashed; every switch of a warm session sends nothing to the producer and maps what the
source's turns stored; later turns prefill only their new tokens (the target's own prefix cache); every target
turn serves what the target computes itself (identity map: the harness's transfer == the target's own prefill);
every store fault is a counted fallback followed by a handoff that maps again; another key on a session's id is
a session of its own; bad requests
are 400s that leave no state; a dead producer is a target prefill and two dead engines a 502 from a proxy that
stays up.
"""
from __future__ import annotations

import json

import pytest
from vllm_tests import SERVE_ONLY, run_script

pytestmark = SERVE_ONLY


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("handoff") / "run"
    run_script("experiments/handoff/load_tiny.py", out, "--sessions", 4, "--turns", 4, kv_space=False)
    return json.loads((out / "report.json").read_text())


def _phase(report, name):
    return [r for r in report["records"] if r["phase"] == name]


def test_load_sessions_hand_over_and_serve_what_the_target_computes(report):
    load = _phase(report, "load")
    assert len(load) == 4 * 4 and all(r["status"] == 200 for r in load)
    switches = [r for r in load if r["switch"]]
    assert len(switches) == 4 and all(r["kvtransfer"]["status"] == "mapped" for r in switches)
    # the switch of a warm session sends nothing to the producer: no save step, its prompt counter does not move
    assert all(r["kvtransfer"]["save_s"] is None and r["producer_prompt_tokens"] == 0 for r in switches)
    # it maps the blocks the source's turns stored and prefills the rest (the last turn) natively
    assert all(r["kvtransfer"]["mapped"] >= r["prompt"] - r["new_tokens"] - 16 for r in switches)
    # later turns hit the target's own cache (this session's salt) and prefill only their new tokens (+ < 1 block)
    later = [r for r in load if r["to_target"] and not r["switch"]]
    assert later and all(r["kvtransfer"]["status"] == "cached" for r in later)
    assert all(r["kvtransfer"]["prefilled"] < r["new_tokens"] + 32 for r in later)  # vLLM block 32
    assert [r for r in load if r["to_target"] and r.get("differs")] == []  # greedy tokens == the target's own prefill
    assert all(r["header"] == "source" for r in load if not r["to_target"])
    # the producer gathered and wrote each stored block once, in the background (no block twice, none failed)
    w = report["producer_writer"]
    assert w["failed"] == 0 and w["written_blocks"] == w["blocks_in_store"] > 0
    assert w["gathered_bytes"] == w["written_bytes"] == w["written_blocks"] * w["bytes_per_block"]


def test_faults_are_counted_fallbacks_and_the_next_handoff_maps(report):
    faults = report["faults"]
    # the block store: a truncated last block ends the stored prefix before it (the blocks before it still map);
    # a block whose K bytes were flipped or replaced fails its checksum in the worker (load_failed -> recompute)
    truncated = faults["truncated"]["header"]
    assert truncated.startswith("mapped ") and int(truncated.split()[1]) < 192, truncated  # not the spoilt block
    for name in ("corrupt_k_bytes", "foreign_weights"):   # the consumer's own decision, not vLLM's cached count
        assert faults[name]["header"] == "fallback_reprefill: consumer_fallback (load_failed)", (name, faults[name])
    assert report["consumer_reasons"].get("load_failed", 0) >= 2, report["consumer_reasons"]
    for name in ("truncated", "corrupt_k_bytes", "foreign_weights"):
        assert faults[name]["after"].startswith("mapped "), name
    # the store lost a handed-over session's blocks: its next turn is served from the target's own cache
    assert faults["evicted"]["header"].startswith("cached "), faults["evicted"]
    # another key on the same id: its own cold session (a save step), no hit of the owner's cached blocks
    second = faults["second_key"]
    assert second["owner"] == second["other"] == 200, second
    assert second["other_kvtransfer"]["save_s"] is not None and not second["other_kvtransfer"]["cached"], second
    assert second["other_kvtransfer"]["status"] == "mapped", second  # the cold switch maps its own save step's
    assert second["owner_switch"].startswith("mapped "), second
    bad = faults["distinct_bad_sessions"]
    assert bad["codes"] == {"400": 2000} and bad["sessions_after"] == bad["sessions_before"]
    assert bad["rss_kb_after"] - bad["rss_kb_before"] < 20_000, bad  # no per-request state kept
    assert faults["producer_dead"]["header"].startswith("fallback_reprefill: save_failed")
    assert faults["bad_requests"] == [400] * len(faults["bad_requests"])
    assert faults["both_dead"]["status"] == 502 and faults["proxy_alive_after"]
    assert report["crashed"] == {"proxy": False}
    assert not [k for k in report["proxy_stats"]["errors"] if k.startswith("proxy_error")]
