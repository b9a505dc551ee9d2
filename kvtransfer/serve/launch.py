"""One command for a handoff deployment: the source engine, the target engine and the proxy, started and checked.

    python -m kvtransfer.serve.launch --source MODEL --target MODEL --mapper MAPPER_DIR [--store DIR] [--port 8000]
        [--state-dir DIR] [--chat-template FILE]

starts, on this host,
  * the source as a vLLM OpenAI server with kvtransfer's connector as `kv_producer` (prefix caching on: each
    turn computes and stores only its new blocks),
  * the target as a vLLM OpenAI server with the connector as `kv_consumer` (the mapper, the source model, prefix
    caching on: a handed-over session's later turns are its own cache hits; `--enable-prompt-tokens-details`),
  * the proxy (`kvtransfer.serve.proxy`) in front of both, its start ids read from the mapper,
waits until all three answer `/health`, prints an OpenAI-SDK client that works against the proxy (a chat client,
or a completions one when the target has no chat template), and stays in the foreground until Ctrl-C or SIGTERM
(then stops all three, and whatever they started). A mapper directory that does not exist is refused with the
command that fits one. Ports: the proxy's `--port`, the engines' the next two.

The state directory (`--state-dir`, default ./kvtransfer-state) holds what is the deployment's and not the
store's: logs/, the consumer's stats and its sink cache (sinks/), and the proxy's secret (`proxy.secret`, mode 0600,
made once): session owners, cache salts and store namespaces are keyed digests under it, so a restart keeps every
session.

`--store` is a directory (the default, ./kvstore) or a Redis URL (redis://host:6379/0, rediss:// for TLS), passed to
both engines and the proxy as it is; it holds only blocks. With a URL the byte cap is
the server's maxmemory (--store-max-gb does not apply), and the proxy keeps its sessions and secret in the same
Redis (or in `--state`), so further proxies on other hosts serve the same sessions. A password in the URL is moved to
the environment ($KVTRANSFER_REDIS_PASSWORD) of the three processes, out of their command lines.
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
from urllib.parse import unquote, urlsplit, urlunsplit

from .blockstore import is_url, redact

CONNECTOR = {"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
             "kv_load_failure_policy": "recompute"}


def kv_transfer_config(role: str, store: Path | str, **extra) -> str:
    """The --kv-transfer-config JSON of kvtransfer's connector for `role` (kv_producer | kv_consumer)."""
    return json.dumps({**CONNECTOR, "kv_role": role,
                       "kv_connector_extra_config": {"store": str(store), **{k: str(v) for k, v in extra.items()}}})


def engine_command(model: str, port: int, name: str, kv_config: str | None, *, dtype: str,
                   max_model_len: int | None = None, chat_template: str | None = None,
                   python: str = sys.executable) -> list[str]:
    """argv of a vLLM OpenAI server for one side of the handoff (eager; prefix caching and prompt token details on;
    the context length is the model's own unless `max_model_len` is given)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    return cmd + (["--kv-transfer-config", kv_config] if kv_config else [])


def commands(args: argparse.Namespace, python: str = sys.executable) -> dict[str, list[str]]:
    """{"source", "target", "proxy"}: the three argvs `main` starts (a pure function of the parsed arguments)."""
    url = is_url(args.store)
    store = split_password(args.store)[0] if url else Path(args.store).resolve()  # a URL is passed through
    state = Path(args.state_dir).resolve()
    mapper = Path(args.mapper).resolve()
    template = str(Path(args.chat_template).resolve()) if args.chat_template else None
    src_port, tgt_port = args.port + 1, args.port + 2
    # a Redis store's cap is the server's maxmemory; the sink cache is this host's state, whatever the store
    cap = {} if args.store_max_gb is None or url else {"store_max_bytes": int(args.store_max_gb * (1 << 30))}
    sinks = {"sink_dir": state / "sinks"}  # the deployment's file, never among the store's blocks
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len, "chat_template": template, "python": python}
    proxy = [python, "-m", "kvtransfer.serve.proxy", "--source", f"http://127.0.0.1:{src_port}",
             "--target", f"http://127.0.0.1:{tgt_port}", "--source-model", args.source_name,
             "--target-model", args.target_name, "--mapper", str(mapper), "--store", str(store),
             "--secret-file", str(state / "proxy.secret"), "--host", args.host, "--port", str(args.port)]
    return {
        "source": engine_command(args.source, src_port, args.source_name,
                                 kv_transfer_config("kv_producer", store, store_retention_s=args.retention_s, **cap),
                                 **engine),
        "target": engine_command(args.target, tgt_port, args.target_name,
                                 kv_transfer_config("kv_consumer", store, mapper=mapper,
                                                    source_model=Path(args.source).resolve()
                                                    if Path(args.source).exists() else args.source,
                                                    stats=state / "consumer_stats.json", **cap, **sinks),
                                 **engine),
        "proxy": proxy + (["--allow-anonymous-sessions"] if args.allow_anonymous_sessions else [])
        + (["--state", split_password(args.state)[0]] if args.state else []),
    }


def split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None): the password travels in the environment instead."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1])), unquote(parts.password)


def store_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment for the three processes: a Redis URL's password as $KVTRANSFER_REDIS_PASSWORD (never in argv,
    where `ps` and logs would show it). SystemExit when the store and state URLs carry different passwords."""
    from .redis_store import PASSWORD_ENV

    found = {split_password(u)[1] for u in (args.store, args.state) if u and is_url(u)} - {None}
    if len(found) > 1:
        raise SystemExit("--store and --state carry different passwords: use one Redis password "
                         f"(${PASSWORD_ENV}) for both")
    return {PASSWORD_ENV: found.pop()} if found else {}


