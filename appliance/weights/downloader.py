"""Fetch one file over HTTP so that nothing is ever lost: resume, watchdog, hash, rename.

A file downloads into `<target>.part` beside its target. On every attempt the prefix already
on disk is the truth: it is re-hashed (hashlib state cannot be saved across a kill) and the
transfer asks for `Range: bytes=<len(part)>-`, so a kill -9, a power cut or a daemon upgrade
costs one re-read of the prefix, never a re-download. Bytes are hashed as they arrive; the file
is renamed into place only when its size and digest match the manifest, after an fsync, so a
file under its final name is always a proven one. A mismatch discards the part and fetches
the file again.

The watchdog drops a connection that delivered no byte for `stall_seconds` (httpx's read
timeout: it is per socket read, i.e. inactivity) or that stayed below the floor rate over a
window (a trickle, which no read timeout notices). Every failure is retried after an
exponential backoff capped at `retry_max` (or the server's Retry-After), for as long as the
pull runs: only the operator's cancel ends it. Exceptions: a refused request (401/403/404) is
`TransferFailed`, and a full disk is `DiskFull`, which pauses the whole pull.

Blocking work (writes, fsync, hashing) runs on the executor the caller passes, never on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import re
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import httpx

from appliance.config import WeightsConfig
from appliance.errors import ApplianceError
from appliance.weights.hashing import Digest, hash_prefix
from appliance.weights.manifest import PART_SUFFIX, ManifestFile
from appliance.weights.sources import (
    SourceError,
    WeightSource,
    refuse_status,
    retry_after_seconds,
)

T = TypeVar("T")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class TransferPolicy:
    """The watchdog and retry settings of every transfer (from `[weights]`)."""

    stall_seconds: float = 60.0
    min_rate_bps: float = 64 * 1024
    min_rate_window: float = 120.0
    retry_base: float = 1.0
    retry_max: float = 60.0
    flush_bytes: int = 8 << 20

    @classmethod
    def from_config(cls, config: WeightsConfig) -> TransferPolicy:
        return cls(stall_seconds=float(config.stall_seconds),
                   min_rate_bps=config.min_rate_kib_s * 1024.0,
                   min_rate_window=float(config.min_rate_window_seconds),
                   retry_max=float(config.retry_max_seconds))

    def backoff(self, failures: int) -> float:
        """Exponential (1, 2, 4 … s) up to retry_max, with jitter so files do not retry in
        lockstep against a struggling server."""
        ceiling = min(self.retry_max, self.retry_base * 2.0 ** max(0, failures - 1))
        return float(ceiling * random.uniform(0.5, 1.0))  # noqa: S311 - jitter, not security


class TransferListener(Protocol):
    """What a transfer reports; called on the event loop."""

    def on_state(self, path: str, state: str) -> None: ...

    def on_bytes(self, path: str, bytes_done: int) -> None: ...

    def on_retry(self, path: str, attempt: int, error: str, delay: float) -> None: ...

    def on_verified(self, path: str) -> None: ...


class DiskFull(ApplianceError):
    """The models volume filled up mid-write; the .part prefix stays valid for a resume."""

    def __init__(self, path: Path) -> None:
        super().__init__("weights_disk_full", f"the models volume is full (writing {path.name})",
                         "free space on the models volume; the pull resumes by itself",
                         status=507)


class TransferFailed(ApplianceError):
    """The source refused the file for a reason waiting cannot fix (auth, not found)."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("weights_transfer_failed", message, hint, status=502)


