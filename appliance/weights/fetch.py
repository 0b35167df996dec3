"""One HTTP attempt at one file, on a worker thread: the downloader's hot loop.

Why blocking and not asyncio: at 1+ GB/s the event loop's per-chunk overhead (httpx, h11,
anyio, 64 KiB reads) made a single thread the bottleneck at ~0.15 GB/s on the benchmark box.
Here each transfer owns a thread that reads into a reused 1 MiB buffer, writes it, hashes it
and reports progress to the loop a few times a second: one copy per byte, no event loop in
the path (benchmarks/download_throughput.py).

The attempt follows redirects itself, dropping the token whenever the origin changes (the
Hub's CDN), goes through an HTTP(S) proxy from the environment, verifies TLS against certifi's
CA bundle, and applies the watchdog: a socket timeout of `stall_seconds` (no byte for that
long) and the floor-rate check over a window (a trickle). Cancel sets an event and shuts the
socket down, so even a blocked read returns at once.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import socket
import ssl
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urljoin, urlsplit

from appliance.sizes import rate_text
from appliance.weights.hashing import Digest
from appliance.weights.sources import SourceError, classify_status, network_reason

BUFFER = 1 << 20
MAX_REDIRECTS = 5
CONNECT_TIMEOUT = 10.0
REPORT_EVERY = 0.25  # seconds between progress reports to the event loop
UNREACHABLE = "cannot reach"  # how a failure to connect at all begins


class RetryAttempt(Exception):
    """This attempt failed and another may succeed; `retry_after` is the server's wish,
    `progressed` whether bytes were added to the part (it resets the backoff)."""

    def __init__(self, message: str, *, retry_after: float | None = None,
                 progressed: bool = False, unreachable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.progressed = progressed
        self.unreachable = unreachable  # no connection at all: the source, not the file


class Refused(Exception):
    """The source refused the file for a reason waiting cannot fix."""

    def __init__(self, error: SourceError) -> None:
        super().__init__(error.message)
        self.error = error


class DiskFullError(Exception):
    """ENOSPC/EDQUOT while writing the part (its prefix stays valid)."""


class Cancelled(Exception):
    pass


class Throttle:
    """A token bucket shared by every transfer thread of a pull (bytes/s; 0: no cap)."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second
        self._allowance = bytes_per_second
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, count: int, cancel: threading.Event) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._allowance = min(self.rate, self._allowance + (now - self._last) * self.rate)
            self._last = now
            self._allowance -= count
            wait = -self._allowance / self.rate if self._allowance < 0 else 0.0
        if wait:
            cancel.wait(wait)


@dataclass
class Plan:
    """What one attempt needs: where from, where to, and the rules."""

    url: str
    headers: dict[str, str]
    part: Path
    offset: int
    size: int
    digest: Digest
    stall_seconds: float
    min_rate_bps: float
    min_rate_window: float
    throttle: Throttle
    cancel: threading.Event = field(default_factory=threading.Event)
    on_bytes: Callable[[int], None] = lambda _: None
    describe: str = ""  # the source, for messages
    _connection: http.client.HTTPConnection | None = None

    def abort(self) -> None:
        """From another thread: stop at once, even inside a blocking read."""
        self.cancel.set()
        connection = self._connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)


def fetch(plan: Plan) -> tuple[int, Digest]:
    """Run one attempt: returns (bytes now in the part, its digest). The digest restarts
    when the server ignores the Range (200 to a ranged request). Raises RetryAttempt,
    Refused, DiskFullError or Cancelled."""
    response = _open(plan)
    try:
        offset = _start_offset(plan, response)
        digest = plan.digest if offset else Digest(plan.digest.file)
        return _receive(plan, response, offset, digest), digest
    finally:
        response.close()
        if plan._connection is not None:
            plan._connection.close()


def _open(plan: Plan) -> http.client.HTTPResponse:
    url, headers = plan.url, dict(plan.headers)
    origin = _origin(url)
    for _ in range(MAX_REDIRECTS + 1):
        if plan.cancel.is_set():
            raise Cancelled
        connection = _connect(url, plan.stall_seconds)
        plan._connection = connection
        target = _request_target(url, connection)
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
        except TimeoutError:
            connection.close()
            raise RetryAttempt(f"stalled: no answer for {plan.stall_seconds:.0f} s") from None
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            if plan.cancel.is_set():
                raise Cancelled from None
            raise RetryAttempt(f"{UNREACHABLE} {_base(url)}: {network_reason(exc)}"[:300],
                               unreachable=True) from None
        location = response.getheader("Location")
        if response.status in (301, 302, 303, 307, 308) and location:
            response.close()
            connection.close()
            url = urljoin(url, location)
            if _origin(url) != origin:  # the CDN: never hand it our token
                headers.pop("Authorization", None)
            continue
        return response
    raise RetryAttempt(f"more than {MAX_REDIRECTS} redirects")


