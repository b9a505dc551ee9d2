"""The OpenAI wire format as the handoff proxy (kvtransfer.serve.proxy) speaks it: its headers and the fields it
passes on, relaying and parsing an engine's server-sent events, and a /v1/completions answer (whole or streamed)
turned into a /v1/chat/completions one."""
from __future__ import annotations

import json
import time
from typing import Any

try:
    import httpx
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs it
    httpx = None

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


async def _relay(reply) -> Any:
    """An engine's raw streamed bytes, passed through; an error event if the upstream stream breaks."""
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    except httpx.HTTPError as err:
        yield f"data: {json.dumps({'error': {'message': f'upstream stream ended: {err}'}})}\n\n".encode()
    finally:
        await reply.aclose()


async def _sse_events(reply):
    """The JSON events of an SSE stream; None for the final `[DONE]`; non-JSON lines skipped."""
    async for line in reply.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            yield None
            return
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _chat_logprobs(logprobs: Any) -> dict | None:
    """A completion choice's logprobs ({tokens, token_logprobs, top_logprobs}) in chat format ({content: [...]})."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, value, top in zip(tokens, values, tops):
        content.append({"token": token, "logprob": value,
                        "top_logprobs": [{"token": t, "logprob": v} for t, v in (top or {}).items()]})
    return {"content": content}


def completion_to_chat(data: dict, model: str) -> dict:
    """A /v1/completions response as a /v1/chat/completions one (text -> assistant message)."""
    choices = []
    for choice in data.get("choices") or []:
        choices.append({"index": choice.get("index", 0),
                        "message": {"role": "assistant", "content": choice.get("text", "")},
                        "logprobs": _chat_logprobs(choice.get("logprobs")),
                        "finish_reason": choice.get("finish_reason")})
    return {"id": "chat" + str(data.get("id", "cmpl")), "object": "chat.completion",
            "created": data.get("created", int(time.time())), "model": model, "choices": choices,
            "usage": data.get("usage")}


def completion_chunk_to_chat(event: dict, model: str, chat_id: str, with_role: bool) -> dict:
    """One streamed completion chunk as a chat.completion.chunk (the first carries the assistant role)."""
    choices = []
    for choice in event.get("choices") or []:
        delta = {"content": choice.get("text", "")}
        if with_role:
            delta["role"] = "assistant"
        choices.append({"index": choice.get("index", 0), "delta": delta,
                        "logprobs": _chat_logprobs(choice.get("logprobs")),
                        "finish_reason": choice.get("finish_reason")})
    out = {"id": chat_id, "object": "chat.completion.chunk", "created": event.get("created", int(time.time())),
           "model": model, "choices": choices}
    if "usage" in event:
        out["usage"] = event["usage"]
    return out
