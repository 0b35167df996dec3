"""Long responses (server-sent events) end when the credential that opened them does.

The auth middleware checks a credential once, when a request arrives; a stream then runs for
as long as the client keeps it open. `while_authorised` re-checks the request's own credential
(the bearer token or the session cookie, exactly as the middleware read it) every
`RECHECK_SECONDS` on the runtime's monotonic clock and ends the stream once it is revoked,
expired or its session closed (logout, a password reset). The re-check is read-only: an open
stream is not activity and does not slide a session's idle deadline.

The interval is measured on `runtime.clock`, so a test with the fake clock advances it instead
of waiting; `TICK_SECONDS` is only how often the real loop wakes to look at that clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from litestar.connection import ASGIConnection

from appliance.auth.sessions import COOKIE_NAME, resolve_session
from appliance.auth.tokens import resolve_token
from appliance.runtime import Runtime, runtime_of

RECHECK_SECONDS = 5.0
TICK_SECONDS = 0.5

T = TypeVar("T")
Check = Callable[[], Awaitable[bool]]


def credential_check(connection: ASGIConnection[Any, Any, Any, Any]) -> Check:
    """A read-only re-check of the credential this request was authenticated with."""
    runtime = runtime_of(connection)
    authorization = connection.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        presented = authorization[7:].strip()

        async def token_alive() -> bool:
            now = runtime.clock.now()
            found = await runtime.db.run(
                lambda s: resolve_token(s, runtime.secret, presented, now, touch=False))
            return found is not None

        return token_alive
    cookie = connection.cookies.get(COOKIE_NAME, "")

    async def session_alive() -> bool:
        if not cookie:
            return False
        now, policy = runtime.clock.now(), runtime.session_policy
        live = await runtime.db.run(
            lambda s: resolve_session(s, cookie, now, policy, touch=False))
        return live is not None

    return session_alive


async def while_authorised(
    source: AsyncIterator[T], runtime: Runtime, check: Check, *,
    every: float = RECHECK_SECONDS, tick: float = TICK_SECONDS, since: float | None = None,
) -> AsyncIterator[T]:
    """Items of `source` until it ends or `check()` says the credential is gone.

    The re-checks count from `since` (the runtime clock's monotonic time the caller opened the
    stream at; its first read when None): a client that saw the response begin has seen the
    stream open, however late a loaded box first reads its body.

    `source` may wait indefinitely between items (a quiet log), so the next item is awaited in
    a task that the loop looks past every `tick` seconds to run the check on time; `source` is
    closed however this ends (the client leaving included)."""

    async def next_item() -> T:
        return await anext(source)

    clock = runtime.clock
    checked = clock.monotonic() if since is None else since
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(next_item())
            done, _ = await asyncio.wait({pending}, timeout=tick)
            if done:
                finished, pending = pending, None
                try:
                    item = finished.result()
                except StopAsyncIteration:
                    return
                yield item
            if clock.monotonic() - checked >= every:
                if not await check():
                    return
                checked = clock.monotonic()
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
