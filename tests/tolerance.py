"""The one place a test compares floats with a tolerance (tests/test_tolerance_lint.py forbids any other).

A bound is derived, never picked where one machine happened to land:

- `assert_close`: rounding error. allowed = eps(dtype) x factor x magnitude, where `dtype` is the
  precision the computation ran in (default: the compared tensors' dtype; Python floats are float64),
  `factor` counts what the rounding error grows with (reduction length, layers, a condition number)
  and `magnitude` is the scale of the values compared (default: max |expected|).
- `assert_within`: a bound that is not rounding (a statistical spread, a modelled estimate, a unit
  rounding in the code under test), stated as an absolute `atol` with its derivation.
- `assert_rounded`: a figure the code rounds for display (`round(x, decimals)`) against the exact
  value: half a unit of the last decimal. Exempt from the headroom guard by construction: where the
  exact value falls between two display steps decides the ratio, the same on every machine.
- `assert_far`: the converse, two results that must differ by more than `atol` (a perturbation really
  changed something).

`reason` says why the bound is what it is. Every call records (test, observed error, allowed error) so
tests/headroom_guard.py (`--headroom 0.1`) can fail a run whose comparisons pass with less than 10x
headroom on the machine it runs on: a bound that holds only where it was written is a latent failure.
A comparison that cannot have that headroom says why in `headroom_exempt`.

Exact results (same kernels on the same shapes, integer arithmetic) are compared with `==` /
`torch.equal`, not here.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

__all__ = ["FORWARD", "Record", "assert_close", "assert_far", "assert_rounded", "assert_within", "eps", "forward_factor", "records"]


@dataclass(frozen=True)
class Record:
    """One comparison: ratio = observed / allowed (assert_far: allowed / observed), so lower is safer."""

    test: str
    where: str
    kind: str
    observed: float
    allowed: float
    reason: str
    exempt: str | None

    @property
    def ratio(self) -> float:
        num, den = (self.allowed, self.observed) if self.kind == "far" else (self.observed, self.allowed)
        if num == 0:
            return 0.0
        return math.inf if den == 0 else num / den


_STACK: list[list[Record]] = [[]]  # one list per pytest session (pytester runs nest sessions)


def push() -> None:
    """Start recording for a (possibly nested) pytest session."""
    _STACK.append([])


def pop() -> list[Record]:
    """End the innermost session's recording and return its records."""
    return _STACK.pop() if len(_STACK) > 1 else _STACK[0]


def records() -> list[Record]:
    """The current session's records so far."""
    return list(_STACK[-1])


def eps(dtype) -> float:
    """Machine epsilon of a torch floating dtype, or of `float` (float64)."""
    return torch.finfo(torch.float64 if dtype is float else dtype).eps


FORWARD = ("float32 forward of a transformer (forward_factor): first-order worst case, eps x the sum of the "
           "reduction lengths a value passes through, relative to the compared values' scale; it bounds each "
           "path's error against exact arithmetic, so also two float32 paths that batch, split or order the "
           "work differently (bit-identical on one CPU, not on another)")


def forward_factor(model, seq: int) -> int:
    """Sum of the reduction lengths one output of `model` passes through over `seq` positions: per layer
    the q/k/v projections and the MLP up (hidden each), QK^T (head_dim), softmax x V (seq), o_proj
    (heads x head_dim) and MLP down (intermediate); then the LM head (hidden). A length-n dot product
    errs by at most ~n eps relative (Higham); to first order these add along the chain (see FORWARD)."""
    c = getattr(model, "config", model)
    c = getattr(c, "text_config", None) or c
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_layer = 2 * c.hidden_size + head_dim + seq + c.num_attention_heads * head_dim + c.intermediate_size
    return c.num_hidden_layers * per_layer + c.hidden_size


def _tensor(x) -> torch.Tensor:
    """x as a tensor; a Python number is float64 (torch would make it float32 and round it)."""
    if isinstance(x, bool):
        raise TypeError("compare bools with ==")
    return torch.as_tensor(x, dtype=torch.float64) if isinstance(x, (int, float)) else torch.as_tensor(x)


