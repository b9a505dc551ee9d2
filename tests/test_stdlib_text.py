"""experiments/data/python_stdlib.py on a made-up Lib/ directory: the evaluation set takes top-level modules of at
least MIN_CHARS characters; the calibration text (`--packages`) takes modules inside packages, never a top-level one,
never a test, and the two are disjoint by construction."""
from __future__ import annotations

import json

import pytest

from scripts import load_script

stdlib = load_script("experiments/data/python_stdlib.py")


@pytest.fixture()
def lib(tmp_path):
    big, small = "x = 1\n" * 2_000, "y = 2\n" * 10
    (tmp_path / "argparse.py").write_text(big)             # evaluation: top-level, long
    (tmp_path / "tiny.py").write_text(small)               # neither: top-level, short
    for rel in ("email/parser.py", "email/mime/text.py", "test/test_x.py", "idlelib/idle_test/t.py",
                "site-packages/pkg/mod.py", "json/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(big if rel != "json/__init__.py" else small)
    return tmp_path


def test_evaluation_and_calibration_text_are_disjoint(lib, tmp_path_factory):
    assert [r["module"] for r in stdlib.records(lib)] == ["argparse"]
    calib = stdlib.package_records(lib)
    assert [r["module"] for r in calib] == ["email.mime.text", "email.parser"]   # path order; no tests, no short ones
    assert all(len(r["text"]) == r["chars"] for r in calib)                      # whole files
    out = tmp_path_factory.mktemp("out") / "calib.jsonl"
    stdlib.main(["--packages", str(lib), str(out)])
    assert [json.loads(line)["module"] for line in out.read_text().splitlines()] == ["email.mime.text", "email.parser"]
    with pytest.raises(FileExistsError):
        stdlib.main(["--packages", str(lib), str(out)])
