"""Bounds on a request's head (request line and headers), for both planes' servers.

uvicorn bounds nothing here with httptools, its fastest parser (and the one it picks when
installed): one 8 MiB header or 100,000 headers were answered 200, 64 MB of headers grew the
gateway by 73 MB, and a client trickling its headers held a connection forever. This is
uvicorn's httptools protocol with three bounds, whatever app runs behind it:

- size: more than `max_bytes` of request line and headers is answered 431 and the connection
  closed. Counted exactly from the parser's callbacks, and from the bytes received while a head
  is still incomplete (httptools buffers a field until it ends, so a field never ending must be
  caught there); memory per connection stays under `max_bytes` plus one read (256 KiB).
- count: more than `max_count` header fields is answered 431.
- time: a head must arrive whole within `timeout_s` of its first byte (or of the connection,
  for the first request): else 408 if it had begun, and the connection is closed. Keep-alive
  idling between requests stays uvicorn's own timeout.

It also answers 400 to a request with more than one `Host` header (RFC 9112 section 3.2): the
console's host guard would check one and its Origin check the other.

Refusals are written by the protocol, before any app runs, as `connection: close` plain text
naming the limit. While an earlier response on the connection is still being written (HTTP
pipelining) the connection is only closed, as a response cannot be cut into.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


@dataclass(frozen=True)
class HeadLimits:
    """What a request's head may be: `max_bytes` of request line and headers, `max_count`
    header fields, whole within `timeout_s` seconds."""

    max_bytes: int = 64 * 1024
    max_count: int = 100
    timeout_s: float = 20.0


class HeadBoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits` (see the module's docstring).

    State per connection: `_in_head` is true from the connection's start or the end of a
    message until the next message's headers are complete; `_raw` counts bytes received
    meanwhile; `_begun` says a request's first byte came (a timeout then answers 408);
    `_size`/`_count`/`_hosts` count the current head's parsed parts. A refusal (`_refusal`)
    stops every later callback; it is written once the chunk being parsed is done.
    """

    limits: ClassVar[HeadLimits] = HeadLimits()

    _in_head = True
    _raw = 0
    _size = 0
    _count = 0
    _hosts = 0
    _begun = False
    _refusal: tuple[int, str] | None = None
    _head_timer: asyncio.TimerHandle | None = None

    # --- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: the transport is closing, what follows is not read
        if self._in_head:
            self._raw += len(data)
            self._arm()
        super().data_received(data)
        if self._refusal is None and self._in_head and self._raw > self.limits.max_bytes:
            self._refusal = (431, self._too_large())
        if self._refusal is not None:
            self._refuse(*self._refusal)

    # --- the parser's callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refusal is not None:
            return
        self._in_head = self._begun = True
        self._size = self._count = self._hosts = 0
        self._arm()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._refusal is not None:
            return
        self._size += len(url)
        if self._size > self.limits.max_bytes:
            self._refusal = (431, self._too_large())
            return
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refusal is not None:
            return
        self._size += len(name) + len(value) + 4  # ": " and CRLF
        self._count += 1
        if self._size > self.limits.max_bytes:
            self._refusal = (431, self._too_large())
            return
        if self._count > self.limits.max_count:
            self._refusal = (431, f"more than {self.limits.max_count} request header fields; "
                                  "send fewer")
            return
        if name.lower() == b"host":
            self._hosts += 1
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refusal is not None:
            return
        self._in_head = False
        self._raw = 0
        self._disarm()
        if self._hosts > 1:
            self._refusal = (400, "more than one Host header; send exactly one")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusal is not None:
            return
        self._in_head, self._begun = True, False
        super().on_message_complete()

    # --- refusing ---------------------------------------------------------------------------

    def _too_large(self) -> str:
        return (f"request line and headers over {self.limits.max_bytes} bytes; "
                "send shorter headers (a smaller cookie or fewer fields)")

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._begun:
            self._refuse(408, f"the request's headers did not arrive within "
                              f"{self.limits.timeout_s:g} s; send them whole")
        else:  # a connection that never began a request: nothing to answer
            self._refusal = (408, "")
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            body = message.encode()
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: "
                        + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def head_bounded(limits: HeadLimits) -> type[HeadBoundedProtocol]:
    """The protocol class to give uvicorn as `http=`, bounded by `limits`."""

    class Bounded(HeadBoundedProtocol):
        pass

    Bounded.limits = limits
    return Bounded
