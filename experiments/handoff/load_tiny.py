"""The handoff proxy under load and faults, tiny family, real vLLM engines over loopback (serving environment).

    PYTHONPATH=$PWD .venv-serve/bin/python experiments/handoff/load_tiny.py OUT_DIR [--sessions 16 --turns 10]
        -> OUT_DIR/report.json (never overwritten)

Three processes on 127.0.0.1: a producer and a consumer vLLM OpenAI server (`vllm.entrypoints.openai.api_server`,
qwen3-tiny-3m, float32, eager, prefix caching on, `--enable-prompt-tokens-details`; the consumer with the
identity map and native sink 1, as experiments/serve/e2e_tiny.py) and `python -m kvtransfer.serve.proxy` (the
mapper and the store given: start ids read from the mapper, switches wait for writes in flight).
With the identity map the harness's `transfer` is the target's own prefill, so the reference of every target
turn is the consumer's normal prefill of the same prompt (`kv_transfer_params {"kvtransfer": "off"}`, sent to
the consumer directly): greedy tokens must be equal ("differing responses", goal 0).

Phase 1 (load): `--sessions` concurrent sessions x `--turns` turns of /v1/completions on token ids (each turn adds
24 user tokens, 8 greedy tokens back, ignore_eos), handoff to the target at a random turn (seeded). The source
turns are written through; the producer's `vllm:prompt_tokens` counter is read before and after each switch (a
switch must not make the producer prefill anything).
Phase 2 (faults), each followed by a good handoff that must map again:
  truncated entry, corrupt entry (bytes flipped inside K tensors, header intact), foreign-weights entry
  (the target's architecture, other weights), evicted entry (deleted between a session's handoff and its next
  turn), bad requests (not JSON, wrong types, unknown model), the producer killed (then its handoffs), the
  consumer killed (the proxy answers from the source); another API key on a session's id (its own session: a
  cold switch of its own, nothing of the first key's); 2,000 bad requests with distinct session ids (the proxy's
  RSS before and after; sessions and locks left).
Every session request carries an API key (`Authorization: Bearer load`); the proxy's secret is OUT_DIR/proxy.secret,
so the script can name a session's store namespace (the spoilt blocks are the session's own).
Counted: requests, mapped, fallbacks by reason (the proxy's and the consumer connector's), crashes (a process
that died without being killed, or a proxy 5xx), differing responses.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models/tiny/qwen3-tiny-3m"
START = 0
PY = sys.executable
KEY = "Bearer load"  # the API key of every session request


def kv(role: str, store: Path, **extra) -> str:
    return json.dumps({"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
                       "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"store": str(store), **{k: str(v) for k, v in extra.items()}}})


def start_engine(port: int, kvcfg: str, log: Path) -> subprocess.Popen:
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", "2048", "--served-model-name", f"tiny-{port}",
           "--block-size", "32",  # the CPU default is 128: these short turns would rarely fill a cacheable block
           "--kv-transfer-config", kvcfg]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Wait until an engine or the proxy answers /health (kvtransfer.serve.launch.wait_healthy)."""
    from kvtransfer.serve.launch import wait_healthy

    wait_healthy(url, proc, time.time() + timeout)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Run:
    def __init__(self, out: Path, proxy: str, consumer: str, store: Path):
        import httpx

        self.out, self.proxy, self.consumer, self.store = out, proxy, consumer, store
        self.client = httpx.AsyncClient(timeout=600)
        self.records: list[dict] = []
        self.switch_lock = asyncio.Lock()

    async def prompt_tokens(self, url: str) -> float:
        """An engine's vllm:prompt_tokens counter (tokens it prefilled or found cached), from /metrics."""
        text = (await self.client.get(url + "/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prompt_tokens_total") or line.startswith("vllm:prompt_tokens{"))

    async def turn(self, ids: list[int], session: str, to_target: bool, phase: str, check: bool = True) -> dict:
        body = {"model": "target" if to_target else "source", "prompt": ids, "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
        t0 = time.perf_counter()
        r = await self.client.post(self.proxy + "/v1/completions", json=body,
                                   headers={"x-kvtransfer-session": session, "authorization": KEY})
        rec = {"phase": phase, "session": session, "prompt": len(ids), "to_target": to_target, "status": r.status_code,
               "seconds": time.perf_counter() - t0, "header": r.headers.get("x-kvtransfer")}
        if r.status_code == 200:
            data = r.json()
            rec["kvtransfer"] = data.get("kvtransfer")
            rec["tokens"] = [int(t.split(":")[1]) for t in data["choices"][0]["logprobs"]["tokens"]]
            if check and to_target and (data.get("kvtransfer") or {}).get("engine") == "target":
                ref = await self.client.post(self.consumer + "/v1/completions",
                                             json={**body, "model": "tiny-8102", "kv_transfer_params": {"kvtransfer": "off"}})
                rec["reference"] = [int(t.split(":")[1]) for t in ref.json()["choices"][0]["logprobs"]["tokens"]]
                rec["differs"] = rec["reference"] != rec["tokens"]
        else:
            rec["body"] = r.text[:300]
        self.records.append(rec)
        return rec

    async def session(self, i: int, turns: int, handoff_at: int, producer_url: str) -> None:
        rng = random.Random(1000 + i)
        ids = [START]
        for t in range(turns):
            ids = ids + [rng.randrange(100, 3000) for _ in range(24)]
            if t == handoff_at:
                async with self.switch_lock:  # no other session's source turn moves the producer's counter meanwhile
                    before = await self.prompt_tokens(producer_url)
                    rec = await self.turn(ids, f"load-{i}", True, "load")
                    rec["producer_prompt_tokens"] = await self.prompt_tokens(producer_url) - before
            else:
                async with self.switch_lock if t < handoff_at else contextlib.nullcontext():
                    rec = await self.turn(ids, f"load-{i}", t >= handoff_at, "load")
            rec["turn"], rec["switch"] = t, t == handoff_at
            rec["new_tokens"] = 24 + len(rec.get("tokens", [])) if t else len(ids)
            ids = ids + rec.get("tokens", [])


def writer_check(timings: Path, store: Path) -> dict:
    """The producer's writer counters after the load phase, and the blocks the store holds then: with
    write-through every block is gathered and written once (bytes gathered == blocks written x bytes a block)."""
    stats = json.loads(timings.read_text()).get("writer", {}) if timings.exists() else {}
    files = entry_paths(store)
    block_bytes = None
    if files:
        from safetensors import safe_open

        with safe_open(str(next(iter(files))), framework="pt") as f:
            block_bytes = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in ("k", "v"))
    return {**stats, "blocks_in_store": len(files), "bytes_per_block": block_bytes}


