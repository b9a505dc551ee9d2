"""Sessions beyond one proxy: two handoff proxies share their session table and secret in one real redis-server (the
fake engines and fake store of tests/test_proxy.py stand in for vLLM). Any proxy serves any turn of a session, a
restarted proxy keeps its sessions and salts, another API key sees nothing, the fleet's lock serialises a session's
turns, and a dead Redis is a counted fallback (a normal prefill), never an error."""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from kvtransfer.serve import proxy as P
from redis_server import RedisServer
from test_proxy import MSGS, START, Engine, FakeStore, Router, _ids

TURN2 = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and now, at some length?"}]


class Fleet:
    """One fake producer and consumer, their fake store, and proxies started on demand against the Redis at `url`
    (each its own HandoffProxy: what two hosts would run)."""

    def __init__(self, url: str, block: int = 16, **proxy_kwargs):
        self.entries: set = set()
        self.source = Engine("src", self.entries, consumer=False)
        self.target = Engine("tgt", self.entries, consumer=True)
        self.source.B = self.target.B = block
        self.router = Router({"source": self.source, "target": self.target})
        self.url, self.block, self.kwargs = url, block, proxy_kwargs
        self.proxies: list[tuple[P.HandoffProxy, httpx.AsyncClient]] = []

    def start(self, **kwargs) -> int:
        """Start a proxy (a new process, as far as state goes: nothing but the Redis URL is shared); its index."""
        proxy = P.HandoffProxy("http://source", "http://target", start_ids=START, block_size=self.block,
                               client=httpx.AsyncClient(transport=self.router), state=self.url,
                               **(self.kwargs | kwargs))
        proxy.store = FakeStore(self.entries, self.block)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=P.build_app(proxy)), base_url="http://proxy")
        self.proxies.append((proxy, client))
        return len(self.proxies) - 1

    async def chat(self, i: int, messages, model="src", session="s", key="k1"):
        headers = {P.SESSION_HEADER: session, "authorization": f"Bearer {key}"}
        return await self.proxies[i][1].post("/v1/chat/completions", json={"model": model, "messages": messages},
                                             headers=headers)

    def gens(self, engine) -> list[dict]:
        """The engine's /v1/completions requests (what the proxy sends on a session's token ids)."""
        return [body for kind, body in engine.calls if kind == "completion"]


def _deployment_url(server) -> str:
    return f"{server.url}?deployment=t{uuid.uuid4().hex[:12]}"  # each test its own keys on the shared server


def run(coro):
    return asyncio.run(coro)


def test_a_session_served_by_one_proxy_switches_on_another_with_no_save_step(redis_server):
    async def go():
        fleet = Fleet(_deployment_url(redis_server))
        one, two = fleet.start(), fleet.start()
        assert fleet.proxies[one][0].sessions.secret == fleet.proxies[two][0].sessions.secret  # the first's won
        r = await fleet.chat(one, MSGS)
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER] == "source"
        r = await fleet.chat(two, TURN2, model="tgt")
        stored = len(_ids(MSGS)) // 16 * 16
        assert r.status_code == 200, r.text
        assert r.headers[P.STATUS_HEADER] == f"mapped {stored} tokens, prefilled {len(_ids(TURN2)) - stored}"
        # proxy 2 knew the session: the producer got the source turn only -- no save step (max_tokens=1) -- and the
        # consumer looked in the namespace the producer stored under
        assert [b.get("max_tokens") for b in fleet.gens(fleet.source)] == [None]
        ns = fleet.gens(fleet.source)[0]["kv_transfer_params"]["kvtransfer_ns"]
        assert fleet.gens(fleet.target)[-1]["kv_transfer_params"] == {"kvtransfer_source_len": stored,
                                                                      "kvtransfer_ns": ns}
        stats = (await fleet.proxies[two][1].get("/kvtransfer/stats")).json()
        assert stats["handoff"] == {"switches": 1} and stats["sessions_backend"] == "redis"
        # the next turn through proxy 1 again: the target's own cache, under the same per-session salt
        turn3 = TURN2 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        r = await fleet.chat(one, turn3, model="tgt")
        assert r.headers[P.STATUS_HEADER].startswith("cached ")
        salts = {b["cache_salt"] for b in fleet.gens(fleet.target)}
        assert len(salts) == 1 and len(fleet.gens(fleet.source)) == 1
    run(go())


