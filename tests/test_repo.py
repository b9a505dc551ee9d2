"""The repository is self-contained and CI cannot pass with skipped tests."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "benchmarks"

SUITE = '''
import pytest

def test_runs():
    pass

@pytest.mark.slow
def test_slow():
    pass
'''


def _run(pytester, *args):
    pytester.makeini("[pytest]\nmarkers = slow: slow\naddopts = -m 'not slow'\n")
    # skip_guard is already imported (tests/conftest.py), hence the assertion-rewrite warning is moot
    return pytester.runpytest("-p", "skip_guard", "-rs", "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_fail_on_skip_fails_a_run_with_a_skipped_test(pytester):
    pytester.makepyfile(test_a=SUITE + '\ndef test_needs_data():\n    pytest.skip("data file not found")\n')
    plain = _run(pytester)
    assert plain.ret == 0
    plain.assert_outcomes(passed=1, skipped=1, deselected=1)
    strict = _run(pytester, "--fail-on-skip")
    assert strict.ret == 1
    strict.assert_outcomes(passed=1, skipped=1, deselected=1)
    strict.stdout.fnmatch_lines(["*--fail-on-skip: 1 skipped, so this run fails*", "SKIPPED *data file not found*"])


def test_fail_on_skip_counts_a_module_skipped_at_import(pytester):
    pytester.makepyfile(test_a=SUITE, test_b='import pytest\npytest.importorskip("no_such_module_xyz")\n\n'
                                               'def test_b():\n    pass\n')
    result = _run(pytester, "--fail-on-skip")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["SKIPPED *no_such_module_xyz*"])


def test_fail_on_skip_passes_when_only_slow_tests_are_left_out(pytester):
    pytester.makepyfile(test_a=SUITE)
    result = _run(pytester, "--fail-on-skip")
    assert result.ret == 0
    result.assert_outcomes(passed=1, deselected=1)


TIGHT = '''
import torch
from tolerance import assert_close

def test_tight():  # observed 1 ulp of 1.0 against an allowance of 2 ulp: ratio 0.5
    assert_close(torch.tensor([1.0 + 2 ** -23]), torch.tensor([1.0]), factor=2, reason="planted: 2 eps")

def test_roomy():  # ratio 1/64
    assert_close(torch.tensor([1.0 + 2 ** -23]), torch.tensor([1.0]), factor=64, reason="planted: 64 eps")
'''


def _run_headroom(pytester, *args):
    # headroom_guard and tolerance are already imported (tests/conftest.py): the warning is moot
    return pytester.runpytest("-p", "headroom_guard", "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_headroom_guard_fails_a_run_with_a_too_tight_comparison(pytester):
    pytester.makepyfile(test_a=TIGHT)
    assert _run_headroom(pytester).ret == 0  # without the flag: both pass
    strict = _run_headroom(pytester, "--headroom", "0.1")
    assert strict.ret == 1
    strict.assert_outcomes(passed=2)
    strict.stdout.fnmatch_lines(["*tolerance headroom: 2 comparison sites (2 guarded)*", "*0.5 *close*test_a.py::test_tight*",
                                 "*0.0156*test_a.py::test_roomy*", "TOO TIGHT*test_a.py::test_tight*",
                                 "*reason given: planted: 2 eps*", "*--headroom 0.1: 1 comparison(s)*run fails*"])
    assert _run_headroom(pytester, "--headroom", "0.6").ret == 0


def test_headroom_guard_passes_a_declared_exemption(pytester):
    pytester.makepyfile(test_a=TIGHT.replace('reason="planted: 2 eps")', 'reason="planted: 2 eps", '
                                             'headroom_exempt="planted: the bound is the quantity")'))
    result = _run_headroom(pytester, "--headroom", "0.1")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["exempt *test_tight*EXEMPT: planted: the bound is the quantity*"])


def test_ci_runs_the_readme_test_command_with_the_skip_and_headroom_guards():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python3 -m pytest -q -rs --fail-on-skip --headroom 0.1" in ci   # the default suite, as typed in README
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^python -m pytest -q -rs --fail-on-skip --headroom 0\.1\s", readme, re.M)


def test_benchmark_samples_ship_with_the_repo_and_match_their_readme():
    """data/benchmarks: every file the README's table lists exists with that many JSON records, and back."""
    readme = (BENCH / "README.md").read_text()
    listed = {name: int(count) for name, count in re.findall(r"^\| `([\w.]+\.jsonl)` \| (\d+) \|", readme, re.M)}
    assert set(listed) == {p.name for p in BENCH.glob("*.jsonl")} and len(listed) == 11
    for name, count in listed.items():
        lines = [line for line in (BENCH / name).read_text().splitlines() if line.strip()]
        assert len(lines) == count, name
        assert all(isinstance(json.loads(line), dict) for line in lines), name
    assert "## Licences at a glance" in readme


def test_nothing_reads_benchmarks_from_outside_the_repo():
    """Tests, configs, the README and the offline task code name data/benchmarks, not a sibling directory."""
    outside = "shared" + "/benchmarks"  # split so this file does not match itself
    files = [*ROOT.glob("tests/*.py"), *ROOT.glob("conf/**/*.yaml"), ROOT / "README.md", ROOT / ".ci" / "run",
             ROOT / "kvtransfer" / "eval" / "tasks.py"]
    assert [str(f.relative_to(ROOT)) for f in files if outside in f.read_text()] == []