def proxy_rss(pid: int) -> int:
    """Resident memory of a process in kB (/proc), 0 where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def block_index(path: Path) -> int:
    """A store block's index in its chain (its header's "block")."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["kvtransfer"])["block"]


def entry_paths(store: Path) -> set[Path]:
    return set(store.rglob("*.safetensors")) - set((store / "sinks").rglob("*"))


async def faults(run: Run, producer: subprocess.Popen, consumer: subprocess.Popen, source_url: str) -> dict:
    rng = random.Random(7)
    body = lambda n: [START] + [rng.randrange(100, 3000) for _ in range(n)]  # noqa: E731
    notes = {}

    async def handoff_then_spoil(name, spoil):
        from kvtransfer.serve.proxy import read_secret
        from kvtransfer.serve.proxy_state import Sessions
        from kvtransfer.serve.store import KVStore

        ids, session = body(200), f"fault-{name}"
        save = await run.turn(ids, session, False, f"fault:{name}_source")  # written through under its namespace
        assert save["status"] == 200, save
        # the producer writes in the background, and may still be writing an earlier session's blocks: find this
        # session's chain by its namespace and hashes (not by which files are new) and wait for its last full block
        keys = Sessions(read_secret(run.out / "proxy.secret"))
        ns = keys.namespace(keys.owner_of(KEY), session)
        store = KVStore(run.store)
        full = len(ids) // store.block_size * store.block_size
        deadline = time.time() + 60
        while ((tip := store.tip(ids, ns=ns)) is None or tip[2] < full) and time.time() < deadline:
            await asyncio.sleep(0.1)
        assert tip is not None and tip[2] == full, f"the producer stored {tip} of {full} tokens within 60 s"
        last = store.block_path(tip[0], tip[1], ns)
        assert block_index(last) == full // store.block_size - 1, last
        spoil(last)  # the prompt's last stored block
        # the session's switch (the producer rewrites nothing: a warm switch sends it nothing)
        rec = await run.turn(ids, session, True, f"fault:{name}")
        good = await run.turn(body(150), f"fault-{name}-after", True, f"after:{name}")
        notes[name] = {"header": rec.get("header"), "after": good.get("header")}

    def truncate(p: Path):
        p.write_bytes(p.read_bytes()[:-4096])

    def corrupt(p: Path):
        data = bytearray(p.read_bytes())
        header = int.from_bytes(data[:8], "little") + 8
        meta = json.loads(data[8:header])
        for name, spec in meta.items():
            if name == "k" or (name.startswith("layers.") and name.endswith(".k")):   # a block's K (or an old entry's)
                a, b = spec["data_offsets"]
                for j in range(header + a, header + b, 7):
                    data[j] ^= 0x5A
        p.write_bytes(bytes(data))

    def foreign(p: Path):
        import torch

        from kvtransfer.core.io import atomic_save_tensors, load_tensors
        tensors, header = load_tensors(p)
        # another checkpoint of the same architecture: the same header and layout, other K/V numbers
        gen = torch.Generator().manual_seed(3)
        spoilt = {k: (torch.randn(v.shape, generator=gen, dtype=torch.float32).to(v.dtype)
                      if k in ("k", "v") or k.startswith("layers.") else v) for k, v in tensors.items()}
        p.unlink()
        atomic_save_tensors(p, spoilt, header)

    await handoff_then_spoil("truncated", truncate)
    await handoff_then_spoil("corrupt_k_bytes", corrupt)
    await handoff_then_spoil("foreign_weights", foreign)

    # evicted: a handed-over session's entry is deleted before its next turn (that turn maps the handed prefix)
    ids = body(120)
    await run.turn(ids, "fault-evicted", True, "fault:evicted_setup")
    for p in entry_paths(run.store):
        p.unlink()
    ids2 = ids + [rng.randrange(100, 3000) for _ in range(20)]
    rec = await run.turn(ids2, "fault-evicted", True, "fault:evicted")
    notes["evicted"] = {"header": rec.get("header")}

    # another API key on a session's id: a session of its own (a cold switch, its own save step), nothing of the
    # first key's (no hit in the target's cache under the first key's salt); the first key's switch still maps
    owner = {"x-kvtransfer-session": "fault-owned", "authorization": "Bearer owner"}
    ids = body(40)
    first = await run.client.post(run.proxy + "/v1/completions", headers=owner,
                                  json={"model": "source", "prompt": ids, "max_tokens": 2})
    other = await run.client.post(run.proxy + "/v1/completions", headers={**owner, "authorization": "Bearer other"},
                                  json={"model": "target", "prompt": ids, "max_tokens": 2})
    then = await run.client.post(run.proxy + "/v1/completions", headers=owner,
                                 json={"model": "target", "prompt": ids, "max_tokens": 2})
    notes["second_key"] = {"owner": first.status_code, "other": other.status_code,
                           "other_kvtransfer": other.json().get("kvtransfer") if other.status_code == 200 else None,
                           "owner_switch": then.headers.get("x-kvtransfer")}

    # bad requests with distinct session ids: the proxy keeps no state for them
    rss_before = proxy_rss(run.proxy_pid)
    sessions_before = (await run.client.get(run.proxy + "/kvtransfer/stats")).json()["sessions"]
    codes = collections.Counter()
    for i in range(2000):
        r = await run.client.post(run.proxy + "/v1/completions", json={"model": "target", "prompt": {"bad": i}},
                                  headers={"x-kvtransfer-session": f"bad-{i:05d}-" + "x" * 2000})
        codes[r.status_code] += 1
    notes["distinct_bad_sessions"] = {
        "codes": dict(codes), "rss_kb_before": rss_before, "rss_kb_after": proxy_rss(run.proxy_pid),
        "sessions_before": sessions_before,
        "sessions_after": (await run.client.get(run.proxy + "/kvtransfer/stats")).json()["sessions"]}

    # bad requests straight at the proxy
    bad = [b"not json", b"[1]", b'{"model": ["x"], "prompt": [0, 5]}', b'{"model": "nope", "prompt": "a"}',
           b'{"model": "target", "prompt": {"a": 1}}', b'{"model": "target", "prompt": [0, 5], "stream": "yes"}',
           b'{"model": "target", "prompt": [0, 5], "max_tokens": "many"}', b'{"model": "target"}']
    codes = []
    for payload in bad:
        r = await run.client.post(run.proxy + "/v1/completions", content=payload,
                                  headers={"content-type": "application/json"})
        codes.append(r.status_code)
        run.records.append({"phase": "fault:bad_request", "status": r.status_code, "header": r.headers.get("x-kvtransfer")})
    notes["bad_requests"] = codes

    # the producer dies: handoffs fall back to a target prefill
    kill(producer)
    rec = await run.turn(body(100), "fault-producer-dead", True, "fault:producer_dead")
    notes["producer_dead"] = {"header": rec.get("header")}
    # the consumer dies too late for nothing: a target request then has no engine to serve it but the dead source
    kill(consumer)
    rec = await run.turn(body(100), "fault-both-dead", True, "fault:both_dead", check=False)
    notes["both_dead"] = {"status": rec["status"]}
    r = await run.client.get(run.proxy + "/health")
    notes["proxy_alive_after"] = r.status_code == 200
    return notes


