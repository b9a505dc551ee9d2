"""Device lint: every torch factory and Generator in kvtransfer/ names its device or says why the CPU is right.

A factory without `device=` makes a CPU tensor; on a GPU run it then meets CUDA tensors and fails. The lint
reads the source (kvtransfer.core.device_audit.lint_package), so it also covers code no CPU test reaches.
"""
from __future__ import annotations

import textwrap

import pytest

from kvtransfer.core.device_audit import PACKAGE, annotated, lint_file, lint_package


def test_every_factory_and_generator_in_the_package_names_a_device_or_is_annotated():
    offenders = lint_package()
    if offenders:
        pytest.fail(f"{len(offenders)} torch factory / Generator call(s) name no device. Pass device=<the device "
                    "of the tensors the result meets>, or, where the CPU is right, end the call's first line with "
                    "`# device: <reason>`:\n" + "\n".join(str(f) for f in offenders), pytrace=False)


def test_the_lint_scans_the_package():
    # a lint that finds no file finds no offender: make sure it reads the modules that hold factories
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert {"maps/controls.py", "core/moments.py", "serve/paged.py"} <= files


def _lint(tmp_path, source: str):
    path = tmp_path / "mod.py"
    path.write_text(textwrap.dedent(source))
    return [(f.line, f.call) for f in lint_file(path)]


def test_the_lint_flags_deviceless_factories_and_generators_and_accepts_a_device_or_an_annotation(tmp_path):
    found = _lint(tmp_path, """\
        import torch
        a = torch.zeros(3)
        b = torch.zeros(3, device=a.device)
        g = torch.Generator().manual_seed(0)
        c = torch.randn(3, generator=g)  # device: seeded CPU draw, moved to the input's device after
        d = torch.tensor([1, 2],
                         dtype=torch.long)
        e = torch.arange(4)  # a comment without the annotation
        f = torch.zeros_like(a)
        h = torch.Generator(device="cpu")
        i = torch.full(
            (2,), 1.0)  # device: on the wrong line (the rule is the call's first line)
        """)
    assert found == [(2, "zeros"), (4, "Generator"), (6, "tensor"), (8, "arange"), (11, "full")]


def test_the_annotation_needs_a_reason():
    assert annotated("x = torch.zeros(3)  # device: host-side row order")
    assert annotated("f = lambda: torch.zeros(3)  # noqa: E731  # device: host-side")
    assert not annotated("x = torch.zeros(3)  # device:")
    assert not annotated("x = torch.zeros(3, device=dev)")