def test_another_key_on_the_same_id_sees_nothing_of_a_session_held_in_redis(redis_server):
    async def go():
        fleet = Fleet(_deployment_url(redis_server))
        one, two = fleet.start(), fleet.start()
        await fleet.chat(one, MSGS, key="k1")
        r = await fleet.chat(two, TURN2, model="tgt", key="k2")  # another key, the same session id
        assert r.status_code == 200
        # a session k2 never served: cold, so the producer reads it once (the save step) into k2's own namespace
        saves = [b for b in fleet.gens(fleet.source) if b.get("max_tokens") == 1]
        assert len(saves) == 1
        ns1 = fleet.gens(fleet.source)[0]["kv_transfer_params"]["kvtransfer_ns"]
        ns2 = saves[0]["kv_transfer_params"]["kvtransfer_ns"]
        assert ns1 != ns2 and fleet.gens(fleet.target)[-1]["kv_transfer_params"]["kvtransfer_ns"] == ns2
        # and k1's session is untouched: its switch maps with no save step
        r = await fleet.chat(one, TURN2, model="tgt", key="k1")
        assert r.headers[P.STATUS_HEADER].startswith("mapped ") and len(fleet.gens(fleet.source)) == 2
    run(go())


def test_a_restarted_proxy_keeps_its_sessions_and_salts(redis_server):
    async def go():
        fleet = Fleet(_deployment_url(redis_server))
        first = fleet.start()
        await fleet.chat(first, MSGS)
        secret = fleet.proxies[first][0].sessions.secret
        restarted = fleet.start(secret=None)  # a new process: its own random candidate loses to the stored secret
        assert fleet.proxies[restarted][0].sessions.secret == secret
        r = await fleet.chat(restarted, TURN2, model="tgt")
        assert r.headers[P.STATUS_HEADER].startswith("mapped ")
        assert [b.get("max_tokens") for b in fleet.gens(fleet.source)] == [None]  # no save step
        # a local secret file that disagrees is replaced by the deployment's (one secret per fleet)
        other = fleet.start(secret=b"f" * 64)
        assert fleet.proxies[other][0].sessions.secret == secret
    run(go())


def test_the_fleets_lock_serialises_a_sessions_turns_and_is_bounded(redis_server):
    async def go():
        fleet = Fleet(_deployment_url(redis_server), lock_wait_s=5.0)
        one = fleet.start()
        await fleet.chat(one, MSGS)
        sessions = fleet.proxies[one][0].sessions
        lock = sessions.key_of("s", sessions.owner_of("Bearer k1")) + ":lock"
        r = redis_server.client()
        held_ms = 400
        r.set(lock, "another-proxy", px=held_ms)  # another proxy's turn in flight, answered within held_ms
        t0 = time.monotonic()
        reply = await fleet.chat(one, TURN2, model="tgt")
        assert reply.status_code == 200 and (time.monotonic() - t0) * 1000 >= held_ms * 3 // 4  # it waited
        assert not r.exists(lock)  # released by its holder
        impatient = fleet.start(lock_wait_s=0.3)
        r.set(lock, "another-proxy", px=10_000)  # a turn that outlasts the bounded wait
        reply = await fleet.chat(impatient, TURN2, model="tgt")
        assert reply.status_code == 409 and "retry" in reply.json()["error"]["message"]
        assert r.get(lock) == b"another-proxy"  # never released by anyone but its holder
        r.delete(lock)
    run(go())


