"""The gateway's byte pump: one admitted request sent on to its upstream (the engine, or a
cell's router) and its answer sent back to the client, metered as it passes.

`Exchange` is one request's bookkeeping, filled in as it goes (by `appliance.gateway.app`
before, here during, and read by the accounting after). `forward` sends the request with the
client's `FORWARDED_HEADERS` and the gateway's own (a class's priority header), and answers
with the upstream's body, or, for a stream, with its events as they arrive (`stream`): the
meter counts tokens and takes the usage chunk the client did not ask for, and an upstream that
stops before its last event gets the client an error event in its shape, never a silent end.

Invariants: nothing here decides admission or records anything; an upstream refusal or
failure before the response began is a `GatewayError` (the caller renders it), after it began
the stream is closed with the error event and the outcome says why.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway.errors import GatewayError, stream_cut
from appliance.gateway.h1 import Response, UpstreamFailed
from appliance.gateway.keys import KeyEntry
from appliance.gateway.parts import GatewayParts
from appliance.gateway.sse import StreamMeter, Usage, usage_of
from appliance.gateway.validate import Endpoint, Parsed

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
FORWARDED_HEADERS = (b"accept", b"anthropic-version", b"anthropic-beta", b"x-request-id")
STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                  (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass
class Exchange:
    """One request's bookkeeping, filled in as it goes."""

    endpoint: Endpoint | None
    started: float
    started_at: dt.datetime
    key: KeyEntry | None = None
    parsed: Parsed | None = None
    status: int = 200
    outcome: str = "ok"
    queue_ms: float = 0.0
    ttft: float | None = None
    predicted: float | None = None  # seconds to its first token, as admission predicted
    usage: Usage = field(default_factory=Usage)
    meter: StreamMeter | None = None  # a stream's, kept here so a cut-short one still counts
    response_started: bool = False
    response_done: bool = False
    service_class: str = ""  # the key's class, once routed to admission
    admitted: float | None = None  # perf_counter when it took its slot
    prompt_estimate: int = 0  # admission's estimate of its prompt tokens (its prefill rate)


async def forward(parts: GatewayParts, ex: Exchange, parsed: Parsed,
                  headers: dict[bytes, bytes], send: Send, carried: dict[str, str]) -> None:
    """Send the request on (with the client's `FORWARDED_HEADERS` and the gateway's own
    `carried` ones) and its answer back."""
    upstream_headers = {"content-type": "application/json"}
    for name in FORWARDED_HEADERS:
        if name in headers:
            upstream_headers[name.decode()] = headers[name].decode("latin-1")
    upstream_headers.update(carried)
    anthropic = parsed.endpoint.anthropic
    route = parts.gate.route  # the one the gate just let this request through by
    target = route.upstream_name
    try:
        async with parts.upstream.request("POST", parsed.endpoint.path, parsed.body,
                                          upstream_headers, route.base_url) as response:
            if response.status == 401:  # only SGLang's (or its router's) key check
                raise GatewayError(
                    502, "engine_key_refused", f"{target} refused the gateway's engine "
                    "key (secrets/engine-api.key changed after one of them started"
                    + ("; every box of the cell must hold the head's" if route.cell
                       else "") + "); restart the gateway, and the engine if that does "
                    "not help")
            if response.status >= 400:
                raise route.upstream_error(response.status, await response.read(), anthropic)
            if parsed.stream and response.content_type == "text/event-stream":
                await stream(ex, parsed, response, send, target)
            else:
                body = await response.read()
                ex.ttft = time.perf_counter() - ex.started
                ex.usage = usage_of(body)
                ex.response_started = ex.response_done = True
                await respond(send, response.status, body,
                              response.headers.get("content-type",
                                                   "application/json").encode("latin-1"))
    except GatewayError:
        raise
    except TimeoutError:
        if ex.response_started:
            ex.outcome = "upstream_timeout"
            await _end_stream(send, _cut(ex, target, anthropic))
            return
        raise GatewayError(504, "engine_timeout", f"{target} did not answer within "
                           "gateway.first_byte_timeout_seconds") from None
    except UpstreamFailed as exc:
        if ex.response_started:
            ex.outcome = "upstream_error"
            await _end_stream(send, _cut(ex, target, anthropic))
            return
        raise route.unreachable(exc) from None


async def stream(ex: Exchange, parsed: Parsed, response: Response, send: Send,
                 target: str) -> None:
    """The upstream's events to the client as they arrive, metered (`StreamMeter`)."""
    meter = ex.meter = StreamMeter(strip_usage=not parsed.wants_usage)
    ex.usage = meter.usage  # filled in as the events pass
    ex.response_started = True
    await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
    chunk: bytes | None = await response.chunk()
    if chunk:
        ex.ttft = time.perf_counter() - ex.started
    # the per-token loop: names looked up once, the upstream read without a coroutine
    feed, take, arrival = meter.feed, response.take, response.arrival
    while chunk:
        out = feed(chunk)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        while (chunk := take()) is None:
            await arrival()
    tail = meter.finish()
    if not meter.ended:  # the upstream closed it cleanly, yet before its last event
        ex.outcome = "stream_interrupted"
        tail += _cut(ex, target, parsed.endpoint.anthropic)
    ex.response_done = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _cut(ex: Exchange, target: str, anthropic: bool) -> bytes:
    """The error event that ends a stream its upstream cut short (nothing for a body that
    was not a stream); a half-sent event is closed first."""
    meter = ex.meter
    if meter is None or ex.response_done:
        return b""
    event = stream_cut(target, meter.events).sse_event(anthropic)
    return (b"\n\n" if meter.partial_sent else b"") + event


async def _end_stream(send: Send, body: bytes = b"") -> None:
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond(send: Send, status: int, body: bytes,
                  content_type: bytes = b"application/json",
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole answer: its head (content-length set) and its body."""
    head = headers or [(b"content-type", content_type)]
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
