"""Fetch one file over HTTP so that nothing is ever lost: resume, watchdog, hash, rename.

A file downloads into `<target>.part` beside its target. On every attempt the prefix already
on disk is the truth: it is re-hashed (hashlib state cannot be saved across a kill) and the
transfer asks for `Range: bytes=<len(part)>-`, so a kill -9, a power cut or a daemon upgrade
costs one re-read of the prefix, never a re-download. Bytes are hashed as they arrive; the file
is renamed into place only when its size and digest match the manifest, after an fsync, so a
file under its final name is always a proven one. A mismatch discards the part and fetches
the file again.

The watchdog (fetch.py, where each attempt runs on a thread of its own) drops a connection
that delivered no byte for `stall_seconds` (a socket timeout: inactivity) or that stayed
below the floor rate over a window (a trickle, which no read timeout notices). Every failure
is retried after an exponential backoff capped at `retry_max` (or the server's Retry-After),
for as long as the pull runs: only the operator's cancel ends it. Exceptions: a refused
request (401/403/404) is `TransferFailed`, and a full disk is `DiskFull`, which pauses the
whole pull.

Blocking work (the transfer itself, fsync, hashing) runs on the executor the caller passes,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import re
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from appliance.config import WeightsConfig
from appliance.errors import ApplianceError
from appliance.weights.fetch import (
    DiskFullError,
    Plan,
    Refused,
    RetryAttempt,
    Throttle,
    fetch,
    truncate_part,
)
from appliance.weights.hashing import Digest, hash_prefix
from appliance.weights.manifest import PART_SUFFIX, ManifestFile
from appliance.weights.sources import WeightSource

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


def part_path(target: Path) -> Path:
    return target.with_name(target.name + PART_SUFFIX)


@dataclass
class Transfer:
    """One file of a pull: `run()` returns once the file is verified under its final name."""

    source: WeightSource
    commit: str
    file: ManifestFile
    target: Path
    policy: TransferPolicy
    throttle: Throttle
    listener: TransferListener
    executor: Executor

    async def run(self) -> None:
        attempt = failures = 0
        while True:
            attempt += 1
            try:
                await self._attempt()
                return
            except RetryAttempt as retry:
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
        if offset < size:
            self.listener.on_state(path, "downloading")
            received, digest = await self._fetch(part, offset, digest)
            if received != size:
                raise RetryAttempt(f"the connection ended at byte {received} of {size}",
                                   progressed=received > offset)
        await self._finish(part, digest)

    async def _fetch(self, part: Path, offset: int, digest: Digest) -> tuple[int, Digest]:
        """The HTTP attempt on a worker thread (fetch.py). Progress comes back to the loop a
        few times a second; cancelling this task aborts the thread's socket at once."""
        loop = asyncio.get_running_loop()
        headers = self.source.headers()
        if offset:
            headers["Range"] = f"bytes={offset}-"
        path = self.file.path

        def report(received: int) -> None:
            loop.call_soon_threadsafe(self.listener.on_bytes, path, received)

        plan = Plan(
            url=self.source.file_url(self.commit, path), headers=headers, part=part,
            offset=offset, size=self.file.size, digest=digest,
            stall_seconds=self.policy.stall_seconds, min_rate_bps=self.policy.min_rate_bps,
            min_rate_window=self.policy.min_rate_window, throttle=self.throttle,
            on_bytes=report, describe=f"{self.source.description}/{path}")
        work = loop.run_in_executor(self.executor, fetch, plan)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            plan.abort()
            with contextlib.suppress(BaseException):
                await work  # the part's handle is closed before anyone touches the file
            raise
        except Refused as refused:
            raise TransferFailed(refused.error.message, refused.error.hint) from None
        except DiskFullError:
            raise DiskFull(part) from None

    async def _finish(self, part: Path, digest: Digest) -> None:
        if not digest.matches():
            await self._io(_remove, part)
            raise RetryAttempt(f"corrupt: the bytes received hash to "
                               f"{digest.hexdigest()[:16]}…, not the manifest's "
                               f"{digest.expected[:16]}… ({digest.algorithm}); discarded, "
                               "fetching the file again")
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
        truncate_part(part, 0)
        return 0
    return length



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
