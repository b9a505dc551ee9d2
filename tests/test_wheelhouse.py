"""scripts/wheelhouse.sh: the wheels an offline GPU node needs beside its CUDA torch image (slow: each build downloads
~200 MB from PyPI; `python -m pytest -m slow tests/test_wheelhouse.py`).

(a) the set is complete for another Python: a dry-run resolve for Python 3.12 of the project's declared requirements
    and torch, with no index, from the wheelhouse and a model of the image (a metadata-only torch wheel -- the image's
    torch is a CUDA build for 3.12 that pip need not read -- and the image's other packages at the versions the
    script left to it, image-has.txt);
(b) the set installs: a fresh Python 3.11 venv with torch (from this machine's configured wheels) and the image's
    packages, then `pip install --no-index --find-links DIR -e '.[dev]'`, then `import kvtransfer.runner, lm_eval`.
Both ignore this machine's pip configuration for the wheelhouse step (PIP_CONFIG_FILE=/dev/null): nothing but the
wheelhouse and the image can satisfy a requirement.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "wheelhouse.sh"
ISOLATED = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
TORCH = "2.13.0"


def _run(cmd, env=None, timeout=1800, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _requirements() -> list[str]:
    """What `pip install -e '.[dev]'` asks for: pyproject's dependencies and its dev extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def _torch_stub(directory: Path) -> Path:
    """A metadata-only torch wheel standing in for the image's (the image has torch installed, so pip never reads it)."""
    directory.mkdir(parents=True, exist_ok=True)
    version = f"{TORCH}+image"
    info = f"torch-{version}.dist-info"
    path = directory / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def wheelhouses(tmp_path_factory):
    """{python version: wheelhouse} built by the script, once per version."""
    built = {}

    def build(pyver: str) -> Path:
        if pyver not in built:
            out = tmp_path_factory.mktemp(f"wheelhouse{pyver}") / "wheels"
            _run(["bash", str(SCRIPT), pyver, str(out)])
            built[pyver] = out
        return built[pyver]
    return build


def _names(directory: Path) -> set[str]:
    return {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in directory.glob("*.whl")}


@pytest.mark.slow
def test_the_script_refuses_bad_arguments(tmp_path):
    for args, message in (([], "usage"), (["312", str(tmp_path)], "major.minor")):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.slow
def test_the_wheelhouse_resolves_the_project_for_python_312_offline(wheelhouses, tmp_path):
    """(a): `pip install --dry-run --only-binary=:all: --python-version 3.12 --no-index --find-links DIR ...`."""
    wheels = wheelhouses("3.12")
    names = _names(wheels)
    assert {"lm-eval", "datasets", "hydra-core", "transformers", "sqlitedict", "word2number",
            "antlr4-python3-runtime"} <= names
    assert not names & {"torch", "triton", "numpy", "jinja2", "filelock", "fsspec", "networkx", "sympy",
                        "typing-extensions"} and not any(n.startswith("nvidia-") for n in names)
    image = tmp_path / "image"
    _torch_stub(image)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
          "3.12", "--dest", str(image), "-r", str(wheels / "image-has.txt")])
    report = tmp_path / "report.json"
    # a current pip (in its own venv): pip 23 checks the resolved set against the running Python, not 3.12
    pip_venv = tmp_path / "pip"
    _run([sys.executable, "-m", "venv", str(pip_venv)])
    _run([str(pip_venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--upgrade", "pip>=24"])
    _run([str(pip_venv / "bin" / "python"), "-m", "pip", "install", "--dry-run", "--ignore-installed",
          "--only-binary=:all:", "--python-version", "3.12", "--no-index", "--find-links", str(wheels),
          "--find-links", str(image), "--report", str(report), *_requirements(), f"torch=={TORCH}+image"],
         env=ISOLATED)
    got = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
           for item in json.loads(report.read_text())["install"]}
    pins = dict(line.split("==") for line in (wheels / "requirements.txt").read_text().split())
    for name in ("transformers", "lm-eval", "hydra-core", "antlr4-python3-runtime", "typepy", "chardet"):
        assert got[name] == pins[name], name  # what the node installs is what the wheelhouse holds
    major, minor = (int(x) for x in got["transformers"].split(".")[:2])
    assert (major, minor) >= (5, 24) and got["antlr4-python3-runtime"] == "4.9.3"
    assert int(got["typepy"].split(".")[0]) < 2 and int(got["chardet"].split(".")[0]) < 7


@pytest.mark.slow
def test_the_wheelhouse_installs_into_a_fresh_311_venv_with_torch(wheelhouses, tmp_path):
    """(b): a fresh venv with torch and the image's packages, then the project from the wheelhouse alone."""
    wheels = wheelhouses("3.11")
    venv = tmp_path / "node"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    # the image: torch (this machine's configured wheels, as CI installs it) and what image-has.txt leaves to it
    _run([*pip, "install", "--quiet", f"torch=={TORCH}", "-r", str(wheels / "image-has.txt")])
    _run([*pip, "install", "--quiet", "--no-index", "--find-links", str(wheels), "-e", f"{ROOT}[dev]"], env=ISOLATED)
    proc = _run([str(venv / "bin" / "python"), "-c",
                 "import kvtransfer, kvtransfer.runner, lm_eval, hydra, transformers; "
                 "print(kvtransfer.__file__, transformers.__version__)"], cwd=tmp_path)
    assert str(ROOT) in proc.stdout
