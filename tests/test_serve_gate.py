"""The per-request gate served through vLLM on the tiny family (issue 30): slow, serving environment only.

    PYTHONPATH=$PWD .venv-serve/bin/python -m pytest -q -m slow tests/test_serve_gate.py
(runs experiments/serve/gate_tiny.py once: a producer and six consumer engines, one after another)
"""
from __future__ import annotations

import json

import pytest
from tolerance import assert_within
from vllm_tests import SERVE_ONLY, run_script, shared_logprobs as _shared

pytestmark = SERVE_ONLY


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate")
    run_script("experiments/serve/gate_tiny.py", out)
    return json.loads((out / "report.json").read_text())


def _gate_of(got: dict) -> dict:
    return got["kv_transfer_params"]["kvtransfer"]["gate"]


def test_forced_full_serves_exactly_the_targets_own_greedy_output(gate):
    """Thresholds below every score: each request is scored, decided `full`, its sampled token dropped and the
    prompt recomputed from block 0 -- the cold output token for token; the response and the stats say so."""
    for name, got in gate["full"].items():
        g = _gate_of(got)
        assert g["action"] == "full" and g["score"] is not None and g["score"] > 0, (name, g)
        assert g["start"] == 0 and g["mapped"] == 0 and g["prefilled"] == gate["prompts"][name]
        assert got["tokens"] == gate["cold"][name]["tokens"], name
        assert_within(*_shared(got, gate["cold"][name]), atol=1e-5,
                      reason="the same engine's own prefill of the same tokens twice: identical kernels, float32 "
                             "rounding of a 6-layer model's logits at most")
    assert gate["full_stats"]["gates"] == {"full": len(gate["prompts"])}
    assert gate["full_stats"]["reasons"] == {"mapped": len(gate["prompts"])}  # not a load failure


def test_forced_map_serves_todays_mapped_output_with_the_gate_tail_native(gate):
    """Thresholds above every score: `map`; the output is today's (ungated) connector's mapping the same tokens --
    all but the gate's tail, which is computed natively by construction -- and differs from the cold one (the map
    is perturbed)."""
    for name, got in gate["map"].items():
        g, plain = _gate_of(got), gate["shorter"][f"map:{name}"]
        n = gate["prompts"][name]
        assert g["action"] == "map" and g["score"] > 0 and g["start"] == g["hi"] - gate["tail"], (name, g)
        assert g["prefilled"] == n - g["start"] == plain["kv_transfer_params"]["kvtransfer"]["prefilled"]
        assert got["kv_transfer_params"]["kvtransfer"]["mapped"] == g["start"] == gate["starts"][f"map:{name}"]
        assert got["tokens"] == plain["tokens"], name
        assert_within(*_shared(got, plain), atol=1e-5,
                      reason="the same tokens mapped and computed by the same kernels in two engines: float32 rounding")
    assert any(gate["map"][k]["tokens"] != gate["cold"][k]["tokens"] for k in gate["cold"])
    # the score is the engine's own measurement, the same whatever the thresholds
    for name in gate["map"]:
        assert_within([_gate_of(gate["map"][name])["score"]], [_gate_of(gate["full"][name])["score"]], atol=1e-6,
                      reason="one engine kind, the same mapped tokens and native tail: float32 rounding of a ratio of "
                             "sums of squares (relative 1e-7) on scores of order 1")


def test_forced_recompute_recomputes_the_recent_blocks(gate):
    """Thresholds putting every request in `recompute` (fraction 0.5): the target recomputes from the block holding
    position hi - round(0.5 (hi - sink)) (serve.gating.recompute_start, the `recent` rule) -- the output equals the
    ungated connector asked to map only the first `start` tokens."""
    from kvtransfer.core.gate import Decision
    from kvtransfer.serve.gating import recompute_start

    for name, got in gate["recompute"].items():
        g = _gate_of(got)
        assert g["action"] == "recompute" and g["fraction"] == 0.5
        want = recompute_start(Decision("recompute", 0.5, g["score"], ""), lo=0, head_end=g["hi"] - gate["tail"],
                               hi=g["hi"], native_sink=1, block_size=g["block_size"])
        assert g["start"] == want == gate["starts"][f"recompute:{name}"]
        assert want % g["block_size"] == 0 and g["block_size"] > 0
        short = gate["shorter"][f"recompute:{name}"]
        assert short["kv_transfer_params"]["kvtransfer"]["mapped"] == want
        assert got["tokens"] == short["tokens"], name
    # the longest prompt keeps part of its map: a partial recompute, not a full one
    assert 0 < _gate_of(gate["recompute"]["longer"])["start"] < _gate_of(gate["map"]["longer"])["start"]


def test_bad_gate_file_falls_back_to_a_normal_prefill_counted(gate):
    """A gate file that is not a valid artifact: the engine serves, every request is prefilled normally (the cold
    output), reason "gate_unusable" counted once per request, and the response names why."""
    stats = gate["bad_stats"]
    assert stats["reasons"] == {"gate_unusable": len(gate["prompts"])}
    assert stats["gates"] == {"full": len(gate["prompts"])}
    for name, got in gate["bad"].items():
        kvt = got["kv_transfer_params"]["kvtransfer"]
        assert kvt["reason"] == "gate_unusable" and "lack" in kvt["gate"]["reason"] and kvt["gate"]["score"] is None
        assert got["tokens"] == gate["cold"][name]["tokens"], name
