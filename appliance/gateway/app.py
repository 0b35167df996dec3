"""The gateway's ASGI application: the data plane in front of the engine.

A plain ASGI app rather than a framework: it has six routes and a budget of a millisecond,
and the hot path is a byte pump. One generation request goes:

    authenticate (failed-key throttle, key cache) → content type → body size → parse and
    validate → engine state → per-key limits (concurrency, requests/minute, tokens/day)
    → admission (fair queue) → forward → stream back, metering → record usage, metrics, history

The forward and the stream back are `appliance.gateway.forward`'s (the byte pump); the rest is
here.

Every refusal is a `GatewayError` rendered in the client's shape (OpenAI's, or Anthropic's on
`/v1/messages`), recorded and counted; nothing refused reaches the engine. While a request
waits or streams, a watcher listens for the client going away: the request then leaves the
queue or its upstream request is closed at once, which makes SGLang abort it, and its slot is
free for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any

import msgspec

from appliance.gateway import validate
from appliance.gateway.admission import QueueFull, QueueTimeout, estimate_prompt_tokens
from appliance.gateway.class_gate import ClassGate
from appliance.gateway.classes import effective
from appliance.gateway.errors import GatewayError
from appliance.gateway.forward import Exchange, Message, Receive, Send, forward, respond
from appliance.gateway.keycache import presented_key
from appliance.gateway.keys import KeyEntry
from appliance.gateway.parts import GatewayParts
from appliance.gateway.priority import priority_headers, priority_on, with_priority
from appliance.gateway.qualified import retry_after
from appliance.gateway.usage import UsageRecord
from appliance.gateway.validate import ENDPOINTS, Endpoint, Parsed
from appliance.sizes import bytes_text

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's code for "the client went away"
RECENT_DURATIONS = 256  # answered requests whose durations give the observed median


class GatewayApp:
    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.served = frozenset({parts.config.engine.served_model_name})
        self.max_body = parts.config.gateway.max_body_mib << 20
        self.queue_wait = float(parts.config.gateway.queue_wait_seconds)
        self.inflight: dict[int, int] = {}
        self.recent_seconds = 1.0  # moving mean of request durations, for Retry-After
        self.recent_durations: deque[float] = deque(maxlen=RECENT_DURATIONS)
        self.classes = ClassGate(parts.admission, effective(parts.config.gateway.classes),
                                 self.queue_wait, parts.metrics)
        # the engine was launched with priority scheduling for these classes (engine/priority)
        self.engine_priority = priority_on(parts.config.gateway.classes)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.parts.start()
                except Exception as exc:
                    log.exception("the gateway could not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.parts.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- routing ------------------------------------------------------------------------------

    async def http(self, scope: Message, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await self._error(send, GatewayError(405, "method_not_allowed",
                                                     f"{path} takes POST"), endpoint.anthropic)
                return
            await self.generate(endpoint, scope, receive, send)
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            await self.models(scope, send)
        elif path == "/metrics":
            await respond(send, 200, self.parts.metrics.render(),
                           b"text/plain; version=0.0.4; charset=utf-8")
        elif path in ("/health", "/healthz"):
            await self.health(send)
        else:
            await self._error(send, GatewayError(404, "not_found", f"there is no route {path}; "
                                                 "the API is under /v1/"), False)

    async def health(self, send: Send) -> None:
        """What a load balancer probes: 200 only while requests can be served (the engine is
        READY, or on a cell's head the cell serves, and the gateway admits), else 503 with
        the reason and Retry-After that a request would get. From memory only: no key, no
        database, no engine call. On a cell's head `cell` says that requests go through the
        cell's router, and the capacity the head published."""
        parts = self.parts
        await parts.fresh(active=False)  # a probe does not keep the poll busy
        route = parts.gate.route
        published = route.published
        admission = parts.admission
        refusal = parts.gate.refusal()
        stated = parts.admission_limit.during(published, parts.clock.now())
        body: dict[str, Any] = {
            "engine": published.state if published else "unknown",
            "admitting": refusal is None, "limit": admission.limit,
            "admitted": admission.in_use, "queued": admission.waiting,
            "admission": stated.to_dict()}
        if route.cell is not None:
            body["cell"] = {"router": route.base_url, "serving": route.cell.serving,
                            "capacity": route.cell.capacity, "message": route.cell.message}
        if refusal is None:
            await respond(send, 200, msgspec.json.encode({"status": "ok", **body}))
            return
        body = {"status": "unavailable", **body, "reason": refusal.message,
                "retry_after": refusal.retry_after}
        await respond(send, 503, msgspec.json.encode(body), headers=refusal.headers())

    async def models(self, scope: Message, send: Send) -> None:
        """The served model, answered here (no engine needed, so clients can list models
        while the engine loads)."""
        await self.parts.fresh()
        try:
            await self._authenticate(scope, dict(scope["headers"]), self.parts.clock.now())
        except GatewayError as err:
            await self._error(send, err, False)
            return
        name = self.parts.config.engine.served_model_name
        card: dict[str, Any] = {"id": name, "object": "model", "created": self.parts.created,
                                "owned_by": "appliance"}
        if self.parts.gate.context_len:
            card["max_model_len"] = self.parts.gate.context_len
        path: str = scope["path"]
        if path == "/v1/models":
            payload: dict[str, Any] = {"object": "list", "data": [card]}
        elif path.removeprefix("/v1/models/") == name:
            payload = card
        else:
            await self._error(send, GatewayError(
                404, "model_not_found", f"the model {path.removeprefix('/v1/models/')!r} "
                f"does not exist here; this box serves {name}", "model"), False)
            return
        await respond(send, 200, msgspec.json.encode(payload))

    # --- generation ---------------------------------------------------------------------------

    async def generate(self, endpoint: Endpoint, scope: Message, receive: Receive,
                       send: Send) -> None:
        parts = self.parts
        ex = Exchange(endpoint, time.perf_counter(), parts.clock.now())
        try:
            await parts.fresh()  # after an idle spell: keys and engine state read since
            headers = dict(scope["headers"])
            ex.key = key = await self._authenticate(scope, headers, ex.started_at)
            unserved = parts.gate.route.unserved(endpoint.path, endpoint.anthropic)
            if unserved is not None:
                raise unserved
            content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if content_type != b"application/json":
                raise GatewayError(415, "unsupported_media_type",
                                   "send the body as JSON with Content-Type: application/json")
            body = await self._read_body(headers, receive)
            ex.parsed = parsed = validate.parse(
                endpoint, body, served=self.served, context_len=parts.gate.context_len,
                key_max_tokens=key.limits.max_tokens)
            refusal = parts.gate.refusal()
            if refusal is not None:
                raise refusal
            self._check_key_limits(key, ex)
            await self._guarded(ex, key, parsed, headers, receive, send)
        except GatewayError as err:
            ex.status, ex.outcome = err.status, err.code
            if not ex.response_started:
                await self._error(send, err, endpoint.anthropic)
        finally:
            self._account(ex)

    async def _authenticate(self, scope: Message, headers: dict[bytes, bytes],
                            now: dt.datetime) -> KeyEntry:
        """The request's key, or a 401; a client address that sent too many wrong keys gets
        429 before its key is looked at (`appliance.gateway.auth_throttle`). A missing key
        is not counted: only a presented key can be a guess."""
        failures, clock = self.parts.auth_failures, self.parts.clock
        client = scope.get("client")
        address = str(client[0]) if client else ""
        wait = failures.blocked(address, clock.monotonic())
        if wait is not None:
            raise GatewayError(
                429, "too_many_failed_keys",
                f"this address sent {failures.max_failures} wrong API keys within "
                f"{failures.window:.0f} s; retry in {wait} s with a valid key",
                retry_after=wait)
        key = presented_key(headers)
        try:
            return await self.parts.keys.resolve(key, now)
        except GatewayError:
            if key:
                failures.failed(address, clock.monotonic())
            raise

    def _too_big(self) -> GatewayError:
        # made when refused, not for every request (its size in words is a format or two)
        return GatewayError(413, "request_too_large", f"the body is larger than "
                            f"{bytes_text(self.max_body)} (gateway.max_body_mib)")

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            raise self._too_big()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise GatewayError(CLIENT_CLOSED, "client_closed",
                                   "the client went away while sending")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_big()
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _check_key_limits(self, key: KeyEntry, ex: Exchange) -> None:
        limits, parts = key.limits, self.parts
        if limits.max_concurrency is not None and \
                self.inflight.get(key.id, 0) >= limits.max_concurrency:
            raise GatewayError(429, "key_concurrency_limit",
                               f"this key already has {limits.max_concurrency} requests in "
                               "flight, its limit; wait for one to finish", retry_after=1)
        if limits.tokens_per_day is not None:
            wait = parts.limiter.over_daily(key.id, limits.tokens_per_day, ex.started_at)
            if wait is not None:
                raise GatewayError(429, "tokens_per_day_limit",
                                   f"this key has used its {limits.tokens_per_day} tokens for "
                                   "today (UTC); the allowance renews at midnight UTC",
                                   retry_after=wait)
        if limits.requests_per_minute is not None:
            wait = parts.limiter.admit_rate(key.id, limits.requests_per_minute, ex.started)
            if wait is not None:
                raise GatewayError(429, "requests_per_minute_limit",
                                   f"this key may send {limits.requests_per_minute} requests a "
                                   "minute", retry_after=wait)

    async def _guarded(self, ex: Exchange, key: KeyEntry, parsed: Parsed,
                       headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        """Admit and forward, while a watcher listens for the client going away."""
        self.inflight[key.id] = self.inflight.get(key.id, 0) + 1
        work = asyncio.ensure_future(self._admit_and_forward(ex, key, parsed, headers, send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not ex.response_done:
                work.cancel()
                ex.status, ex.outcome = CLIENT_CLOSED, "client_closed"
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return
            await work
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            count = self.inflight[key.id] - 1
            if count:
                self.inflight[key.id] = count
            else:
                del self.inflight[key.id]

    async def _admit_and_forward(self, ex: Exchange, key: KeyEntry, parsed: Parsed,
                                 headers: dict[bytes, bytes], send: Send) -> None:
        parts = self.parts
        weight = parsed.n
        ex.prompt_estimate = tokens = estimate_prompt_tokens(parsed.body)
        cls = self.classes.of(key.service_class)
        ex.service_class = cls.name
        if parsed.endpoint.generates and not self.classes.try_acquire(cls, weight, tokens):
            # a 429 now, where a wait would miss the SLO
            ex.predicted = self.classes.refuse_early(cls, tokens, weight)
            waited = time.perf_counter()
            allowance = self.classes.allowance(cls, tokens)
            try:
                await self.classes.acquire(cls, key.id, weight, tokens, allowance)
            except QueueFull:
                raise self._busy(full=True, waited=allowance) from None
            except QueueTimeout:
                self.classes.waited_out(cls, tokens, ex.predicted, allowance)
                raise self._busy(full=False, waited=allowance) from None
            finally:
                ex.queue_ms = (time.perf_counter() - waited) * 1000
                parts.metrics.queue_wait.observe(ex.queue_ms / 1000)
        ex.admitted = time.perf_counter()
        # in flight, for the next arrivals' estimates: its tokens so far once it streams
        ticket = self.classes.board(
            cls, weight, tokens, parsed.max_tokens,
            lambda: ex.meter.events if ex.meter is not None else None,
            lambda: ex.started + ex.ttft if ex.meter is not None and ex.ttft is not None
            else None) if parsed.endpoint.generates else None
        try:
            refusal = parts.gate.refusal()  # the engine may have begun to stop meanwhile
            if refusal is not None:
                raise refusal
            carried: dict[str, str] = {}
            if self.engine_priority and parsed.endpoint.generates:
                # in the body where SGLang has the field, else in its header (/v1/messages)
                parsed = replace(parsed, body=with_priority(parsed.body, parsed.endpoint.path,
                                                            cls.priority))
                carried = priority_headers(parsed.endpoint.path, cls.priority)
            await forward(parts, ex, parsed, headers, send, carried)
        finally:
            if ticket is not None:
                self.classes.release(cls, weight, ticket)

    def _busy(self, *, full: bool, waited: float) -> GatewayError:
        admission = self.parts.admission
        retry = retry_after(admission.waiting + 1, admission.limit, self.parts.qualified,
                            self.recent_durations, self.recent_seconds)
        who = "the cell" if self.parts.gate.route.through_cell else "the engine"
        if full:
            return GatewayError(429, "queue_full",
                                f"{who} is busy ({admission.in_use} running, "
                                f"{admission.waiting} waiting, the queue is full); retry later",
                                retry_after=retry)
        return GatewayError(429, "queue_timeout",
                            f"waited {waited:.0f} s for a free slot ({who} is "
                            f"busy: {admission.in_use} running); retry later", retry_after=retry)

    # --- accounting ---------------------------------------------------------------------------

    def _account(self, ex: Exchange) -> None:
        parts = self.parts
        ended = time.perf_counter()
        duration = ended - ex.started
        endpoint = ex.endpoint.name if ex.endpoint else ""
        usage = ex.usage
        if not usage.reported and ex.meter is not None and ex.meter.events:
            usage.completion_tokens = ex.meter.events  # cut short: count the chunks sent
        metrics = parts.metrics
        metrics.requests.labels(endpoint, str(ex.status), ex.outcome).inc()
        metrics.duration.labels(endpoint).observe(duration)
        parsed, key = ex.parsed, ex.key
        history = ""
        slo = self._judge(ex, ended, duration)
        if ex.outcome == "ok":
            self.recent_seconds += (duration - self.recent_seconds) * 0.05
            if parsed is not None and parsed.endpoint.generates:
                self.recent_durations.append(duration)
            if ex.ttft is not None:
                metrics.ttft.observe(ex.ttft)
            metrics.tokens.labels("prompt").inc(usage.prompt_tokens)
            metrics.tokens.labels("completion").inc(usage.completion_tokens)
            metrics.tokens.labels("cached").inc(usage.cached_tokens)
            if parsed is not None and parsed.messages is not None and key is not None:
                history = parts.history.classify(key.id, parsed.messages)
        if key is not None and (usage.prompt_tokens or usage.completion_tokens):
            parts.limiter.add_tokens(key.id, usage.prompt_tokens + usage.completion_tokens,
                                     ex.started_at)
        parts.recorder.add(UsageRecord(
            key_id=key.id if key else None, model=parsed.model if parsed else "",
            endpoint=endpoint, stream=bool(parsed and parsed.stream), status=ex.status,
            outcome=ex.outcome, prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
            started_at=ex.started_at,
            ended_at=ex.started_at + dt.timedelta(seconds=duration), queue_ms=round(ex.queue_ms, 3),
            ttft_ms=None if ex.ttft is None else round(ex.ttft * 1000, 3),
            duration_ms=round(duration * 1000, 3), history=history,
            service_class=ex.service_class, slo=slo))

    def _judge(self, ex: Exchange, ended: float, duration: float) -> str:
        """Feed the class gate's measures with an answered request and count what it got of
        its class's promise. A stream is judged by its first token and its decode speed; a
        non-streamed answer (its first token unseen) by its wait for a slot."""
        generated = ex.parsed is not None and ex.parsed.endpoint.generates
        streamed = ex.meter is not None and ex.ttft is not None
        first = ex.started + ex.ttft if ex.ttft is not None else None
        if ex.predicted is not None and streamed and ex.ttft is not None:
            self.classes.erred(ex.service_class, ex.ttft - ex.predicted)
        if ex.outcome == "ok" and generated and ex.admitted is not None:
            # the prefill rate in estimated tokens, as the estimate divides them
            self.classes.served(ex.service_class, held_seconds=ended - ex.admitted,
                                prompt_tokens=ex.prompt_estimate,
                                engine_ttft_seconds=first - ex.admitted
                                if streamed and first is not None else None,
                                completion_tokens=ex.usage.completion_tokens,
                                decode_seconds=ended - first
                                if streamed and first is not None else None)
        return self.classes.result(
            ex.service_class, ex.outcome, judged=generated,
            ttft_seconds=ex.ttft if streamed else ex.queue_ms / 1000,
            completion_tokens=ex.usage.completion_tokens,
            decode_seconds=ended - first if streamed and first is not None else None)

    async def _error(self, send: Send, err: GatewayError, anthropic: bool) -> None:
        await respond(send, err.status, err.body(anthropic), headers=err.headers())


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
