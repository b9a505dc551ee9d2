"""The handoff proxy (kvtransfer.serve.proxy) against in-process fake engines (no vLLM, no sockets).

The fakes speak the part of vLLM's OpenAI server the proxy uses: /v1/models, /tokenize (a character
tokenizer and a toy chat template), /v1/completions and /v1/chat/completions (streaming too). The fake
producer records every prompt it read into a shared store, under the request's namespace
(`kv_transfer_params.kvtransfer_ns`, as the real connector does); the fake consumer reports the tokens it could
take from that store under the request's namespace as `usage.prompt_tokens_details.cached_tokens`, with the
connector's rule (a stored prompt maps all but its last token; `kvtransfer_source_len` = n maps the first n
tokens when stored). Both fakes keep a prefix cache per `cache_salt`, as vLLM does, and report its hits.
"""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

import httpx  # the [dev] extra installs httpx and fastapi
from fastapi import FastAPI, Request  # module level: FastAPI resolves the (string) annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from kvtransfer.serve import proxy as P

START = [7]


class Engine:
    """A fake vLLM OpenAI server: `name` is its served model; `store` is shared by producer and consumer."""

    def __init__(self, name: str, store: set, *, consumer: bool, report_cached: bool = True):
        self.name, self.store, self.consumer, self.report_cached = name, store, consumer, report_cached
        self.calls: list[tuple[str, dict]] = []
        self.cache: dict[str, set] = {}  # the engine's prefix cache: salt -> prompts it holds
        self.report_decision = True  # return the connector's decision as kv_transfer_params (the real consumer does)
        self.maps = True
        self.fail_status = 0  # answer every generation request with this HTTP status
        self.fail_message = "boom"
        self.vocab = 1 << 20
        self.stores = True  # a producer whose connector stores what it reads
        self.write_delay = 0.0  # seconds after its response that a producer's write lands (its writer thread)
        self.app = self._app()

    @staticmethod
    def template(messages, add_generation_prompt=True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    def reply_text(self, ids: list[int]) -> str:
        return f"{self.name}:{len(ids)}:{sum(ids) % 97}"

    B = 1  # the fake store's block size (Rig(block=...) sets it for both engines and the proxy)

    def stored(self, ids: list[int], params: dict) -> int:
        """Tokens of `ids` the fake store holds: the longest common prefix with a prompt the producer read, in
        whole blocks, capped by kvtransfer_source_len."""
        n = params.get("kvtransfer_source_len", len(ids))
        ns = params.get("kvtransfer_ns", "")
        best = 0
        for space, prompt in self.store:
            if space != ns:
                continue
            k = 0
            while k < min(len(prompt), len(ids), n) and prompt[k] == ids[k]:
                k += 1
            best = max(best, k // self.B * self.B)
        return best

    def decision(self, ids: list[int], body: dict) -> dict | None:
        """The fake connector's decision: vLLM's prefix-cache hits under the request's cache_salt (the prompts this
        salt served before), then the store beyond them; every prompt keeps its last token native."""
        params = body.get("kv_transfer_params") or {}
        salt = body.get("cache_salt")
        if not self.consumer:
            return {"reason": "source", "mapped": 0, "cached": self.cache_hits(ids, salt), "prefilled": 0}
        hits = 0
        for prompt in self.cache.get(salt, ()) if salt else ():
            k = 0
            while k < min(len(prompt), len(ids) - 1) and prompt[k] == ids[k]:
                k += 1
            hits = max(hits, k // self.B * self.B)
        if salt:
            self.cache.setdefault(salt, set()).add(tuple(ids))
        stored = min(self.stored(ids, params), len(ids) - 1) if self.maps and params.get("kvtransfer") != "off" else 0
        if stored > hits:
            return {"reason": "mapped", "mapped": stored - hits, "cached": hits, "prefilled": len(ids) - stored}
        return {"reason": "cached" if hits else "no_entry", "mapped": 0, "cached": hits, "prefilled": len(ids) - hits}

    def cache_hits(self, ids: list[int], salt: str | None) -> int:
        """The producer's prefix-cache hits: whole blocks shared with a prompt it read under the same salt (vLLM
        hashes the salt into a request's first block); then the prompt joins the cache."""
        hits = 0
        for prompt in self.cache.get(salt or "", ()):
            k = 0
            while k < min(len(prompt), len(ids) - 1) and prompt[k] == ids[k]:
                k += 1
            hits = max(hits, k // self.B * self.B)
        self.cache.setdefault(salt or "", set()).add(tuple(ids))
        return hits

    def _app(self):
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.name}]}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            self.calls.append(("tokenize", body))
            if "messages" in body:
                ids = self.encode(self.template(body["messages"], body.get("add_generation_prompt", True)))
            else:
                ids = self.encode(body["prompt"])
            return {"tokens": ids, "count": len(ids)}

        async def generate(kind: str, request: Request):
            body = await request.json()
            self.calls.append((kind, body))
            if self.fail_status:
                return JSONResponse({"error": {"message": self.fail_message}}, status_code=self.fail_status)
            if body.get("model") != self.name:
                return JSONResponse({"error": {"message": f"model {body.get('model')} not found"}}, status_code=404)
            if kind == "completion" and isinstance(body.get("prompt"), list) and \
                    any(i >= self.vocab for i in body["prompt"]):  # vLLM checks ids against its vocabulary
                return JSONResponse({"error": {"message": "token id out of vocabulary"}}, status_code=400)
            if kind == "chat":
                ids = self.encode(self.template(body["messages"]))
            else:
                ids = list(body["prompt"]) if isinstance(body["prompt"], list) else self.encode(body["prompt"])
            if not self.consumer and kind == "completion" and self.stores:  # the connector saves what it reads
                entry = ((body.get("kv_transfer_params") or {}).get("kvtransfer_ns", ""), tuple(ids))
                if self.write_delay:
                    asyncio.get_running_loop().call_later(self.write_delay, self.store.add, entry)
                else:
                    self.store.add(entry)
            decision = self.decision(ids, body)
            cached = decision["mapped"] + decision["cached"]
            body["usage_seen"] = {"cached": cached}  # what this engine reported (tests read it from `calls`)
            usage = {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3}
            if self.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            text = self.reply_text(ids)
            logprobs = None
            if kind == "completion" and body.get("logprobs") is not None:
                logprobs = {"tokens": ["a"], "token_logprobs": [-0.5],
                            "top_logprobs": [{"a": -0.5, "b": -1.5}][: 1]}
            if not body.get("stream"):
                if kind == "chat":
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                    return {"id": "chatcmpl-x", "object": "chat.completion", "model": self.name,
                            "choices": [choice], "usage": usage}
                out = {"id": "cmpl-x", "object": "text_completion", "model": self.name,
                       "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
                       "usage": usage}
                if self.consumer and self.report_decision:
                    out["kv_transfer_params"] = {"kvtransfer": decision}
                return out
            options = body.get("stream_options") or {}

            async def events():
                pieces = [text[:4], text[4:]]
                for i, piece in enumerate(pieces):
                    if kind == "chat":
                        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece, "finish_reason": "length" if i else None}
                    event = {"id": "x", "choices": [choice]}
                    if options.get("continuous_usage_stats"):  # vLLM: no prompt_tokens_details here
                        event["usage"] = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
                    yield f"data: {json.dumps(event)}\n\n"
                if options.get("include_usage"):
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await generate("chat", request)

        return app