async def main_async(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "report.json").exists():
        raise SystemExit(f"{out}/report.json exists: results are never overwritten, pick a new OUT_DIR")
    store = out / "store"
    provenance = machine()  # the tree the engines load, before anything else can change it
    from transformers import AutoConfig

    from kvtransfer.serve.mapping import identity_mapper

    identity_mapper(AutoConfig.from_pretrained(TARGET), model_id=str(TARGET), start_ids=[START]).save(out / "identity")
    t_start = time.time()
    producer = start_engine(8101, kv("kv_producer", store, stats=out / "producer_stats.json"), out / "producer.log")
    consumer = start_engine(8102, kv("kv_consumer", store, mapper=out / "identity", source_model=TARGET,
                                     stats=out / "consumer_stats.json"), out / "consumer.log")
    proxy = subprocess.Popen([PY, "-m", "kvtransfer.serve.proxy", "--source", "http://127.0.0.1:8101", "--target",
                              "http://127.0.0.1:8102", "--mapper", str(out / "identity"), "--store", str(store),
                              "--secret-file", str(out / "proxy.secret"), "--port", "8100"],
                             stdout=(out / "proxy.log").open("w"), stderr=subprocess.STDOUT,
                             env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        for url, proc in (("http://127.0.0.1:8101", producer), ("http://127.0.0.1:8102", consumer),
                          ("http://127.0.0.1:8100", proxy)):
            wait_up(url, proc)
        t_up = time.time()
        run = Run(out, "http://127.0.0.1:8100", "http://127.0.0.1:8102", store)
        run.proxy_pid = proxy.pid
        rng = random.Random(0)
        plan = [rng.randrange(1, args.turns) for _ in range(args.sessions)]
        await asyncio.gather(*(run.session(i, args.turns, plan[i], "http://127.0.0.1:8101")
                               for i in range(args.sessions)))
        t_load = time.time()
        proxy_stats_load = (await run.client.get(run.proxy + "/kvtransfer/stats")).json()
        await asyncio.sleep(2)  # the producer's timings file is written on a 0.5 s timer
        writer = writer_check(out / "producer_stats.json.worker.json", store)
        notes = await faults(run, producer, consumer, "http://127.0.0.1:8101")
        proxy_stats = (await run.client.get(run.proxy + "/kvtransfer/stats")).json()
        crashed = {"proxy": proxy.poll() is not None}
    finally:
        for proc in (proxy, producer, consumer):
            kill(proc)
    consumer_stats = json.loads((out / "consumer_stats.json").read_text()) if (out / "consumer_stats.json").exists() else {}
    report = {"sessions": args.sessions, "turns": args.turns, "handoff_turns": plan, "records": run.records,
              "proxy_stats_after_load": proxy_stats_load, "proxy_stats": proxy_stats,
              "consumer_reasons": consumer_stats.get("reasons"), "faults": notes, "crashed": crashed,
              "producer_writer": writer,
              "seconds": {"startup": t_up - t_start, "load": t_load - t_up, "faults": time.time() - t_load},
              "machine": provenance}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def machine() -> dict:
    """The checkout (commit, dirty: kvtransfer.config.provenance.git_state, untracked source counted) and the machine."""
    import platform

    from kvtransfer.config.provenance import cpu_model, json_provenance

    return {**json_provenance(), "cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_model()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    asyncio.run(main_async(parser.parse_args()))
