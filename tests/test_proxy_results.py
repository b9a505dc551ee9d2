"""results/handoff/README.md's generated blocks are what experiments/handoff/collect.py makes of the committed JSON."""
from __future__ import annotations

import json
from pathlib import Path
from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _collect():
    return load_script("experiments/handoff/collect.py")


def test_readme_blocks_match_the_committed_reports():
    from kvtransfer.report import readme

    have = readme.blocks((ROOT / "results/handoff/README.md").read_text())
    want = _collect().readme_blocks()
    assert "load_tiny" in want and set(want) <= {"load_tiny", "latency", "overhead", "conversation", "store_io"}
    assert {k: have[k] for k in want} == {k: v.rstrip("\n") + "\n" for k, v in want.items()}


def test_load_report_counts_what_the_readme_claims():
    rep = json.loads((ROOT / "results/handoff/load_tiny.json").read_text())
    load = [r for r in rep["records"] if r["phase"] == "load"]
    assert len(load) == rep["sessions"] * rep["turns"]
    assert not [r for r in load if r.get("differs")] and not rep["crashed"]["proxy"]
    switches = [r for r in load if r.get("switch")]
    assert len(switches) == rep["sessions"] and all(r["producer_prompt_tokens"] == 0 for r in switches)
