"""The fake Hub's listening side: the state its request threads share, and a stdlib
threading HTTP server that keeps track of its connections.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code. The
routes live in `handler.py`.

Invariants: handler threads are daemons and `server_close` never joins them; stopping sets
the shared stop event (every fault wait watches it) and shuts down every open connection, so a
thread blocked on a stalled or hung client wakes at once.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from appliance.testing.fake_hub.faults import FaultSet
from appliance.testing.fake_hub.repo import Repo
from appliance.testing.fake_hub.requestlog import RequestLog


@dataclass
class HubState:
    """What all request threads of one fake Hub share. The origins are set once bound."""

    repos: dict[str, Repo]
    token: str | None
    faults: FaultSet
    log: RequestLog
    page_size: int
    stop: threading.Event = field(default_factory=threading.Event)
    origin: str = ""
    cdn_origin: str = ""


class HubServer(ThreadingHTTPServer):
    """A threading HTTP server that knows its open connections, so `close_connections` can wake
    threads blocked on a client, and that can end a connection with a TCP reset."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], state: HubState,
                 handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.state = state
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._to_reset: set[socket.socket] = set()
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open.add(request)
        try:
            super().finish_request(request, client_address)
        finally:
            with self._lock:
                self._open.discard(request)

    def reset_on_close(self, sock: socket.socket) -> None:
        with self._lock:
            self._to_reset.add(sock)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            reset = request in self._to_reset
            self._to_reset.discard(request)
        if reset:
            # Linger 0 and no shutdown(SHUT_WR) first: close() then sends RST, not FIN.
            request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.close()
            return
        super().shutdown_request(request)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def close_connections(self) -> None:
        with self._lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away, or a socket closed by stop(), is the normal life of a
        # fault-injecting server; anything else is a bug worth a traceback.
        if self.state.stop.is_set() or isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)
