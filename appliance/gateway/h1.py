"""A lean HTTP/1.1 client for the gateway's generation requests to its upstream (the engine on
127.0.0.1, or a cell's router): one `asyncio.Protocol` per connection, httptools' response
parser (the one uvicorn already uses for the gateway's server side), a keep-alive pool.

Why not aiohttp's client here (it still serves the gateway's few JSON reads, `Upstream`): a
paced stream is one read from the engine per token, and aiohttp pays for each with a
`StreamReader` feed, a future, a task wake-up inside its timer context and a re-armed read
timer, which measured as 36-39 % of the gateway's CPU per stream at 64 paced streams, more
than the gateway's own work (benchmarks/README.md, "Gateway throughput"). Here a token costs
one parser call, one list append and, when the reader waits, one future.

Invariants:
- `read_timeout` bounds the wait for the first byte and between any two reads (aiohttp's
  `sock_read`), checked by one watchdog per request that re-arms itself only when it fires,
  not per read; connecting is bounded by `connect_timeout`.
- A connection goes back to the pool only after a response read to its end that the server
  did not mark `Connection: close`, from a request that did not say close; a response left
  unread (the client went away, an error) closes its connection, which is how SGLang learns
  to abort the request. A pooled connection idle for `keepalive` seconds is not used again
  (less than uvicorn's 5 s `timeout_keep_alive`, so the server never closes one under a
  request being sent).
- Failures are `UpstreamTimeout` (a `TimeoutError`) or `UpstreamFailed` (a `ConnectionError`),
  naming what happened; a body cut before its end is `UpstreamFailed` too.
- Plain `http://` only: the gateway's upstreams are on loopback or the cell's private network.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # buffered body bytes at which the upstream is asked to pause


class UpstreamTimeout(TimeoutError):
    """The upstream did not answer, or stopped sending, within the read timeout."""


class UpstreamFailed(ConnectionError):
    """The upstream could not be reached, or broke the connection or the protocol."""


class _Connection(asyncio.Protocol):
    """One connection and the response being read on it (one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.address: tuple[str, int] = ("", 0)  # as the pool knows it
        self.reset()

    def reset(self) -> None:
        """Ready for the next response (a new connection, or one taken from the pool)."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.headers_done = False
        self.done = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_read = self.loop.time()
        self.paused = False

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, yet have its methods
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamFailed(f"the upstream's answer is not valid HTTP ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done:
            return
        if self.headers_done and "content-length" not in self.headers and \
                "chunked" not in self.headers.get("transfer-encoding", "") and exc is None:
            self.done = True  # a body delimited by the connection's close: that was its end
            self._wake()
            return
        self.fail(UpstreamFailed("the upstream closed the connection before the end of its "
                                 "answer" + (f" ({exc})" if exc else "")))

    # --- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        # per token of a stream: kept to an append and, when the reader waits, its wake-up
        self.chunks.append(body)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
            return
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True  # the client reads slower than the upstream writes
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    # --- the reading side --------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.done:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def arrival(self) -> asyncio.Future[None]:
        """A future done when something new arrives (headers, body, the end, a failure)."""
        waiter = self.waiter = self.loop.create_future()
        return waiter


class Response:
    """An upstream's answer: status and headers once `Client.request` returned it, the body
    read with `chunk()` (what arrived since the last call, b"" at its end) or `read()`."""

    def __init__(self, connection: _Connection) -> None:
        self._conn = connection
        # the connection's own method, bound here: a stream calls it once per token
        self.arrival = connection.arrival
        self.status = connection.status
        self.headers: Mapping[str, str] = connection.headers

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    def take(self) -> bytes | None:
        """What arrived since the last call; b"" at the body's end, None when nothing came
        yet (then await `arrival()`). Raises the upstream's failure. Not a coroutine: a
        stream calls it once per token, and each coroutine frame in the loop costs there."""
        conn = self._conn
        chunks = conn.chunks
        if chunks:
            conn.chunks, conn.buffered = [], 0
            if conn.paused and conn.transport is not None:
                conn.paused = False
                conn.transport.resume_reading()
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if conn.error is not None:
            raise conn.error
        return b"" if conn.done else None

    async def chunk(self) -> bytes:
        """What arrived since the last call, waiting for it; b"" at the body's end."""
        while (data := self.take()) is None:
            await self.arrival()
        return data

    async def read(self) -> bytes:
        parts = []
        while data := await self.chunk():
            parts.append(data)
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        conn = self._conn
        return conn.done and not conn.chunks and conn.error is None


class Call:
    """`async with client.request(...) as response`: the connection comes back to the pool
    on a clean exit after the whole body, and is closed otherwise."""

    def __init__(self, client: Client, method: str, url: str, body: bytes | None,
                 headers: Mapping[str, str]) -> None:
        self.client, self.method, self.url, self.body, self.headers = \
            client, method, url, body, headers
        self.conn: _Connection | None = None
        self.response: Response | None = None
        self.watchdog: asyncio.TimerHandle | None = None
        self.reusable = True

    async def __aenter__(self) -> Response:
        client = self.client
        split = urlsplit(self.url)
        if split.scheme != "http" or not split.hostname:
            raise UpstreamFailed(f"the gateway speaks plain http:// to its upstream, not "
                                 f"{self.url!r}")
        host, port = split.hostname, split.port or 80
        target = split.path + (f"?{split.query}" if split.query else "")
        lines = [f"{self.method} {target} HTTP/1.1", f"Host: {split.netloc}"]
        for name, value in {**client.headers, **self.headers}.items():
            if name.lower() == "connection" and value.lower() == "close":
                self.reusable = False
            lines.append(f"{name}: {value}")
        body = self.body or b""
        lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self.conn = await client.connection(host, port)
        conn.last_read = client.loop.time()
        self.watchdog = client.loop.call_later(client.read_timeout, self._watch)
        assert conn.transport is not None
        conn.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            conn.transport.write(body)
        while not conn.headers_done:
            if conn.error is not None:
                raise conn.error
            await conn.arrival()
        self.response = Response(conn)
        return self.response

    def _watch(self) -> None:
        """The one watchdog: fire the read timeout if nothing came for `read_timeout`."""
        conn, client = self.conn, self.client
        if conn is None or conn.done or conn.error is not None:
            return
        idle = client.loop.time() - conn.last_read
        if idle >= client.read_timeout:
            conn.fail(UpstreamTimeout(f"the upstream sent nothing for {client.read_timeout:g} s"))
            return
        self.watchdog = client.loop.call_later(client.read_timeout - idle, self._watch)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        conn = self.conn
        if conn is None:
            return
        response = self.response
        if kind is None and self.reusable and conn.keep_alive and not conn.closed and \
                response is not None and response.complete:
            self.client.release(conn)
        else:
            conn.close()


class Client:
    """A pool of keep-alive connections per upstream address, with `headers` on every
    request (the engine's key)."""

    def __init__(self, *, read_timeout: float, connect_timeout: float, keepalive: float = 2.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self.read_timeout, self.connect_timeout, self.keepalive = \
            read_timeout, connect_timeout, keepalive
        self.headers = dict(headers or {})
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def request(self, method: str, url: str, body: bytes | None,
                headers: Mapping[str, str]) -> Call:
        return Call(self, method, url, body, headers)

    async def connection(self, host: str, port: int) -> _Connection:
        """A pooled connection to host:port still fresh enough to use, else a new one."""
        loop = self.loop
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed and loop.time() - conn.idle_since < self.keepalive:
                conn.reset()
                return conn
            conn.close()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), host, port),
                self.connect_timeout)
        except TimeoutError:
            raise UpstreamTimeout(f"connecting to {host}:{port} took over "
                                  f"{self.connect_timeout:g} s") from None
        except OSError as exc:
            raise UpstreamFailed(f"cannot connect to {host}:{port}: "
                                 f"{exc.strerror or exc}") from None
        protocol.address = (host, port)
        return protocol

    def release(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.address, []).append(conn)

    def close(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                with contextlib.suppress(Exception):
                    conn.close()
        self._idle.clear()
