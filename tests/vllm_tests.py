"""What the slow vLLM tests share (tests/test_serve_vllm.py, test_serve_gate.py, test_proxy_vllm.py): their marks --
slow, and the serving environment only -- and running one experiment script as a subprocess."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVE_ONLY = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run in the serving environment (scripts/setup_serve.sh cpu)")]


def run_script(script: str, *args, timeout: int = 2400, kv_space: bool = True) -> None:
    """Run ROOT/`script` with `args` in this interpreter (cwd ROOT, PYTHONPATH ROOT); kv_space: vLLM's CPU KV cache
    space defaults to 1 GiB (the tiny family needs little). Fails the test with the output's tail on a non-zero exit."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    if kv_space:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def shared_logprobs(a: dict, b: dict) -> tuple[list[float], list[float]]:
    """(a's, b's) first-token logprobs of the candidates both list, in one order."""
    shared = sorted(set(a["first_logprobs"]) & set(b["first_logprobs"]))
    assert shared, "no first-token candidates in common"
    return [a["first_logprobs"][t] for t in shared], [b["first_logprobs"][t] for t in shared]
