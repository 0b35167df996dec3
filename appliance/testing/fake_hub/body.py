"""Sending a file body: Range parsing, the fast path and the faulty one.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code.

Without faults or a rate limit the body goes out with `os.sendfile` in large chunks, so in a
throughput benchmark the fake Hub is not the bottleneck (it is compared against curl fetching
from the same server). With a `BodyPlan` that is not plain, the body is read and written in
chunks so it can be paced, corrupted and cut.

Invariants: the byte count returned is what the kernel accepted for the socket, which is what
the request log reports; every wait is on the server's stop event, so stopping the server never
hangs on a stalled or trickling body.
"""

from __future__ import annotations

import os
import re
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.testing.fake_hub.faults import BodyPlan

_SENDFILE_CHUNK = 16 << 20
_SLOW_CHUNK = 1 << 20
# Paced writes: a trickle is a few small writes a second, as a dying link looks; a plain rate
# limit writes ten times a second so its throughput is smooth at test time scales.
_TRICKLE_INTERVAL = 0.5
_RATE_INTERVAL = 0.1
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class RangeNotSatisfiable(Exception):
    """The Range asks for bytes past the end: answer 416 with `Content-Range: bytes */size`."""


@dataclass(frozen=True)
class ByteRange:
    """Inclusive first and last byte, as in Content-Range."""

    first: int
    last: int

    @property
    def length(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class Sent:
    """Body bytes the socket took, and whether that was the whole body (if not, the connection
    must be closed: the client was promised more)."""

    bytes: int
    complete: bool


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The single byte range a `Range` header asks for, or None to send the whole body.

    `bytes=N-`, `bytes=N-M` (M clamped to the end) and `bytes=-M` (the last M bytes) are
    honoured. A header that is malformed or asks for several ranges is ignored, as RFC 9110
    allows; so is any range of an empty file. Raises `RangeNotSatisfiable` when the range
    starts at or past the end of a non-empty file (or asks for the last 0 bytes).
    """
    if header is None or size == 0:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match[1], match[2]
    if first and last:
        if int(first) > int(last):
            return None
        if int(first) >= size:
            raise RangeNotSatisfiable
        return ByteRange(int(first), min(int(last), size - 1))
    if first:
        if int(first) >= size:
            raise RangeNotSatisfiable
        return ByteRange(int(first), size - 1)
    if last:
        if int(last) == 0:
            raise RangeNotSatisfiable
        return ByteRange(max(0, size - int(last)), size - 1)
    return None


def send_file(sock: socket.socket, path: Path, start: int, length: int, plan: BodyPlan,
              stop: threading.Event) -> Sent:
    """Send `length` bytes of `path` from `start` as `plan` says. Never raises for a client
    that went away; the result says how far it got."""
    with path.open("rb") as handle:
        if plan.plain:
            return _sendfile(sock, handle.fileno(), start, length)
        return _send_paced(sock, handle.fileno(), os.fstat(handle.fileno()).st_size, start,
                           length, plan, stop)


def _sendfile(sock: socket.socket, fd: int, start: int, length: int) -> Sent:
    sent = 0
    try:
        while sent < length:
            n = os.sendfile(sock.fileno(), fd, start + sent, min(length - sent, _SENDFILE_CHUNK))
            if n == 0:
                break  # the file shrank under us
            sent += n
    except OSError:
        return Sent(sent, False)
    return Sent(sent, sent == length)


def _send_paced(sock: socket.socket, fd: int, file_size: int, start: int, length: int,
                plan: BodyPlan, stop: threading.Event) -> Sent:
    # Flipped at fixed file offsets, so every corrupted GET carries the same damage, inside
    # a shard's tensor data: a silent corruption only a hash catches (the header stays valid).
    corrupt_at = {file_size // 2, file_size - 1} if plan.corrupt and file_size else set()
    cut = plan.cut if plan.cut is not None and plan.cut.after < length else None
    limit = cut.after if cut is not None else length
    trickle = plan.trickle
    sent = 0
    while sent < limit and not stop.is_set():
        chunk = limit - sent
        rates = [plan.rate] if plan.rate is not None else []
        interval = _RATE_INTERVAL
        if trickle is not None and sent >= trickle.after:
            rates.append(trickle.rate)
            interval = _TRICKLE_INTERVAL
        elif trickle is not None:
            chunk = min(chunk, trickle.after - sent)  # switch to the trickle at exactly `after`
        rate = min(rates) if rates else None
        chunk = min(chunk, _SLOW_CHUNK if rate is None else max(1, int(rate * interval)))
        data = bytearray(os.pread(fd, chunk, start + sent))
        if not data:
            break
        for offset in corrupt_at:
            if start + sent <= offset < start + sent + len(data):
                data[offset - start - sent] ^= 0xFF
        try:
            sock.sendall(data)
        except OSError:
            return Sent(sent, False)
        sent += len(data)
        if rate is not None and stop.wait(len(data) / rate):
            break
    if cut is not None and sent == limit and cut.kind == "stall":
        wait_or_gone(sock, cut.seconds, stop)
    return Sent(sent, sent == length)


def wait_or_gone(sock: socket.socket, seconds: float, stop: threading.Event) -> None:
    """Wait `seconds`, or until the server stops or the client closes its end (so a stalled
    thread ends when the client gives up, not an hour later)."""
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            readable, _, _ = select.select([sock], [], [], min(left, 0.2))
            if readable and not sock.recv(1, socket.MSG_PEEK):
                return
        except (OSError, ValueError):  # ValueError: the socket was closed under us
            return
        if readable:
            stop.wait(min(left, 0.2))  # pipelined bytes, not EOF: keep waiting, don't spin
