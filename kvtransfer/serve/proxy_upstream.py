"""The handoff proxy's calls to its engines: a JSON POST, an engine's served name, a request forwarded as it came
(streamed or not), a completion streamed on token ids, and the completion body the proxy builds on them.

`EngineCalls` is a part of `kvtransfer.serve.proxy.HandoffProxy`; it uses the attributes HandoffProxy.__init__
sets: urls, models, client, sessions and stats."""
from __future__ import annotations

import json
import time
import uuid

try:
    import httpx
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs them
    pass

from .proxy_state import BadRequest, Outcome, Unreachable, ascii_header
from .proxy_wire import CHAT_CONVERTED, STATUS_HEADER, _relay, _sse_events, completion_chunk_to_chat


class EngineCalls:
    """Upstream calls of the handoff proxy (see the module docstring for the attributes they use)."""

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

    def engine_salt(self, engine: str, owner: str) -> str:
        """The cache salt of an owner's request forwarded as it came: per owner on either engine ("" without a key),
        never the consumer's mapped salt (a forwarded request is never mapped)."""
        if not owner:
            return ""
        return self.sessions.source_salt(owner) if engine == "source" else \
            "kvtransfer-target:" + self.sessions.source_salt(owner).split(":", 1)[1]

    async def _forward_or_source(self, kind: str, body: dict, outcome: Outcome, owner: str) -> "Response":
        try:
            return await self._forward("target", kind, body, outcome, owner)
        except Unreachable as err:
            return await self._forward("source", kind, body,
                                       Outcome("fallback_source", "source", reason=f"target_unreachable ({err})"),
                                       owner)

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