def test_redis_killed_mid_session_is_a_counted_normal_prefill_and_nothing_raises():
    server = RedisServer()
    try:
        async def go():
            fleet = Fleet(server.url, state_timeout_s=0.5)
            one, two = fleet.start(), fleet.start()
            await fleet.chat(one, MSGS)
            server.stop()  # a crash: the session table is gone mid-session
            t0 = time.monotonic()
            r = await fleet.chat(two, TURN2, model="tgt")
            assert time.monotonic() - t0 < 5
            assert r.status_code == 200, r.text
            assert r.headers[P.STATUS_HEADER].startswith("fallback_reprefill: state_unavailable")
            served = [b for kind, b in fleet.target.calls if kind == "chat"][-1]  # forwarded as it came
            assert "kv_transfer_params" not in served  # a normal prefill: nothing of the session is mapped
            assert not served["cache_salt"].startswith(P.MAPPED_SALT)
            assert len(fleet.gens(fleet.source)) == 1  # and no save step either
            r = await fleet.chat(one, TURN2)  # a source turn: served, unstored
            assert r.status_code == 200 and r.headers[P.STATUS_HEADER] == "source: not_stored (state_unavailable)"
            stats = (await fleet.proxies[two][1].get("/kvtransfer/stats")).json()
            assert stats["errors"]["state_unavailable"] == 1
            assert stats["fallbacks"] == {"fallback_reprefill:state_unavailable": 1}
            assert stats["errors"]["state_lock:ConnectionError"] == 1  # the first call that met the dead server
            metrics = (await fleet.proxies[two][1].get("/metrics")).text
            assert 'kvtransfer_proxy_errors_total{kind="state_unavailable"} 1' in metrics
            deleted = await fleet.proxies[one][1].delete("/kvtransfer/sessions/s",
                                                         headers={"authorization": "Bearer k1"})
            assert deleted.status_code == 503 and "retry" in deleted.json()["error"]["message"]
        run(go())
    finally:
        server.stop()


def test_the_proxys_own_redis_store_calls_are_on_its_metrics(redis_server):
    """With a Redis store the proxy's switch asks it for the tip: hits, misses, latency and errors are on /metrics;
    a killed store server is counted and the switch goes on (the consumer looks for itself)."""
    server = RedisServer()
    try:
        async def go():
            proxy = P.HandoffProxy("http://source", "http://target", start_ids=START, store=server.url,
                                   state=_deployment_url(redis_server), state_timeout_s=0.5, switch_stall_s=0.05)
            engines = Fleet(server.url)
            proxy.client = httpx.AsyncClient(transport=engines.router)
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=P.build_app(proxy)), base_url="http://proxy")

            async def chat(model, messages, session):
                return await client.post("/v1/chat/completions", json={"model": model, "messages": messages},
                                         headers={P.SESSION_HEADER: session, "authorization": "Bearer k"})

            await chat("src", MSGS, "s")
            assert (await chat("tgt", TURN2, "s")).status_code == 200
            text = (await client.get("/metrics")).text
            assert 'kvtransfer_proxy_store_misses_total{op="tip"}' in text  # the fake producer writes no Redis blocks
            assert 'kvtransfer_proxy_store_latency_seconds_count{op="tip"}' in text
            await chat("src", MSGS, "s2")
            server.stop()
            t0 = time.monotonic()
            r = await chat("tgt", TURN2, "s2")
            assert r.status_code == 200 and r.headers[P.STATUS_HEADER].startswith("mapped ")
            assert time.monotonic() - t0 < 3
            text = (await client.get("/metrics")).text
            assert 'kvtransfer_proxy_errors_total{kind="store_unavailable:StoreUnavailable"} 1' in text
            assert 'kvtransfer_proxy_store_errors_total{kind="tip:ConnectionError"} 1' in text
        run(go())
    finally:
        server.stop()


def test_a_bad_deployment_name_is_refused_by_name():
    with pytest.raises(ValueError, match="deployment 'a\\*b'"):
        P.redis_sessions("redis://127.0.0.1:1/0?deployment=a*b", b"a" * 64, timeout_s=0.2)