class Router(httpx.AsyncBaseTransport):
    """Sends each host's requests to its fake engine; a host in `dead` refuses the connection."""

    def __init__(self, engines: dict):
        self.transports = {host: httpx.ASGITransport(app=e.app) for host, e in engines.items()}
        self.dead: set[str] = set()

    async def handle_async_request(self, request):
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.transports[host].handle_async_request(request)


class FakeStore:
    """What the proxy asks of the block store (`tip`, `delete_namespace`), over the fakes' shared set of
    (namespace, prompt): a prompt stands for its whole blocks."""

    def __init__(self, entries: set, block_size: int):
        self.entries, self.block_size = entries, block_size

    def tip(self, ids, model_key=None, ns=""):
        best = 0
        for space, prompt in list(self.entries):
            k = 0
            while space == ns and k < min(len(prompt), len(ids)) and prompt[k] == ids[k]:
                k += 1
            best = max(best, k // self.block_size * self.block_size)
        return ("m", "h", best) if best else None

    def delete_namespace(self, ns):
        gone = {e for e in self.entries if e[0] == ns}
        self.entries -= gone
        return len(gone)

    def holds(self, ns) -> bool:
        return self.count(ns) > 0

    def count(self, ns) -> int:
        return sum(1 for e in self.entries if e[0] == ns)


class Rig:
    """A proxy in front of a fake producer ("src", host source) and consumer ("tgt", host target); store=True
    gives the proxy a view of the fakes' store (waits at a switch, deletes)."""

    def __init__(self, block: int = 1, store: bool = False, **kwargs):
        self.store: set = set()
        self.source = Engine("src", self.store, consumer=False)
        self.target = Engine("tgt", self.store, consumer=True, **kwargs)
        self.source.B = self.target.B = block
        self.router = Router({"source": self.source, "target": self.target})
        upstream = httpx.AsyncClient(transport=self.router)
        self.proxy = P.HandoffProxy("http://source", "http://target", start_ids=START, client=upstream,
                                    block_size=block)
        self.fake_store = FakeStore(self.store, block)
        if store:
            self.proxy.store = self.fake_store
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=P.build_app(self.proxy)),
                                        base_url="http://proxy")

    async def chat(self, messages, model="src", session=None, key="k1", **extra):
        """POST a chat request as the client with API key `key` (None: no Authorization header)."""
        headers = {P.SESSION_HEADER: session} if session else {}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        headers.update(extra.pop("headers", {}))
        return await self.client.post("/v1/chat/completions", json={"model": model, "messages": messages, **extra},
                                      headers=headers)

    def ns(self, session: str, key: str = "k1") -> str:
        """The store namespace of `key`'s session `session`."""
        return self.proxy.sessions.namespace(self.proxy.sessions.owner_of(f"Bearer {key}"), session)

    def gen_calls(self, engine, kind="completion"):
        return [body for k, body in engine.calls if k == kind]


def run(coro):
    return asyncio.run(coro)


MSGS = [{"role": "user", "content": "hello there"}]


def _ids(messages):
    return START + Engine.encode(Engine.template(messages))


def test_source_serves_a_session_until_it_asks_for_the_target():
    async def go():
        rig = Rig()
        r = await rig.chat(MSGS, session="s")
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER] == "source"
        assert r.json()["object"] == "chat.completion"
        assert r.json()["choices"][0]["message"]["content"] == rig.source.reply_text(_ids(MSGS))
        assert r.json()["kvtransfer"]["status"] == "source"
        # written through: the source read the session's token ids (start ids + the target's template)
        assert [b["prompt"] for b in rig.gen_calls(rig.source)] == [_ids(MSGS)] and not rig.gen_calls(rig.source, "chat")
        assert rig.gen_calls(rig.target, "chat") == [] and rig.gen_calls(rig.target) == []
    run(go())


def test_the_switch_of_a_warm_session_sends_nothing_to_the_producer():
    async def go():
        rig = Rig(block=16)
        await rig.chat(MSGS, session="s")
        turn2 = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and now?"}]
        r = await rig.chat(turn2, model="tgt", session="s", max_tokens=5)
        ids, stored = _ids(turn2), len(_ids(MSGS)) // 16 * 16
        assert len(rig.gen_calls(rig.source)) == 1  # only the source's own turn: no save, no re-prefill
        served = rig.gen_calls(rig.target)[-1]
        assert served["prompt"] == ids and served["model"] == "tgt" and served["max_tokens"] == 5
        ns = rig.ns("s")  # the session's store namespace: the source stored under it, the target looks there
        assert served["kv_transfer_params"] == {"kvtransfer_source_len": stored, "kvtransfer_ns": ns}
        assert rig.gen_calls(rig.source)[0]["kv_transfer_params"] == {"kvtransfer_ns": ns}
        assert served["cache_salt"].startswith(P.MAPPED_SALT + ":")
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER] == f"mapped {stored} tokens, prefilled {len(ids) - stored}"
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "tgt"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": rig.target.reply_text(ids)}
        assert body["kvtransfer"]["save_s"] is None
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert stats["counts"]["mapped"] == 1 and stats["counts"]["source"] == 1 and stats["counts"]["requests"] == 2
        assert stats["handoff"] == {"written_through": 1, "switches": 1}
    run(go())


