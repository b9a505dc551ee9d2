"""Every number in a README's generated block is what its collect script makes from the committed summaries.

Each block (`<!-- BEGIN generated:NAME -->` ... `<!-- END generated:NAME -->`, kvtransfer.report.readme) is
regenerated here from results/*/ and compared with the README text; a typed edit inside a block, a summary
changed without re-collecting, or a block no script writes fails. Reads JSON only (no model, no timing)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtransfer.report import readme
from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _module(rel: str):
    return load_script(rel)


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
    c = _module("results/plan/make.py")
    return c.doc_blocks(c.load_plans())


def _handoff() -> dict[Path, dict[str, str]]:
    c = _module("experiments/handoff/collect.py")
    return {ROOT / "results/handoff/README.md": c.readme_blocks()}


def _baselines() -> dict[Path, dict[str, str]]:
    c = _module("experiments/baselines/collect.py")
    body, top, _ = c.blocks(c.load_runs(ROOT / "results/baselines/runs"))
    return {ROOT / "results/baselines/README.md": body, ROOT / "README.md": top}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[Path, dict[str, str]]:
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)  # the collect scripts' default paths are relative to the repository root
    try:
        out: dict[Path, dict[str, str]] = {}
        for make in (_qwen25coder, _maps, _tiny, _bench_cpu, _serve, _maps_trained, _plan, _handoff, _baselines):
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
    for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("results/*/README.md"))]:
        for name, body in readme.blocks(path.read_text()).items():
            assert name in generated.get(path, {}), f"{path.relative_to(ROOT)}: no script writes block {name!r}"
            assert re.search(r"\d", body), f"{path.relative_to(ROOT)}: block {name!r} is empty"


def test_replace_blocks_rewrites_only_the_named_block():
    text = "a\n<!-- BEGIN generated:x -->\nold 1\n<!-- END generated:x -->\nb\n<!-- BEGIN generated:y -->\nkeep 2\n<!-- END generated:y -->\n"
    new = readme.replace_blocks(text, {"x": "new 3"})
    assert readme.blocks(new) == {"x": "new 3\n", "y": "keep 2\n"} and new.startswith("a\n") and "\nb\n" in new
    with pytest.raises(ValueError, match="no generated block"):
        readme.replace_blocks(text, {"z": "1"})


def test_the_r2_split_is_exact_and_puts_a_planted_shift_where_it_belongs():
    """experiments/maps_trained/r2_offset.py: centred SSE + shared-shift term = the SSE R² reports, and a map off by
    a constant vector c has all of that offset (n c², nothing else) in the shift term."""
    import torch
    from tolerance import assert_close

    r2_offset = _module("experiments/maps_trained/r2_offset.py")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g, dtype=torch.float64) + 3.0   # features with a mean, as keys have
    w, b = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    noise = 0.1 * torch.randn(256, 4, generator=g, dtype=torch.float64)
    y = x @ w + b + noise
    c = torch.tensor([2.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    exact, shifted = r2_offset.split_sse(x, y, w, b), r2_offset.split_sse(x, y, w, b - c)
    # the map off by c: the same centred residual; the shift term is n (mean noise + c)^2 per column
    assert torch.equal(exact["sst"], shifted["sst"])
    assert_close(shifted["centred"], exact["centred"], dtype=torch.float64, factor=256, magnitude=float(noise.pow(2).sum()),
                 reason="the same centred residual summed over 256 rows: fp64 rounding")
    assert_close(shifted["shift"], 256 * (noise.mean(0) + c) ** 2, dtype=torch.float64, factor=256, magnitude=256 * 5.0,
                 reason="n (mean r)^2 with mean r summed over 256 rows: fp64 rounding")
    full = ((y - (x @ w + b - c)) ** 2).sum(0)
    assert_close(shifted["centred"] + shifted["shift"], full, dtype=torch.float64, factor=256, magnitude=float(full.max()),
                 reason="sum of squares = centred + n mean², exact up to fp64 rounding over 256 rows")
    r2 = r2_offset.per_head_r2(shifted["centred"] + shifted["shift"], shifted["sst"], 2)
    assert r2.shape == (2,) and bool((r2 < r2_offset.per_head_r2(shifted["centred"], shifted["sst"], 2)).all())
