"""A gateway restart refuses nobody (issue 15): the listener outlives the process, and a
stopping process hands its keep-alive connections back to their clients cleanly.

Two halves:

- **The listening socket belongs to systemd** (`appliance-gateway.socket`, socket activation,
  sd_listen_fds(3)). Each gateway process receives it as a file descriptor and closes only its
  own copy when it stops: connections that arrive while the old process drains and the new one
  starts wait in the kernel's accept queue instead of being refused. `inherited_socket` reads
  the descriptor from the environment (and unsets the variables, as sd_listen_fds does);
  `check_address` proves it listens where the configuration says, so the two cannot drift
  apart silently. Without the variables (development, demo, tests) the gateway binds itself.
- **A SIGTERM drains connections instead of cutting them** (`DrainingProtocol`). uvicorn
  closes an idle keep-alive connection at once, and a request a client wrote on it in that
  instant meets a reset. Here, from the drain's start: a request in flight, or one that
  arrives on a kept-alive connection, is served and answered `Connection: close`; an idle
  connection is closed only after `IDLE_GRACE_SECONDS` (time for a request already on its way
  to arrive), and never while a request's bytes are arriving. Clients (httpx, the OpenAI SDK)
  see a clean close between requests and reconnect, to the queue the next process accepts.
  A connection accepted as the listener closed drains the same way (`Drain.started`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import ClassVar

import uvicorn

from appliance.errors import EX_CONFIG, ApplianceError
from appliance.headbounds import HeadBoundedProtocol, HeadLimits
from appliance.serving import OwnSignalsServer

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed descriptors start here
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
FD_NAME = "gateway"  # FileDescriptorName= in systemd/appliance-gateway.socket
IDLE_GRACE_SECONDS = 1.5
SOCKET_UNIT = "appliance-gateway.socket"
LISTEN_DROPIN = "/usr/local/lib/systemd/system/appliance-gateway.socket.d/listen.conf"


# --- the inherited listener ---------------------------------------------------------------


def inherited_socket(env: MutableMapping[str, str] | None = None,
                     pid: int | None = None) -> socket.socket | None:
    """The listening socket systemd passed this process, or None when it passed none.

    The protocol: LISTEN_PID is this process, LISTEN_FDS counts descriptors from 3 on,
    LISTEN_FDNAMES names them (ours is FD_NAME; without names, the first). The variables are
    removed either way, so nothing this process starts mistakes them for its own. The socket
    is made close-on-exec; it must be a listening TCP socket.
    """
    env = os.environ if env is None else env
    values = {name: env.pop(name, "") for name in LISTEN_VARS}
    try:
        listen_pid, count = int(values["LISTEN_PID"]), int(values["LISTEN_FDS"])
    except ValueError:
        return None
    if listen_pid != (os.getpid() if pid is None else pid) or count < 1:
        return None
    names = values["LISTEN_FDNAMES"].split(":") if values["LISTEN_FDNAMES"] else []
    index = names.index(FD_NAME) if FD_NAME in names else 0
    if index >= count:
        index = 0
    sock = socket.socket(fileno=SD_LISTEN_FDS_START + index)
    sock.set_inheritable(False)
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
            sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()  # not ours to close: systemd's descriptor, whatever it is
        raise ApplianceError(
            "socket_unusable", f"systemd passed the gateway descriptor "
            f"{SD_LISTEN_FDS_START + index}, which is not a listening TCP socket",
            f"{SOCKET_UNIT} must have ListenStream=<host>:<port> and Accept=no "
            "(see systemd/README.md)", exit_code=EX_CONFIG)
    return sock


def check_address(sock: socket.socket, host: str, port: int, source: str) -> None:
    """Refuse (exit 78, no restart loop) a socket that does not listen on `host`:`port`,
    saying which of the two to change. A host name is resolved (blocking: call this before
    the event loop runs)."""
    found_host, found_port = sock.getsockname()[:2]
    if found_port == port and _same_host(str(found_host), host, port):
        return
    found = f"[{found_host}]:{found_port}" if ":" in str(found_host) else \
        f"{found_host}:{found_port}"
    raise ApplianceError(
        "socket_mismatch",
        f"{SOCKET_UNIT} listens on {found}, but {source} says gateway.host = {host!r}, "
        f"gateway.port = {port}",
        f"make them agree: run the installer again after changing gateway.host or "
        f"gateway.port (it writes {LISTEN_DROPIN} from the configuration), or put them back "
        f"to {found}; then: systemctl daemon-reload; systemctl restart {SOCKET_UNIT}; "
        f"systemctl start appliance-gateway.service",
        exit_code=EX_CONFIG)


def _same_host(found: str, host: str, port: int) -> bool:
    address = ipaddress.ip_address(found.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    try:
        return ipaddress.ip_address(host) == address
    except ValueError:  # a name: any of its addresses
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return False
        return any(ipaddress.ip_address(str(info[4][0]).split("%")[0]) == address
                   for info in infos)


# --- draining ---------------------------------------------------------------------------------


@dataclass
class Drain:
    """One server's drain. `started` turns true when its shutdown begins and stays so; every
    connection reads it, those the loop accepted as the listener closed included."""

    idle_grace_s: float = IDLE_GRACE_SECONDS
    started: bool = False


class DrainingProtocol(HeadBoundedProtocol):
    """The head-bounded httptools protocol whose `shutdown()` drains (module docstring).

    Invariant once draining: every response on the connection is its last (keep-alive off,
    so `Connection: close` is sent when the head is still unwritten, and the connection is
    closed after the body either way); the connection is closed while idle only by the
    grace timer, which spares one whose next request has begun (`_begun`) or is running.
    """

    drain: ClassVar[Drain] = Drain()

    _draining = False
    _idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.drain.started:
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """Called by uvicorn for each connection when the server stops (and by
        connection_made for a late one)."""
        self._draining = True
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # this response is the last
        elif not self._begun:
            if self.drain.idle_grace_s <= 0:
                self.transport.close()
            elif self._idle_timer is None:
                self._idle_timer = self.loop.call_later(self.drain.idle_grace_s,
                                                        self._close_if_idle)
        # else a request's head is arriving: on_headers_complete makes it the last

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def _close_if_idle(self) -> None:
        self._idle_timer = None
        if self.transport.is_closing():
            return
        if self._begun or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request came after all; its response closes the connection
        self.transport.close()


def draining_protocol(limits: HeadLimits, drain: Drain) -> type[DrainingProtocol]:
    """The protocol class to give uvicorn as `http=`: heads bounded by `limits`, draining
    by `drain` (one per server)."""

    class Draining(DrainingProtocol):
        pass

    Draining.limits = limits
    Draining.drain = drain
    return Draining


class DrainingServer(OwnSignalsServer):
    """OwnSignalsServer that starts `drain` before uvicorn stops accepting and shuts each
    connection down (uvicorn closes its copy of a passed socket; systemd keeps the queue)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.started = True
        await super().shutdown(sockets=sockets)
