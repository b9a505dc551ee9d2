"""The deployment as a user starts it: `python -m kvtransfer.serve.launch` on the tiny family with real vLLM engines
and its store and session table in a real redis-server; two API keys through the OpenAI SDK, a switch; a second
handoff proxy against the same engines and Redis (what a second host runs); then SIGTERM -- and nothing left running.
Slow, serving environment.

    PYTHONPATH=$PWD .venv-serve/bin/python -m pytest -q -m slow tests/test_launch_vllm.py

The two proxies share every session: a session's source turns go through one and its switch through the other,
which maps the stored prefix with no save step (the source engine serves nothing during the switch: its own
request counter says so); another API key on the same session id gets nothing of it; the session outlives a
SIGKILL and restart of the first proxy; and a Redis killed mid-session turns the switch into a counted normal prefill
while both proxies and both engines keep answering. tests/test_proxy_redis.py checks the same with fake engines.

The engines start once for the module; its tests run in file order (the last one stops the deployment). The mapper
is the identity map of the tiny 3M model onto itself (source = target), fitted by nothing: this test is about the
deployment (start, sessions across proxies, isolation, stop); what a fitted map is worth is measured elsewhere.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_server import RedisServer, free_port
from test_serve_launch import _alive, _free_base
from vllm_tests import ROOT, SERVE_ONLY

pytestmark = SERVE_ONLY

MODEL = ROOT / "models" / "tiny" / "qwen3-tiny-3m"
DOC = ("The lighthouse keeper logged every ship that passed the northern reef, and each entry named the hour, the "
       "flag, the cargo and the weather. ") * 12
SESSION, STATUS = "X-KVTransfer-Session", "x-kvtransfer"  # kvtransfer.serve.proxy's headers


def _session_members(leaders: set[int]) -> set[int]:
    """Every live process whose session id is one of `leaders` (the launcher starts each server as a session
    leader, so an engine's own workers are found with it)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in leaders:  # fields after the command: state, ppid, pgrp, session
            out.add(int(stat.parent.name))
    return out


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return out


def _metric(text: str, name: str, **labels: str) -> int:
    """The sum of a Prometheus counter's samples named `name` whose labels include `labels` (0 when none): vLLM's
    counters are whole numbers written as floats, the proxy's are integers."""
    total = 0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, value = line.rsplit(" ", 1)
        metric, _, rest = head.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += int(float(value))
    return total


@pytest.fixture(scope="module")
def redis():
    """The deployment's Redis (store, session table, secret): its own server, since one test kills it."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, redis):
    from transformers import AutoConfig

    from kvtransfer.serve.mapping import identity_mapper

    tmp = tmp_path_factory.mktemp("deploy")
    identity_mapper(AutoConfig.from_pretrained(MODEL), model_id=str(MODEL), start_ids=[0]).save(tmp / "mapper")
    port = _free_base()
    argv = [sys.executable, "-m", "kvtransfer.serve.launch", "--source", str(MODEL), "--target", str(MODEL),
            "--mapper", str(tmp / "mapper"), "--chat-template", str(ROOT / "models/tiny/chat_template.jinja"),
            "--port", str(port), "--store", f"{redis.url}?deployment=launch",  # the many-hosts store
            "--kv-space-gb", "1"]  # a small KV space; every other option at its default, as a user types it
    proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    lines, deadline = [], time.time() + 1200
    for line in proc.stdout:
        lines.append(line)
        if "The handoff proxy is ready" in line or time.time() > deadline:
            break
    ready = "The handoff proxy is ready" in "".join(lines)
    leaders = _children(proc.pid)
    if not ready:
        _stop(proc, leaders)
        logs = "".join(p.read_text()[-3000:] for p in sorted((tmp / "kvtransfer-state" / "logs").glob("*.log")))
        pytest.fail("the launcher did not come up:\n" + "".join(lines)[-3000:] + logs)
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "port": port, "argv": argv, "tmp": tmp,
           "leaders": leaders, "members": _session_members(leaders), "printed": lines, "redis": redis}
    _stop(proc, leaders)


def _stop(proc: subprocess.Popen, leaders: set[int]) -> None:
    """Stop the launcher as a user does (SIGTERM), then SIGKILL whatever of its servers' sessions is left (a test
    that failed before the SIGTERM test leaves nothing running either)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for pid in _session_members(leaders):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ProxyProcess:
    """A further handoff proxy on this host, started with the argv the launcher gives its own (the deployment's
    engines, mapper and Redis store) but its own port and secret file; its output in `log`."""

    def __init__(self, deployment: dict, secret_file: Path, log: Path):
        from kvtransfer.serve import launch

        self.cmd = launch.commands(launch.parser().parse_args(deployment["argv"][3:]))["proxy"]
        self.port = free_port()
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)
        self.cmd[self.cmd.index("--secret-file") + 1] = str(secret_file)
        self.url, self.log, self.cwd, self.proc = f"http://127.0.0.1:{self.port}", log, deployment["tmp"], None

    def start(self) -> None:
        from kvtransfer.serve.launch import wait_healthy

        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ | {"PYTHONPATH": str(ROOT)}, start_new_session=True)
        wait_healthy(self.url, self.proc, time.time() + 180)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is saved on the way out)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)