def test_a_cold_session_is_read_once_by_the_producer_then_mapped():
    async def go():
        rig = Rig(block=16)
        r = await rig.chat(MSGS, model="tgt", session="s")
        ids = _ids(MSGS)
        save = rig.gen_calls(rig.source)[-1]
        assert save["prompt"] == ids and save["max_tokens"] == 1 and save["model"] == "src"
        assert r.headers[P.STATUS_HEADER] == f"mapped {len(ids) // 16 * 16} tokens, prefilled {len(ids) % 16}"
        assert r.json()["kvtransfer"]["save_s"] >= 0
    run(go())


def test_later_turns_hit_the_targets_own_cache_and_prefill_only_the_new_turn():
    async def go():
        rig = Rig(block=16)
        await rig.chat(MSGS, session="s")
        turn2 = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more " * 8}]
        await rig.chat(turn2, model="tgt", session="s")
        salt = rig.gen_calls(rig.target)[-1]["cache_salt"]
        turn3 = turn2 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "last"}]
        r = await rig.chat(turn3, model="tgt", session="s")
        assert len(rig.gen_calls(rig.source)) == 1
        served = rig.gen_calls(rig.target)[-1]
        assert served["cache_salt"] == salt  # the same session, the same salt: its own blocks are exact hits
        hits = len(_ids(turn2)) // 16 * 16
        assert r.headers[P.STATUS_HEADER] == f"cached {hits} tokens, prefilled {len(_ids(turn3)) - hits}"
        assert r.json()["kvtransfer"]["status"] == "cached" and r.json()["kvtransfer"]["mapped"] == 0
        # another session with the same conversation never shares those blocks: its own salt, mapped from the store
        await rig.chat(MSGS, session="other")
        r = await rig.chat(turn2, model="tgt", session="other")
        assert rig.gen_calls(rig.target)[-1]["cache_salt"] != salt
        assert r.headers[P.STATUS_HEADER].startswith("mapped ")
        # an edited history no longer extends the session: counted, and the consumer maps what the store holds
        r = await rig.chat([{"role": "user", "content": "other"}], model="tgt", session="s")
        assert r.status_code == 200 and len(rig.gen_calls(rig.source)) == 2
        assert (await rig.client.get("/kvtransfer/stats")).json()["handoff"]["history_rewritten"] == 1
    run(go())


def test_header_and_alias_select_the_target():
    async def go():
        rig = Rig()
        r = await rig.chat(MSGS, model="src", headers={P.MODEL_HEADER: "target"})
        assert r.headers[P.STATUS_HEADER].startswith("mapped ")
        r = await rig.chat(MSGS, model="target")
        assert r.headers[P.STATUS_HEADER].startswith("mapped ")
        r = await rig.client.post("/v1/completions", json={"prompt": "abc"})  # no model: the source
        assert r.headers[P.STATUS_HEADER] == "source"
    run(go())


def test_completions_text_and_ids_get_start_ids_once():
    async def go():
        rig = Rig()
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": "abcd"})
        assert rig.gen_calls(rig.source)[-1]["prompt"] == START + Engine.encode("abcd")
        assert r.json()["object"] == "text_completion" and r.json()["kvtransfer"]["status"] == "mapped"
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": START + [50, 51, 52]})
        assert rig.gen_calls(rig.source)[-1]["prompt"] == START + [50, 51, 52]
        assert r.headers[P.STATUS_HEADER] == "mapped 3 tokens, prefilled 1"
    run(go())


def test_dead_producer_falls_back_to_a_target_prefill():
    async def go():
        rig = Rig()
        rig.router.dead.add("source")
        r = await rig.chat(MSGS, model="tgt", session="s")
        assert r.status_code == 200
        assert r.headers[P.STATUS_HEADER].startswith("fallback_reprefill: save_failed")
        assert r.json()["kvtransfer"]["prefilled"] == len(_ids(MSGS)) and r.json()["kvtransfer"]["mapped"] == 0
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert stats["fallbacks"] == {"fallback_reprefill:save_failed": 1}
        # the next turn, with the producer back, is a fresh handoff (nothing was handed over): the producer reads it,
        # but the consumer already holds this session's prompt in its own cache (its fallback prefilled it)
        rig.router.dead.clear()
        r = await rig.chat(MSGS, model="tgt", session="s")
        assert rig.gen_calls(rig.source)[-1]["max_tokens"] == 1
        assert r.headers[P.STATUS_HEADER] == f"cached {len(_ids(MSGS)) - 1} tokens, prefilled 1"
        r = await rig.chat(MSGS, model="tgt", session="fresh")  # a new session: mapped from the store
        assert r.headers[P.STATUS_HEADER].startswith("mapped ")
    run(go())


def test_producer_error_status_is_a_save_failure_not_a_crash():
    async def go():
        rig = Rig()
        rig.source.fail_status = 500
        r = await rig.chat(MSGS, model="tgt")
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].startswith("fallback_reprefill: save_failed")
    run(go())


def test_consumer_declining_is_counted_as_its_fallback():
    async def go():
        rig = Rig()
        rig.target.maps = False
        r = await rig.chat(MSGS, model="tgt")
        assert r.headers[P.STATUS_HEADER] == "fallback_reprefill: consumer_fallback (no_entry)"
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert stats["fallbacks"] == {"fallback_reprefill:consumer_fallback": 1}
        rig.target.report_decision = False  # a consumer that reports only vLLM's usage: read from its cached tokens
        r = await rig.chat(MSGS, model="tgt")
        assert r.headers[P.STATUS_HEADER] == "fallback_reprefill: consumer_fallback"
    run(go())


def test_dead_target_is_served_by_the_source():
    async def go():
        rig = Rig()
        rig.router.dead.add("target")
        rig.proxy.models = {"source": "src", "target": "tgt"}
        r = await rig.chat(MSGS, model="tgt", session="s")
        assert r.status_code == 200
        assert r.headers[P.STATUS_HEADER].startswith("fallback_source: ")
        assert r.json()["choices"][0]["message"]["content"].startswith("src:")
        rig.target.fail_status = 503
        rig.router.dead.clear()
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": [7, 1, 2]})
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].startswith("fallback_source: ")
    run(go())


