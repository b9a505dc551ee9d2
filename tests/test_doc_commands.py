"""The commands a user pastes from README.md and docs/: every command of a ```bash block is classified, and each class is
checked as far as a CPU test can:

- run: executed as typed (cheap: the resource plan, --help, collect --check), from a scratch working directory;
- compose: `python run.py ...` too long to run here -- its overrides are composed into the run's config (a sweep
  into every point of it), and each point is checked against what the run would refuse first (k beyond the
  source's layers, an unknown launcher);
- parse: a CLI too long to run here -- its arguments are parsed by that CLI's own parser;
- not run: with the reason (GPUs, a vLLM server, hours, an install); the reasons are part of the test.

An unclassified command fails the test, so a new command in the docs says how it is checked.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest

from run_configs import compose_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (pattern on the command, how it is checked, why) -- first match wins
RULES = [
    (r"^python -m kvtransfer\.plan ", "run", "seconds: the plan reads model configs only"),
    (r"^python (experiments/\S+/collect\.py) --check", "run", "compares README blocks with the committed runs"),
    (r"^(pip|python -m pip) install", "not run", "installs packages (.ci/run and tests/test_packaging.py cover it)"),
    (r"^python -m pytest", "not run", "the test suite itself"),
    (r"^(KVT_\w+=\S+ )*python -m pytest", "not run", "the test suite itself (needs the real pair's models)"),
    (r"^(bash )?scripts/setup_serve\.sh", "not run", "builds the vLLM serving environment (~5 GB, minutes)"),
    (r"^(bash )?scripts/wheelhouse\.sh", "not run", "downloads ~200 MB of wheels from PyPI (tests/test_wheelhouse.py, "
                                                 "slow, runs it)"),
    (r"^bash experiments/qwen25coder/get_models\.sh", "not run", "downloads ~1.8 GB of models and text"),
    (r"^bash experiments/\S+/run\.sh", "not run", "the real-pair runs: hours on a CPU"),
    (r"^python experiments/gpu_bench\.py", "not run", "needs a GPU"),
    (r"^(PYTHONUNBUFFERED=1 )?python3? experiments/gpu_check\.py", "not run", "needs a GPU (the device check)"),
    (r"^python3? results/plan/make\.py", "not run", "rewrites results/plan; tests/test_results_plan.py reruns it"),
    (r"^python3? results/precision/make\.py", "not run", "calibrates twice: minutes (tiny) to hours (real pair)"),
    (r"^python3? experiments/\S+/collect\.py", "not run", "rewrites a results README from committed runs "
                                                        "(tests/test_readme_numbers.py checks the blocks)"),
    (r"^python -m kvtransfer\.bench ", "parse", "minutes of CPU at full depth (tests/test_bench.py runs small shapes)"),
    (r"^python -m kvtransfer\.serve\.proxy ", "parse", "needs two running vLLM servers (tests/test_proxy.py fakes them)"),
    (r"^(\.venv-serve/bin/)?python -m kvtransfer\.serve\.launch ", "parse",
     "starts two vLLM servers and the proxy (tests/test_serve_launch.py checks the commands it starts)"),
    (r"^python -m kvtransfer\.eval ", "not run", "lm-eval through the map: minutes (tests/test_eval_cli.py runs it)"),
    (r"^(python -m vllm\.|vllm serve )", "not run", "a vLLM server: the serving environment (docs/serving.md)"),
    (r"^[A-Z_]+=(?!.*\b(python|vllm|bash)\b)", "not run", "sets shell variables for the commands after it"),
    (r"^python run\.py", "compose", "a run: minutes on the tiny pair, GPUs for a paper pair (tests/test_runner.py "
                                   "runs the tiny pipeline)"),
]


WORDS: dict[str, list[str]] = {}   # a command as shown -> its words as the shell splits them


def fenced_commands(path: Path) -> list[str]:
    """The commands of the ```bash / ```sh blocks of `path`: continuation lines joined, a command spanning lines
    inside quotes kept whole, comments and blank lines dropped, `&` / trailing comments removed."""
    out = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", path.read_text(), re.S | re.M):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:   # an open quote: the command goes on
                continue
            pending = ""
            words = [w for w in words if w != "&"]
            if words:
                out.append(" ".join(words))
                WORDS[out[-1]] = words
    return out


def classify(command: str) -> tuple[str, str]:
    for pattern, how, why in RULES:
        if re.search(pattern, command):
            return how, why
    raise AssertionError(f"no rule says how to check {command!r}: add one to RULES in {__file__}")


def all_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in fenced_commands(p)]


def _sweep(overrides: list[str]) -> list[list[str]]:
    """A multirun's points: `a=1,2 b=x` -> [[a=1, b=x], [a=2, b=x]] (commas inside brackets or braces do not split)."""
    choices = []
    for o in overrides:
        key, _, value = o.partition("=")
        parts, depth, cur = [], 0, ""
        for ch in value:
            depth += ch in "[{(" and 1 or (ch in "]})" and -1 or 0)
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        choices.append([f"{key}={v}" for v in parts])
    return [list(p) for p in product(*choices)]