def test_a_user_starts_it_and_two_keys_share_it(deployment):
    import httpx
    from openai import OpenAI

    url = deployment["url"]
    alice = OpenAI(base_url=url + "/v1", api_key="alice", max_retries=0)
    mallory = OpenAI(base_url=url + "/v1", api_key="mallory", max_retries=0)

    def chat(client, session, messages, model, **kw):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0.0,
            extra_headers={SESSION: session} if session else None, **kw)
        return raw.parse(), raw.headers.get(STATUS)

    # alice: a session on the source, then the switch (mapped), then a later turn (the target's own cache)
    msgs = [{"role": "user", "content": DOC + " Which reef?"}]
    first, header = chat(alice, "doc", msgs, "source-model")
    assert header == "source" and first.choices[0].message.content is not None
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the weather?"}]
    second, header = chat(alice, "doc", msgs, "target-model")
    assert header.startswith("mapped "), header
    assert second.model_extra["kvtransfer"]["save_s"] is None  # a warm switch: nothing sent to the source
    msgs += [{"role": "assistant", "content": second.choices[0].message.content},
             {"role": "user", "content": "And the cargo?"}]
    _, header = chat(alice, "doc", msgs, "target-model")
    assert header.startswith("cached "), header

    # mallory: the same session id is her own session (a cold switch: the source reads her prompt once); her
    # guess of alice's document hits nothing of alice's in either engine's cache
    guess = [{"role": "user", "content": DOC + " Which reef?"}]
    src, _ = chat(mallory, "m", guess, "source-model")
    assert src.usage.prompt_tokens_details.cached_tokens == 0  # alice's prompt is in the source's cache, not hers
    hers, header = chat(mallory, "doc", guess, "target-model")
    assert hers.model_extra["kvtransfer"]["save_s"] is not None and not hers.model_extra["kvtransfer"]["cached"]
    # the cold switch maps what her own save step stored (the producer gathered it, though alice's identical
    # prompt is in the store: another namespace)
    assert header.startswith("mapped ") and hers.model_extra["kvtransfer"]["status"] == "mapped", header
    mine, _ = chat(alice, "doc2", guess, "source-model")  # the same prompt as alice: her own cache, the control
    assert mine.usage.prompt_tokens_details.cached_tokens > 0
    # mallory deletes "doc": hers; alice's session and stored blocks stay
    r = httpx.delete(url + "/kvtransfer/sessions/doc", headers={"authorization": "Bearer mallory"})
    assert r.status_code == 200 and r.json()["deleted"] is True
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And the flag?"}]
    _, header = chat(alice, "doc", msgs, "target-model")
    assert header.startswith(("cached ", "mapped ")), header
    # a session without a key is refused; the proxy's counters saw all of it
    r = httpx.post(url + "/v1/chat/completions", headers={"X-KVTransfer-Session": "anon"},
                   json={"model": "source-model", "messages": guess, "max_tokens": 2})
    assert r.status_code == 401
    stats = httpx.get(url + "/kvtransfer/stats").json()
    assert stats["counts"]["mapped"] >= 2 and stats["errors"].get("unauthorized") == 1
    assert stats["sessions_backend"] == "redis"  # the launcher gave its proxy the store's Redis for its sessions
    assert not [k for k in stats["errors"] if k.startswith("proxy_error")], stats["errors"]