def test_both_engines_down_is_a_502_and_the_proxy_keeps_serving():
    async def go():
        rig = Rig()
        rig.proxy.models = {"source": "src", "target": "tgt"}
        rig.router.dead.update({"source", "target"})
        r = await rig.chat(MSGS, model="tgt")
        assert r.status_code == 502 and "error" in r.json()
        r = await rig.chat(MSGS)
        assert r.status_code == 502
        rig.router.dead.clear()
        r = await rig.chat(MSGS, model="tgt")
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].startswith("mapped ")
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert stats["errors"] == {"engines_down": 2}
    run(go())


@pytest.mark.parametrize("payload", [
    b"not json", b"[1, 2]", b'{"model": ["tgt"], "messages": []}', b'{"model": "nope", "messages": []}',
    b'{"model": "tgt", "messages": "hi"}', b'{"model": "tgt", "messages": [], "stream": "yes"}',
    b'{"model": "tgt", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": "2"}',
])
def test_bad_requests_are_400s(payload):
    async def go():
        rig = Rig()
        r = await rig.client.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert (await rig.client.get("/kvtransfer/stats")).json()["errors"] == {"bad_request": 1}
        r = await rig.chat(MSGS, model="tgt")  # and the proxy still serves
        assert r.status_code == 200
    run(go())


def test_bad_completion_prompts_and_headers_are_400s():
    async def go():
        rig = Rig()
        for body, headers in [({"model": "tgt"}, {}), ({"model": "tgt", "prompt": [["a"], 3]}, {}),
                              ({"model": "tgt", "prompt": ["a", "b"]}, {}), ({"prompt": "a"}, {P.MODEL_HEADER: "big"})]:
            r = await rig.client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 400, body
        # an engine's own 4xx (e.g. its model refuses the request) reaches the client as a 400, not a fallback
        rig.target.fail_status, rig.target.fail_message = 400, "this model's context is 8 tokens"
        for stream in (False, True):
            r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": "ab", "stream": stream},
                                      headers={P.MODEL_HEADER: "target"})
            assert r.status_code == 400 and "context is 8 tokens" in r.json()["error"]["message"], stream
        rig.target.fail_status = 0
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": "ab"},
                                  headers={P.MODEL_HEADER: "target"})
        assert r.status_code == 200
    run(go())


def test_streaming_handoff_is_chat_chunks_with_the_status_last():
    async def go():
        rig = Rig()
        plain = (await rig.chat(MSGS, model="tgt")).json()["choices"][0]["message"]["content"]
        r = await rig.chat(MSGS, model="tgt", stream=True)
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].startswith("handoff: ")
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [json.loads(x) for x in lines[:-1]]
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "role" not in events[1]["choices"][0]["delta"]
        assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == plain
        n = len(_ids(MSGS))
        assert events[-1]["choices"] == [] and events[-1]["kvtransfer"]["summary"] == f"mapped {n - 1} tokens, prefilled 1"
        assert all("usage" not in e for e in events)  # the client did not ask for usage
        upstream = rig.gen_calls(rig.target)[-1]
        assert upstream["stream"] and upstream["stream_options"]["include_usage"]
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert stats["counts"]["mapped"] == 2
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": "xyz", "stream": True,
                                                           "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == rig.target.reply_text(START + Engine.encode("xyz"))
        assert events[-1]["usage"]["prompt_tokens"] == 4 and events[-1]["kvtransfer"]["status"] == "mapped"
    run(go())


def test_streaming_with_a_dead_producer_says_so_up_front():
    async def go():
        rig = Rig()
        rig.router.dead.add("source")
        rig.proxy.models["source"] = "src"
        r = await rig.chat(MSGS, model="tgt", stream=True)
        assert r.headers[P.STATUS_HEADER].startswith("fallback_reprefill: save_failed")
        last = json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])
        assert last["kvtransfer"]["status"] == "fallback_reprefill" and last["kvtransfer"]["mapped"] == 0
    run(go())


def test_streaming_from_the_source_is_relayed():
    async def go():
        rig = Rig()
        r = await rig.client.post("/v1/completions", json={"model": "src", "prompt": "abc", "stream": True},
                                  headers={P.SESSION_HEADER: "s", "authorization": "Bearer k1"})
        assert r.headers[P.STATUS_HEADER] == "source"
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == rig.source.reply_text(START + Engine.encode("abc"))  # written through: on the session's ids
        assert events[-1]["kvtransfer"]["status"] == "source"
        r = await rig.chat(MSGS, model="src", stream=True, session="t", headers={P.WRITE_THROUGH_HEADER: "off"})
        assert r.headers[P.STATUS_HEADER] == "source" and rig.gen_calls(rig.source, "chat")  # relayed as it came
        text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"] for line in r.text.splitlines()
                       if line.startswith("data: {"))
        assert text == rig.source.reply_text(Engine.encode(Engine.template(MSGS)))
        await rig.chat(MSGS, model="src")  # no session: nothing can hand it over, so it is relayed too
        assert len(rig.gen_calls(rig.source, "chat")) == 2
    run(go())


def test_chat_only_fields_go_to_the_target_as_chat_unmapped():
    async def go():
        rig = Rig()
        r = await rig.chat(MSGS, model="tgt", tools=[{"type": "function", "function": {"name": "f"}}])
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER] == "fallback_reprefill: chat_fields (tools)"
        assert rig.gen_calls(rig.target, "chat") and not rig.gen_calls(rig.source)
    run(go())


def test_unknown_mapped_count_says_how_to_get_it():
    async def go():
        rig = Rig(report_cached=False)
        rig.target.report_decision = False
        r = await rig.chat(MSGS, model="tgt")
        assert r.status_code == 200 and "--enable-prompt-tokens-details" in r.headers[P.STATUS_HEADER]
    run(go())


def test_chat_logprobs_are_converted():
    async def go():
        rig = Rig()
        r = await rig.chat(MSGS, model="tgt", logprobs=True, top_logprobs=2, max_completion_tokens=4)
        upstream = rig.gen_calls(rig.target)[-1]
        assert upstream["logprobs"] == 2 and upstream["max_tokens"] == 4 and "messages" not in upstream
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content == [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                                             {"token": "b", "logprob": -1.5}]}]
    run(go())


