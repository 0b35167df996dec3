"""Plain-ASGI plumbing for the engine emulator's HTTP surface: replies, SSE streams, request
bodies, and running a request's work until the client goes away (which aborts it, as SGLang's
`create_abort_task` does). A test and demo instrument (`appliance.testing.fake_sglang`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from appliance.testing.fake_sglang import EMULATOR_NAME

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Scope = dict[str, Any]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
JSON = "application/json"


class Disconnected(Exception):
    """The client went away before its request body arrived."""


async def respond(send: Send, status: int, body: bytes | str | dict[str, Any] | None = None,
                  content_type: str = JSON) -> None:
    """A whole reply; a dict goes out as compact JSON, as SGLang's ORJSONResponse writes it."""
    if isinstance(body, dict):
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
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


async def emit(send: Send, frame: str) -> None:
    """One SSE frame (`data: ...\\n\\n`, or `event: ...` + `data: ...`), more to come."""
    await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})


async def end_stream(send: Send, frame: str = "") -> None:
    await send({"type": "http.response.body", "body": frame.encode(), "more_body": False})


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def read_json(receive: Receive) -> dict[str, Any] | str:
    """The request body as a JSON object, or why it is not one."""
    try:
        body = json.loads(await read_body(receive) or b"{}")
    except ValueError as exc:
        return f"JSON decode error: {exc}"
    if not isinstance(body, dict):
        return "The request body must be a JSON object"
    return body


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> bool:
    """Run `work` until it ends (True) or the client goes away (False: `work` is cancelled,
    which aborts its request, queued or running)."""

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
