"""Issue 32: every cached artifact carries its own provenance, and a run that reads it says who made it.

A run at one (faked) commit from a dirty tree makes every artifact; a second run, at the real checkout, reads
them all from the cache: its own `environment` is the checkout's, while its `producers` name the faked commit
and dirty tree for each artifact, and the results header says so. Also: untracked source files make a tree
dirty, and the provenance root is the repository, not the package."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtransfer.config import provenance
from kvtransfer.runner import execute
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 -- the fixture

ROOT = Path(__file__).resolve().parents[1]
FAKE = {"commit": "f" * 40, "dirty": True, "dirty_paths": ["kvtransfer/core/ridge.py"]}


def test_the_provenance_root_is_the_repository():
    assert (provenance.ROOT / "pyproject.toml").is_file() and (provenance.ROOT / "kvtransfer").is_dir()


def test_untracked_source_files_make_the_tree_dirty(tmp_path, git_repo):
    git = git_repo
    (tmp_path / ".gitignore").write_text("artifacts/\n")
    (tmp_path / "code.py").write_text("0")
    git("add", "-A")
    git("commit", "-qm", "init")
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "x.json").write_text("{}")        # ignored: an output
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "new.json").write_text("{}")        # results/: an output
    (tmp_path / "NOTES.md").write_text("text")                  # Markdown: no number changes
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "new_module.py").write_text("X = 1\n")  # code the commit does not hold
    state = provenance.git_state(tmp_path)
    assert state["dirty"] is True and state["dirty_paths"] == ["pkg/new_module.py"]


def test_produced_by_names_the_commit_time_packages_and_code_version(monkeypatch):
    monkeypatch.setattr(provenance, "git_state", lambda root=provenance.ROOT: dict(FAKE))
    stamp = provenance.produced_by(3)
    assert stamp["commit"] == FAKE["commit"] and stamp["dirty"] is True and stamp["code_version"] == 3
    assert stamp["time"].endswith("+00:00") and stamp["torch"] and stamp["transformers"]
    assert set(provenance.json_provenance()) == {"commit", "dirty", "dirty_paths", "time"}


def test_a_run_names_the_producers_of_the_cached_artifacts_it_reads(tiny_pair_dirs, tmp_path, monkeypatch):  # noqa: F811
    extra = ("stage=[calibrate,fit,eval,bench]", "eval.tasks=[tiny_cloze]", "eval.limit=4", "eval.max_gen_toks=2",
             "eval.modes=[target,transfer,no_context,gated]", "eval.controls=[]", "eval.ppl.prefixes=[0,16]",
             "eval.ppl.continuation=8", "eval.ppl.windows=2", "eval.coqa.enabled=false", "eval.bootstrap=20",
             "eval.gate.enabled=true", "eval.gate.sequences=4", "eval.fidelity.sequences=2",
             "eval.fidelity.continuation=8", "bench.tokens=[16]", "bench.warmup=0", "bench.repeats=1")
    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, *extra)
    with monkeypatch.context() as m:
        m.setattr(provenance, "git_state", lambda root=provenance.ROOT: dict(FAKE))
        first = execute(cfg, tmp_path / "made")
    kinds = {s["artifact"] for s in first["producers"]["artifacts"].values()}
    assert {"calibration", "mapper", "gate", "fidelity", "eval_tasks", "eval_tasks_mapped", "eval_ppl",
            "eval_ppl_mapped", "bench"} <= kinds
    assert set(first["producers"]["commits"]) == {"fffffff"} and not first["producers"]["not_recorded"]

    again = execute(cfg, tmp_path / "read")   # every artifact from the cache, at the real checkout
    real = provenance.git_state()
    assert again["environment"].get("commit") == real.get("commit") != FAKE["commit"]
    assert again["producers"]["artifacts"].keys() == first["producers"]["artifacts"].keys()
    for where, stamp in again["producers"]["artifacts"].items():
        made = first["producers"]["artifacts"][where]
        assert stamp["commit"] == FAKE["commit"] and stamp["dirty"] is True, where
        assert stamp["time"] == made["time"] and stamp["code_version"] >= 1, where   # read back, not restamped
    assert sorted(again["producers"]["dirty"]) == sorted(again["producers"]["artifacts"])
    header = provenance.provenance_header({"read": again}, "collect.py",
                                          not_rerun={} if not real.get("dirty") else {"read": "a test"})
    assert "`fffffff` (" in header and "dirty) tree**: " in header and "mapper × 1" in header
    # the summary on disk holds the same list
    on_disk = json.loads((tmp_path / "read" / "summary.json").read_text())
    assert on_disk["producers"] == again["producers"]


def test_the_header_names_runs_made_before_producers_were_listed():
    old = {"environment": {"commit": "a" * 40, "dirty": False}}
    text = provenance.provenance_header({"old": old}, "collect.py")
    assert "Made before summaries listed the producers" in text and "`old`" in text
    unrecorded = {"environment": {"commit": "a" * 40, "dirty": False},
                  "producers": provenance.summarize_producers({"mappers/x": {"artifact": "mapper", "commit": None}})}
    assert "record no producer" in provenance.provenance_header({"new": unrecorded}, "collect.py")


@pytest.mark.parametrize("dirty", [False, True])
def test_summarize_producers_groups_by_commit(dirty):
    p = provenance.summarize_producers({"a": {"artifact": "mapper", "commit": "1" * 40, "dirty": dirty},
                                        "b": {"artifact": "gate", "commit": "2" * 40, "dirty": False},
                                        "c": {"artifact": "bench", "commit": None}})
    assert p["commits"] == {"1111111": ["a"], "2222222": ["b"]} and p["not_recorded"] == ["c"]
    assert p["dirty"] == (["a"] if dirty else [])
