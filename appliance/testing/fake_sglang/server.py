"""The engine emulator's HTTP surface: a plain ASGI app served by uvicorn once "ready". A test
and demo instrument (`appliance.testing.fake_sglang`); every response carries the header
`x-emulator: fake_sglang`.

Endpoints as SGLang 0.5.23's `http_server.py`: `/health` and `/health_generate` (503 while
starting or draining, else a one-token generation), `/ready`, `/server_info`
(`/get_server_info`), `/model_info` (`/get_model_info`), `/v1/models[/{id}]`, `/v1/loads`,
`/metrics` (only with `--enable-metrics`, as in SGLang), `GET|POST /flush_cache`, `GET /`;
generation (`openai_serving.py`): `POST /v1/chat/completions` (reasoning, tool calls),
`POST /v1/completions`, `POST /generate`; Anthropic's (`anthropic_serving.py`):
`POST /v1/messages`, `POST /v1/messages/count_tokens`. With `--api-key` everything but
`/health*`, `/ready*`, `/metrics*` and `/emulator/*` needs `Authorization: Bearer <key>`.
During a SIGTERM drain new requests are still served, as SGLang does.

EMULATOR-ONLY extension, for tests (no real SGLang has it, and it needs no key):
`GET /emulator/stats` answers `{"running", "waiting", "peak_running", "requests_total",
"finished_total", "aborted_total", "max_running_requests"}` (`peak_running`: the most requests
running at once since start or the last reset; `aborted_total`: requests whose client went
away, queued or running; the startup warmup is one finished request), and
`POST /emulator/stats/reset` sets `peak_running` to what runs now and answers the stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from urllib.parse import parse_qs, unquote

from appliance.testing.fake_sglang import protocol as oai
from appliance.testing.fake_sglang import reports
from appliance.testing.fake_sglang.anthropic_serving import AnthropicServing
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.asgi import Disconnected, Handler, Receive, Scope, Send, respond
from appliance.testing.fake_sglang.core import Core
from appliance.testing.fake_sglang.logwriter import LogWriter
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.openai_serving import OpenAIServing
from appliance.testing.fake_sglang.startup import Model, Timings

OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/emulator/")
DEPRECATED = ("Endpoint '{old}' is deprecated and will be removed in a future version. "
              "Please use '{new}' instead.")
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")


def health_check_timeout() -> float:
    try:
        return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
    except ValueError:
        return 20.0


class App:
    """The ASGI application (lifespan + http)."""

    def __init__(self, args: ServeArgs, cap: Capacity, model: Model, timings: Timings,
                 core: Core, log: LogWriter) -> None:
        self.args, self.cap, self.model, self.timings = args, cap, model, timings
        self.core, self.log = core, log
        self.created = int(time.time())
        openai = OpenAIServing(args, cap, core)
        messages = AnthropicServing(args, cap, core)
        self.get_routes: dict[str, Handler] = {
            "/health": self.health, "/health_generate": self.health, "/ready": self.ready,
            "/server_info": self.server_info, "/get_server_info": self.get_server_info,
            "/model_info": self.model_info, "/get_model_info": self.get_model_info,
            "/v1/models": self.models, "/v1/loads": self.loads, "/metrics": self.metrics,
            "/flush_cache": self.flush_cache, "/emulator/stats": self.stats, "/": self.root,
        }
        self.post_routes: dict[str, Handler] = {
            "/v1/chat/completions": openai.chat, "/v1/completions": openai.completions,
            "/generate": openai.generate, "/v1/messages": messages.messages,
            "/v1/messages/count_tokens": messages.count_tokens,
            "/flush_cache": self.flush_cache, "/emulator/stats/reset": self.reset_stats,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

    def authorized(self, scope: Scope, path: str) -> bool:
        key = self.args.api_key
        if not key or scope["method"] == "OPTIONS" or path.startswith(OPEN_PREFIXES):
            return True
        header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, key)

    # -- probes ---------------------------------------------------------------------------
    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        core.auto_create_handle_loop()  # its one-token generation goes through the tokenizer
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

    async def ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200 if self.core.ready() else 503)

    async def root(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, "SGLang is running (fake_sglang emulator)", "text/plain")

    # -- reports --------------------------------------------------------------------------
    async def server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.core.auto_create_handle_loop()  # get_internal_state asks the schedulers
        await respond(send, 200,
                      reports.server_info(self.args, self.cap, self.core, self.timings))

    async def get_server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.log.line(DEPRECATED.format(old="/get_server_info", new="/server_info"))
        await self.server_info(scope, receive, send)

    async def model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, reports.model_info(self.args, self.model))

    async def get_model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.log.line(DEPRECATED.format(old="/get_model_info", new="/model_info"))
        await self.model_info(scope, receive, send)

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = oai.model_card(self.args.served_model_name, self.cap.context_len, self.created)
        await respond(send, 200, {"object": "list", "data": [card]})

    async def one_model(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = unquote(scope["path"].removeprefix("/v1/models/"))
        if name != self.args.served_model_name:
            await respond(send, 404, {"error": {
                "message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}})
            return
        await respond(send, 200, oai.model_card(name, self.cap.context_len, self.created))

    async def loads(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        include = None
        if query.get("include"):
            include = {s.strip() for s in query["include"][0].split(",") if s.strip()}
            if not include <= set(reports.SECTIONS):
                await respond(send, 400, {"detail": (
                    f"Invalid include sections: {include - set(reports.SECTIONS)}. "
                    f"Valid options: {sorted(reports.SECTIONS)}")})
                return
        self.core.auto_create_handle_loop()  # get_loads asks the schedulers
        body = reports.loads(self.cap, self.core, self.args.tp_size, include)
        if query.get("format", [""])[0] == "prometheus":
            await respond(send, 200, reports.loads_prometheus(body["loads"][0]),
                          "text/plain; version=0.0.4; charset=utf-8")
            return
        await respond(send, 200, body)

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.args.enable_metrics:
            await respond(send, 404, {"detail": "Not Found"})
            return
        await respond(send, 200, reports.metrics(self.args, self.cap, self.core, self.timings),
                      "text/plain; version=0.0.4; charset=utf-8")

    # -- cache and emulator stats ----------------------------------------------------------
    async def flush_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.core.auto_create_handle_loop()
        if self.core.flush_cache():
            await respond(send, 200, FLUSHED, "text/plain; charset=utf-8")
        else:
            await respond(send, 400, "Flush cache failed.\n", "text/plain; charset=utf-8")

    async def stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Emulator-only (see the module docstring)."""
        await respond(send, 200, self.core.stats())

    async def reset_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.core.reset_peak()
        await respond(send, 200, self.core.stats())