def test_concurrent_sessions_stay_apart():
    async def go():
        rig = Rig()

        async def session(i):
            msgs = [{"role": "user", "content": f"session {i}"}]
            out = []
            for turn in range(4):
                model = "tgt" if turn >= 2 else "src"
                r = await rig.chat(msgs, model=model, session=f"s{i}")
                out.append(r.headers[P.STATUS_HEADER])
                msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                               {"role": "user", "content": f"turn {turn}"}]
            return out

        results = await asyncio.gather(*(session(i) for i in range(8)))
        for statuses in results:
            assert statuses[:2] == ["source", "source"]
            assert statuses[2].startswith("mapped ") and statuses[3].startswith("cached ")
        assert len(rig.gen_calls(rig.source)) == 8 * 2  # 2 source turns per session, no save
        assert len({body["cache_salt"] for body in rig.gen_calls(rig.target)}) == 8  # one salt per session
    run(go())


def test_session_table_is_bounded():
    async def go():
        rig = Rig()
        rig.proxy.max_sessions = 3
        for i in range(6):
            await rig.chat(MSGS, session=f"s{i}")
        assert rig.proxy.sessions.ids() == ["s3", "s4", "s5"]
    run(go())


def test_start_ids_argument():
    assert P._ids("151643") == [151643] and P._ids("1,2") == [1, 2]
    with pytest.raises(Exception, match="comma-separated"):
        P._ids("a,b")


def test_the_consumers_own_decision_outranks_vllms_cached_count():
    """vLLM reports a rejected load's tokens as cached; the connector's kv_transfer_params says load_failed: the
    proxy reports the fallback, not a mapping. Without the field it reads the usage as before."""
    proxy = P.HandoffProxy("http://s", "http://t")
    usage = {"prompt_tokens": 201, "prompt_tokens_details": {"cached_tokens": 192}}
    failed = {"kvtransfer": {"reason": "load_failed", "mapped": 0, "prefilled": 201}}
    out = proxy.judge(usage, "", 0.1, failed)
    assert (out.status, out.mapped, out.prefilled, out.header()) == (
        "fallback_reprefill", 0, 201, "fallback_reprefill: consumer_fallback (load_failed)")
    ok = proxy.judge(usage, "", 0.1, {"kvtransfer": {"reason": "mapped", "mapped": 176, "prefilled": 25}})
    assert ok.header() == "mapped 176 tokens, prefilled 25"
    assert proxy.judge(usage, "", 0.1, None).header() == "mapped 192 tokens, prefilled 9"
    assert proxy.judge(usage, "", 0.1, {"kvtransfer": "garbled"}).header() == "mapped 192 tokens, prefilled 9"
    gated = {"kvtransfer": {"reason": "mapped", "mapped": 0, "prefilled": 201,
                            "gate": {"action": "full", "reason": "score 0.4 > 0.3"}}}
    assert proxy.judge(usage, "", 0.1, gated).header() == "fallback_reprefill: gate_full (score 0.4 > 0.3)"
    kept = {"kvtransfer": {"reason": "mapped", "mapped": 128, "prefilled": 73, "gate": {"action": "recompute"}}}
    assert proxy.judge(usage, "", 0.1, kept).header() == "mapped 128 tokens, prefilled 73"


def test_a_session_is_its_keys_alone_another_key_with_the_same_id_gets_its_own():
    async def go():
        rig = Rig(block=4, store=True)
        doc = [{"role": "user", "content": "alice's private document " * 3}]
        assert (await rig.chat(doc, session="s", key="alice")).status_code == 200
        # mallory opens the same id and guesses alice's document: a session of her own, a cold switch (the
        # producer reads her prompt once) that maps only what she stored, and nothing of alice's in any cache
        r = await rig.chat(doc, model="tgt", session="s", key="mallory")
        assert r.status_code == 200 and r.json()["kvtransfer"]["save_s"] is not None
        served = rig.gen_calls(rig.target)[-1]
        assert served["kv_transfer_params"]["kvtransfer_ns"] == rig.ns("s", "mallory") != rig.ns("s", "alice")
        assert r.json()["kvtransfer"]["cached"] in (None, 0)  # no hit in the target's cache under alice's salt
        assert rig.gen_calls(rig.source)[-1]["usage_seen"]["cached"] == 0  # nor in the source's (alice's salt)
        # mallory deletes "her" session: alice's session and blocks are untouched, and alice's switch maps them
        r = await rig.client.delete("/kvtransfer/sessions/s", headers={"authorization": "Bearer mallory"})
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert rig.fake_store.holds(rig.ns("s", "alice")) and not rig.fake_store.holds(rig.ns("s", "mallory"))
        r = await rig.chat(doc, model="tgt", session="s", key="alice")
        assert r.status_code == 200 and r.json()["kvtransfer"]["status"] == "mapped"
        assert r.json()["kvtransfer"]["save_s"] is None  # her own warm switch: no save step
        assert (await rig.client.get("/kvtransfer/stats")).json()["errors"] == {}
    run(go())


def test_the_module_docstring_says_what_another_key_on_a_taken_id_gets():
    """The proxy's own description of isolation matches what it does: another key that sends a taken session id
    gets a 200 and a session of its own (a different namespace), not a 403."""
    assert "403" not in P.__doc__ and "a session of its own" in " ".join(P.__doc__.split())

    async def go():
        rig = Rig(block=4)
        assert (await rig.chat(MSGS, session="s", key="alice")).status_code == 200
        r = await rig.chat(MSGS, session="s", key="mallory")
        assert r.status_code == 200 and len(rig.proxy.sessions) == 2
        assert rig.gen_calls(rig.source)[-1]["kv_transfer_params"]["kvtransfer_ns"] == rig.ns("s", "mallory")
    run(go())


