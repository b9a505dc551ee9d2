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

Bounded and isolated: a session is a few numbers (a length and a hash of its ids, not the ids), keyed by (API key
(`Authorization` header), session id) -- another key that sends the same id opens a session of its own and reaches
nothing of the first one's; locks exist only while a request holds them;
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
from pathlib import Path
from typing import Any

try:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    HAVE_SERVE_STACK = True
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs them
    HAVE_SERVE_STACK = False

from .blockstore import is_url
from .proxy_metrics import Stats, prometheus_text
from .proxy_state import (BadRequest, Outcome, RedisSessions, Session, SessionBusy, Sessions,  # noqa: F401
                          StateUnavailable, Unauthorized, Unreachable, ascii_header, shared_secret)
from .proxy_switch import Switch
from .proxy_upstream import EngineCalls
from .proxy_wire import (CHAT_ONLY, CLIENT_PARAMS, MAPPED_SALT, MAX_KEY, MAX_TOKEN_ID, MODEL_HEADER,  # noqa: F401
                         SESSION_HEADER, STATUS_HEADER, WRITE_THROUGH_HEADER, completion_chunk_to_chat,
                         completion_to_chat)

log = logging.getLogger("kvtransfer.proxy")

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


class HandoffProxy(EngineCalls, Switch):
    """The proxy's state and logic: engine URLs and model names, sessions (LRU-bounded), counters.

    source / target: base URLs of the producer and the consumer engine. start_ids: the mapper's position-0 token ids
    (`mapper_start_ids`), put in front of every session's token sequence. store: the producer's store directory, if
    the proxy can see it (waits for writes in flight at a switch; deleting a session removes its blocks).
    write_through: serve source turns on the session's token ids (default); off, they go to the source as they
    come and a switch re-runs the source's prefill. secret: the key of session owners' digests, cache salts and
    store namespaces (default: random per start, so a restart re-maps; the launcher keeps one per deployment).
    allow_anonymous_sessions: serve session requests without an Authorization header (anyone who knows such a
    session's id can use it); off, they are 401s. store: a directory or a redis:// URL (kvtransfer.serve.blockstore).
    state: a redis:// URL holding the session table and the secret, shared by every proxy of the deployment
    (default: the store's URL when the store is a Redis one; else sessions live in this process). switch_wait_s / switch_stall_s: a switch waits for the
    producer's write in flight at most this long in all / this long without the store growing. client: an
    httpx.AsyncClient (tests pass one whose transport reaches in-process fakes).
    """

    def __init__(self, source: str, target: str, *, source_model: str | None = None,
                 target_model: str | None = None, start_ids: list[int] | tuple[int, ...] = (),
                 client: "httpx.AsyncClient | None" = None, timeout_s: float = 600.0, max_sessions: int = 10000,
                 remap_turns: bool = True, store: str | None = None, write_through: bool = True,
                 switch_wait_s: float = 5.0, secret: bytes | None = None, max_body_bytes: int = 16 << 20,
                 block_size: int = 16, allow_anonymous_sessions: bool = False, switch_stall_s: float = 1.0,
                 state: str | None = None, state_timeout_s: float = 2.0, session_ttl_s: float = 7 * 24 * 3600.0,
                 lock_wait_s: float = 120.0):
        if not HAVE_SERVE_STACK:
            raise ImportError("kvtransfer.serve.proxy needs fastapi, uvicorn and httpx: pip install -e '.[serve]'")
        self.urls = {"source": source.rstrip("/"), "target": target.rstrip("/")}
        self.models = {"source": source_model, "target": target_model}
        self.start_ids = [int(i) for i in start_ids]
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.stats = Stats()
        self.store = None
        if store is not None:
            from .stores import open_store

            self.store = open_store(store, timeout_s=state_timeout_s)
        if state is None and store is not None and is_url(str(store)):
            state = str(store)  # one Redis for blocks and sessions unless told otherwise
        if state is not None:
            self.sessions = redis_sessions(state, secret, timeout_s=state_timeout_s, ttl_s=session_ttl_s,
                                           lock_wait_s=lock_wait_s, errors=self.stats.errors)
            self.sessions.max_sessions = max_sessions
        else:
            self.sessions = Sessions(secret or os.urandom(32), max_sessions)
        self.remap_turns, self.write_through = remap_turns, write_through
        self.switch_wait_s, self.switch_stall_s, self.max_body_bytes = switch_wait_s, switch_stall_s, max_body_bytes
        self.allow_anonymous_sessions = allow_anonymous_sessions
        self.block_size = self.store.block_size if self.store is not None else block_size

    @property
    def max_sessions(self) -> int:
        return self.sessions.max_sessions

    @max_sessions.setter
    def max_sessions(self, n: int) -> None:
        self.sessions.max_sessions = n

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
            try:
                async with self.sessions.locked(key, owner):
                    session, new = await self.sessions.fetch(key, owner)
                    try:
                        response = await self._route(kind, body, request.headers, wanted, session)
                    except Exception:
                        if new:  # a session's first request failed: it leaves nothing behind
                            await self.sessions.forget(key, owner)
                        raise
                    await self.sessions.save(key, owner, session)
                    return response
            except StateUnavailable as err:  # the shared session table is down: served without the session
                return await self._without_session(kind, body, wanted, owner, err)
        except BadRequest as err:
            self.stats.errors["bad_request"] += 1
            return _error(400, str(err))
        except TooLarge as err:
            self.stats.errors["body_too_large"] += 1
            return _error(413, str(err))
        except Unauthorized as err:
            self.stats.errors["unauthorized"] += 1
            return _error(401, str(err), "authentication_error")
        except SessionBusy as err:
            self.stats.errors["session_busy"] += 1
            return _error(409, str(err), "conflict_error")
        except Unreachable as err:
            self.stats.errors["engines_down"] += 1
            return _error(502, f"no engine could serve the request: {err}", "upstream_error")
        except Exception as err:  # noqa: BLE001 -- never down: any bug is a counted 500, the proxy keeps serving
            log.exception("kvtransfer proxy: unexpected error")
            self.stats.errors[f"proxy_error:{type(err).__name__}"] += 1
            return _error(500, f"proxy error {type(err).__name__}: {err}", "internal_error")

    async def _without_session(self, kind: str, body: dict, wanted: str, owner: str, err: Exception) -> "Response":
        """Serve a session's request while the shared session table is down: the target prefills normally (nothing
        is mapped: which blocks are the session's is unknown), the source serves the turn unstored; counted."""
        self.stats.errors["state_unavailable"] += 1
        log.warning("kvtransfer proxy: %s; serving the request without its session", err)
        if wanted == "target":
            return await self._forward_or_source(kind, body, Outcome("fallback_reprefill", "target",
                                                                     reason="state_unavailable (the session table "
                                                                            "did not answer)"), owner)
        return await self._forward("source", kind, body,
                                   Outcome("source", "source", reason="not_stored (state_unavailable)"), owner)

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
            session = await self.sessions.forget(key, owner)
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

    def snapshot() -> dict:
        tier = getattr(proxy.store, "tier_stats", None)
        return {**proxy.stats.as_dict(), "sessions": proxy.sessions.count(),
                "sessions_backend": proxy.sessions.backend, "store": tier() if tier is not None else {}}

    @app.get("/kvtransfer/stats")
    async def stats():
        return snapshot()

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(snapshot()), media_type="text/plain; version=0.0.4")

    @app.delete("/kvtransfer/sessions/{key:path}")  # :path -- an id may hold "/"
    async def delete_session(key: str, request: Request):
        try:
            return await proxy.delete_session(key, request.headers.get("authorization"))
        except BadRequest as err:
            return _error(400, str(err))
        except Unauthorized as err:
            return _error(401, str(err), "authentication_error")
        except SessionBusy as err:
            return _error(409, str(err), "conflict_error")
        except (StateUnavailable, OSError) as err:  # the session table or the store is down: retry later
            proxy.stats.errors[f"delete_unavailable:{type(err).__name__}"] += 1
            return _error(503, f"deleting the session failed: the store or the session table did not answer "
                               f"({type(err).__name__}); retry", "service_unavailable")
        except Exception as err:  # noqa: BLE001 -- a store fault is a counted 500; the proxy keeps serving
            log.exception("kvtransfer proxy: deleting a session failed")
            proxy.stats.errors[f"delete_error:{type(err).__name__}"] += 1
            return _error(500, f"deleting the session failed ({type(err).__name__}); retry", "internal_error")

    return app


