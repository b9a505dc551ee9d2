"""The handoff proxy: one OpenAI-compatible endpoint in front of a producer (source) and a consumer (target) engine.
    python -m kvtransfer.serve.proxy --source http://127.0.0.1:8001 --target http://127.0.0.1:8002 \
        --start-ids 151643 --port 8000

Routes: `/v1/chat/completions`, `/v1/completions` (both streaming or not), `/v1/models`, `/health`,
`/kvtransfer/stats` (the proxy's counters, JSON).

A session (header `X-KVTransfer-Session`; without one every request is its own session) is served by the
source. A request that asks for the target -- its `model` is the target's served name (or "target"), or the
header `X-KVTransfer-Model: target` -- hands the session over:
  1. the prompt's token ids are computed by the target's `/tokenize` (chat: its chat template with the
     generation prompt), with the mapper's position-0 ids (`--start-ids`, e.g. `<|endoftext|>` for
     `context_start=prefix_token`) put in front;
  2. the producer reads them once (`/v1/completions`, those ids, `max_tokens=1`): its connector saves the KV;
  3. the consumer gets the same ids (`/v1/completions`): its connector maps the stored prefix and prefills
     the rest. Later turns of a handed-over session go to the consumer with
     `kv_transfer_params.kvtransfer_source_len` = the handed-over length, while their prompt still starts
     with the handed-over ids (it maps that prefix; the target prefills the new turns).
A chat request is answered in chat format (the consumer's completion converted: text, finish reason,
logprobs, usage).

What happened is in the response header `X-KVTransfer` and in the body field `kvtransfer` (streaming: the
header says `handoff: ...` and the field rides on the stream's last event, since vLLM reports cached tokens
only in its final usage chunk): `mapped N tokens, prefilled M` (N = the consumer's
`usage.prompt_tokens_details.cached_tokens`: start the consumer with `--enable-prompt-tokens-details`,
prefix caching off), `fallback_reprefill: <reason>` (the consumer prefilled everything; the proxy's reason:
`save_failed`, `consumer_fallback` -- the consumer's connector declined, its stats file says why -- or `gate_full`:
its per-request gate chose a full prefill), `fallback_source: <reason>` (the target is down), or `source`.

Never down: a malformed request is a 400 in OpenAI's error format; a dead or failing engine is a fallback
(target -> source) or, with both down, a 502; every outcome is counted (`/kvtransfer/stats`). The proxy
depends on the engines only through HTTP and the fields above, so it works with any consumer that reports
mapped tokens as cached tokens. Large -> small is the same proxy with the engines' roles swapped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

try:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    HAVE_SERVE_STACK = True
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs them
    HAVE_SERVE_STACK = False

from .proxy_state import BadRequest, Outcome, Session, Stats, Unreachable  # noqa: F401 (re-exported)
from .proxy_wire import _relay, _sse_events, completion_chunk_to_chat, completion_to_chat  # noqa: F401

log = logging.getLogger("kvtransfer.proxy")

SESSION_HEADER = "x-kvtransfer-session"
MODEL_HEADER = "x-kvtransfer-model"
STATUS_HEADER = "x-kvtransfer"
# chat fields a completion request cannot carry: such a request is forwarded to the target as chat, unmapped
CHAT_ONLY = ("tools", "tool_choice", "functions", "function_call", "response_format", "documents",
             "continue_final_message", "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar")
# chat fields consumed by the conversion itself
CHAT_CONVERTED = ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                  "chat_template", "chat_template_kwargs", "echo")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> "JSONResponse":
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in value)


class HandoffProxy:
    """The proxy's state and logic: engine URLs and model names, sessions (LRU-bounded), counters.

    source / target: base URLs of the producer and the consumer engine. start_ids: the mapper's position-0
    token ids, put in front of every prompt the proxy hands over. client: an httpx.AsyncClient (tests pass
    one whose transport reaches in-process fakes). max_sessions: sessions kept (least recently used dropped).
    """

    def __init__(self, source: str, target: str, *, source_model: str | None = None,
                 target_model: str | None = None, start_ids: list[int] | tuple[int, ...] = (),
                 client: "httpx.AsyncClient | None" = None, timeout_s: float = 600.0, max_sessions: int = 10000,
                 remap_turns: bool = True):
        if not HAVE_SERVE_STACK:
            raise ImportError("kvtransfer.serve.proxy needs fastapi, uvicorn and httpx: pip install -e '.[serve]'")
        self.urls = {"source": source.rstrip("/"), "target": target.rstrip("/")}
        self.models = {"source": source_model, "target": target_model}
        self.start_ids = [int(i) for i in start_ids]
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.max_sessions = max_sessions
        self.remap_turns = remap_turns
        self.stats = Stats()
        self._locks: dict[str, asyncio.Lock] = {}

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
    def _session(self, key: str | None) -> Session:
        if key is None:
            return Session()
        session = self.sessions.pop(key, None) or Session()
        self.sessions[key] = session
        while len(self.sessions) > self.max_sessions:
            dropped, _ = self.sessions.popitem(last=False)
            self._locks.pop(dropped, None)
        return session

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

    # ------------------------------------------------------------------ the handoff
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
        if self.start_ids and ids[:len(self.start_ids)] != self.start_ids:
            ids = self.start_ids + ids
        return ids

    async def save(self, ids: list[int]) -> float:
        """The producer reads `ids` once (max_tokens=1): its connector stores their KV. Seconds taken."""
        t0 = time.perf_counter()
        await self._post("source", "/v1/completions", {"model": await self.model_name("source"), "prompt": ids,
                                                         "max_tokens": 1, "temperature": 0.0})
        return time.perf_counter() - t0

    def completion_body(self, kind: str, body: dict, ids: list[int], source_len: int | None, model: str) -> dict:
        """The consumer's /v1/completions body for a (chat or completion) request, on the token ids `ids`."""
        drop = CHAT_CONVERTED if kind == "chat" else ()
        out = {k: v for k, v in body.items() if k not in drop and k not in ("prompt", "model")}
        out["model"], out["prompt"] = model, ids
        if kind == "chat":
            if body.get("logprobs"):
                top = body.get("top_logprobs") or 0
                if not isinstance(top, int) or isinstance(top, bool) or top < 0:
                    raise BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}")
                out["logprobs"] = top
            if "max_completion_tokens" in body and "max_tokens" not in body:
                out["max_tokens"] = body["max_completion_tokens"]
        params = dict(body.get("kv_transfer_params") or {}) if isinstance(body.get("kv_transfer_params"), dict) else {}
        if source_len is not None:
            params["kvtransfer_source_len"] = source_len
        if params:
            out["kv_transfer_params"] = params
        else:
            out.pop("kv_transfer_params", None)
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

    def judge(self, usage: dict | None, save_error: str, save_s: float | None, connector: Any = None) -> Outcome:
        """The outcome of a consumer request: its connector's own decision (`kv_transfer_params.kvtransfer`; vLLM
        counts rejected loads as cached), else its usage's cached tokens; plus the save step's error."""
        decision = connector.get("kvtransfer") if isinstance(connector, dict) else None
        if isinstance(decision, dict) and isinstance(decision.get("reason"), str):
            mapped, prefilled = decision.get("mapped"), (lambda n: n if isinstance(n, int) else None)(decision.get("prefilled"))
            if decision["reason"] == "mapped" and isinstance(mapped, int) and mapped > 0:
                return Outcome("mapped", "target", mapped, prefilled, "", save_s)
            gate = decision.get("gate") if isinstance(decision.get("gate"), dict) else {}  # gate_full: its own prefill
            why = f"gate_full ({gate.get('reason')})" if gate.get("action") == "full" else f"consumer_fallback ({decision['reason']})"
            return Outcome("fallback_reprefill", "target", 0, prefilled, save_error or why, save_s)
        mapped, prefilled = self.counted(usage, save_error)
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
            body = await request.json()
        except ValueError:
            self.stats.errors["bad_request"] += 1
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            self.stats.errors["bad_request"] += 1
            return _error(400, "the request body must be a JSON object")
        key = request.headers.get(SESSION_HEADER)
        lock = self._locks.setdefault(key, asyncio.Lock()) if key is not None else None
        try:
            if lock is None:
                return await self._route(kind, body, request.headers, None)
            async with lock:  # one turn of a session at a time: its state changes with each
                return await self._route(kind, body, request.headers, key)
        except BadRequest as err:
            self.stats.errors["bad_request"] += 1
            return _error(400, str(err))
        except Unreachable as err:
            self.stats.errors["engines_down"] += 1
            return _error(502, f"no engine could serve the request: {err}", "upstream_error")
        except Exception as err:  # noqa: BLE001 -- never down: any bug is a counted 500, the proxy keeps serving
            log.exception("kvtransfer proxy: unexpected error")
            self.stats.errors[f"proxy_error:{type(err).__name__}"] += 1
            return _error(500, f"proxy error {type(err).__name__}: {err}", "internal_error")

    async def _route(self, kind: str, body: dict, headers, key: str | None) -> "Response":
        wanted = await self.wanted(body, headers)
        if kind == "chat" and not isinstance(body.get("messages"), list):
            raise BadRequest("messages must be a list")
        if kind == "completion" and "prompt" not in body:
            raise BadRequest("prompt is required")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise BadRequest(f"stream must be a boolean, got {body['stream']!r}")
        session = self._session(key)
        if wanted == "source" and session.engine == "source":
            return await self._forward("source", kind, body, Outcome("source", "source"))
        if wanted == "source":  # a handed-over session asking for the source: served there, re-prefilled
            return await self._forward("source", kind, body,
                                       Outcome("fallback_reprefill", "source", reason="no reverse map in this proxy"))
        return await self._to_target(kind, body, session)

    async def _to_target(self, kind: str, body: dict, session: Session) -> "Response":
        if kind == "chat" and any(k in body for k in CHAT_ONLY):
            reason = "chat fields " + ",".join(k for k in CHAT_ONLY if k in body)
            return await self._forward_or_source(kind, body, Outcome("fallback_reprefill", "target", reason=reason))
        try:
            ids = await self.prompt_ids(kind, body)
        except Unreachable as err:
            return await self._forward_or_source(kind, body, Outcome("fallback_reprefill", "target",
                                                                     reason=f"tokenize_failed ({err})"))
        source_len, save_error, save_s = None, "", None
        handed = session.handed_ids
        if session.engine == "target" and self.remap_turns and handed and ids[:len(handed)] == handed:
            source_len = len(handed)  # a later turn: map what the source read, prefill the new turns
        else:
            try:
                save_s = await self.save(ids)
            except (Unreachable, BadRequest) as err:
                save_error = f"save_failed ({err})"
            session.engine, session.handed_ids = "target", (ids if not save_error else [])
        upstream = self.completion_body(kind, body, ids, source_len, await self.model_name("target"))
        try:
            if upstream.get("stream"):
                return await self._stream_target(kind, body, upstream, save_error, save_s)
            data = await self._post("target", "/v1/completions", upstream)
        except Unreachable as err:
            session.engine = "source"
            return await self._forward("source", kind, body,
                                       Outcome("fallback_source", "source", reason=f"target_unreachable ({err})"))
        out = self.judge(data.get("usage"), save_error, save_s, data.get("kv_transfer_params"))
        self.stats.outcome(out)
        if kind == "chat":
            data = completion_to_chat(data, await self.model_name("target"))
        data["kvtransfer"] = out.field()
        return JSONResponse(data, headers={STATUS_HEADER: out.header()})

    async def _forward_or_source(self, kind: str, body: dict, outcome: Outcome) -> "Response":
        try:
            return await self._forward("target", kind, body, outcome)
        except Unreachable as err:
            return await self._forward("source", kind, body,
                                       Outcome("fallback_source", "source", reason=f"target_unreachable ({err})"))

    async def _forward(self, engine: str, kind: str, body: dict, outcome: Outcome) -> "Response":
        """Pass the request to one engine as it is (model renamed), adding the outcome header and field."""
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        upstream = {**body, "model": await self.model_name(engine)}
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

    async def _stream_target(self, kind: str, body: dict, upstream: dict, save_error: str,
                             save_s: float | None) -> "Response":
        """Stream the consumer's completion (as chat chunks for a chat request).

        vLLM reports cached (mapped) tokens only in the stream's final usage chunk, so the header carries
        what is known when the stream starts (`handoff: ...` or the save's fallback) and the `kvtransfer`
        field rides on the last event (the usage chunk, or a `choices: []` chunk when the client did not
        ask for usage); the counters are updated when the stream ends.
        """
        try:
            req = self.client.build_request("POST", self.urls["target"] + "/v1/completions", json=upstream)
            reply = await self.client.send(req, stream=True)
        except httpx.HTTPError as err:
            raise Unreachable(f"target {type(err).__name__}") from err
        if reply.status_code >= 400:
            text = (await reply.aread()).decode(errors="replace")
            await reply.aclose()
            if reply.status_code >= 500:
                raise Unreachable(f"target HTTP {reply.status_code}")
            raise BadRequest(f"target refused the request: {text[:500]}")
        keep_usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
        model = await self.model_name("target")
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        header = (f"fallback_reprefill: {save_error}" if save_error
                  else "handoff: mapped tokens in the stream's last event (kvtransfer field)")

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
            except httpx.HTTPError as err:  # the consumer died mid-stream: end the stream with an error event
                self.stats.errors["target_died_mid_stream"] += 1
                yield f"data: {json.dumps({'error': {'message': f'target stream ended: {err}'}})}\n\n".encode()
            finally:
                await reply.aclose()
            out = self.judge(usage, save_error or ("" if ended else "the consumer's stream ended early"), save_s)
            self.stats.outcome(out)
            last = {"id": chat_id if kind == "chat" else "cmpl-kvtransfer",
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": int(time.time()), "model": model, "choices": [], "kvtransfer": out.field()}
            if keep_usage:
                last["usage"] = usage
            yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(produce(), media_type="text/event-stream", headers={STATUS_HEADER: header})


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

    return app


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
    parser.add_argument("--start-ids", type=_ids, default=[],
                        help="the mapper's position-0 token ids, comma-separated (151643 for Qwen2.5 prefix_token)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take per request")
    parser.add_argument("--no-remap-turns", action="store_true",
                        help="later turns of a handed-over session are prefilled by the target, not mapped")
    args = parser.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per upstream request
    proxy = HandoffProxy(args.source, args.target, source_model=args.source_model, target_model=args.target_model,
                         start_ids=args.start_ids, timeout_s=args.timeout, remap_turns=not args.no_remap_turns)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
