"""`--headroom RATIO`: fail a run in which a tolerance comparison passed with too little headroom.

Every comparison through tests/tolerance.py records observed error / allowed error (for
`assert_far`, allowed / observed). A bound that one machine passes at ratio 0.9 fails on the next
machine (another CPU's kernels, thread count, BLAS): the issue behind this guard was a split-vs-full
prefill passing at 1e-5 here and landing at 1.14e-5 on an AVX-512 Xeon. With `--headroom 0.1` (CI's
setting) the run exits non-zero when any comparison's ratio exceeds 0.1 on the machine it runs on,
unless it declared `headroom_exempt="<why>"`. The summary lists the tightest comparisons either way, and
every comparison site whose worst ratio stays below `VACUOUS` (5e-3) as possibly vacuous: a bound two
hundred times looser than what it ever sees would pass on garbage that small too (re-derive it tighter).
It reports them; it does not fail on them.
Registered from tests/conftest.py (`pytest_plugins`), like tests/skip_guard.py.
"""
from __future__ import annotations

import pytest

import tolerance

SHOW = 10  # rows of the tightest comparisons printed in the summary
VACUOUS = 5e-3  # a site whose worst ratio stays below this is reported as possibly vacuous
_SITES = pytest.StashKey[list]()  # the session's worst record per call site, for the summary


def pytest_addoption(parser):
    parser.addoption("--float-only", action="store_true", default=False,
                     help="run only the float comparisons: tests whose own source calls a tests/tolerance.py helper "
                          "(.ci/run reruns these under each CPU capability torch can select)")
    parser.addoption("--headroom", type=float, default=None, metavar="RATIO",
                     help="exit with status 1 if any tolerance comparison (tests/tolerance.py) used more than "
                          "RATIO of its allowed error, unless it is headroom_exempt (CI: 0.1)")


HELPERS = ("assert_close", "assert_within", "assert_far", "assert_rounded")


def uses_tolerance(item) -> bool:
    """Whether a test item's own function (or a module-level helper it calls by name) calls a tolerance helper."""
    import inspect

    fn = getattr(item, "function", None)
    if fn is None:
        return False
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return True  # cannot tell: keep it
    if any(h in source for h in HELPERS):
        return True
    module = inspect.getmodule(fn)
    for name, obj in vars(module).items() if module else ():
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and obj is not fn and f"{name}(" in source:
            try:
                if any(h in inspect.getsource(obj) for h in HELPERS):
                    return True
            except (OSError, TypeError):
                return True
    return False


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("float_only"):
        return
    keep = [i for i in items if uses_tolerance(i)]
    dropped = [i for i in items if not uses_tolerance(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_sessionstart(session):
    tolerance.push()


def _worst_per_site(records) -> list[tuple[tolerance.Record, int]]:
    """The highest-ratio record of each (test, call site), with how many comparisons it ran there."""
    worst: dict[tuple, tuple[tolerance.Record, int]] = {}
    for r in records:
        key = (r.test, r.where)
        best, n = worst.get(key, (r, 0))
        worst[key] = (r if r.ratio > best.ratio else best, n + 1)
    return sorted(worst.values(), key=lambda rn: -rn[0].ratio)


def vacuous(sites) -> list[tuple[tolerance.Record, int]]:
    """Sites (worst record, count) whose bound is >= 1/VACUOUS times what they observe: possibly vacuous.
    `far` records are left out (their ratio is allowed / observed: small means a clear difference), and so are
    exact agreements (observed 0: this machine's kernels agreed bit for bit, which says nothing of the bound)."""
    return [(r, n) for r, n in sites if r.kind in ("close", "within") and 0 < r.observed and r.ratio < VACUOUS]


def _offenders(sites, limit):
    return [(r, n) for r, n in sites if r.ratio > limit and not r.exempt]


def pytest_sessionfinish(session, exitstatus):
    sites = _worst_per_site(tolerance.pop())
    session.config.stash[_SITES] = sites
    limit = session.config.getoption("headroom")
    if limit is not None and exitstatus == pytest.ExitCode.OK and _offenders(sites, limit):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _row(r: tolerance.Record, n: int) -> str:
    note = f" EXEMPT: {r.exempt}" if r.exempt else ""
    return (f"{r.ratio:9.3g}  {r.kind:6s} obs {r.observed:9.3g} / allowed {r.allowed:9.3g}  x{n:<4d} "
            f"{r.where}  {r.test}{note}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    limit = config.getoption("headroom")
    sites = config.stash.get(_SITES, [])
    if limit is None or not sites:
        return
    tr = terminalreporter
    guarded = [(r, n) for r, n in sites if not r.exempt]
    tr.write_sep("-", f"tolerance headroom: {len(sites)} comparison sites ({len(guarded)} guarded), tightest guarded "
                      "first (ratio = used / allowed)")
    for r, n in guarded[:SHOW]:
        tr.write_line(_row(r, n))
    loose = vacuous(sites)
    if loose:
        tr.write_sep("-", f"possibly vacuous: {len(loose)} comparison site(s) use less than {VACUOUS:g} of their bound "
                          "(a bound that loose passes on garbage that small; re-derive it tighter)")
        for r, n in loose:
            tr.write_line("loose   " + _row(r, n))
    exempt = [(r, n) for r, n in sites if r.exempt and r.ratio > limit]
    for r, n in exempt:
        tr.write_line("exempt  " + _row(r, n))
    bad = _offenders(sites, limit)
    if bad:
        for r, n in bad:
            tr.write_line(f"TOO TIGHT {_row(r, n)}\n          reason given: {r.reason}", red=True)
        tr.write_sep("=", f"--headroom {limit}: {len(bad)} comparison(s) used more than {limit:g} of their allowed "
                          "error, so this run fails (re-derive the bound, or declare headroom_exempt)",
                     red=True, bold=True)
