"""The handoff proxy's switch: a request that asks for the target maps the session's stored prefix.

A warm session (its source turns were written through) waits for the producer's write in flight, then the
consumer maps what is stored and prefills the rest; a cold one (its first request asks for the target) is first
read once by the producer (the save step), whose write it waits for the same way. `judge` reads what the consumer
did from its connector's decision (or its usage) into an Outcome.

`Switch` is a part of `kvtransfer.serve.proxy.HandoffProxy`; it uses the attributes HandoffProxy.__init__ sets
(store, block_size, switch_wait_s, switch_stall_s, remap_turns, sessions, stats) and EngineCalls' methods."""
from __future__ import annotations

import asyncio
import time
from typing import Any

try:
    from fastapi.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - the [serve] / [dev] extra installs them
    pass

from .proxy_state import BadRequest, Outcome, Session, Unreachable
from .proxy_wire import CHAT_ONLY, MAPPED_SALT, STATUS_HEADER, completion_to_chat


class Switch:
    """The target side of the handoff proxy (see the module docstring for the attributes it uses)."""

    async def save(self, ids: list[int], session: Session) -> float:
        """The producer reads `ids` once (max_tokens=1): its connector stores their KV under the session's namespace.
        Seconds taken. Only for a session the source never served (a warm session's blocks are already stored)."""
        t0 = time.perf_counter()
        body = {"model": await self.model_name("source"), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"kvtransfer_ns": session.ns}}
        salt = self.sessions.source_salt(session.owner)
        await self._post("source", "/v1/completions", {**body, "cache_salt": salt} if salt else body)
        return time.perf_counter() - t0

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
            try:
                tip = await asyncio.to_thread(self.store.tip, ids[:want], None, ns=ns)
            except Exception as err:  # noqa: BLE001 -- a store that does not answer: the consumer looks for itself
                self.stats.errors[f"store_unavailable:{type(err).__name__}"] += 1
                return 0
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
