"""`--fail-on-skip`: a run in which any collected test was skipped exits non-zero (what CI uses).

The default suite must skip nothing on a fresh clone: a skip there hides an untested path (a
missing data file, a missing dev dependency). Tests deselected by `-m` (the slow ones) are not
skipped and do not count. xfail is not a skip either. The skip reasons are still printed by `-rs`;
this plugin only changes the exit status and says why. Hooks are imported into tests/conftest.py.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--fail-on-skip", action="store_true", default=False,
                     help="exit with status 1 if any test (or test module) was skipped")


def _skipped(config) -> list:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return [] if reporter is None else list(reporter.stats.get("skipped", []))


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("fail_on_skip") and exitstatus == pytest.ExitCode.OK and _skipped(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = _skipped(config)
    if config.getoption("fail_on_skip") and skipped:
        terminalreporter.write_sep("=", f"--fail-on-skip: {len(skipped)} skipped, so this run fails "
                                        "(reasons above with -rs)", red=True, bold=True)
