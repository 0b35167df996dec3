"""The engine emulator's HTTP surface: a plain ASGI app served by uvicorn once "ready". A test
and demo instrument (`appliance.testing.fake_sglang`); every response carries the header
`x-emulator: fake_sglang`.

Endpoints as SGLang 0.5.23's `http_server.py`: `/health` and `/health_generate` (503 while
starting or draining, else a one-token generation), `/ready`, `/server_info`
(`/get_server_info`), `/model_info` (`/get_model_info`), `/v1/models[/{id}]`, `/v1/loads`,
`/metrics` (only with `--enable-metrics`, as in SGLang), `POST /v1/chat/completions`,
`POST /v1/completions` (streaming or not), `POST /generate`, `GET /`. With `--api-key`
everything but `/health*`, `/ready*` and `/metrics*` needs `Authorization: Bearer <key>`.
During a SIGTERM drain new requests are still served, as SGLang does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import parse_qs, unquote

from appliance.testing.fake_sglang import EMULATOR_NAME, reports
from appliance.testing.fake_sglang import protocol as oai
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.core import Core, Request
from appliance.testing.fake_sglang.logwriter import LogWriter
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.startup import Model, Timings

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
JSON = "application/json"


class Disconnected(Exception):
    pass


def health_check_timeout() -> float:
    try:
        return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
    except ValueError:
        return 20.0


async def respond(send: Send, status: int, body: bytes | str | dict[str, Any] | None = None,
                  content_type: str = JSON) -> None:
    if isinstance(body, dict):
        payload = json.dumps(body).encode()
    elif isinstance(body, str):
        payload = body.encode()
    else:
        payload = body or b""
    headers = [(b"content-type", content_type.encode()), (b"x-emulator", EMULATOR_NAME.encode()),
               (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def start_stream(send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-emulator", EMULATOR_NAME.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> bool:
    """Run `work` until it ends (True) or the client goes away (False: `work` is cancelled,
    which aborts its request)."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