class _Retry(Exception):
    """One attempt failed; `retry_after` is the server's wish, `progressed` whether the
    attempt moved the file forward (it resets the backoff)."""

    def __init__(self, message: str, *, retry_after: float | None = None,
                 progressed: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.progressed = progressed


def part_path(target: Path) -> Path:
    return target.with_name(target.name + PART_SUFFIX)


class RateLimiter:
    """A token bucket shared by every transfer of a pull (bytes per second; 0: no cap)."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second
        self._allowance = bytes_per_second
        self._last = 0.0
        self._lock = asyncio.Lock()

    async def take(self, count: int) -> None:
        if self.rate <= 0:
            return
        async with self._lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._last:
                self._allowance = min(self.rate, self._allowance + (now - self._last) * self.rate)
            self._last = now
            self._allowance -= count
            if self._allowance < 0:
                await asyncio.sleep(-self._allowance / self.rate)


@dataclass
class Transfer:
    """One file of a pull: `run()` returns once the file is verified under its final name."""

    client: httpx.AsyncClient
    source: WeightSource
    commit: str
    file: ManifestFile
    target: Path
    policy: TransferPolicy
    limiter: RateLimiter
    listener: TransferListener
    executor: Executor

    async def run(self) -> None:
        attempt = failures = 0
        while True:
            attempt += 1
            try:
                await self._attempt()
                return
            except _Retry as retry:
                failures = 1 if retry.progressed else failures + 1
                delay = (retry.retry_after if retry.retry_after is not None
                         else self.policy.backoff(failures))
                self.listener.on_retry(self.file.path, attempt, retry.message, delay)
                await asyncio.sleep(delay)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _attempt(self) -> None:
        path, size = self.file.path, self.file.size
        part = part_path(self.target)
        offset = await self._io(_prepare_part, part, size)
        digest = Digest(self.file)
        if offset:
            self.listener.on_state(path, "verifying")  # re-hashing the prefix from disk
            await self._io(hash_prefix, part, offset, digest)
        self.listener.on_bytes(path, offset)
        if offset == size:
            await self._finish(part, digest)
            return
        self.listener.on_state(path, "downloading")
        headers = self.source.headers()
        if offset:
            headers["Range"] = f"bytes={offset}-"
        timeout = httpx.Timeout(30.0, connect=10.0, read=self.policy.stall_seconds)
        url = self.source.file_url(self.commit, path)
        try:
            async with self.client.stream("GET", url, headers=headers, timeout=timeout,
                                          follow_redirects=True) as response:
                offset = await self._check_response(response, part, offset)
                if offset == 0:
                    digest = Digest(self.file)
                received = await self._receive(response, part, offset, digest)
        except httpx.TimeoutException as exc:
            stalled = isinstance(exc, httpx.ReadTimeout)
            raise _Retry(f"stalled: no bytes for {self.policy.stall_seconds:.0f} s" if stalled
                         else f"timed out: {type(exc).__name__}") from None
        except httpx.TransportError as exc:
            raise _Retry(f"connection failed: {type(exc).__name__}: {exc}"[:300]) from None
        if received != size:
            raise _Retry(f"the connection ended at byte {received} of {size}",
                         progressed=received > offset)
        await self._finish(part, digest)

    async def _check_response(self, response: httpx.Response, part: Path, offset: int) -> int:
        """The offset the body starts at (0 when the server ignored the Range)."""
        status = response.status_code
        if status == 416:
            await self._io(_truncate, part, 0)
            raise _Retry("the server refused the resume range; starting the file over")
        if status >= 300:
            try:
                refuse_status(response, self.file.path, self.source.description)
            except SourceError as exc:
                if not exc.retryable:
                    raise TransferFailed(exc.message, exc.hint) from None
                raise _Retry(exc.message, retry_after=retry_after_seconds(response)) from None
        if status == 206:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
            if not match or int(match.group(1)) != offset:
                raise _Retry(f"the server answered a different range "
                             f"({response.headers.get('Content-Range')!r}) than bytes={offset}-")
            return offset
        if offset:  # 200 to a ranged request: the whole file follows; start over
            await self._io(_truncate, part, 0)
        return 0

    async def _receive(self, response: httpx.Response, part: Path, offset: int,
                       digest: Digest) -> int:
        """Stream the body into the part, hashing it; returns the bytes now on disk."""
        loop = asyncio.get_running_loop()
        handle = await self._io(_open_at, part, offset)
        received = offset
        buffer = bytearray()
        started = last_flush = loop.time()
        window: deque[tuple[float, int]] = deque([(started, offset)])
        try:
            async for chunk in response.aiter_raw():  # as they come: a chunk size would
                # make httpx hold bytes back, and a stall would lose them
                await self.limiter.take(len(chunk))
                buffer += chunk
                now = loop.time()
                # Flush by size (few thread hops at speed) and by time (a slow stream's bytes
                # reach the disk, and the progress moves, at least every second).
                if len(buffer) >= self.policy.flush_bytes or now - last_flush >= 1.0:
                    received += await self._flush(handle, digest, buffer, part)
                    self.listener.on_bytes(self.file.path, received)
                    last_flush = now
                if received + len(buffer) > self.file.size:
                    raise _Retry(f"the server sent more than the manifest's {self.file.size} "
                                 "bytes")
                self._watch_rate(now, received + len(buffer), window, offset)
            if buffer:
                received += await self._flush(handle, digest, buffer, part)
                self.listener.on_bytes(self.file.path, received)
        except BaseException as exc:
            # Whatever ends the stream (a watchdog, a dropped connection, a cancel), what
            # arrived is a valid continuation of the prefix: keep it for the resume.
            if buffer and not isinstance(exc, DiskFull):
                with contextlib.suppress(Exception):
                    received += await self._flush(handle, digest, buffer, part)
            if isinstance(exc, _Retry):
                exc.progressed = received > offset
            raise
        finally:
            await self._io(handle.close)
        return received

    def _watch_rate(self, now: float, total: int, window: deque[tuple[float, int]],
                    offset: int) -> None:
        """Raise _Retry when the bytes of the last `min_rate_window` seconds are below the
        floor. `window` holds (time, bytes) samples; one sample at or before the window's
        start is kept so the rate always spans the whole window."""
        policy = self.policy
        if policy.min_rate_bps <= 0:
            return
        window.append((now, total))
        while len(window) > 2 and window[1][0] <= now - policy.min_rate_window:
            window.popleft()
        since, then = window[0]
        span = now - since
        if span >= policy.min_rate_window and (total - then) / span < policy.min_rate_bps:
            rate = (total - then) / span / 1024
            raise _Retry(f"too slow: {rate:.1f} KiB/s over the last {span:.0f} s, below the "
                         f"{policy.min_rate_bps / 1024:.0f} KiB/s floor",
                         progressed=total > offset)

    async def _flush(self, handle: IO[bytes], digest: Digest, buffer: bytearray,
                     part: Path) -> int:
        data = bytes(buffer)
        buffer.clear()
        try:
            await self._io(_absorb, handle, digest, data)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(part) from None
            raise
        return len(data)

    async def _finish(self, part: Path, digest: Digest) -> None:
        if not digest.matches():
            await self._io(_remove, part)
            raise _Retry(f"corrupt: the bytes received hash to {digest.hexdigest()[:16]}…, "
                         f"not the manifest's {digest.expected[:16]}… ({digest.algorithm}); "
                         "discarded, fetching the file again")
        try:
            await self._io(_commit, part, self.target)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(part) from None
            raise
        self.listener.on_verified(self.file.path)


# --- blocking helpers (run on the executor) ----------------------------------------------------


def _prepare_part(part: Path, size: int) -> int:
    """Length of the usable prefix: 0 when there is no part; a part longer than the file is
    garbage and is emptied."""
    part.parent.mkdir(parents=True, exist_ok=True)
    try:
        length = part.stat().st_size
    except FileNotFoundError:
        return 0
    if length > size:
        _truncate(part, 0)
        return 0
    return length


def _truncate(part: Path, length: int) -> None:
    with part.open("ab") as handle:
        handle.truncate(length)


def _open_at(part: Path, offset: int) -> IO[bytes]:
    handle = part.open("r+b") if part.exists() else part.open("w+b")
    handle.truncate(offset)
    handle.seek(offset)
    return handle


def _absorb(handle: IO[bytes], digest: Digest, data: bytes) -> None:
    handle.write(data)
    handle.flush()
    digest.update(data)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _commit(part: Path, target: Path) -> None:
    """fsync the part, rename it into place, fsync the folder: after a power cut the target
    either does not exist or is complete."""
    with part.open("rb") as handle:
        os.fsync(handle.fileno())
    os.replace(part, target)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
