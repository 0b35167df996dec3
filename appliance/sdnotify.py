"""sd_notify(3) in the standard library: one datagram to $NOTIFY_SOCKET.

A no-op when not started by systemd. The daemon sends READY=1 only once uvicorn has bound its
socket, STATUS= lines a person reads in `systemctl status`, WATCHDOG=1 from an event-loop task
(so a blocked loop stops the pings, which is the point), and STOPPING=1 on the way down.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` (newline-separated KEY=VALUE pairs). True if a socket was there."""
    env = os.environ if env is None else env
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # Linux abstract namespace
    elif not address.startswith("/"):
        return False  # vsock and friends: not used on this box
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings (half systemd's WatchdogSec), or None when no watchdog is set."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process the daemon spawns: never inherit the notify socket."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in NOTIFY_VARS}