def test_two_proxies_share_sessions_through_redis_and_outlive_a_restart_and_a_dead_redis(deployment, tmp_path):
    import httpx

    two = deployment["url"]  # the launcher's own proxy
    source = f"http://127.0.0.1:{deployment['port'] + 1}"
    target = f"http://127.0.0.1:{deployment['port'] + 2}"
    one = ProxyProcess(deployment, tmp_path / "one.secret", tmp_path / "one.log")

    def chat(proxy: str, key: str, session: str, messages: list, model: str) -> httpx.Response:
        return httpx.post(proxy + "/v1/chat/completions", timeout=300,
                          headers={"authorization": f"Bearer {key}", SESSION: session},
                          json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0})

    def served_by_source() -> int:  # the source engine's own count of requests it finished
        return _metric(httpx.get(source + "/metrics", timeout=30).text, "vllm:request_success_total")

    def counter(proxy: str, group: str, kind: str) -> int:
        return _metric(httpx.get(proxy + "/metrics", timeout=30).text, f"kvtransfer_proxy_{group}_total", kind=kind)

    def then(messages: list, reply: httpx.Response, question: str) -> list:
        return messages + [{"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                           {"role": "user", "content": question}]

    try:
        one.start()
        # the session's source turn through proxy 1 (written through: the producer stores its blocks in Redis)
        msgs = [{"role": "user", "content": DOC + " Which reef?"}]
        first = chat(one.url, "carol", "fleet", msgs, "source-model")
        assert first.status_code == 200 and first.headers[STATUS] == "source", first.text
        stored = first.json()["usage"]["prompt_tokens"] // 16 * 16  # the store's blocks of 16 tokens
        assert stored > 0
        # its switch through proxy 2, which never saw the session: found in Redis, mapped, no save step
        msgs = then(msgs, first, "And the weather?")
        before, switches = served_by_source(), counter(two, "handoff", "switches")
        second = chat(two, "carol", "fleet", msgs, "target-model")
        assert second.status_code == 200 and second.headers[STATUS].startswith("mapped "), second.text
        prompt = second.json()["usage"]["prompt_tokens"]  # every stored block mapped, the new turn prefilled
        assert second.headers[STATUS] == f"mapped {stored} tokens, prefilled {prompt - stored}", second.headers[STATUS]
        assert second.json()["kvtransfer"]["save_s"] is None
        assert served_by_source() == before  # nothing was sent to the source
        assert counter(two, "handoff", "switches") == switches + 1  # a warm switch (a save step is not one)

        # proxy 1 crashes and restarts with a secret file of its own: the deployment's secret in Redis replaces it,
        # and the next turn through it is the session's (the target's own cache under its salt, no save step)
        one.kill()
        one.start()
        assert one.log.read_text().count("already holds this deployment's secret") == 2
        msgs = then(msgs, second, "And the cargo?")
        before = served_by_source()
        third = chat(one.url, "carol", "fleet", msgs, "target-model")
        assert third.status_code == 200 and third.headers[STATUS].startswith("cached "), third.text
        assert third.json()["kvtransfer"]["save_s"] is None and third.json()["kvtransfer"]["cached"] > 0
        assert served_by_source() == before

        # another key on the same session id, through either proxy: a session of its own (cold: the source reads
        # the prompt once), none of carol's blocks in the target's cache; carol's session goes on as it was
        before = served_by_source()
        hers = chat(two, "mallory", "fleet", msgs, "target-model")
        assert hers.status_code == 200, hers.text
        assert hers.json()["kvtransfer"]["save_s"] is not None and not hers.json()["kvtransfer"]["cached"]
        assert hers.headers[STATUS].startswith("mapped "), hers.headers[STATUS]  # her save step's blocks, mapped
        assert served_by_source() == before + 1  # her save step
        msgs = then(msgs, third, "And the flag?")
        fourth = chat(two, "carol", "fleet", msgs, "target-model")
        assert fourth.status_code == 200 and fourth.headers[STATUS].startswith("cached "), fourth.text

        # Redis dies mid-session (a crash: the session table, the secret and the stored blocks are gone): the
        # switch is a counted normal prefill, and both proxies and both engines keep answering
        crash = [{"role": "user", "content": DOC + " Which flag?"}]
        turn = chat(one.url, "carol", "crash", crash, "source-model")
        assert turn.status_code == 200 and turn.headers[STATUS] == "source", turn.text
        before = served_by_source()
        unavailable = counter(two, "errors", "state_unavailable")
        fallbacks = counter(two, "fallbacks", "fallback_reprefill:state_unavailable")
        deployment["redis"].stop()
        crash = then(crash, turn, "And the hour?")
        switch = chat(two, "carol", "crash", crash, "target-model")
        assert switch.status_code == 200, switch.text
        assert switch.headers[STATUS].startswith("fallback_reprefill: state_unavailable"), switch.headers[STATUS]
        assert switch.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a normal prefill: nothing reused
        assert served_by_source() == before  # and no save step either
        assert counter(two, "errors", "state_unavailable") == unavailable + 1
        assert counter(two, "fallbacks", "fallback_reprefill:state_unavailable") == fallbacks + 1
        turn = chat(one.url, "carol", "crash", crash, "source-model")  # a source turn: served, unstored
        assert turn.status_code == 200 and turn.headers[STATUS] == "source: not_stored (state_unavailable)"
        # a request without a session: the save step's write, the proxy's wait for it and the consumer's lookup all
        # meet the dead store, each counted, and the consumer prefills normally
        store_errors = counter(two, "errors", "store_unavailable:StoreUnavailable")
        plain = httpx.post(two + "/v1/chat/completions", timeout=300,
                           json={"model": "target-model", "messages": crash, "max_tokens": 8})
        assert plain.status_code == 200, plain.text
        assert plain.headers[STATUS] == "fallback_reprefill: consumer_fallback (store_unavailable)"
        assert counter(two, "errors", "store_unavailable:StoreUnavailable") == store_errors + 1
        for url in (one.url, two, source, target):
            assert httpx.get(url + "/health", timeout=30).status_code == 200, url
        for url in (one.url, two):
            errors = httpx.get(url + "/kvtransfer/stats", timeout=30).json()["errors"]
            assert not [k for k in errors if k.startswith("proxy_error")], errors
    finally:
        one.kill()
    assert one.proc is not None and not _alive(one.proc.pid)


def test_sigterm_stops_the_launcher_and_everything_it_started(deployment):
    proc = deployment["proc"]
    members = deployment["members"] | _session_members(deployment["leaders"])
    assert len(deployment["leaders"]) == 3 and members
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(pid) for pid in members):
        time.sleep(0.5)
    assert [pid for pid in members if _alive(pid)] == [], "left running after SIGTERM"
    logs = deployment["tmp"] / "kvtransfer-state" / "logs"
    assert (logs / "target.log").is_file() and (deployment["tmp"] / "kvtransfer-state" / "proxy.secret").is_file()