def _source_layers(cfg: dict) -> int | None:
    path = (cfg.get("pair") or {}).get("source", {}).get("path")
    if path and (ROOT / path / "config.json").is_file():
        return json.loads((ROOT / path / "config.json").read_text())["num_hidden_layers"]
    return (cfg.get("pair") or {}).get("source", {}).get("layers")


def check_compose(command: str) -> int:
    """Compose every point of a `python run.py` command; return how many were checked."""
    words = WORDS.get(command, command.split())[2:]
    multirun = "-m" in words or "--multirun" in words
    overrides = [w for w in words if w not in ("-m", "--multirun")]
    for w in overrides:
        if w.startswith("hydra/launcher="):
            name = w.split("=", 1)[1]
            assert (ROOT / "conf" / "hydra" / "launcher" / f"{name}.yaml").is_file(), f"no launcher {name!r}"
    plain = [o for o in overrides if not o.startswith(("hydra/", "hydra."))]
    points = _sweep(plain) if multirun else [plain]
    assert multirun or len(points) == 1
    for point in points:
        cfg = compose_config(*point)
        k, layers = (cfg.get("mapper") or {}).get("k"), _source_layers(cfg)
        if isinstance(k, int) and layers:
            assert 1 <= k <= layers, f"{command!r}: mapper.k={k} but the pair's source has {layers} layers"
    return len(points)


COMMANDS = all_commands()


def test_the_docs_have_commands_and_every_one_is_classified():
    assert len(COMMANDS) > 40
    seen = {classify(c)[0] for _, c in COMMANDS}
    assert {"run", "compose", "parse", "not run"} <= seen


def test_the_extraction_joins_continuations_and_quoted_lines(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("```bash\npython run.py a=1 \\\n  b=2   # note\nX=1 Y=2\npython -m x --c '{\"a\":\n 1}' &\n```\n"
                   "```\nnot a command\n```\n")
    assert fenced_commands(doc) == ["python run.py a=1 b=2", "X=1 Y=2", 'python -m x --c {"a":\n 1}']
    assert WORDS['python -m x --c {"a":\n 1}'] == ["python", "-m", "x", "--c", '{"a":\n 1}']


def test_a_sweep_beyond_the_tiny_sources_layers_is_caught():
    """The old README's `python run.py -m mapper.k=1,2,4,8` ran on the tiny pair (4 source layers): its k = 8 job
    failed. The compose check says so before anything runs."""
    assert check_compose("python run.py -m mapper.k=1,2,4") == 3
    with pytest.raises(AssertionError, match="mapper.k=8 but the pair's source has 4 layers"):
        check_compose("python run.py -m mapper.k=1,2,4,8")


@pytest.mark.parametrize("where,command", [c for c in COMMANDS if classify(c[1])[0] == "compose"],
                         ids=lambda x: x[:60] if isinstance(x, str) else x)
def test_run_commands_compose(where, command):
    assert check_compose(command) >= 1


@pytest.mark.parametrize("where,command", [c for c in COMMANDS if classify(c[1])[0] == "parse"],
                         ids=lambda x: x[:60] if isinstance(x, str) else x)
def test_cli_commands_parse(where, command):
    words = WORDS[command]
    module, args = words[2], words[3:]
    if module == "kvtransfer.bench":
        from kvtransfer.bench.cli import parser
        from kvtransfer.bench.shapes import PAIRS

        parsed = parser().parse_args(args)
        assert set(parsed.pair.split(",")) <= set(PAIRS), command
        assert all(t.rstrip("kK").isdigit() for t in parsed.tokens.split(",")), command
    elif module == "kvtransfer.serve.launch":
        from kvtransfer.serve import launch

        cmds = launch.commands(launch.parser().parse_args(args))   # the three command lines it would start
        assert set(cmds) == {"source", "target", "proxy"}, command
    elif module == "kvtransfer.serve.proxy":
        from kvtransfer.serve import proxy

        with pytest.raises(SystemExit) as done:   # --help after the command's own arguments: they parse first
            proxy.main([*args, "--help"])
        assert done.value.code == 0
    else:
        raise AssertionError(f"no parser for {module}")


@pytest.mark.parametrize("where,command", [c for c in COMMANDS if classify(c[1])[0] == "run"],
                         ids=lambda x: x[:60] if isinstance(x, str) else x)
def test_cheap_commands_run_as_typed(where, command, tmp_path):
    words = WORDS[command]
    if words[:2] == ["python", "-m"]:
        argv, cwd = [sys.executable, *words[1:]], tmp_path   # a scratch working directory: outputs land there
    else:
        argv, cwd = [sys.executable, *words[1:]], ROOT
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