def test_a_freed_id_reopened_by_another_key_reaches_nothing_of_the_first_owners():
    """The first owner deletes (or the table evicts) a session; another key opens the same id: its salt and its
    namespace differ, so neither the consumer's prefix cache nor the store gives it the first owner's tokens."""
    async def go():
        rig = Rig(block=4, store=True)
        doc = [{"role": "user", "content": "alice's document, two pages long " * 3}]
        await rig.chat(doc, session="s", key="alice")
        await rig.chat(doc, model="tgt", session="s", key="alice")  # handed over: the target caches it under a salt
        alice_salt = rig.gen_calls(rig.target)[-1]["cache_salt"]
        await rig.client.delete("/kvtransfer/sessions/s", headers={"authorization": "Bearer alice"})
        assert not rig.fake_store.holds(rig.ns("s", "alice"))
        rig.source.fail_status = 500  # no save step can store anything for mallory: only a leak could map
        r = await rig.chat(doc, model="tgt", session="s", key="mallory")
        served = rig.gen_calls(rig.target)[-1]
        assert served["cache_salt"] != alice_salt and served["prompt"] == _ids(doc)
        assert r.status_code == 200 and r.json()["kvtransfer"]["status"] == "fallback_reprefill"
        assert r.json()["kvtransfer"]["cached"] == 0 and r.json()["kvtransfer"]["mapped"] == 0
        # alice re-opens her id: hers again (no 403), and her salt is the one she had
        rig.source.fail_status = 0
        assert (await rig.chat(doc, model="tgt", session="s", key="alice")).status_code == 200
        assert rig.gen_calls(rig.target)[-1]["cache_salt"] == alice_salt
    run(go())


def test_the_sources_cache_is_salted_per_key_so_a_guess_learns_nothing():
    async def go():
        rig = Rig(block=4)
        secret = [{"role": "user", "content": "the merger closes on the 14th at 9am " * 2}]
        await rig.chat(secret, session="a", key="alice")
        guess = [{"role": "user", "content": "the merger closes on the 14th"}]
        r = await rig.chat(guess, key="mallory")  # no session: forwarded to the source under mallory's salt
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = await rig.chat(guess, session="m", key="mallory")  # a session: written through under her salt
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = await rig.chat(guess, session="a2", key="alice")  # as alice it hits her own cache: the fake can see it
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    run(go())


def test_keyless_callers_share_one_unsalted_source_cache_as_the_docs_say():
    """Requests without an API key carry no cache salt to the source: one keyless caller's guessed prefix of
    another's prompt is a cache hit it can read off its usage (a keyed caller's guess is not). docs/serving.md
    says so where it describes isolation."""
    from pathlib import Path

    async def go():
        rig = Rig(block=4)
        rig.proxy.allow_anonymous_sessions = True
        secret = [{"role": "user", "content": "the merger closes on the 14th at 9am " * 2}]
        guess = [{"role": "user", "content": "the merger closes on the 14th"}]
        await rig.chat(secret, session="a", key=None)  # an anonymous session's source turn
        assert "cache_salt" not in rig.gen_calls(rig.source)[-1]
        r = await rig.chat(guess, session="b", key=None)  # another keyless caller's session
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        r = await rig.chat(guess, session="m", key="mallory")  # a keyed caller's guess: her own salt, no hit
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await rig.chat(secret, key=None)  # keyless requests without a session, forwarded as they came: the same
        r = await rig.chat(guess, key=None)
        assert "cache_salt" not in rig.gen_calls(rig.source, "chat")[-1]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    run(go())
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().split())
    assert "Callers without an API key have no salt" in doc and "share one unsalted prefix cache" in doc


def test_a_session_without_a_key_is_refused_unless_the_deployment_allows_it():
    async def go():
        rig = Rig()
        r = await rig.chat(MSGS, session="s", key=None)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "--allow-anonymous-sessions" in r.json()["error"]["message"] and len(rig.proxy.sessions) == 0
        r = await rig.client.delete("/kvtransfer/sessions/s")
        assert r.status_code == 401
        assert (await rig.chat(MSGS, key=None)).status_code == 200  # no session: nothing to bind
        rig.proxy.allow_anonymous_sessions = True
        assert (await rig.chat(MSGS, session="s", key=None)).status_code == 200
    run(go())


def test_delete_takes_ids_with_slashes_and_every_block_of_the_session():
    async def go():
        rig = Rig(block=4, store=True)
        doc = [{"role": "user", "content": "a document of some length"}]
        await rig.chat(doc, session="team/a b", key="alice")
        rewritten = [{"role": "user", "content": "another first draft entirely"}]
        await rig.chat(rewritten, session="team/a b", key="alice")  # a rewritten history: a second chain
        ns = rig.ns("team/a b", "alice")
        assert rig.fake_store.count(ns) == 2
        r = await rig.client.delete("/kvtransfer/sessions/team/a b", headers={"authorization": "Bearer alice"})
        assert r.status_code == 200 and r.json() == {"deleted": True, "blocks": 2}
        assert rig.fake_store.count(ns) == 0 and len(rig.proxy.sessions) == 0
        await rig.chat(doc, model="tgt", session="cold", key="alice")  # opened on the target: the save step's chain
        r = await rig.client.delete("/kvtransfer/sessions/cold", headers={"authorization": "Bearer alice"})
        assert r.json() == {"deleted": True, "blocks": 1} and not rig.fake_store.holds(rig.ns("cold", "alice"))
        # after an LRU eviction the blocks still go: the namespace is a digest of (key, id), not table state
        await rig.chat(doc, session="t", key="alice")
        rig.proxy.sessions.table.clear()
        r = await rig.client.delete("/kvtransfer/sessions/t", headers={"authorization": "Bearer alice"})
        assert r.json() == {"deleted": False, "blocks": 1}
    run(go())


def test_a_cold_switch_waits_for_its_own_save_to_reach_the_store():
    async def go():
        rig = Rig(block=4, store=True)
        rig.source.write_delay = 0.3  # the producer's writer thread lands the blocks after its response
        r = await rig.chat(MSGS, model="tgt", session="s")
        assert r.json()["kvtransfer"]["status"] == "mapped", r.json()["kvtransfer"]
        stats = (await rig.client.get("/kvtransfer/stats")).json()["handoff"]
        assert stats["switch_waited"] == 1 and "switch_partial" not in stats
    run(go())


def test_a_switch_stops_waiting_when_the_store_does_not_grow_and_counts_it_partial():
    import time

    async def go():
        rig = Rig(block=4, store=True)
        rig.proxy.switch_wait_s, rig.proxy.switch_stall_s = 30.0, 0.2
        rig.source.stores = False  # a producer that stores nothing
        await rig.chat(MSGS, session="s")
        t0 = time.perf_counter()
        r = await rig.chat(MSGS, model="tgt", session="s")
        assert time.perf_counter() - t0 < rig.proxy.switch_wait_s / 6 and r.status_code == 200  # not the wait
        assert r.json()["kvtransfer"]["status"] == "fallback_reprefill"
        stats = (await rig.client.get("/kvtransfer/stats")).json()["handoff"]
        assert stats["switch_partial"] == 1
    run(go())


