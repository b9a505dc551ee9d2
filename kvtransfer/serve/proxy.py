"""The handoff proxy: one OpenAI-compatible endpoint in front of a producer (source) and a consumer (target) engine.
    python -m kvtransfer.serve.proxy --source http://127.0.0.1:8001 --target http://127.0.0.1:8002 \
        --mapper runs/.../mapper --store /var/lib/kvtransfer/store --port 8000

Routes: `/v1/chat/completions`, `/v1/completions` (both streaming or not), `/v1/models`, `/health`,
`/kvtransfer/stats` (the proxy's counters, JSON), `/metrics` (the same, Prometheus text), and
`DELETE /kvtransfer/sessions/<id>` (forget a session and remove its stored blocks).

A session (header `X-KVTransfer-Session`; without one every request is its own session) is served by the
source, written through: the proxy gives the session one token sequence from its first turn -- the mapper's
position-0 ids (read from the mapper) + the chat template's tokens as the target's `/tokenize` makes them (the
family shares its tokenizer) -- and sends each source turn as a `/v1/completions` request on those ids, so the
producer's connector stores the session's blocks as it serves them (with prefix caching on, each turn computes
and stores only its new blocks).

A request that asks for the target -- its `model` is the target's served name (or "target"), or the header
`X-KVTransfer-Model: target` -- hands the session over. Nothing is sent to the producer: the consumer gets the
same token sequence, maps the longest stored prefix and prefills the rest (the latest turns) natively. A store
write still in flight at the switch (the producer writes in the background) is waited for up to
`--switch-wait` seconds when the proxy can see the store (`--store`); after that the consumer maps what is
complete, and the switch is counted `switch_partial`. A session the source never served (its first request asks
for the target) is first read once by the producer (`max_tokens=1`: the save step) and then mapped.

After the switch the target keeps the session: its requests carry a per-session `cache_salt`
("kvtransfer-mapped:<keyed digest of the session>"), so the consumer's prefix cache (on) serves each later turn's
earlier tokens as exact hits of this session's own blocks and prefills only the new turn; the mapped blocks are
never a hit for any other session or request. If the consumer's cache evicted the session, it re-maps from the
store and prefills the rest. A chat template that rewrites history (the new prompt does not extend the last one)
is counted `history_rewritten`; the consumer then maps the longest stored prefix of the new prompt.

A chat request is answered in chat format (the engine's completion converted: text, finish reason, logprobs,
usage). What happened is in the response header `X-KVTransfer` and the body field `kvtransfer` (streaming: the
header says `handoff: ...` and the field rides on the stream's last event, since vLLM reports cached tokens only
in its final usage chunk): `mapped N tokens, prefilled M` (the consumer's connector decision), `cached N tokens,
prefilled M` (a later turn: the consumer's own prefix cache), `fallback_reprefill: <reason>` (the consumer
prefilled everything: `save_failed`, `consumer_fallback (<its reason>)`, or `gate_full`), `fallback_source:
<reason>` (the target is down), or `source`.

Bounded and isolated: a session is a few numbers (a length and a hash of its ids, not the ids), bound to the API key
(`Authorization` header) that opened it -- another key gets a 403; locks exist only while a request holds them;
bodies are capped (`--max-body-bytes`); of a client's `kv_transfer_params` only `kvtransfer` ("on"/"off") and
`kvtransfer_tag` reach the consumer, and a client's `cache_salt` is replaced by the session's.

Never down: a malformed request is a 400 in OpenAI's error format; a dead or failing engine is a fallback
(target -> source) or, with both down, a 502; every outcome is counted. Large -> small is the same proxy with the
engines' roles swapped (and a mapper fitted in that direction).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

try:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    HAVE_SERVE_STACK = True
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs them
    HAVE_SERVE_STACK = False

from .proxy_state import BadRequest, Outcome, ascii_header, Session, Sessions, Stats, Unauthorized, Unreachable  # noqa: F401
from .proxy_wire import _relay, _sse_events, completion_chunk_to_chat, completion_to_chat  # noqa: F401

log = logging.getLogger("kvtransfer.proxy")

SESSION_HEADER = "x-kvtransfer-session"
MODEL_HEADER = "x-kvtransfer-model"
STATUS_HEADER = "x-kvtransfer"
WRITE_THROUGH_HEADER = "x-kvtransfer-write-through"
MAPPED_SALT = "kvtransfer-mapped"  # the consumer connector's mapped_cache_salt; a session's salt is "<this>:<digest>"
CLIENT_PARAMS = ("kvtransfer", "kvtransfer_tag")  # the client kv_transfer_params that reach the consumer
MAX_KEY = 256  # characters of a session id
MAX_TOKEN_ID = 2 ** 31 - 1  # a token id beyond any vocabulary (and beyond what the store hashes as int64) is refused
# chat fields a completion request cannot carry: such a request is forwarded to the target as chat, unmapped
CHAT_ONLY = ("tools", "tool_choice", "functions", "function_call", "response_format", "documents",
             "continue_final_message", "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar")
# chat fields consumed by the conversion itself
CHAT_CONVERTED = ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                  "chat_template", "chat_template_kwargs", "echo")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> "JSONResponse":
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class TooLarge(ValueError):
    """A request body over the proxy's limit (HTTP 413)."""