def _base(url: str) -> str:
    """scheme://host[:port] of `url`: what a person checks when it cannot be reached."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host, secure = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    proxy = _proxy_for(parts.scheme, host)
    connection: http.client.HTTPConnection
    if secure:
        context = ssl.create_default_context(cafile=_ca_bundle())
        if proxy is not None:
            connection = http.client.HTTPSConnection(proxy[0], proxy[1], timeout=timeout,
                                                     context=context)
            connection.set_tunnel(host, port)
        else:
            connection = http.client.HTTPSConnection(host, port, timeout=timeout,
                                                     context=context)
    else:
        address = proxy or (host, port)
        connection = http.client.HTTPConnection(address[0], address[1], timeout=timeout)
    return connection


def _request_target(url: str, connection: http.client.HTTPConnection) -> str:
    parts = urlsplit(url)
    if parts.scheme == "http" and connection.host != parts.hostname:  # through a proxy
        return url
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _proxy_for(scheme: str, host: str) -> tuple[str, int] | None:
    """The environment's proxy (HTTP(S)_PROXY, NO_PROXY) for this scheme and host."""
    if urllib.request.proxy_bypass(host):
        return None
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy:
        return None
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return parts.hostname or "", parts.port or 3128


def _ca_bundle() -> str | None:
    try:
        import certifi  # httpx's dependency: the same CAs the API calls trust
    except ImportError:
        return None
    return str(certifi.where())


def _start_offset(plan: Plan, response: http.client.HTTPResponse) -> int:
    """The offset the body starts at: `plan.offset` for a 206, 0 for a 200."""
    status = response.status
    if status == 416:
        truncate_part(plan.part, 0)
        raise RetryAttempt("the server refused the resume range; starting the file over")
    if status >= 300:
        error = classify_status(status, response.getheader("X-Error-Code", ""),
                                plan.describe.rsplit("/", 1)[-1] or "the file", plan.describe)
        if not error.retryable:
            raise Refused(error)
        raise RetryAttempt(error.message, retry_after=_retry_after(response))
    if status == 206:
        content_range = response.getheader("Content-Range", "")
        start = content_range.removeprefix("bytes ").split("-", 1)[0]
        if not start.isdigit() or int(start) != plan.offset:
            raise RetryAttempt(f"the server answered a different range ({content_range!r}) "
                               f"than bytes={plan.offset}-")
        return plan.offset
    if plan.offset:  # 200 to a ranged request: the whole file follows; start over
        truncate_part(plan.part, 0)
    return 0


def _retry_after(response: http.client.HTTPResponse) -> float | None:
    value = (response.getheader("Retry-After") or "").strip()
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _receive(plan: Plan, response: http.client.HTTPResponse, offset: int,
             digest: Digest) -> int:
    received = offset
    started = last_report = time.monotonic()
    window: deque[tuple[float, int]] = deque([(started, offset)])
    with _open_part(plan.part, offset) as handle:
        while True:
            if plan.cancel.is_set():
                raise Cancelled
            try:
                # read1: what the socket has (at most one recv), so a stall or a reset
                # never swallows bytes already received, as a fill-the-buffer read would.
                data = response.read1(BUFFER)
            except TimeoutError:
                raise RetryAttempt(f"stalled: no bytes for {plan.stall_seconds:.0f} s",
                                   progressed=received > offset) from None
            except (OSError, http.client.HTTPException) as exc:
                if plan.cancel.is_set():
                    raise Cancelled from None
                raise RetryAttempt(f"the connection broke at byte {received}: "
                                   f"{network_reason(exc)}"[:300],
                                   progressed=received > offset) from None
            count = len(data)
            if not count:
                break  # the end, or a short body: the caller compares with the size
            if received + count > plan.size:
                raise RetryAttempt(f"the server sent more than the manifest's {plan.size} "
                                   "bytes")
            plan.throttle.take(count, plan.cancel)
            _absorb(plan, handle, digest, data)
            received += count
            now = time.monotonic()
            if now - last_report >= REPORT_EVERY:
                plan.on_bytes(received)
                last_report = now
                _watch_rate(plan, now, received, window, offset)
    plan.on_bytes(received)
    return received


def _absorb(plan: Plan, handle: IO[bytes], digest: Digest, data: bytes) -> None:
    try:
        handle.write(data)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(str(plan.part)) from None
        raise
    digest.update(data)


def _watch_rate(plan: Plan, now: float, total: int, window: deque[tuple[float, int]],
                offset: int) -> None:
    """RetryAttempt when the bytes of the last `min_rate_window` seconds are below the floor.
    Samples come at most every REPORT_EVERY; one at or before the window's start is kept so
    the rate always spans the whole window."""
    if plan.min_rate_bps <= 0:
        return
    window.append((now, total))
    while len(window) > 2 and window[1][0] <= now - plan.min_rate_window:
        window.popleft()
    since, then = window[0]
    span = now - since
    if span >= plan.min_rate_window and (total - then) / span < plan.min_rate_bps:
        raise RetryAttempt(f"too slow: {rate_text((total - then) / span)} over the last "
                           f"{span:.0f} s, below the {rate_text(plan.min_rate_bps)} floor",
                           progressed=total > offset)


def _open_part(part: Path, offset: int) -> IO[bytes]:
    handle = part.open("r+b") if part.exists() else part.open("w+b")
    handle.truncate(offset)
    handle.seek(offset)
    return handle


def truncate_part(part: Path, length: int) -> None:
    with part.open("ab") as handle:
        handle.truncate(length)