class App:
    """The ASGI application (lifespan + http)."""

    def __init__(self, args: ServeArgs, cap: Capacity, model: Model, timings: Timings,
                 core: Core, log: LogWriter) -> None:
        self.args, self.cap, self.model, self.timings = args, cap, model, timings
        self.core, self.log = core, log
        self.created = int(time.time())
        self.get_routes: dict[str, Handler] = {
            "/health": self.health, "/health_generate": self.health, "/ready": self.ready,
            "/server_info": self.server_info, "/get_server_info": self.server_info,
            "/model_info": self.model_info, "/get_model_info": self.model_info,
            "/v1/models": self.models, "/v1/loads": self.loads, "/metrics": self.metrics,
            "/": self.root,
        }
        self.post_routes: dict[str, Handler] = {
            "/v1/chat/completions": self.chat, "/v1/completions": self.completions,
            "/generate": self.generate,
        }

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if not self.authorized(scope, path):
            await respond(send, 401, {"error": "Unauthorized"})
            return
        routes = self.get_routes if method in ("GET", "HEAD") else self.post_routes
        handler = routes.get(path)
        if handler is None and method == "GET" and path.startswith("/v1/models/"):
            handler = self.one_model
        if handler is None:
            known = path in self.get_routes or path in self.post_routes
            await respond(send, 405 if known else 404,
                          {"detail": "Method Not Allowed" if known else "Not Found"})
            return
        with contextlib.suppress(Disconnected):
            await handler(scope, receive, send)

    def authorized(self, scope: dict[str, Any], path: str) -> bool:
        key = self.args.api_key
        if not key or scope["method"] == "OPTIONS" or path.startswith(OPEN_PREFIXES):
            return True
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, key)

    # -- probes ---------------------------------------------------------------------------
    async def health(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        core = self.core
        if core.draining:
            self.log.line("Health check request received during shutdown. Returning 503.")
            await respond(send, 503)
            return
        if core.status == "Starting":
            await respond(send, 503)
            return
        if scope["path"] == "/health" and \
                os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1") in ("0", "false"):
            await respond(send, 200)
            return
        if self.core.faults.unhealthy:
            tic = time.strftime("%H:%M:%S")
            timeout = health_check_timeout()
            await asyncio.sleep(timeout)
            beat = time.strftime("%H:%M:%S", time.localtime(self.timings.started))
            self.log.line(
                f"Health check failed. Server couldn't get a response from detokenizer for last "
                f"{timeout:g} seconds. tic start time: {tic}. last_heartbeat time: {beat}")
            core.status = "UnHealthy"
            await respond(send, 503)
            return
        await asyncio.sleep(core.token_seconds)
        core.status = "Up"
        await respond(send, 200)

    async def ready(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await respond(send, 200 if self.core.ready() else 503)

    async def root(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await respond(send, 200, "SGLang is running (fake_sglang emulator)", "text/plain")

    # -- reports --------------------------------------------------------------------------
    async def server_info(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await respond(send, 200,
                      reports.server_info(self.args, self.cap, self.core, self.timings))

    async def model_info(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await respond(send, 200, reports.model_info(self.args, self.model))

    async def models(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        card = oai.model_card(self.args.served_model_name, self.cap.context_len, self.created)
        await respond(send, 200, {"object": "list", "data": [card]})

    async def one_model(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        name = unquote(scope["path"].removeprefix("/v1/models/"))
        if name != self.args.served_model_name:
            await respond(send, 404, {"error": {
                "message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}})
            return
        await respond(send, 200, oai.model_card(name, self.cap.context_len, self.created))

    async def loads(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        include = None
        if query.get("include"):
            include = {s.strip() for s in query["include"][0].split(",") if s.strip()}
            if not include <= set(reports.SECTIONS):
                await respond(send, 400, {"detail": (
                    f"Invalid include sections: {include - set(reports.SECTIONS)}. "
                    f"Valid options: {sorted(reports.SECTIONS)}")})
                return
        body = reports.loads(self.cap, self.core, self.args.tp_size, include)
        if query.get("format", [""])[0] == "prometheus":
            await respond(send, 200, reports.loads_prometheus(body["loads"][0]),
                          "text/plain; version=0.0.4; charset=utf-8")
            return
        await respond(send, 200, body)

    async def metrics(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if not self.args.enable_metrics:
            await respond(send, 404, {"detail": "Not Found"})
            return
        await respond(send, 200, reports.metrics(self.args, self.cap, self.core, self.timings),
                      "text/plain; version=0.0.4; charset=utf-8")

    # -- generation -----------------------------------------------------------------------
    async def _json(self, receive: Receive, send: Send) -> dict[str, Any] | None:
        try:
            body = json.loads(await read_body(receive) or b"{}")
        except ValueError as exc:
            await respond(send, 400, oai.error_body(f"JSON decode error: {exc}"))
            return None
        if not isinstance(body, dict):
            await respond(send, 400, oai.error_body("The request body must be a JSON object"))
            return None
        return body

    async def chat(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self._openai(receive, send, chat=True)

    async def completions(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self._openai(receive, send, chat=False)

    async def _openai(self, receive: Receive, send: Send, *, chat: bool) -> None:
        body = await self._json(receive, send)
        if body is None:
            return
        try:
            prompt, prompt_tokens = oai.chat_prompt(body) if chat else oai.completion_prompt(body)
            params = oai.sampling(body)
        except oai.BadRequest as exc:
            await respond(send, 400, oai.error_body(exc.message, param=exc.param))
            return
        if prompt_tokens >= self.cap.context_len:
            await respond(send, 400, oai.error_body(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({self.cap.context_len} tokens)."))
            return
        req = self.core.plan(prompt, prompt_tokens, params.max_tokens, params.min_tokens,
                             params.ignore_eos)
        model = str(body.get("model") or self.args.served_model_name)
        if params.stream:
            await until_disconnect(self._stream(req, model, chat, params.include_usage, send),
                                   receive)
            return
        if await until_disconnect(self._drain_tokens(req), receive):
            shape = oai.chat_response if chat else oai.completion_response
            await respond(send, 200, shape(req, model))

    async def _drain_tokens(self, req: Request) -> None:
        async with contextlib.aclosing(self.core.generate(req)) as tokens:
            async for _ in tokens:
                pass

    async def _stream(self, req: Request, model: str, chat: bool, include_usage: bool,
                      send: Send) -> None:
        created = int(time.time())
        await start_stream(send)

        async def emit(text: str) -> None:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})

        if chat:
            await emit(oai.chat_chunk(req, model, created, role="assistant", content=""))
        async with contextlib.aclosing(self.core.generate(req)) as tokens:
            async for token in tokens:
                last = req.generated >= req.completion_tokens
                if chat:
                    await emit(oai.chat_chunk(req, model, created, content=token, finish=last))
                else:
                    await emit(oai.completion_chunk(req, model, created, text=token, finish=last))
        if req.completion_tokens == 0:
            chunk = oai.chat_chunk(req, model, created, content="", finish=True) if chat \
                else oai.completion_chunk(req, model, created, finish=True)
            await emit(chunk)
        if include_usage:
            chunk = oai.chat_chunk(req, model, created, with_usage=True) if chat \
                else oai.completion_chunk(req, model, created, with_usage=True)
            await emit(chunk)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    async def generate(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """The native API (`text` or `input_ids`, `sampling_params`): what the warmup calls."""
        body = await self._json(receive, send)
        if body is None:
            return
        started = time.monotonic()
        try:
            key = "text" if "text" in body else "input_ids"
            prompt, prompt_tokens = oai.completion_prompt(body, key)
            params = oai.sampling(body, native=True)
        except oai.BadRequest as exc:
            await respond(send, 400, oai.error_body(exc.message, param=exc.param))
            return
        req = self.core.plan(prompt, prompt_tokens, params.max_tokens, params.min_tokens,
                             params.ignore_eos)
        if not params.stream:
            if await until_disconnect(self._drain_tokens(req), receive):
                await respond(send, 200, oai.generate_response(req, started))
            return

        async def stream() -> None:
            await start_stream(send)
            async with contextlib.aclosing(self.core.generate(req)) as tokens:
                async for _ in tokens:
                    chunk = json.dumps(oai.generate_response(req, started))
                    await send({"type": "http.response.body", "body": f"data: {chunk}\n\n".encode(),
                                "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})

        await until_disconnect(stream(), receive)