def _valid_key(key: str) -> bool:
    return 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable()


def mapper_start_ids(mapper_dir: str | os.PathLike) -> list[int]:
    """The position-0 token ids a saved mapper was fitted with (its manifest's calibration.start_ids): what every
    prompt handed over must start with. ValueError naming the fix when the directory is not a saved mapper."""
    path = Path(mapper_dir) / "mapper.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable mapper manifest ({err}): give --mapper the directory a fitted "
                         "mapper was saved to") from err
    ids = (manifest.get("calibration") or {}).get("start_ids") if isinstance(manifest, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path} records no start_ids: refit the mapper with context_start=prefix_token")
    return ids


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in value)


class HandoffProxy:
    """The proxy's state and logic: engine URLs and model names, sessions (LRU-bounded), counters.

    source / target: base URLs of the producer and the consumer engine. start_ids: the mapper's position-0 token ids
    (`mapper_start_ids`), put in front of every session's token sequence. store: the producer's store directory, if
    the proxy can see it (waits for writes in flight at a switch; deleting a session removes its blocks).
    write_through: serve source turns on the session's token ids (default); off, they go to the source as they
    come and a switch re-runs the source's prefill. secret: the key of session owners' digests, cache salts and
    store namespaces (default: random per start, so a restart re-maps; the launcher keeps one per deployment).
    allow_anonymous_sessions: serve session requests without an Authorization header (anyone who knows such a
    session's id can use it); off, they are 401s. switch_wait_s / switch_stall_s: a switch waits for the
    producer's write in flight at most this long in all / this long without the store growing. client: an
    httpx.AsyncClient (tests pass one whose transport reaches in-process fakes).
    """

    def __init__(self, source: str, target: str, *, source_model: str | None = None,
                 target_model: str | None = None, start_ids: list[int] | tuple[int, ...] = (),
                 client: "httpx.AsyncClient | None" = None, timeout_s: float = 600.0, max_sessions: int = 10000,
                 remap_turns: bool = True, store: str | None = None, write_through: bool = True,
                 switch_wait_s: float = 5.0, secret: bytes | None = None, max_body_bytes: int = 16 << 20,
                 block_size: int = 16, allow_anonymous_sessions: bool = False, switch_stall_s: float = 1.0):
        if not HAVE_SERVE_STACK:
            raise ImportError("kvtransfer.serve.proxy needs fastapi, uvicorn and httpx: pip install -e '.[serve]'")
        self.urls = {"source": source.rstrip("/"), "target": target.rstrip("/")}
        self.models = {"source": source_model, "target": target_model}
        self.start_ids = [int(i) for i in start_ids]
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.sessions = Sessions(secret or os.urandom(32), max_sessions)
        self.remap_turns, self.write_through = remap_turns, write_through
        self.switch_wait_s, self.switch_stall_s, self.max_body_bytes = switch_wait_s, switch_stall_s, max_body_bytes
        self.allow_anonymous_sessions = allow_anonymous_sessions
        self.store = None
        if store is not None:
            from .store import KVStore

            self.store = KVStore(store)
        self.block_size = self.store.block_size if self.store is not None else block_size
        self.stats = Stats()

    @property
    def max_sessions(self) -> int:
        return self.sessions.max_sessions

    @max_sessions.setter
    def max_sessions(self, n: int) -> None:
        self.sessions.max_sessions = n

    # ------------------------------------------------------------------ upstream calls
    async def _post(self, engine: str, path: str, body: dict) -> dict:
        """POST JSON to an engine; its JSON reply. Unreachable on no answer / 5xx; BadRequest on a 4xx."""
        try:
            reply = await self.client.post(self.urls[engine] + path, json=body)
        except httpx.HTTPError as err:
            raise Unreachable(f"{engine} {type(err).__name__}") from err
        if reply.status_code >= 500:
            raise Unreachable(f"{engine} HTTP {reply.status_code}")
        try:
            data = reply.json()
        except ValueError as err:
            raise Unreachable(f"{engine} answered non-JSON") from err
        if reply.status_code >= 400:
            message = data.get("error", {}).get("message") if isinstance(data.get("error"), dict) else None
            raise BadRequest(f"{engine} refused the request: {message or data}")
        return data

    async def model_name(self, engine: str) -> str:
        """The engine's served model name (`--source-model` / `--target-model`, else its first /v1/models id)."""
        if self.models[engine] is None:
            try:
                reply = await self.client.get(self.urls[engine] + "/v1/models")
                self.models[engine] = reply.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
                raise Unreachable(f"{engine} /v1/models: {type(err).__name__}") from err
        return self.models[engine]

    # ------------------------------------------------------------------ routing
    async def wanted(self, body: dict, headers) -> str:
        """'source' or 'target': the engine the request asks for (header, else its `model` field)."""
        asked = headers.get(MODEL_HEADER)
        if asked is not None:
            if asked not in ("source", "target"):
                raise BadRequest(f"{MODEL_HEADER}: {asked!r}: use 'source' or 'target'")
            return asked
        model = body.get("model")
        if model is None or model == "source":
            return "source"
        if not isinstance(model, str):
            raise BadRequest(f"model must be a string, got {type(model).__name__}")
        if model == "target":
            return "target"
        names = {}
        for engine in ("source", "target"):
            try:
                names[engine] = await self.model_name(engine)
            except Unreachable:
                names[engine] = None
        for engine, name in names.items():
            if model == name:
                return engine
        raise BadRequest(f"model {model!r} is served by neither engine: use {names['source']!r} (source), "
                         f"{names['target']!r} (target), 'source' or 'target'")

    # ------------------------------------------------------------------ the token sequence
    async def prompt_ids(self, kind: str, body: dict) -> list[int]:
        """The prompt's token ids as the target tokenizes it, with start_ids in front (BadRequest if unusable)."""
        target = await self.model_name("target")
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            tok = {"model": target, "messages": messages,
                   "add_generation_prompt": body.get("add_generation_prompt", True)}
            for key in ("chat_template", "chat_template_kwargs"):
                if key in body:
                    tok[key] = body[key]
            ids = (await self._post("target", "/tokenize", tok)).get("tokens")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = (await self._post("target", "/tokenize", {"model": target, "prompt": prompt})).get("tokens")
            elif _int_list(prompt):
                ids = list(prompt)
            elif isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _int_list(prompt[0])):
                return await self.prompt_ids(kind, {**body, "prompt": prompt[0]})
            else:
                raise BadRequest("prompt must be a string or a list of token ids (one prompt per handoff request)")
        if not _int_list(ids):
            raise Unreachable("target /tokenize returned no token ids")
        if not all(0 <= i <= MAX_TOKEN_ID for i in ids):
            raise BadRequest(f"prompt token ids must lie in 0..{MAX_TOKEN_ID}")
        if self.start_ids and ids[:len(self.start_ids)] != self.start_ids:
            ids = self.start_ids + ids
        return ids

    async def save(self, ids: list[int], session: Session) -> float:
        """The producer reads `ids` once (max_tokens=1): its connector stores their KV under the session's namespace.
        Seconds taken. Only for a session the source never served (a warm session's blocks are already stored)."""
        t0 = time.perf_counter()
        body = {"model": await self.model_name("source"), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"kvtransfer_ns": session.ns}}
        salt = self.sessions.source_salt(session.owner)
        await self._post("source", "/v1/completions", {**body, "cache_salt": salt} if salt else body)
        return time.perf_counter() - t0

    def client_params(self, body: dict) -> dict:
        """The client's kv_transfer_params that may reach the consumer (the allowlist); others are dropped, counted."""
        params = body.get("kv_transfer_params")
        if params is None:
            return {}
        if not isinstance(params, dict):
            raise BadRequest("kv_transfer_params must be an object")
        kept = {k: v for k, v in params.items() if k in CLIENT_PARAMS}
        if kept.get("kvtransfer", "on") not in ("on", "off"):
            raise BadRequest(f"kv_transfer_params.kvtransfer={kept['kvtransfer']!r}: use \"on\" or \"off\"")
        if not isinstance(kept.get("kvtransfer_tag", ""), str) or len(kept.get("kvtransfer_tag", "")) > 128:
            raise BadRequest("kv_transfer_params.kvtransfer_tag must be a string of at most 128 characters")
        if len(kept) < len(params):
            self.stats.handoff["params_dropped"] += 1
        return kept

    def completion_body(self, kind: str, body: dict, ids: list[int], model: str, *, params: dict | None = None,
                        salt: str | None = None) -> dict:
        """An engine's /v1/completions body for a (chat or completion) request, on the token ids `ids`; `params`
        becomes its kv_transfer_params and `salt` its cache_salt (the client's own are never passed on)."""
        drop = CHAT_CONVERTED if kind == "chat" else ()
        out = {k: v for k, v in body.items()
               if k not in drop and k not in ("prompt", "model", "kv_transfer_params", "cache_salt")}
        out["model"], out["prompt"] = model, ids
        if kind == "chat":
            if body.get("logprobs"):
                top = body.get("top_logprobs") or 0
                if not isinstance(top, int) or isinstance(top, bool) or top < 0:
                    raise BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}")
                out["logprobs"] = top
            if "max_completion_tokens" in body and "max_tokens" not in body:
                out["max_tokens"] = body["max_completion_tokens"]
        if params:
            out["kv_transfer_params"] = params
        if salt:
            out["cache_salt"] = salt
        if out.get("stream"):
            options = dict(out.get("stream_options") or {}) if isinstance(out.get("stream_options"), dict) else {}
            options["include_usage"] = True  # vLLM puts cached tokens in the final usage chunk only
            out["stream_options"] = options
        return out

    @staticmethod
    def counted(usage: dict | None, reason_if_none: str) -> tuple[int | None, int | None]:
        """(mapped, prefilled) from a consumer's usage; (None, None) when it does not report cached tokens."""
        if not isinstance(usage, dict):
            return None, None
        details = usage.get("prompt_tokens_details")
        prompt = usage.get("prompt_tokens")
        if not isinstance(details, dict) or not isinstance(prompt, int):
            return None, prompt if isinstance(prompt, int) else None
        cached = details.get("cached_tokens") or 0
        return int(cached), int(prompt) - int(cached)

    def judge(self, usage: dict | None, save_error: str, save_s: float | None, connector: Any = None, *,
              later_turn: bool = False) -> Outcome:
        """The outcome of a consumer request: its connector's own decision (`kv_transfer_params.kvtransfer`: mapped,
        cached by its own prefix cache, or why neither; vLLM counts rejected loads as cached), else its usage's
        cached tokens; plus the save step's error."""
        decision = connector.get("kvtransfer") if isinstance(connector, dict) else None
        if isinstance(decision, dict) and isinstance(decision.get("reason"), str):
            num = lambda n: n if isinstance(n, int) else None  # noqa: E731
            mapped, cached, prefilled = num(decision.get("mapped")), num(decision.get("cached")), num(decision.get("prefilled"))
            if decision["reason"] == "mapped" and mapped:
                return Outcome("mapped", "target", mapped, prefilled, "", save_s, cached)
            if cached and not save_error:  # a later turn: the session's own blocks in the consumer's prefix cache
                return Outcome("cached", "target", 0, prefilled, "", save_s, cached)
            gate = decision.get("gate") if isinstance(decision.get("gate"), dict) else {}  # gate_full: its own prefill
            why = f"gate_full ({gate.get('reason')})" if gate.get("action") == "full" else f"consumer_fallback ({decision['reason']})"
            return Outcome("fallback_reprefill", "target", 0, prefilled, save_error or why, save_s, cached)
        mapped, prefilled = self.counted(usage, save_error)
        if later_turn and mapped and not save_error:  # the target's own cache, or the store where it evicted them
            return Outcome("reused", "target", None, prefilled, "", save_s, mapped)
        if mapped is None:
            return Outcome("fallback_reprefill" if save_error else "handoff", "target", None, prefilled, save_error or
                           "mapped tokens unknown: start the consumer with --enable-prompt-tokens-details", save_s)
        if mapped > 0:
            return Outcome("mapped", "target", mapped, prefilled, "", save_s)
        return Outcome("fallback_reprefill", "target", 0, prefilled, save_error or "consumer_fallback", save_s)

    # ------------------------------------------------------------------ request handling
    async def handle(self, kind: str, request: "Request") -> "Response":
        """Serve one /v1/chat/completions (kind 'chat') or /v1/completions (kind 'completion') request."""
        self.stats.counts["requests"] += 1
        try:
            body = await self._body(request)
            key = request.headers.get(SESSION_HEADER)
            if key is not None and not _valid_key(key):
                raise BadRequest(f"{SESSION_HEADER} must be 1..{MAX_KEY} printable ASCII characters")
            wanted = await self.wanted(body, request.headers)
            self._validate(kind, body)
            owner = self.sessions.owner_of(request.headers.get("authorization"))
            if key is None:  # its own session, never written through: nothing later can hand it over
                session = Session(owner=owner, salt=self.sessions.salt(owner, None),
                                  ns=self.sessions.namespace(owner, None), write_through=False, ephemeral=True)
                return await self._route(kind, body, request.headers, wanted, session)
            self._check_key(owner)
            async with self.sessions.locked(key, owner):
                new = self.sessions.get(key, owner) is None
                session = self.sessions.open(key, owner)
                try:
                    return await self._route(kind, body, request.headers, wanted, session)
                except Exception:
                    if new:  # a session's first request failed: it leaves nothing behind
                        self.sessions.drop(key, owner)
                    raise
        except BadRequest as err:
            self.stats.errors["bad_request"] += 1
            return _error(400, str(err))
        except TooLarge as err:
            self.stats.errors["body_too_large"] += 1
            return _error(413, str(err))
        except Unauthorized as err:
            self.stats.errors["unauthorized"] += 1
            return _error(401, str(err), "authentication_error")
        except Unreachable as err:
            self.stats.errors["engines_down"] += 1
            return _error(502, f"no engine could serve the request: {err}", "upstream_error")
        except Exception as err:  # noqa: BLE001 -- never down: any bug is a counted 500, the proxy keeps serving
            log.exception("kvtransfer proxy: unexpected error")
            self.stats.errors[f"proxy_error:{type(err).__name__}"] += 1
            return _error(500, f"proxy error {type(err).__name__}: {err}", "internal_error")

    async def _body(self, request: "Request") -> dict:
        """The request's JSON object (TooLarge beyond max_body_bytes, BadRequest if not a JSON object)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise TooLarge(f"the request body is {declared} bytes; this proxy takes at most {self.max_body_bytes}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise TooLarge(f"the request body exceeds {self.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        except RecursionError:
            raise BadRequest("the request body nests JSON too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _check_key(self, owner: str) -> None:
        """Unauthorized for a session request without an API key, unless anonymous sessions are allowed."""
        if not owner and not self.allow_anonymous_sessions:
            raise Unauthorized("a session (X-KVTransfer-Session) needs an API key (Authorization: Bearer <key>): it "
                               "binds the session to you. Start the proxy with --allow-anonymous-sessions to serve "
                               "sessions without one (anyone who knows such an id can then use it)")

    @staticmethod
    def _validate(kind: str, body: dict) -> None:
        if kind == "chat" and not isinstance(body.get("messages"), list):
            raise BadRequest("messages must be a list")
        if kind == "completion" and "prompt" not in body:
            raise BadRequest("prompt is required")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise BadRequest(f"stream must be a boolean, got {body['stream']!r}")

    async def _route(self, kind: str, body: dict, headers, wanted: str, session: Session) -> "Response":
        if wanted == "source" and session.engine == "source":
            asked = headers.get(WRITE_THROUGH_HEADER)
            if asked is not None and asked not in ("on", "off"):
                raise BadRequest(f"{WRITE_THROUGH_HEADER}: {asked!r}: use 'on' or 'off'")
            if not session.n_ids and not session.ephemeral:  # the first turn fixes the session's mode
                session.write_through = self.write_through if asked is None else asked == "on"
            return await self._source_turn(kind, body, session)
        if wanted == "source":  # a handed-over session asking for the source: served there, re-prefilled
            return await self._forward("source", kind, body,
                                       Outcome("fallback_reprefill", "source", reason="no_reverse_map (this proxy "
                                                                                        "maps source to target only)"),
                                       session.owner)
        return await self._to_target(kind, body, session)

    async def _source_turn(self, kind: str, body: dict, session: Session) -> "Response":
        """A source turn: on the session's token ids (write-through: the producer stores the blocks as it serves),
        else forwarded as it came."""
        if not session.write_through or (kind == "chat" and any(k in body for k in CHAT_ONLY)):
            return await self._forward("source", kind, body, Outcome("source", "source"), session.owner)
        try:
            ids = await self.prompt_ids(kind, body)
        except Unreachable as err:  # the target's tokenizer is down: serve the turn unstored
            self.stats.handoff["write_through_skipped"] += 1
            return await self._forward("source", kind, body,
                                       Outcome("source", "source", reason=f"not_stored ({err})"), session.owner)
        if session.n_ids and not session.extends(ids):
            self.stats.handoff["history_rewritten"] += 1
        upstream = self.completion_body(kind, body, ids, await self.model_name("source"),
                                        params={"kvtransfer_ns": session.ns},
                                        salt=self.sessions.source_salt(session.owner))
        out = Outcome("source", "source")
        if upstream.get("stream"):
            response = await self._stream("source", kind, body, upstream, out.header(), lambda usage, ended: out)
        else:
            data = await self._post("source", "/v1/completions", upstream)
            self.stats.outcome(out)
            if kind == "chat":
                data = completion_to_chat(data, await self.model_name("source"))
            data["kvtransfer"] = out.field()
            response = JSONResponse(data, headers={STATUS_HEADER: out.header()})
        session.remember(ids)
        session.stored = len(ids) // self.block_size * self.block_size
        self.stats.handoff["written_through"] += 1
        return response

    async def _stored_until(self, ids: list[int], want: int, ns: str) -> int:
        """Tokens of `ids` the store holds under namespace `ns`, waiting for `want` of them (a write in flight) up to
        switch_wait_s in all, and no longer than switch_stall_s without the stored prefix growing (a write that
        is not coming: a producer that stores nothing, blocks evicted or deleted meanwhile). Store calls run in a
        thread: a slow disk never stalls the proxy's other requests."""
        if self.store is None or want <= 0:
            return want
        start = time.monotonic()
        deadline, last, grew_at, waited = start + self.switch_wait_s, -1, start, False
        while True:
            tip = await asyncio.to_thread(self.store.tip, ids[:want], None, ns=ns)
            have = tip[2] if tip else 0
            now = time.monotonic()
            if have > last:
                last, grew_at = have, now
            if have >= want or now >= deadline or now - grew_at >= self.switch_stall_s:
                if waited:
                    self.stats.handoff["switch_waited"] += 1
                return have
            waited = True
            await asyncio.sleep(0.02)

    async def _to_target(self, kind: str, body: dict, session: Session) -> "Response":
        if kind == "chat" and any(k in body for k in CHAT_ONLY):
            reason = "chat_fields (" + ",".join(k for k in CHAT_ONLY if k in body) + ")"
            return await self._forward_or_source(kind, body, Outcome("fallback_reprefill", "target", reason=reason),
                                                 session.owner)
        params = self.client_params(body)
        try:
            ids = await self.prompt_ids(kind, body)
        except Unreachable as err:
            return await self._forward_or_source(kind, body, Outcome("fallback_reprefill", "target",
                                                                     reason=f"tokenize_failed ({err})"), session.owner)
        rewritten = bool(session.n_ids) and not session.extends(ids)
        if rewritten:
            self.stats.handoff["history_rewritten"] += 1
        save_error, save_s, expect = "", None, None
        later = session.engine == "target" and bool(session.handed)  # vLLM's usage counts its own hits as cached too
        if session.engine == "source" and session.stored:  # the switch of a warm session: its blocks are stored
            self.stats.handoff["switches"] += 1
            # a rewritten history's stored blocks are all there is: no write of them is in flight
            expect = await self._stored_until(ids, 0 if rewritten else session.stored, session.ns)
            self._count_partial(expect, session.stored, rewritten)
            session.handed = session.stored
        elif session.engine == "source" or not session.handed:  # nothing stored for it: the producer reads it once
            try:
                save_s = await self.save(ids, session)
                session.handed = len(ids) // self.block_size * self.block_size
                # the save's blocks reach the store on the producer's writer thread, after its response
                expect = await self._stored_until(ids, session.handed, session.ns)
                self._count_partial(expect, session.handed, False)
            except (Unreachable, BadRequest) as err:
                save_error = f"save_failed ({err})"
        if session.handed and self.remap_turns and params.get("kvtransfer") != "off":
            params["kvtransfer_source_len"] = session.handed  # map at most what the source stored of this session
        elif not self.remap_turns and session.engine == "target":
            params["kvtransfer"] = "off"
        params["kvtransfer_ns"] = session.ns  # after the client's: a client never picks the namespace
        upstream = self.completion_body(kind, body, ids, await self.model_name("target"), params=params,
                                        salt=f"{MAPPED_SALT}:{session.salt}")
        try:
            if upstream.get("stream"):
                response = await self._stream("target", kind, body, upstream,
                                              f"fallback_reprefill: {save_error}" if save_error else
                                              "handoff: mapped tokens in the stream's last event (kvtransfer field)",
                                              lambda usage, ended: self.judge(
                                                  usage, save_error or ("" if ended else
                                                                        "stream_ended (the consumer's stream ended "
                                                                        "early)"), save_s,
                                                  later_turn=later), after=lambda: self._forget_blocks(session))
            else:
                try:
                    data = await self._post("target", "/v1/completions", upstream)
                finally:
                    await self._forget_blocks(session)
                out = self.judge(data.get("usage"), save_error, save_s, data.get("kv_transfer_params"))
                self.stats.outcome(out)
                if expect is not None and out.mapped is not None and \
                        (out.mapped or 0) + (out.cached or 0) < min(expect, len(ids) - 1):
                    self.stats.handoff["switch_mapped_less"] += 1  # the consumer took less than the store held
                if kind == "chat":
                    data = completion_to_chat(data, await self.model_name("target"))
                data["kvtransfer"] = out.field()
                response = JSONResponse(data, headers={STATUS_HEADER: out.header()})
        except Unreachable as err:
            session.engine = "source"
            return await self._forward("source", kind, body,
                                       Outcome("fallback_source", "source", reason=f"target_unreachable ({err})"),
                                       session.owner)
        session.engine = "target"
        session.remember(ids)
        return response

    async def _forget_blocks(self, session: Session) -> None:
        """Remove a request-only session's stored blocks once the consumer has read them (nothing else can)."""
        if session.ephemeral and self.store is not None:
            try:
                await asyncio.to_thread(self.store.delete_namespace, session.ns)
            except Exception as err:  # noqa: BLE001 -- retention removes them later; the request is served
                self.stats.errors[f"store_delete:{type(err).__name__}"] += 1

    def _count_partial(self, have: int, want: int, rewritten: bool) -> None:
        """Count a switch whose store held fewer of the session's tokens than the source stored (`switch_partial`;
        after a rewritten history that is expected, and counted apart)."""
        if have < want:
            self.stats.handoff["switch_partial_rewritten" if rewritten else "switch_partial"] += 1

    async def _forward_or_source(self, kind: str, body: dict, outcome: Outcome, owner: str) -> "Response":
        try:
            return await self._forward("target", kind, body, outcome, owner)
        except Unreachable as err:
            return await self._forward("source", kind, body,
                                       Outcome("fallback_source", "source", reason=f"target_unreachable ({err})"),
                                       owner)

    def engine_salt(self, engine: str, owner: str) -> str:
        """The cache salt of an owner's request forwarded as it came: per owner on either engine ("" without a key),
        never the consumer's mapped salt (a forwarded request is never mapped)."""
        if not owner:
            return ""
        return self.sessions.source_salt(owner) if engine == "source" else \
            "kvtransfer-target:" + self.sessions.source_salt(owner).split(":", 1)[1]

    async def _forward(self, engine: str, kind: str, body: dict, outcome: Outcome, owner: str = "") -> "Response":
        """Pass the request to one engine as it is (model renamed, kvtransfer's fields removed, the owner's cache
        salt set), adding the outcome header and field."""
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        upstream = {**{k: v for k, v in body.items() if k not in ("kv_transfer_params", "cache_salt")},
                    "model": await self.model_name(engine)}
        salt = self.engine_salt(engine, owner)
        if salt:
            upstream["cache_salt"] = salt
        if body.get("stream"):
            try:
                req = self.client.build_request("POST", self.urls[engine] + path, json=upstream)
                reply = await self.client.send(req, stream=True)
            except httpx.HTTPError as err:
                raise Unreachable(f"{engine} {type(err).__name__}") from err
            if reply.status_code >= 500:
                await reply.aclose()
                raise Unreachable(f"{engine} HTTP {reply.status_code}")
            self.stats.outcome(outcome)
            return StreamingResponse(_relay(reply), status_code=reply.status_code,
                                     media_type=reply.headers.get("content-type", "text/event-stream"),
                                     headers={STATUS_HEADER: outcome.header()})
        data = await self._post(engine, path, upstream)  # Unreachable propagates: the caller falls back
        self.stats.outcome(outcome)
        data["kvtransfer"] = outcome.field()
        return JSONResponse(data, headers={STATUS_HEADER: outcome.header()})

    async def _stream(self, engine: str, kind: str, body: dict, upstream: dict, header: str, finish,
                      after=None) -> "Response":
        """Stream an engine's completion on token ids (as chat chunks for a chat request).

        vLLM reports cached (mapped) tokens only in the stream's final usage chunk, so the header carries what is
        known when the stream starts and the `kvtransfer` field rides on the last event (the usage chunk, or a
        `choices: []` chunk when the client did not ask for usage): `finish(usage, ended)` gives its Outcome, counted
        when the stream ends; `after()`, a coroutine function, runs then too (and if the engine refuses the stream).
        """
        try:
            req = self.client.build_request("POST", self.urls[engine] + "/v1/completions", json=upstream)
            reply = await self.client.send(req, stream=True)
        except httpx.HTTPError as err:
            if after is not None:
                await after()
            raise Unreachable(f"{engine} {type(err).__name__}") from err
        if reply.status_code >= 400:
            text = (await reply.aread()).decode(errors="replace")
            await reply.aclose()
            if after is not None:
                await after()
            if reply.status_code >= 500:
                raise Unreachable(f"{engine} HTTP {reply.status_code}")
            raise BadRequest(f"{engine} refused the request: {text[:500]}")
        keep_usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
        model = await self.model_name(engine)
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"

        async def produce():
            role_sent, usage, ended = False, None, False
            try:
                async for event in _sse_events(reply):
                    if event is None:
                        ended = True
                        break
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
                    if not event.get("choices"):
                        continue  # the usage chunk: re-emitted last, with the status
                    event = {k: v for k, v in event.items() if k != "usage"}
                    if kind == "chat":
                        event = completion_chunk_to_chat(event, model, chat_id, with_role=not role_sent)
                        role_sent = True
                    yield f"data: {json.dumps(event)}\n\n".encode()
            except httpx.HTTPError as err:  # the engine died mid-stream: end the stream with an error event
                self.stats.errors[f"{engine}_died_mid_stream"] += 1
                yield f"data: {json.dumps({'error': {'message': f'{engine} stream ended: {err}'}})}\n\n".encode()
            finally:
                await reply.aclose()
                if after is not None:
                    await after()
            out = finish(usage, ended)
            self.stats.outcome(out)
            last = {"id": chat_id if kind == "chat" else "cmpl-kvtransfer",
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": int(time.time()), "model": model, "choices": [], "kvtransfer": out.field()}
            if keep_usage:
                last["usage"] = usage
            yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(produce(), media_type="text/event-stream", headers={STATUS_HEADER: ascii_header(header)})

    # ------------------------------------------------------------------ sessions
    async def delete_session(self, key: str, authorization: str | None) -> dict:
        """Forget the caller's session `key` and remove its stored blocks (when the proxy sees the store):
        {"deleted": whether the table held it, "blocks": blocks removed, or None without a store}. The blocks go
        even after the session left the table (LRU, restart): their namespace is a digest of (key, id). Another
        key's session of the same id is a different session and is untouched."""
        if not _valid_key(key):
            raise BadRequest(f"a session id is 1..{MAX_KEY} printable ASCII characters")
        owner = self.sessions.owner_of(authorization)
        self._check_key(owner)
        async with self.sessions.locked(key, owner):
            session = self.sessions.drop(key, owner)
            blocks = None
            if self.store is not None:
                blocks = await asyncio.to_thread(self.store.delete_namespace, self.sessions.namespace(owner, key))
        self.stats.handoff["sessions_deleted"] += 1
        return {"deleted": session is not None, "blocks": blocks}


def build_app(proxy: HandoffProxy) -> "FastAPI":
    """The FastAPI application serving `proxy`."""
    app = FastAPI(title="kvtransfer handoff proxy")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle("completion", request)

    @app.get("/v1/models")
    async def models():
        data = []
        for engine in ("source", "target"):
            try:
                data.append({"id": await proxy.model_name(engine), "object": "model", "owned_by": "kvtransfer",
                             "kvtransfer_role": engine})
            except Unreachable:
                pass
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/kvtransfer/stats")
    async def stats():
        return {**proxy.stats.as_dict(), "sessions": len(proxy.sessions)}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text({**proxy.stats.as_dict(), "sessions": len(proxy.sessions)}),
                        media_type="text/plain; version=0.0.4")

    @app.delete("/kvtransfer/sessions/{key:path}")  # :path -- an id may hold "/"
    async def delete_session(key: str, request: Request):
        try:
            return await proxy.delete_session(key, request.headers.get("authorization"))
        except BadRequest as err:
            return _error(400, str(err))
        except Unauthorized as err:
            return _error(401, str(err), "authentication_error")
        except Exception as err:  # noqa: BLE001 -- a store fault is a counted 500; the proxy keeps serving
            log.exception("kvtransfer proxy: deleting a session failed")
            proxy.stats.errors[f"delete_error:{type(err).__name__}"] += 1
            return _error(500, f"deleting the session failed ({type(err).__name__}); retry", "internal_error")

    return app