def redis_sessions(url: str, secret: bytes | None, *, timeout_s: float = 2.0, ttl_s: float = 7 * 24 * 3600.0,
                   lock_wait_s: float = 120.0, errors=None) -> RedisSessions:
    """The session table in the Redis at `url` (?deployment=name selects the deployment's keys), with the
    deployment's secret: the one Redis holds, else `secret` (or a random one), stored there for every other proxy
    (the first proxy's wins). With Redis down at start the local secret is used and a warning logged (sessions then
    start afresh on this proxy until it is restarted with Redis up). Credentials never reach a log line."""
    from .blockstore import redact
    from .redis_store import DEPLOYMENT, connect, split_url

    client_url, ours = split_url(url)
    deployment = ours.get("deployment") or "default"
    if not DEPLOYMENT.fullmatch(deployment):
        raise ValueError(f"--state {redact(url)}: deployment {deployment!r} is not 1..64 letters, digits, '_', '.', "
                         f"'-'")
    client = connect(client_url, timeout_s=timeout_s)
    candidate = secret or os.urandom(32).hex().encode()
    try:
        shared = shared_secret(client, deployment, candidate)
        if secret is not None and shared != secret:
            log.warning("kvtransfer proxy: the session table %s already holds this deployment's secret; it replaces "
                        "the local one (every proxy of the deployment uses the first proxy's)", redact(url))
    except Exception as err:  # noqa: BLE001 -- start anyway: requests then count state_unavailable until it is back
        if type(err).__name__.startswith("Authentication"):
            raise ValueError(f"--state {redact(url)} refused the credentials: check the password in the URL or "
                             f"$KVTRANSFER_REDIS_PASSWORD") from None
        log.warning("kvtransfer proxy: the session table %s did not answer (%s); using the local secret",
                    redact(url), type(err).__name__)
        shared = candidate
    return RedisSessions(client, shared, deployment=deployment, ttl_s=ttl_s, lock_wait_s=lock_wait_s,
                         where=redact(url), errors=errors)


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
    parser.add_argument("--store", help="the KV store, if this host sees it (a directory, or the engines' redis:// "
                                        "URL): a switch waits for writes in flight, and deleting a session removes "
                                        "its blocks")
    parser.add_argument("--state", help="a redis:// URL for the session table and the secret, shared by every proxy "
                                        "of the deployment (default: --store when it is a redis:// URL; else "
                                        "sessions live in this process)")
    parser.add_argument("--state-timeout", type=float, default=2.0,
                        help="seconds each Redis call (store or session table) may take before it counts as down")
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
                         allow_anonymous_sessions=args.allow_anonymous_sessions, switch_stall_s=args.switch_stall,
                         state=args.state, state_timeout_s=args.state_timeout)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