def test_a_rewritten_history_does_not_wait_for_blocks_that_cannot_come():
    import time

    async def go():
        rig = Rig(block=4, store=True)
        rig.proxy.switch_wait_s, rig.proxy.switch_stall_s = 30.0, 30.0
        await rig.chat(MSGS, session="s")
        t0 = time.perf_counter()
        r = await rig.chat([{"role": "user", "content": "hello again"}], model="tgt", session="s")
        assert time.perf_counter() - t0 < rig.proxy.switch_wait_s / 6 and r.status_code == 200  # not the wait
        stats = (await rig.client.get("/kvtransfer/stats")).json()["handoff"]
        assert stats["history_rewritten"] == 1 and stats["switch_partial_rewritten"] == 1
    run(go())


def test_bad_input_is_a_400_or_a_fallback_never_a_500():
    async def go():
        rig = Rig(block=4)
        nested = b'{"model": "tgt", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        r = await rig.client.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nests" in r.json()["error"]["message"]
        r = await rig.client.post("/v1/completions", json={"model": "tgt", "prompt": [1, 2 ** 40]},
                                  headers={"authorization": "Bearer k1", P.SESSION_HEADER: "s"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        rig.source.fail_status, rig.source.fail_message = 400, "naïve – ☃ refused"  # non-Latin-1 in the reason
        r = await rig.chat(MSGS, model="tgt", session="cold")
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].isascii()
        assert r.headers[P.STATUS_HEADER].startswith("fallback_reprefill: save_failed (source refused")
        r = await rig.chat(MSGS, model="tgt", session="cold2", stream=True)
        assert r.status_code == 200 and r.headers[P.STATUS_HEADER].isascii()
        stats = (await rig.client.get("/kvtransfer/stats")).json()
        assert not [k for k in stats["errors"] if k.startswith("proxy_error")], stats["errors"]
        assert set(stats["fallbacks"]) == {"fallback_reprefill:save_failed"}
    run(go())


def test_a_reason_that_is_not_an_identifier_is_counted_as_other():
    assert P.Outcome("fallback_reprefill", "target", reason="stream_ended (the consumer's stream ended early)").code \
        == "stream_ended"
    assert P.Outcome("fallback_reprefill", "target", reason="the consumer said no").code == "the"
    assert P.Outcome("fallback_reprefill", "target", reason="ünïcode reason").code == "other"
    assert P.Outcome("fallback_reprefill", "target", reason="consumer_fallback (no_entry)").code == "consumer_fallback"


def test_rejected_requests_leave_no_session_and_no_lock():
    async def go():
        rig = Rig()
        for i in range(2500):
            r = await rig.client.post("/v1/chat/completions", json={"model": "tgt", "messages": "not a list"},
                                      headers={P.SESSION_HEADER: f"{i:04d}" + "x" * 200})
            assert r.status_code == 400
        r = await rig.chat(MSGS, session="y" * 300)  # over the id limit
        assert r.status_code == 400
        for i in range(50):  # valid in shape, refused later (an empty conversation): no session either
            r = await rig.chat([], model="tgt", session=f"empty-{i}")
            assert r.status_code == 400
        assert len(rig.proxy.sessions) == 0 and rig.proxy.sessions._locks == {}
        await rig.chat(MSGS, session="ok")
        assert rig.proxy.sessions.ids() == ["ok"] and rig.proxy.sessions._locks == {}
        assert not hasattr(next(iter(rig.proxy.sessions.table.values())), "handed_ids")  # a length and a hash
    run(go())


def test_bodies_over_the_limit_are_413s():
    async def go():
        rig = Rig()
        rig.proxy.max_body_bytes = 1000
        r = await rig.chat([{"role": "user", "content": "x" * 2000}])
        assert r.status_code == 413
        assert (await rig.chat(MSGS)).status_code == 200
    run(go())


def test_only_allowed_kv_transfer_params_reach_the_consumer_and_client_salts_never_do():
    async def go():
        rig = Rig()
        await rig.chat(MSGS, session="s")
        params = {"kvtransfer_tag": "mine", "kvtransfer_source_len": 1, "do_remote_prefill": True}
        r = await rig.chat(MSGS, model="tgt", session="s", kv_transfer_params=params, cache_salt="kvtransfer-mapped:x")
        assert r.status_code == 200
        served = rig.gen_calls(rig.target)[-1]
        assert served["kv_transfer_params"] == {"kvtransfer_tag": "mine", "kvtransfer_source_len": len(_ids(MSGS)),
                                                "kvtransfer_ns": rig.ns("s")}
        assert served["cache_salt"] != "kvtransfer-mapped:x"
        assert (await rig.client.get("/kvtransfer/stats")).json()["handoff"]["params_dropped"] == 1
        r = await rig.chat(MSGS, model="tgt", kv_transfer_params={"kvtransfer": "maybe"})
        assert r.status_code == 400
    run(go())


def test_a_switch_waits_for_the_write_in_flight_then_maps_what_is_there(tmp_path):
    from kvtransfer.serve.store import KVStore

    async def go():
        rig = Rig(block=4)
        rig.proxy.store, rig.proxy.switch_wait_s = KVStore(tmp_path, block_size=4), 5.0
        ident = {"key": "0123456789abcdef", "n_layers": 1, "n_kv": 1, "head_dim": 2}
        ids = _ids(MSGS)
        n = len(ids) // 4 * 4
        await rig.chat(MSGS, session="s")
        layers = [(torch.zeros(1, len(ids), 2), torch.zeros(1, len(ids), 2))]
        writer = threading.Timer(0.3, lambda: rig.proxy.store.write(ids, layers, ident))
        writer.start()
        assert await rig.proxy._stored_until(ids, n, "") == n  # waited for the producer's write (0.3 s later)
        rig.proxy.switch_wait_s = 0.05
        assert await rig.proxy._stored_until(ids + [1] * 8, n + 8, "") == n  # never written: what is complete
        stats = rig.proxy.stats.as_dict()["handoff"]
        assert stats["switch_waited"] == 2
    run(go())


def test_metrics_and_mapper_start_ids(tmp_path):
    async def go():
        rig = Rig()
        await rig.chat(MSGS, session="s")
        text = (await rig.client.get("/metrics")).text
        assert 'kvtransfer_proxy_counts_total{kind="source"} 1' in text and "kvtransfer_proxy_sessions 1" in text
    run(go())
    (tmp_path / "mapper.json").write_text(json.dumps({"calibration": {"start_ids": [151643]}}))
    assert P.mapper_start_ids(tmp_path) == [151643]
    (tmp_path / "mapper.json").write_text(json.dumps({"calibration": {}}))
    with pytest.raises(ValueError, match="context_start=prefix_token"):
        P.mapper_start_ids(tmp_path)
    with pytest.raises(ValueError, match="give --mapper"):
        P.mapper_start_ids(tmp_path / "missing")


def test_a_later_turns_stream_says_its_reused_tokens_are_cached_or_mapped():
    """vLLM streams carry no kv_transfer_params: a later turn's usage counts the target's own cache hits and any
    re-mapped tokens together, and the proxy says so instead of calling them mapped."""
    async def go():
        rig = Rig(block=16)
        await rig.chat(MSGS, session="s")
        turn2 = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more " * 8}]
        r = await rig.chat(turn2, model="tgt", session="s", stream=True)
        last = json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])
        assert last["kvtransfer"]["status"] == "mapped"  # the switch: nothing can be cached under a fresh salt
        turn3 = turn2 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "last"}]
        r = await rig.chat(turn3, model="tgt", session="s", stream=True)
        last = json.loads([line for line in r.text.splitlines() if line.startswith("data: {")][-1][6:])
        hits = len(_ids(turn2)) // 16 * 16
        assert last["kvtransfer"]["status"] == "reused" and last["kvtransfer"]["cached"] == hits
        assert last["kvtransfer"]["summary"].startswith(f"reused {hits} tokens (cached or mapped")
    run(go())


