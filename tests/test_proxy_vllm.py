"""The handoff proxy in front of two real vLLM engines (tiny family, loopback): slow, serving environment only.

    PYTHONPATH=$PWD .venv-serve/bin/python -m pytest -q -m slow tests/test_proxy_vllm.py

Runs experiments/handoff/load_tiny.py at a small size (4 sessions x 4 turns, then every fault) and checks
its report: nothing crashed, every clean handoff is mapped and serves what the target computes itself
(identity map: the harness's transfer == the target's own prefill), every fault is a counted fallback
followed by a handoff that maps again, bad requests are 400s, a dead producer is a target prefill and
two dead engines a 502 from a proxy that stays up.
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
    target = [r for r in load if r["to_target"]]
    assert target and all(r["kvtransfer"]["status"] == "mapped" for r in target)
    assert all(r["kvtransfer"]["mapped"] > 0 and r["kvtransfer"]["prefilled"] >= 1 for r in target)
    assert [r for r in target if r.get("differs")] == []  # greedy tokens == the target's own prefill
    assert all(r["header"] == "source" for r in load if not r["to_target"])


def test_faults_are_counted_fallbacks_and_the_next_handoff_maps(report):
    faults = report["faults"]
    # the block store: a truncated last block ends the stored prefix before it (the blocks before it still map);
    # a block whose K bytes were flipped or replaced fails its checksum in the worker (load_failed -> recompute)
    truncated = faults["truncated"]["header"]
    assert truncated.startswith("mapped ") and int(truncated.split()[1]) < 192, truncated  # not the spoilt block
    for name in ("corrupt_k_bytes", "foreign_weights"):   # the consumer's own decision, not vLLM's cached count
        assert faults[name]["header"] == "fallback_reprefill: consumer_fallback (load_failed)", (name, faults[name])
    assert report["consumer_reasons"].get("load_failed", 0) >= 2, report["consumer_reasons"]
    assert faults["evicted"]["header"].startswith("fallback_reprefill: consumer_fallback")
    for name in ("truncated", "corrupt_k_bytes", "foreign_weights"):
        assert faults[name]["after"].startswith("mapped "), name
    assert faults["producer_dead"]["header"].startswith("fallback_reprefill: save_failed")
    assert faults["bad_requests"] == [400] * len(faults["bad_requests"])
    assert faults["both_dead"]["status"] == 502 and faults["proxy_alive_after"]
    assert report["crashed"] == {"proxy": False}
    assert not [k for k in report["proxy_stats"]["errors"] if k.startswith("proxy_error")]
    assert report["consumer_reasons"]["no_entry"] >= 1
