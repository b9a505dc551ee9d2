"""A code version per artifact kind (kvtransfer.runner.code_versions): the committed digests are those of the
code now, a docstring or comment edit keeps the digest and a code edit moves it, a bump moves the kind's key
and its dependants' keys and no other, and version 1 keeps the keys artifacts were made under before."""
from __future__ import annotations

import json
import textwrap

import pytest

from kvtransfer.runner import artifacts, code_versions
from kvtransfer.runner.artifacts import ARTIFACTS, KEY_VERSION, compute_key, key_inputs, upstream_of
from kvtransfer.runner.keys import artifact_key


def test_the_committed_digests_are_those_of_the_code_now():
    """Fails when the code that computes an artifact changed without a decision (see the message)."""
    if code_versions.recorded().get("python") != code_versions.python_minor():
        # ast.unparse spells code per Python version: check the digests are computable and stable here instead
        now = code_versions.current({k: a.code for k, a in ARTIFACTS.items()})
        assert now == code_versions.current({k: a.code for k, a in ARTIFACTS.items()})
        return
    diff = code_versions.changed({name: art.code for name, art in ARTIFACTS.items()})
    assert not diff, (
        f"the code computing {sorted(diff)} changed since its version was recorded. If the change can move any "
        "number those artifacts hold, run `python -m kvtransfer.runner.code_versions --bump KIND ...` (cached "
        "artifacts of those kinds are then recomputed); if it cannot, `python -m kvtransfer.runner.code_versions "
        "--update`. Commit code_versions.json with the change.")


def test_every_artifact_declares_its_producing_code_and_has_a_version():
    for name, art in ARTIFACTS.items():
        assert art.code, f"{name} declares no producing code (Artifact.code)"
        files = code_versions.closure(art.code)
        assert all(f.is_file() for f in files)
        assert code_versions.version(name) >= 1


def _module(tmp_path, source: str):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_the_digest_ignores_docstrings_comments_and_layout_but_not_code(tmp_path, monkeypatch):
    monkeypatch.setattr(code_versions, "PACKAGE", tmp_path)
    base = code_versions.code_digest([_module(tmp_path, '''
        """Module doc."""
        def f(x):
            """Doc."""
            return x + 1
    ''')])
    reworded = code_versions.code_digest([_module(tmp_path, '''
        """Another module doc, longer."""
        def f(x):  # a comment
            """Other doc."""

            return (x
                    + 1)
    ''')])
    changed = code_versions.code_digest([_module(tmp_path, '''
        """Module doc."""
        def f(x):
            """Doc."""
            return x + 2
    ''')])
    assert base == reworded
    assert changed != base


def test_the_closure_follows_function_level_imports_and_names_modules_not_packages():
    files = {str(f.relative_to(code_versions.PACKAGE)) for f in code_versions.closure(("runner/gate_stage",))}
    # gate_stage imports core.gate and core.transfer inside its function
    assert {"runner/gate_stage.py", "core/gate.py", "core/transfer.py"} <= files
    assert "runner/__init__.py" not in files and "runner/pipeline.py" not in files
    evals = {str(f.relative_to(code_versions.PACKAGE)) for f in code_versions.closure(ARTIFACTS["eval_tasks"].code)}
    assert {"eval/adapter.py", "eval/prefix.py", "eval/metrics.py"} <= evals


def _keys(cfg: dict, versions: dict) -> dict[str, str]:
    """Every artifact's key under `cfg` with code versions `versions`, upstream keys chained."""
    keys: dict[str, str] = {}

    def key(name):
        if name not in keys:
            keys[name] = compute_key(name, cfg, upstream={u: key(u) for u in upstream_of(name, cfg)},
                                     identities={i: i for i in ARTIFACTS[name].identities},
                                     extra={e: e for e in ARTIFACTS[name].extra})
        return keys[name]
    for name in ARTIFACTS:
        key(name)
    return keys


def _tiny_cfg() -> dict:
    from run_configs import compose_config

    return compose_config("pair=tiny", "mapper.weighting=attention_mass", "eval.gate.enabled=true")


