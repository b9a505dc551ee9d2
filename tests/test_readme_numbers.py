"""Every number in a README's generated block is what its collect script makes from the committed summaries.

Each block (`<!-- BEGIN generated:NAME -->` ... `<!-- END generated:NAME -->`, kvtransfer.report.readme) is
regenerated here from results/*/ and compared with the README text; a typed edit inside a block, a summary
changed without re-collecting, or a block no script writes fails. Reads JSON only (no model, no timing)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvtransfer.report import readme

ROOT = Path(__file__).resolve().parents[1]


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_").removesuffix(".py"), ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _qwen25coder() -> dict[Path, dict[str, str]]:
    c = _module("experiments/qwen25coder/collect.py")
    runs = c.load_runs(ROOT / "results/qwen25coder/runs")
    return {ROOT / "results/qwen25coder/README.md": c.readme_blocks(runs, ROOT / "results/qwen25coder"),
            ROOT / "README.md": c.top_readme_blocks(runs)}


def _maps() -> dict[Path, dict[str, str]]:
    c = _module("experiments/maps/collect.py")
    args = c.parse_args(["--no-timing"])  # the CPU times an earlier collect measured (maps.json)
    data = c.build(args)
    return {ROOT / "results/maps/README.md": c.readme_blocks(data, c.load_all(args)),
            ROOT / "README.md": c.top_readme_blocks(data)}


def _tiny() -> dict[Path, dict[str, str]]:
    c = _module("experiments/tiny/collect.py")
    s = c.load(ROOT / "results/tiny")
    return {ROOT / "results/tiny/README.md": c.blocks(s), ROOT / "README.md": c.top_blocks(s)}


def _bench_cpu() -> dict[Path, dict[str, str]]:
    c = _module("experiments/bench_cpu/collect.py")
    return {ROOT / "results/bench_cpu/README.md": c.blocks(c.load(ROOT / "results/bench_cpu"))}


def _serve() -> dict[Path, dict[str, str]]:
    c = _module("experiments/serve/collect.py")
    return {ROOT / "results/serve/README.md": c.blocks(ROOT / "results/serve")}


def _maps_trained() -> dict[Path, dict[str, str]]:
    c = _module("experiments/maps_trained/collect.py")
    data, blocks = c.collect(ROOT / "results/maps_trained")
    return {ROOT / "results/maps_trained/README.md": blocks, ROOT / "README.md": {"maps_trained_headline": data["top"]}}


def _plan() -> dict[Path, dict[str, str]]:
    c = _module("results/plan/figure.py")
    return {ROOT / "results/plan/README.md": {"key_numbers": c.key_numbers(c.load_plans())}}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[Path, dict[str, str]]:
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)  # the collect scripts' default paths are relative to the repository root
    try:
        out: dict[Path, dict[str, str]] = {}
        for make in (_qwen25coder, _maps, _tiny, _bench_cpu, _serve, _maps_trained, _plan):
            for path, blocks in make().items():
                out.setdefault(path, {}).update(blocks)
        return out
    finally:
        os.chdir(cwd)


def test_every_generated_block_matches_its_summaries(generated):
    for path, want in generated.items():
        have = readme.blocks(path.read_text())
        for name, body in want.items():
            assert name in have, f"{path.relative_to(ROOT)} lacks the generated block {name!r}"
            assert have[name] == body.rstrip("\n") + "\n", (
                f"{path.relative_to(ROOT)} block {name!r} is not what its collect script makes from the summaries: "
                "rerun the collect script (never edit inside a generated block)")


def test_no_orphan_blocks_and_numbers_present(generated):
    """Every generated block of a README is written by some script, and each holds numbers (a table or a line)."""
    for path in [ROOT / "README.md", *sorted(ROOT.glob("results/*/README.md"))]:
        for name, body in readme.blocks(path.read_text()).items():
            assert name in generated.get(path, {}), f"{path.relative_to(ROOT)}: no script writes block {name!r}"
            assert re.search(r"\d", body), f"{path.relative_to(ROOT)}: block {name!r} is empty"


def test_replace_blocks_rewrites_only_the_named_block():
    text = "a\n<!-- BEGIN generated:x -->\nold 1\n<!-- END generated:x -->\nb\n<!-- BEGIN generated:y -->\nkeep 2\n<!-- END generated:y -->\n"
    new = readme.replace_blocks(text, {"x": "new 3"})
    assert readme.blocks(new) == {"x": "new 3\n", "y": "keep 2\n"} and new.startswith("a\n") and "\nb\n" in new
    with pytest.raises(ValueError, match="no generated block"):
        readme.replace_blocks(text, {"z": "1"})
