"""The engine emulator's generation endpoints: `POST /v1/chat/completions`,
`POST /v1/completions` (streaming or not) and the native `POST /generate`. A test and demo
instrument (`appliance.testing.fake_sglang`). Every request goes through the core's scheduler
(`core.plan`, `core.generate`): it counts toward running and queued, and a client that goes
away aborts it. A request the engine aborts (`EngineAbort`: the performance model's timeouts)
is answered as SGLang does: 503 with an error body, or, once a stream has started, HTTP 200
and the error in-band (`data: {"error": {...}}`, then `[DONE]`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from http import HTTPStatus
from typing import Any

from appliance.testing.fake_sglang import protocol as oai
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.asgi import (
    Receive,
    Scope,
    Send,
    emit,
    end_stream,
    json_content_error,
    read_json,
    respond,
    start_stream,
    until_disconnect,
    validation_message,
)
from appliance.testing.fake_sglang.chat import ChatChunks, ChatPlan, chat_response, plan_chat
from appliance.testing.fake_sglang.core import Core, EngineAbort, Request
from appliance.testing.fake_sglang.disagg import bootstrap_of
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.priority import (
    BadHeader,
    Refused,
    header_overrides_on,
    header_priority,
    requested_priority,
)

DONE = "data: [DONE]\n\n"


def abort_body(exc: EngineAbort) -> dict[str, object]:
    return oai.error_body(exc.message, exc.status, HTTPStatus(exc.status).name)


class OpenAIServing:
    def __init__(self, args: ServeArgs, cap: Capacity, core: Core) -> None:
        self.args, self.cap, self.core = args, cap, core
        self.cache_report = args.enable_cache_report
        self.header_overrides = header_overrides_on(os.environ)

    async def drain_tokens(self, req: Request) -> None:
        async with contextlib.aclosing(self.core.generate(req)) as tokens:
            async for _ in tokens:
                pass

    async def finished(self, req: Request, receive: Receive, send: Send) -> bool:
        """Run a non-streaming request to its end: True when it completed; False when the
        client went away, or the engine aborted it (its 503 has then been sent)."""
        try:
            return await until_disconnect(self.drain_tokens(req), receive)
        except EngineAbort as exc:
            await respond(send, exc.status, abort_body(exc))
            return False

    async def prioritized(self, req: Request, body: dict[str, Any], send: Send, *,
                          scope: Scope | None = None, native: bool = False,
                          stream: bool = False) -> bool:
        """Set the request's `priority` (priority.py): the body's, or the `x-override-priority`
        header's where the path reads it (`scope` given: /v1/chat/completions and /generate)
        and the overrides are on. False once its error has been sent: a body priority that
        is no integer (FastAPI's 400), a header `int()` refuses (the HTTPException's 400,
        type "400"), out of range (the tokenizer manager's ValueError: `BadRequestError`, or
        /generate's bare `{"error": {"message"}}`, in-band when it streams), or refused while
        disabled (503)."""
        try:
            requested = requested_priority(body)
        except ValueError:
            await respond(send, 400, oai.error_body(validation_message({
                "type": "int_type", "loc": ("body", "priority"),
                "msg": "Input should be a valid integer"}), kind=oai.VALIDATION))
            return False
        try:
            if scope is not None and self.header_overrides:
                requested = header_priority(scope.get("headers", []), requested)
            req.priority = self.core.priority.assign(requested)
        except BadHeader as exc:
            await respond(send, 400, oai.error_body(exc.message, 400, "400"))
            return False
        except Refused as exc:
            if exc.status != 400:
                await respond(send, exc.status, oai.error_body(
                    exc.message, exc.status, HTTPStatus(exc.status).name))
            elif native and stream:  # raised inside the stream, after its 200 (http_server.py)
                await start_stream(send)
                await end_stream(send, oai.sse({"error": {
                    "message": exc.message, "type": "invalid_request_error", "code": 400,
                    "retryable": False}}) + DONE)
            elif native:
                await respond(send, 400, {"error": {"message": exc.message}})
            else:
                await respond(send, 400, oai.error_body(exc.message))
            return False
        return True

    async def json_body(self, scope: Scope, receive: Receive,
                        send: Send) -> dict[str, Any] | None:
        """A /v1/* route's JSON object, or None once its 400 (FastAPI's validation, answered
        by SGLang's handler: type `Bad Request`) has been sent."""
        problem = json_content_error(scope)
        body = await read_json(receive) if problem is None else problem
        if isinstance(body, str):
            await respond(send, 400, oai.error_body(body, kind=oai.VALIDATION))
            return None
        return body

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self.json_body(scope, receive, send)
        if body is None:
            return
        try:
            plan = plan_chat(body, self.args, self.cap.context_len, self.core)
        except oai.BadRequest as exc:
            await respond(send, 400, oai.error_body(exc.message, kind=exc.kind, param=exc.param))
            return
        plan.req.bootstrap = bootstrap_of(body)
        if not await self.prioritized(plan.req, body, send, scope=scope):
            return
        if plan.params.stream:
            await until_disconnect(self.chat_stream(plan, send), receive)
        elif await self.finished(plan.req, receive, send):
            await respond(send, 200, chat_response(plan, self.cache_report))

    async def chat_stream(self, plan: ChatPlan, send: Send) -> None:
        """SGLang's `_generate_chat_stream`: nothing until the first token (a queued request
        is silent), then one frame per token that shows something."""
        chunks = ChatChunks(plan, self.cache_report)
        req, started = plan.req, False
        await start_stream(send)
        try:
            async with contextlib.aclosing(self.core.generate(req)) as tokens:
                async for _ in tokens:
                    if not started:
                        started = True
                        await emit(send, chunks.role())
                    frame = chunks.piece(plan.script.piece(req.seed, req.generated - 1))
                    if frame:
                        await emit(send, frame)
        except EngineAbort as exc:
            await end_stream(send, oai.sse({"error": abort_body(exc)}) + DONE)
            return
        if not started:
            await emit(send, chunks.role())
        await emit(send, chunks.finish())
        if plan.params.include_usage:
            await emit(send, chunks.usage())
        await end_stream(send, DONE)

    # -- /v1/completions ------------------------------------------------------------------
    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self.json_body(scope, receive, send)
        if body is None:
            return
        try:
            prompt = oai.completion_prompt(body)
            params = oai.sampling(body)
        except oai.BadRequest as exc:
            await respond(send, 400, oai.error_body(exc.message, kind=exc.kind, param=exc.param))
            return
        too_long = oai.context_error(prompt, self.cap.context_len)
        if too_long:
            await respond(send, 400, oai.error_body(too_long))
            return
        req = self.core.plan(prompt, params.max_tokens, params.min_tokens, params.ignore_eos)
        req.bootstrap = bootstrap_of(body)
        if not await self.prioritized(req, body, send):
            return
        model = str(body.get("model") or self.args.served_model_name)
        if params.stream:
            await until_disconnect(self.completion_stream(req, model, params, send), receive)
        elif await self.finished(req, receive, send):
            await respond(send, 200, oai.completion_response(req, model, self.cache_report))

    async def completion_stream(self, req: Request, model: str, params: oai.Sampling,
                                send: Send) -> None:
        created = int(time.time())
        await start_stream(send)
        try:
            async with contextlib.aclosing(self.core.generate(req)) as tokens:
                async for token in tokens:
                    await emit(send, oai.completion_chunk(
                        req, model, created, text=token,
                        finish=req.generated >= req.completion_tokens,
                        continuous_usage=params.continuous_usage))
        except EngineAbort as exc:
            await end_stream(send, oai.sse({"error": abort_body(exc)}) + DONE)
            return
        if req.completion_tokens == 0:
            await emit(send, oai.completion_chunk(req, model, created, finish=True,
                                                  continuous_usage=params.continuous_usage))
        if params.include_usage:
            await emit(send, oai.completion_usage_chunk(req, model, created, self.cache_report))
        await end_stream(send, DONE)

    # -- /generate ------------------------------------------------------------------------
    async def generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The native API (`text` or `input_ids`, `sampling_params`): what the warmup calls."""
        body = await read_json(receive)
        if isinstance(body, str):
            await respond(send, 400, oai.error_body(body, kind=oai.VALIDATION))
            return
        started = time.monotonic()
        try:
            prompt = oai.completion_prompt(body, "text" if "text" in body else "input_ids")
            params = oai.sampling(body, native=True)
        except oai.BadRequest as exc:
            await respond(send, 400, oai.error_body(exc.message, kind=exc.kind, param=exc.param))
            return
        req = self.core.plan(prompt, params.max_tokens, params.min_tokens, params.ignore_eos)
        req.bootstrap = bootstrap_of(body)
        if not await self.prioritized(req, body, send, scope=scope, native=True,
                                      stream=params.stream):
            return
        if not params.stream:
            if await self.finished(req, receive, send):
                await respond(send, 200, oai.generate_response(req, started))
            return

        async def stream() -> None:
            await start_stream(send)
            try:
                async with contextlib.aclosing(self.core.generate(req)) as tokens:
                    async for _ in tokens:
                        chunk = json.dumps(oai.generate_response(req, started))
                        await emit(send, f"data: {chunk}\n\n")
            except EngineAbort as exc:  # SGLang's native stream: the abort as a finish reason
                aborted = {"text": "", "output_ids": [], "meta_info": {
                    "id": req.rid, "completion_tokens": req.generated, "finish_reason": {
                        "type": "abort", "status_code": exc.status, "message": exc.message}}}
                await end_stream(send, f"data: {json.dumps(aborted)}\n\n{DONE}")
                return
            await end_stream(send, DONE)

        await until_disconnect(stream(), receive)
