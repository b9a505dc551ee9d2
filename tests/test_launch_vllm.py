"""The deployment as a user starts it: `python -m kvtransfer.serve.launch` on the tiny family with real vLLM engines,
two API keys through the OpenAI SDK, a switch, then SIGTERM -- and nothing left running. Slow, serving environment.

    PYTHONPATH=$PWD .venv-serve/bin/python -m pytest -q -m slow tests/test_launch_vllm.py

The mapper is the identity map of the tiny 3M model onto itself (source = target), fitted by nothing: this test is
about the deployment (start, isolation, stop); what a fitted map is worth is measured elsewhere.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_serve_launch import _alive, _free_base
from vllm_tests import ROOT, SERVE_ONLY

pytestmark = SERVE_ONLY

MODEL = ROOT / "models" / "tiny" / "qwen3-tiny-3m"
DOC = ("The lighthouse keeper logged every ship that passed the northern reef, and each entry named the hour, the "
       "flag, the cargo and the weather. ") * 12


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


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from transformers import AutoConfig

    from kvtransfer.serve.mapping import identity_mapper

    tmp = tmp_path_factory.mktemp("deploy")
    identity_mapper(AutoConfig.from_pretrained(MODEL), model_id=str(MODEL), start_ids=[0]).save(tmp / "mapper")
    port = _free_base()
    argv = [sys.executable, "-m", "kvtransfer.serve.launch", "--source", str(MODEL), "--target", str(MODEL),
            "--mapper", str(tmp / "mapper"), "--chat-template", str(ROOT / "models/tiny/chat_template.jinja"),
            "--port", str(port)]  # every other option at its default, as a user types it
    proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    lines, deadline = [], time.time() + 1200
    for line in proc.stdout:
        lines.append(line)
        if "The handoff proxy is ready" in line or time.time() > deadline:
            break
    ready = "The handoff proxy is ready" in "".join(lines)
    if not ready:
        proc.kill()
        logs = "".join(p.read_text()[-3000:] for p in sorted((tmp / "kvtransfer-state" / "logs").glob("*.log")))
        pytest.fail("the launcher did not come up:\n" + "".join(lines)[-3000:] + logs)
    leaders = _children(proc.pid)
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "tmp": tmp, "leaders": leaders,
           "members": _session_members(leaders), "printed": lines}
    if proc.poll() is None:
        proc.kill()


def test_a_user_starts_it_two_keys_share_it_and_sigterm_stops_everything(deployment):
    import httpx
    from openai import OpenAI

    url = deployment["url"]
    alice = OpenAI(base_url=url + "/v1", api_key="alice", max_retries=0)
    mallory = OpenAI(base_url=url + "/v1", api_key="mallory", max_retries=0)

    def chat(client, session, messages, model, **kw):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0.0,
            extra_headers={"X-KVTransfer-Session": session} if session else None, **kw)
        return raw.parse(), raw.headers.get("x-kvtransfer")

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
    assert not [k for k in stats["errors"] if k.startswith("proxy_error")], stats["errors"]

    # SIGTERM: the launcher stops its three servers and every process they started
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
