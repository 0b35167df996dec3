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


def validation_message(error: dict[str, Any]) -> str:
    """How SGLang's handler of FastAPI's RequestValidationError words one error (http_server.py:
    `str(exc)`, then the errors' list when it differs), the source location left out."""
    return f"1 validation error:\n  {error!r} [{error!r}]"


async def read_json(receive: Receive) -> dict[str, Any] | str:
    """The request body as a JSON object, or why it is not one (FastAPI's validation words)."""
    try:
        body = json.loads(await read_body(receive) or b"{}")
    except ValueError as exc:
        return validation_message({"type": "json_invalid", "loc": ("body", 0),
                                   "msg": "JSON decode error", "input": {},
                                   "ctx": {"error": str(exc)}})
    if not isinstance(body, dict):
        return validation_message({"type": "model_attributes_type", "loc": ("body",),
                                   "msg": "Input should be a valid dictionary or object to "
                                          "extract fields from"})
    return body


def json_content_error(scope: Scope) -> str | None:
    """SGLang's `validate_json_request` (the /v1/* generation routes): a body whose media type
    is not application/json is refused before it is read."""
    header = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
    if header.split(";", 1)[0].strip().lower() == JSON:
        return None
    return validation_message({"loc": ["header", "content-type"], "msg": "Unsupported Media "
                               "Type: Only 'application/json' is allowed", "type": "value_error"})


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