# ---------------------------------------------------------------- the deployment's secret
def test_the_secret_file_is_made_once_mode_0600_and_reused(tmp_path):
    import os
    import stat

    path = tmp_path / "proxy.secret"
    first = P.read_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # only the proxy's user can read it
    assert len(first) == 64 and all(c in b"0123456789abcdef" for c in first)
    assert P.read_secret(path) == first  # a restart reads the same secret, never a new one
    assert P.read_secret(tmp_path / "other.secret") != first  # another deployment: its own


@pytest.mark.parametrize("text", ["", "short0123", "Z" * 64, "0123456789abcdef" * 3 + "not hex!" * 2])
def test_a_malformed_secret_file_is_refused_naming_the_fix_and_left_alone(tmp_path, text):
    path = tmp_path / "proxy.secret"
    path.write_text(text)
    with pytest.raises(ValueError, match="does not hold a secret.*remove it"):
        P.read_secret(path)
    assert path.read_text() == text  # never overwritten: the operator decides


def test_a_restarted_proxy_with_the_same_secret_file_keeps_every_sessions_names(tmp_path):
    """Session owners, cache salts and store namespaces are keyed digests under the secret: a proxy restarted on
    the same secret file derives the same ones for the same key and id (its sessions' stored blocks and the
    target's cached ones stay theirs); another secret derives others."""
    path = tmp_path / "proxy.secret"

    def names(proxy):
        owner = proxy.sessions.owner_of("Bearer alice")
        return owner, proxy.sessions.salt(owner, "doc"), proxy.sessions.namespace(owner, "doc"), \
            proxy.sessions.source_salt(owner)

    def start(secret):
        return P.HandoffProxy("http://source", "http://target", start_ids=START, secret=secret)

    before, after = names(start(P.read_secret(path))), names(start(P.read_secret(path)))
    assert before == after and all(before)
    assert names(start(P.read_secret(tmp_path / "new.secret")))[1:3] != before[1:3]

    async def go():  # end to end: the restarted proxy's switch maps what the first one's source turn stored
        rig = Rig(block=4, store=True)
        rig.proxy.sessions = start(P.read_secret(path)).sessions
        await rig.chat(MSGS, session="doc", key="alice")
        rig.proxy.sessions = start(P.read_secret(path)).sessions  # a restart: the session table is empty
        rig.source.fail_status = 500  # no save step can store anything now: only the first proxy's blocks can map
        r = await rig.chat(MSGS, model="tgt", session="doc", key="alice")
        assert r.json()["kvtransfer"]["status"] == "mapped"
        served = rig.gen_calls(rig.target)[-1]
        assert served["kv_transfer_params"]["kvtransfer_ns"] == before[2]
        assert served["cache_salt"] == f"{P.MAPPED_SALT}:{before[1]}"
    run(go())


# ---------------------------------------------------------------- the event loop
@pytest.mark.parametrize("call", ["tip", "delete_namespace"])
def test_a_slow_store_call_never_stalls_the_proxys_other_requests(call):
    """The proxy's store calls (a switch's `tip`, a DELETE's `delete_namespace`) run in a thread: while one takes
    STALL seconds (a slow disk, a stuck mount), /health and /metrics answer at once. On the event loop they would
    answer only after the call returned, STALL seconds after it began."""
    import time

    STALL = 0.5
    entered = threading.Event()
    state = {}

    async def go():
        rig = Rig(block=4, store=True)
        rig.proxy.switch_wait_s = rig.proxy.switch_stall_s = 0.0  # one store call per switch
        await rig.chat(MSGS, session="s")
        slow = getattr(rig.fake_store, call)

        def stalled(*args, **kwargs):
            state["t0"] = time.monotonic()
            entered.set()
            time.sleep(STALL)
            return slow(*args, **kwargs)

        setattr(rig.fake_store, call, stalled)
        blocked = (rig.chat(MSGS, model="tgt", session="s") if call == "tip" else
                   rig.client.delete("/kvtransfer/sessions/s", headers={"authorization": "Bearer k1"}))
        task = asyncio.ensure_future(blocked)
        while not entered.is_set():
            await asyncio.sleep(0.005)
        for path in ("/health", "/metrics"):
            assert (await rig.client.get(path)).status_code == 200
        state["answered"] = time.monotonic() - state["t0"]
        assert (await task).status_code == 200
        assert time.monotonic() - state["t0"] >= STALL  # the store call really took STALL seconds

    run(go())
    assert state["answered"] < STALL / 2, state  # not after the store call: the loop kept serving