def test_a_bump_moves_the_kind_and_its_dependants_and_nothing_else(monkeypatch):
    cfg = _tiny_cfg()
    base = {k: dict(v) for k, v in code_versions.recorded().items() if isinstance(v, dict)}
    before = _keys(cfg, base)
    bumped = dict(base, calibration=dict(base["calibration"], version=base["calibration"]["version"] + 1))
    monkeypatch.setattr(artifacts, "recorded", lambda: bumped)
    after = _keys(cfg, bumped)
    moved = {k for k in ARTIFACTS if before[k] != after[k]}
    # what reads the calibration, directly or through the map
    assert {"calibration", "feature_sample", "mapper", "gate", "fidelity", "eval_tasks_mapped", "eval_ppl_mapped"} <= moved
    # the baselines and the timing on random weights never read it
    assert not moved & {"eval_tasks", "eval_ppl", "eval_coqa", "eval_tasks_native", "bench_shapes"}


def test_version_one_keeps_the_keys_made_before_code_versions(monkeypatch):
    cfg = _tiny_cfg()
    name = "eval_tasks"
    ups = {u: "u" for u in upstream_of(name, cfg)}
    ids = {i: i for i in ARTIFACTS[name].identities}
    plain = artifact_key(KEY_VERSION, name, key_inputs(name, cfg), ups, ids, {})
    monkeypatch.setattr(artifacts, "recorded", lambda: {name: {"version": 1, "digest": "x"}})
    assert compute_key(name, cfg, upstream=ups, identities=ids, extra={}) == plain
    monkeypatch.setattr(artifacts, "recorded", lambda: {name: {"version": 2, "digest": "x"}})
    assert compute_key(name, cfg, upstream=ups, identities=ids, extra={}) != plain


def test_the_cli_reports_a_change_and_records_a_bump(tmp_path, monkeypatch, capsys):
    versions = tmp_path / "code_versions.json"
    recorded = json.loads(artifacts.CODE_VERSIONS_FILE.read_text())
    recorded["gate"]["digest"] = "0" * 16   # as if gate's code changed since it was recorded
    versions.write_text(json.dumps(recorded))
    monkeypatch.setattr(artifacts, "CODE_VERSIONS_FILE", versions)
    artifacts.recorded.cache_clear()
    try:
        assert code_versions.main([]) == 1 and "gate: code changed" in capsys.readouterr().out
        assert code_versions.main(["--bump", "gate"]) == 0
        written = json.loads(versions.read_text())
        assert written["gate"]["version"] == recorded["gate"]["version"] + 1
        assert written["gate"]["digest"] != "0" * 16
        assert written["mapper"]["version"] == recorded["mapper"]["version"]
        assert code_versions.main([]) == 0
        with pytest.raises(SystemExit):
            code_versions.main(["--bump", "no_such_kind"])
    finally:
        artifacts.recorded.cache_clear()


def _scratch_package(tmp_path):
    import shutil

    copy = tmp_path / "kvtransfer"
    shutil.copytree(code_versions.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_kinds_see_the_code_they_reach_through_run_function_by_function(tmp_path, monkeypatch):
    """Stages are handed `run`: an edit to `core/data.token_sequences` (how calibration text is tokenized, reached
    through `Run.token_ids`) or to one `Run` method moves the kinds whose code reaches it, and only those."""
    declared = {k: a.code for k, a in ARTIFACTS.items()}
    scratch = _scratch_package(tmp_path)
    monkeypatch.setattr(code_versions, "PACKAGE", scratch)
    base = code_versions.current(declared)

    _edit(scratch / "core" / "data.py", "def token_sequences(", "def token_sequences(*_unused, ")
    tokens = code_versions.current(declared)
    moved_by_tokens = {k for k in declared if tokens[k] != base[k]}
    assert {"calibration", "feature_sample", "mapper", "eval_tasks_mapped", "eval_ppl_mapped"} <= moved_by_tokens

    _edit(scratch / "runner" / "run.py", "        return mapper.native_sink\n", "        return int(mapper.native_sink)\n")
    sink = code_versions.current(declared)
    moved_by_sink = {k for k in declared if sink[k] != tokens[k]}
    assert {"mapper", "fidelity", "gate", "eval_tasks_mapped", "eval_ppl_mapped", "eval_coqa_mapped"} <= moved_by_sink
    assert not moved_by_sink & {"calibration", "feature_sample"}   # the calibration never asks for the sink

    # a docstring edit in a Run method moves nothing; an edit to a function nothing reaches moves nothing
    _edit(scratch / "runner" / "run.py", "(mapper.native_sink when it was fitted)", "(the fitted mapper's)")
    (scratch / "core" / "unused_helper.py").write_text("def helper():\n    return 1\n")
    assert code_versions.current(declared) == sink
