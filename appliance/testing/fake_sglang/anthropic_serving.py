"""The engine emulator's Anthropic Messages API: `POST /v1/messages` (streaming or not) and
`POST /v1/messages/count_tokens`, in SGLang 0.5.23's shapes (`srt/entrypoints/anthropic/`).
A test and demo instrument (`appliance.testing.fake_sglang`). A request is translated to a
chat request (`anthropic.py`) and planned and scheduled like one (`chat.plan_chat`,
`core.generate`): it counts toward running and queued, and a client that goes away aborts it.

Non-stream: `{"id": "msg_<32 hex>", "type": "message", "role": "assistant", "content":
[thinking?, text?, tool_use?], "model", "stop_reason": "end_turn"|"max_tokens"|"tool_use",
"usage": {"input_tokens", "output_tokens", "cache_read_input_tokens"?}}` (null fields left
out). `input_tokens` is the prompt less its cached tokens; `cache_read_input_tokens` appears
only with --enable-cache-report and a cache hit.

Stream (`event: <type>` + `data: <json>` frames, no pings): `message_start` (the message with
`content: []` and usage `{"input_tokens", "output_tokens": 0, "cache_read_input_tokens"?}`),
then per block `content_block_start` (`{"type": "thinking", "thinking": ""}`,
`{"type": "text", "text": ""}` or `{"type": "tool_use", "id", "name", "input": {}}`),
`content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta` with
`partial_json`), `content_block_stop`; then `message_delta` `{"delta": {"stop_reason"},
"usage": {"output_tokens"}}` and `message_stop`.

Priority: the body has no field for it; the request takes `x-override-priority` when the
engine runs with the header overrides on (priority.py), else `--default-priority-value`.
Errors, as `AnthropicServing` answers them: a header `int()` refuses is a 400
`invalid_request_error` naming it (a stream's is a 500 `api_error`: its conversion's
HTTPException falls into the `except Exception` branch); a priority out of range is a 400
of type `BadRequestError` (the chat handler's type, kept for a 4xx), in-band as an `error`
event when streaming; an engine abort (a full queue, a higher priority, a timeout) is its
status, `overloaded_error` for 503, "Internal server error" (a 5xx says no more), and
in-band when streaming, with the abort's words.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any

from appliance.testing.fake_sglang import anthropic
from appliance.testing.fake_sglang import protocol as oai
from appliance.testing.fake_sglang.answer import Piece
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.asgi import (
    Receive,
    Scope,
    Send,
    emit,
    end_stream,
    read_json,
    respond,
    start_stream,
    until_disconnect,
)
from appliance.testing.fake_sglang.chat import ChatPlan, plan_chat
from appliance.testing.fake_sglang.core import Core, EngineAbort, Request
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.priority import (
    BadHeader,
    Refused,
    header_overrides_on,
    header_priority,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage(req: Request, cache_report: bool, *, with_input: bool = True,
          output: int | None = None) -> dict[str, int]:
    cached = req.cached_tokens if cache_report else 0
    out: dict[str, int] = {}
    if with_input:
        out["input_tokens"] = max(req.prompt_tokens - cached, 0)
    out["output_tokens"] = req.generated if output is None else output
    if with_input and cached:
        out["cache_read_input_tokens"] = cached
    return out


def message(plan: ChatPlan, cache_report: bool) -> dict[str, Any]:
    req, script = plan.req, plan.script
    content: list[dict[str, Any]] = []
    if script.reasoning_text(req):
        content.append({"type": "thinking", "thinking": script.reasoning_text(req)})
    if script.content_text(req):
        content.append({"type": "text", "text": script.content_text(req)})
    call = script.made_call(req)
    if call is not None:
        content.append({"type": "tool_use", "id": call.id, "name": call.name,
                        "input": json.loads(call.arguments)})
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "content": content or [{"type": "text", "text": ""}], "model": plan.model,
            "stop_reason": STOP_REASONS.get(script.finish_reason(req), "end_turn"),
            "usage": usage(req, cache_report)}


def frame(event: dict[str, Any]) -> str:
    return (f"event: {event['type']}\n"
            f"data: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n")


class MessageEvents:
    """The SSE frames of one streamed message, block by block."""

    def __init__(self, plan: ChatPlan, cache_report: bool) -> None:
        self.plan, self.cache_report = plan, cache_report
        self.id = f"msg_{uuid.uuid4().hex}"
        self.started = False
        self.index = 0
        self.open: str | None = None

    def _start(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        return [frame({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": self.plan.model,
            "usage": usage(self.plan.req, self.cache_report, output=0)}})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [frame({"type": "content_block_stop", "index": self.index - 1})]

    def _block(self, kind: str, block: dict[str, Any], *, new: bool = False) -> list[str]:
        frames = self._close() if self.open is not None and (new or self.open != kind) else []
        if self.open is None:
            self.open = kind
            frames.append(frame({"type": "content_block_start", "index": self.index,
                                 "content_block": block}))
        return frames

    def _delta(self, delta: dict[str, Any]) -> str:
        return frame({"type": "content_block_delta", "index": self.index, "delta": delta})

    def piece(self, piece: Piece) -> list[str]:
        call = self.plan.script.call
        if piece.kind == "none" or (call is None and piece.kind in ("call", "arguments")):
            return []
        frames = self._start()
        if piece.kind == "reasoning":
            frames += self._block("thinking", {"type": "thinking", "thinking": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": piece.text}))
        elif piece.kind == "content":
            frames += self._block("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": piece.text}))
        elif piece.kind == "call" and call is not None:
            frames += self._block("tool_use", {"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": {}}, new=True)
        elif self.open == "tool_use":
            frames.append(self._delta({"type": "input_json_delta", "partial_json": piece.text}))
        return frames

    def failed(self, kind: str, message: str) -> list[str]:
        """SGLang's `_flush_on_error`: the message started, any open block closed, then an
        `error` event and `message_stop`."""
        return [*self._start(), *self._close(),
                frame({"type": "error", "error": {"type": kind, "message": message}}),
                frame({"type": "message_stop"})]

    def end(self) -> list[str]:
        req = self.plan.req
        stop = STOP_REASONS.get(self.plan.script.finish_reason(req), "end_turn")
        return [*self._start(), *self._close(),
                frame({"type": "message_delta", "delta": {"stop_reason": stop},
                       "usage": usage(req, self.cache_report, with_input=False)}),
                frame({"type": "message_stop"})]


class AnthropicServing:
    def __init__(self, args: ServeArgs, cap: Capacity, core: Core) -> None:
        self.args, self.cap, self.core = args, cap, core
        self.cache_report = args.enable_cache_report
        self.header_overrides = header_overrides_on(os.environ)

    async def _request(self, receive: Receive, send: Send,
                       count_only: bool = False) -> dict[str, Any] | None:
        body = await read_json(receive)
        try:
            if isinstance(body, str):
                raise anthropic.AnthropicError(body)
            anthropic.validate(body, count_only=count_only)
            return anthropic.chat_body(body, self.args.reasoning_parser)
        except anthropic.AnthropicError as exc:
            await respond(send, exc.status, exc.body())
            return None

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = await self._request(receive, send, count_only=True)
        if chat is None:
            return
        try:
            tokens = oai.chat_prompt(chat).tokens
        except oai.BadRequest as exc:
            await respond(send, 400, anthropic.error_body("invalid_request_error", exc.message))
            return
        await respond(send, 200, {"input_tokens": tokens})

    async def messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = await self._request(receive, send)
        if chat is None:
            return
        try:
            plan = plan_chat(chat, self.args, self.cap.context_len, self.core)
        except oai.BadRequest as exc:
            await respond(send, 400, anthropic.error_body("invalid_request_error", exc.message))
            return
        if not await self.prioritized(plan, scope, send):
            return
        if plan.params.stream:
            await until_disconnect(self.stream(plan, send), receive)
            return
        try:
            if not await until_disconnect(self.drain(plan.req), receive):
                return
        except EngineAbort as exc:
            await respond(send, exc.status, anthropic.error_body(
                anthropic.ERROR_TYPES.get(exc.status, "api_error"),
                anthropic.scrubbed(exc.message, exc.status)))
            return
        await respond(send, 200, message(plan, self.cache_report))

    async def prioritized(self, plan: ChatPlan, scope: Scope, send: Send) -> bool:
        """Set the request's priority: the header's, with the overrides on, else the
        engine's default (priority.py). False once its error has been sent (the module
        docstring says which)."""
        stream = plan.params.stream
        try:
            requested = (header_priority(scope.get("headers", []), None)
                         if self.header_overrides else None)
            plan.req.priority = self.core.priority.assign(requested)
        except BadHeader as exc:
            if stream:
                await respond(send, 500, anthropic.error_body("api_error",
                                                              "Internal server error"))
            else:
                await respond(send, 400, anthropic.error_body(
                    "invalid_request_error", anthropic.scrubbed(exc.message, 400)))
            return False
        except Refused as exc:
            if exc.status != 400:  # an abort, before the request ran
                kind = anthropic.ERROR_TYPES.get(exc.status, "api_error")
                if stream:
                    await self.failed_stream(plan, send, kind, exc.message)
                else:
                    await respond(send, exc.status, anthropic.error_body(
                        kind, anthropic.scrubbed(exc.message, exc.status)))
            elif stream:
                await self.failed_stream(plan, send, "invalid_request_error", exc.message)
            else:
                await respond(send, 400, anthropic.error_body(
                    "BadRequestError", anthropic.scrubbed(exc.message, 400)))
            return False
        return True

    async def failed_stream(self, plan: ChatPlan, send: Send, kind: str, message: str) -> None:
        await start_stream(send)
        *frames, last = MessageEvents(plan, self.cache_report).failed(kind, message)
        for text in frames:
            await emit(send, text)
        await end_stream(send, last)

    async def drain(self, req: Request) -> None:
        async with contextlib.aclosing(self.core.generate(req)) as tokens:
            async for _ in tokens:
                pass

    async def stream(self, plan: ChatPlan, send: Send) -> None:
        events, req = MessageEvents(plan, self.cache_report), plan.req
        await start_stream(send)
        try:
            async with contextlib.aclosing(self.core.generate(req)) as tokens:
                async for _ in tokens:
                    for text in events.piece(plan.script.piece(req.seed, req.generated - 1)):
                        await emit(send, text)
        except EngineAbort as exc:  # the chat stream's error envelope, forwarded in-band
            *frames, last = events.failed(anthropic.ERROR_TYPES.get(exc.status, "api_error"),
                                          exc.message)
        else:
            *frames, last = events.end()
        for text in frames:
            await emit(send, text)
        await end_stream(send, last)