def prometheus_text(stats: dict) -> str:
    """The proxy's counters in Prometheus' text format (every name prefixed kvtransfer_proxy_)."""
    lines = []
    for group in ("counts", "fallbacks", "errors", "handoff"):
        name = f"kvtransfer_proxy_{group}_total"
        lines.append(f"# TYPE {name} counter")
        for label, value in sorted(stats.get(group, {}).items()):
            escaped = str(label).replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{name}{{kind="{escaped}"}} {value}')
    for key in ("mapped_tokens", "cached_tokens", "prefilled_tokens"):
        lines += [f"# TYPE kvtransfer_proxy_{key}_total counter", f"kvtransfer_proxy_{key}_total {stats.get(key, 0)}"]
    lines += ["# TYPE kvtransfer_proxy_sessions gauge", f"kvtransfer_proxy_sessions {stats.get('sessions', 0)}"]
    return "\n".join(lines) + "\n"


def read_secret(path: str | os.PathLike) -> bytes:
    """The deployment secret kept in `path` (64 hex characters), created with mode 0600 if the file is missing.
    ValueError naming the fix for a file that is not such a secret."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    text = path.read_text().strip()
    if len(text) < 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{path} does not hold a secret (at least 32 lowercase hex characters): remove it and a new "
                         f"one is made (sessions and their stored blocks are then unreachable)")
    return text.encode()


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--start-ids takes comma-separated token ids, got {text!r}") from err


def main(argv: list[str] | None = None) -> None:
    """Command line: start the proxy with uvicorn."""
    parser = argparse.ArgumentParser(prog="python -m kvtransfer.serve.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="the producer engine's base URL (e.g. http://127.0.0.1:8001)")
    parser.add_argument("--target", required=True, help="the consumer engine's base URL")
    parser.add_argument("--source-model", help="the producer's served model name (default: its /v1/models)")
    parser.add_argument("--target-model", help="the consumer's served model name (default: its /v1/models)")
    parser.add_argument("--mapper", help="the mapper directory the consumer serves: its start ids are read from it")
    parser.add_argument("--start-ids", type=_ids, default=None,
                        help="the mapper's position-0 token ids, comma-separated (default: read from --mapper)")
    parser.add_argument("--store", help="the KV store directory, if this host sees it: a switch waits for writes "
                                        "in flight, and deleting a session removes its blocks")
    parser.add_argument("--write-through", choices=("on", "off"), default="on",
                        help="serve source turns on the session's token ids so the producer stores them as it "
                             "serves (default on; a client's X-KVTransfer-Write-Through header overrides per session)")
    parser.add_argument("--switch-wait", type=float, default=5.0,
                        help="seconds a switch waits for the source's store write in flight (needs --store)")
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20)
    parser.add_argument("--max-sessions", type=int, default=10000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take per request")
    parser.add_argument("--no-remap-turns", action="store_true",
                        help="later turns of a handed-over session are prefilled by the target, not mapped")
    parser.add_argument("--secret-file", help="the deployment's secret (created, mode 0600, if missing): session "
                                              "owners, cache salts and store namespaces are keyed digests under it, "
                                              "so sessions survive a restart. Default: $KVTRANSFER_PROXY_SECRET, "
                                              "else random per start")
    parser.add_argument("--allow-anonymous-sessions", action="store_true",
                        help="serve session requests without an API key (anyone who knows such a session's id can "
                             "use it); default: they are 401s")
    parser.add_argument("--switch-stall", type=float, default=1.0,
                        help="seconds a switch waits for the store to grow before mapping what is there")
    args = parser.parse_args(argv)
    start_ids = args.start_ids
    if args.mapper:
        try:
            recorded = mapper_start_ids(args.mapper)
        except ValueError as err:
            parser.error(str(err))
        if start_ids is not None and start_ids != recorded:
            parser.error(f"--start-ids {start_ids} differ from the mapper's {recorded}: drop --start-ids")
        start_ids = recorded
    if start_ids is None:
        parser.error("give --mapper (the consumer's mapper directory; its start ids are read from it)")
    try:
        secret = read_secret(args.secret_file) if args.secret_file else \
            (os.environ["KVTRANSFER_PROXY_SECRET"].encode() if os.environ.get("KVTRANSFER_PROXY_SECRET") else None)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per upstream request
    proxy = HandoffProxy(args.source, args.target, source_model=args.source_model, target_model=args.target_model,
                         start_ids=start_ids, timeout_s=args.timeout, remap_turns=not args.no_remap_turns,
                         store=args.store, write_through=args.write_through == "on", switch_wait_s=args.switch_wait,
                         secret=secret, max_body_bytes=args.max_body_bytes, max_sessions=args.max_sessions,
                         allow_anonymous_sessions=args.allow_anonymous_sessions, switch_stall_s=args.switch_stall)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
