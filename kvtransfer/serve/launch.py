"""One command for a handoff deployment: the source engine, the target engine and the proxy, started and checked.

    python -m kvtransfer.serve.launch --source MODEL --target MODEL --mapper MAPPER_DIR [--store DIR] [--port 8000]

starts, on this host,
  * the source as a vLLM OpenAI server with kvtransfer's connector as `kv_producer` (prefix caching on: each
    turn computes and stores only its new blocks),
  * the target as a vLLM OpenAI server with the connector as `kv_consumer` (the mapper, the source model, prefix
    caching on: a handed-over session's later turns are its own cache hits; `--enable-prompt-tokens-details`),
  * the proxy (`kvtransfer.serve.proxy`) in front of both, its start ids read from the mapper,
waits until all three answer `/health`, prints an OpenAI-SDK client that works against the proxy, and stays in
the foreground until interrupted (then stops all three). Logs go to <store>/logs/. A mapper directory that does
not exist is refused with the command that fits one. Ports: the proxy's `--port`, the engines' the next two.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CONNECTOR = {"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
             "kv_load_failure_policy": "recompute"}


def kv_transfer_config(role: str, store: Path, **extra) -> str:
    """The --kv-transfer-config JSON of kvtransfer's connector for `role` (kv_producer | kv_consumer)."""
    return json.dumps({**CONNECTOR, "kv_role": role,
                       "kv_connector_extra_config": {"store": str(store), **{k: str(v) for k, v in extra.items()}}})


def engine_command(model: str, port: int, name: str, kv_config: str | None, *, dtype: str, max_model_len: int,
                   python: str = sys.executable) -> list[str]:
    """argv of a vLLM OpenAI server for one side of the handoff (eager; prefix caching and prompt token details on)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(max_model_len)]
    return cmd + (["--kv-transfer-config", kv_config] if kv_config else [])


def commands(args: argparse.Namespace, python: str = sys.executable) -> dict[str, list[str]]:
    """{"source", "target", "proxy"}: the three argvs `main` starts (a pure function of the parsed arguments)."""
    store = Path(args.store).resolve()
    mapper = Path(args.mapper).resolve()
    src_port, tgt_port = args.port + 1, args.port + 2
    return {
        "source": engine_command(args.source, src_port, args.source_name,
                                 kv_transfer_config("kv_producer", store, store_retention_s=args.retention_s),
                                 dtype=args.dtype, max_model_len=args.max_model_len, python=python),
        "target": engine_command(args.target, tgt_port, args.target_name,
                                 kv_transfer_config("kv_consumer", store, mapper=mapper,
                                                    source_model=Path(args.source).resolve()
                                                    if Path(args.source).exists() else args.source,
                                                    stats=store / "consumer_stats.json"),
                                 dtype=args.dtype, max_model_len=args.max_model_len, python=python),
        "proxy": [python, "-m", "kvtransfer.serve.proxy", "--source", f"http://127.0.0.1:{src_port}",
                  "--target", f"http://127.0.0.1:{tgt_port}", "--source-model", args.source_name,
                  "--target-model", args.target_name, "--mapper", str(mapper), "--store", str(store),
                  "--host", args.host, "--port", str(args.port)],
    }


def client_snippet(host: str, port: int, source_name: str, target_name: str) -> str:
    """A Python client (OpenAI SDK) that runs a session on the source and hands it to the target."""
    return f'''from openai import OpenAI

client = OpenAI(base_url="http://{host}:{port}/v1", api_key="my-key")  # the key binds the session to you
session = {{"X-KVTransfer-Session": "demo-1"}}
messages = [{{"role": "user", "content": "Here is a long document: ... What is it about?"}}]
first = client.chat.completions.create(model="{source_name}", messages=messages, max_tokens=64,
                                       extra_headers=session)
messages += [{{"role": "assistant", "content": first.choices[0].message.content}},
             {{"role": "user", "content": "Now answer in more depth."}}]
second = client.chat.completions.create(model="{target_name}", messages=messages, max_tokens=64,
                                        extra_headers=session)
print(second.choices[0].message.content)
print(second.model_extra["kvtransfer"]["summary"])  # e.g. "mapped 1024 tokens, prefilled 41"
'''


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvtransfer.serve.launch", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="the source model (a directory or a hub id)")
    p.add_argument("--target", required=True, help="the target model (a directory or a hub id)")
    p.add_argument("--mapper", required=True, help="the fitted mapper directory (source -> target)")
    p.add_argument("--store", default="kvstore", help="the KV store directory (default ./kvstore)")
    p.add_argument("--dtype", default="float32", help="both engines' dtype (float32 on CPU; bfloat16 on GPUs)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-space-gb", type=float, default=2.0, help="vLLM's CPU KV cache space per engine (GiB)")
    p.add_argument("--retention-s", type=float, default=7 * 24 * 3600,
                   help="stored blocks unused this long are removed (default 7 days)")
    p.add_argument("--source-name", default="source-model")
    p.add_argument("--target-name", default="target-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port; the engines take the next two")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the engines to start")
    return p


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    """Return once `url`/health answers 200; RuntimeError if `proc` exits first, TimeoutError at `deadline`
    (time.time() seconds)."""
    import httpx

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode} (see its log)")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer /health in time")


def main(argv: list[str] | None = None) -> None:
    """Command line: start the three processes, wait for them, print the client, run until interrupted."""
    args = parser().parse_args(argv)
    if not (Path(args.mapper) / "mapper.json").is_file():
        raise SystemExit(f"{args.mapper} holds no fitted mapper. Fit one first, e.g. "
                         f"`python run.py pair=<pair> stage=[calibrate,fit]` (docs/running.md), then pass the "
                         f"mapper directory it reports")
    store = Path(args.store)
    (store / "logs").mkdir(parents=True, exist_ok=True)
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gb)}
    procs = {}
    try:
        for name, cmd in commands(args).items():
            procs[name] = subprocess.Popen(cmd, stdout=(store / "logs" / f"{name}.log").open("w"),
                                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
            print(f"started {name}: {' '.join(cmd[:4])} ... (log: {store / 'logs' / f'{name}.log'})", flush=True)
        deadline = time.time() + args.timeout
        for name, port in (("source", args.port + 1), ("target", args.port + 2), ("proxy", args.port)):
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], deadline)
            print(f"{name} is up on port {port}", flush=True)
        print("\nThe handoff proxy is ready. A client:\n")
        print(client_snippet(args.host, args.port, args.source_name, args.target_name), flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        dead = [name for name, p in procs.items() if p.poll() is not None]
        raise SystemExit(f"{', '.join(dead)} exited (see {store / 'logs'}); stopping the others")
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