def client_snippet(host: str, port: int, source_name: str, target_name: str, chat: bool = True) -> str:
    """A Python client (OpenAI SDK) that runs a session on the source and hands it to the target: chat
    completions, or plain completions (`chat=False`, for models without a chat template)."""
    if not chat:
        return f'''from openai import OpenAI

client = OpenAI(base_url="http://{host}:{port}/v1", api_key="my-key")  # the key binds the session to you
session = {{"X-KVTransfer-Session": "demo-1"}}
text = "Here is a long document: ... It is about"
first = client.completions.create(model="{source_name}", prompt=text, max_tokens=32, extra_headers=session)
text += first.choices[0].text + " In more depth:"
second = client.completions.create(model="{target_name}", prompt=text, max_tokens=32, extra_headers=session)
print(second.choices[0].text)
print(second.model_extra["kvtransfer"]["summary"])  # e.g. "mapped 1024 tokens, prefilled 41"
'''
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
    p.add_argument("--store", default="kvstore",
                   help="the KV store: a directory (default ./kvstore) or a redis:// / rediss:// URL shared by "
                        "engines and proxies on many hosts")
    p.add_argument("--state", help="a redis:// URL for the proxy's sessions and secret (default: --store when it is "
                                   "a URL; else the proxy keeps them itself)")
    p.add_argument("--state-dir", default="kvtransfer-state",
                   help="logs, the consumer's stats and the proxy's secret (default ./kvtransfer-state)")
    p.add_argument("--dtype", default="float32", help="both engines' dtype (float32 on CPU; bfloat16 on GPUs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="both engines' context length (default: each model's own, from its config)")
    p.add_argument("--chat-template", help="a Jinja chat template file for both engines, for models that ship none "
                                           "(e.g. models/tiny/chat_template.jinja for the tiny family)")
    p.add_argument("--kv-space-gb", type=_positive_int, default=2,
                   help="vLLM's CPU KV cache space per engine, whole GiB (VLLM_CPU_KVCACHE_SPACE; CPU engines only)")
    p.add_argument("--store-max-gb", type=float, default=20.0,
                   help="the store's size cap in GiB, least recently used blocks evicted beyond it (default 20)")
    p.add_argument("--retention-s", type=float, default=7 * 24 * 3600,
                   help="stored blocks unused this long are removed (default 7 days)")
    p.add_argument("--allow-anonymous-sessions", action="store_true",
                   help="serve session requests without an API key (anyone who knows such an id can use it)")
    p.add_argument("--source-name", default="source-model")
    p.add_argument("--target-name", default="target-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port; the engines take the next two")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the engines to start")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of GiB (vLLM reads it as an integer)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1 GiB")
    return value


def has_chat_template(model: str) -> bool:
    """Whether a model directory ships a chat template (tokenizer_config.json's or chat_template.jinja); a hub id
    is assumed to (vLLM says otherwise when it does not)."""
    path = Path(model)
    if not path.is_dir():
        return True
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


class Stop(Exception):
    """SIGTERM or SIGHUP: stop the deployment as Ctrl-C does."""


def _stop(signum, frame):
    raise Stop(signal.Signals(signum).name)


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


def stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM each process group, then SIGKILL those still alive after `grace_s` seconds (an engine's own
    workers are in its group: nothing is left behind)."""
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace_s
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs.values():  # the group, not just its leader: a leader that exited may leave workers
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    """Command line: start the three processes, wait for them, print the client, run until Ctrl-C or SIGTERM."""
    args = parser().parse_args(argv)
    if not (Path(args.mapper) / "mapper.json").is_file():
        raise SystemExit(f"{args.mapper} holds no fitted mapper. Fit one first, e.g. "
                         f"`python run.py pair=<pair> stage=[calibrate,fit]` (docs/running.md), then pass the "
                         f"mapper directory it reports")
    if args.chat_template and not Path(args.chat_template).is_file():
        raise SystemExit(f"--chat-template {args.chat_template}: no such file")
    for spec in (args.store, args.state):
        if spec and "://" in spec and not is_url(spec):
            raise SystemExit(f"{redact(spec)}: a store or state URL is redis://host:port/db (rediss:// for TLS)")
    if args.state and not is_url(args.state):
        raise SystemExit(f"--state {args.state}: a redis:// URL (a directory store keeps sessions in the proxy)")
    logs = Path(args.state_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not is_url(args.store):
        Path(args.store).mkdir(parents=True, exist_ok=True)
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gb)} | store_env(args)
    procs: dict[str, subprocess.Popen] = {}
    handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for name, cmd in commands(args).items():
            with (logs / f"{name}.log").open("w") as log:
                procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)
            print(f"started {name}: {' '.join(cmd[:4])} ... (log: {logs / f'{name}.log'})", flush=True)
        deadline = time.time() + args.timeout
        for name, port in (("source", args.port + 1), ("target", args.port + 2), ("proxy", args.port)):
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], deadline)
            print(f"{name} is up on port {port}", flush=True)
        chat = args.chat_template is not None or has_chat_template(args.target)
        print("\nThe handoff proxy is ready. A client:\n")
        print(client_snippet(args.host, args.port, args.source_name, args.target_name, chat=chat), flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        dead = [name for name, p in procs.items() if p.poll() is not None]
        raise SystemExit(f"{', '.join(dead)} exited (see {logs}); stopping the others")
    except (KeyboardInterrupt, Stop) as why:
        print(f"stopping ({type(why).__name__} {why})".strip(), flush=True)
    finally:
        for sig in handlers:  # a second SIGTERM must not cut the stop short and orphan the engines
            signal.signal(sig, signal.SIG_IGN)
        stop_all(procs)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    main()