def _as_tensors(actual, expected):
    a, e = _tensor(actual), _tensor(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: actual {tuple(a.shape)} vs expected {tuple(e.shape)}")
    for t in (a, e):
        if not (t.is_floating_point() or t.dtype in (torch.int64, torch.int32)):
            raise TypeError(f"compare floats here, not {t.dtype} (use == / torch.equal for exact values)")
    return a.detach().cpu(), e.detach().cpu()


def _max_error(a: torch.Tensor, e: torch.Tensor) -> float:
    """max |a - e| in float64 over finite entries; non-finite entries must match exactly."""
    a64, e64 = a.double(), e.double()
    fa, fe = torch.isfinite(a64), torch.isfinite(e64)
    if not torch.equal(fa, fe) or not torch.equal(a64[~fa], e64[~fe]):
        return math.inf  # a NaN/inf where the other has a number (or a different non-finite value)
    return float((a64[fa] - e64[fe]).abs().max()) if fa.any() else 0.0


def _caller() -> str:
    frame = sys._getframe(3)  # _caller <- _record <- assert_* <- the test
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _record(kind, observed, allowed, reason, exempt) -> Record:
    """The comparison's record; kept for the guard by _keep once it passed (a failure fails its test)."""
    if not reason or not reason.strip():
        raise ValueError("state the derivation of the bound in reason=")
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    return Record(test, _caller(), kind, observed, allowed, reason, exempt)


def _keep(rec: Record) -> Record:
    _STACK[-1].append(rec)
    return rec


def assert_close(actual, expected, *, factor: float, reason: str, dtype=None, magnitude: float | None = None,
                 headroom_exempt: str | None = None) -> Record:
    """Assert max |actual - expected| <= eps(dtype) x factor x magnitude (rounding error).

    actual, expected: tensors (same shape) or Python numbers. dtype: the precision the compared
    computation ran in (default: the lower precision of the two; Python floats are float64).
    factor: how many eps of relative error the computation may accumulate, derived in `reason`.
    magnitude: the scale the error is relative to (default max |expected|; required when that is 0).
    """
    a, e = _as_tensors(actual, expected)
    if dtype is None:
        floats = [t.dtype for t in (a, e) if t.is_floating_point()] or [torch.float64]
        dtype = min(floats, key=lambda d: torch.finfo(d).bits)
    if magnitude is None:
        finite = e.double()[torch.isfinite(e.double())]
        magnitude = float(finite.abs().max()) if finite.numel() else 0.0
        if magnitude == 0:
            raise ValueError("expected is all zero: pass magnitude= (the scale of the values the computation "
                             "went through)")
    allowed = eps(dtype) * factor * magnitude
    rec = _record("close", _max_error(a, e), allowed, reason, headroom_exempt)
    assert rec.observed <= allowed, (f"max |actual - expected| = {rec.observed:.3g} > allowed {allowed:.3g} "
                                     f"(eps({dtype}) x {factor} x {magnitude:.3g}): {reason}")
    return _keep(rec)


def assert_within(actual, expected, *, atol: float, reason: str, headroom_exempt: str | None = None) -> Record:
    """Assert max |actual - expected| <= atol, for a bound that is not rounding (derive it in `reason`)."""
    a, e = _as_tensors(actual, expected)
    rec = _record("within", _max_error(a, e), float(atol), reason, headroom_exempt)
    assert rec.observed <= atol, f"max |actual - expected| = {rec.observed:.3g} > atol {atol:.3g}: {reason}"
    return _keep(rec)


def assert_rounded(reported, exact, *, decimals: int, reason: str) -> Record:
    """Assert |reported - exact| <= half a unit of the `decimals`-th decimal (+ 4 eps64 of |exact| for the
    float64 arithmetic forming it): `reported` is `round(exact, decimals)` up to that arithmetic."""
    a, e = _as_tensors(reported, exact)
    allowed = 0.5 * 10.0 ** -decimals + 4 * eps(torch.float64) * float(e.double().abs().max())
    rec = _record("rounded", _max_error(a, e), allowed, reason,
                  "display rounding: the error is where the exact value falls between two steps, not machine-dependent")
    assert rec.observed <= allowed, (f"|reported - exact| = {rec.observed:.3g} > half a unit of decimal {decimals}: "
                                     f"{reason}")
    return _keep(rec)


def assert_far(actual, other, *, atol: float, reason: str, headroom_exempt: str | None = None) -> Record:
    """Assert max |actual - other| > atol: the two really differ (e.g. a change had an effect). Both must be
    finite: a NaN or inf is no evidence of an effect (it would read as an infinite difference)."""
    a, e = _as_tensors(actual, other)
    for name, t in (("actual", a), ("other", e)):
        bad = int((~torch.isfinite(t.double())).sum())
        if bad:
            raise AssertionError(f"assert_far: {name} holds {bad} non-finite value(s), so the difference proves "
                                 f"nothing: {reason}")
    rec = _record("far", _max_error(a, e), float(atol), reason, headroom_exempt)
    assert rec.observed > atol, f"max |actual - other| = {rec.observed:.3g} <= {atol:.3g}: {reason}"
    return _keep(rec)
