"""The gateway's in-memory copy of the API keys, so authenticating costs one dict lookup and
one HMAC, never a database query.

`refresh` (polled every half second) reads a cheap fingerprint of the key table and reloads
only when it moved, so a key revoked in the console stops working here within a second.
Expiry needs no reload: it is checked against the clock on every request. A well-formed key
with an unknown prefix (created a moment ago) triggers one early reload, at most four times a
second, so a new key works at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time

from sqlalchemy.orm import Session

from appliance.db.database import Database
from appliance.gateway.errors import GatewayError
from appliance.gateway.keys import KeyEntry, keys_version, load_entries, prefix_of

MISSING = GatewayError(401, "invalid_api_key",
                       "no API key: send `Authorization: Bearer <key>` (ask the box's "
                       "administrator for a key)")
EARLY_RELOAD_GAP = 0.25
INVALID = GatewayError(401, "invalid_api_key",
                       "the API key is not valid: it is unknown, revoked or expired; ask the "
                       "box's administrator for a new one")


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    """The key from `Authorization: Bearer` or Anthropic's `x-api-key`."""
    value = headers.get(b"authorization")
    if value:
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    value = headers.get(b"x-api-key")
    return value.decode("latin-1").strip() if value else None


class KeyCache:
    def __init__(self, db: Database, secret: bytes) -> None:
        self.db, self.secret = db, secret
        self._by_prefix: dict[str, KeyEntry] = {}
        self._version: tuple[int, dt.datetime | None] | None = None
        self._early_reload = -EARLY_RELOAD_GAP
        self._reloading: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        await self.db.run(self.refresh_in)

    def refresh_in(self, session: Session) -> None:
        """Reload inside the caller's transaction (the poll shares one with the engine state)
        when the key table's fingerprint moved. Runs on a worker thread: the dict is
        replaced whole, never edited, so the event loop always sees a complete one."""
        version = keys_version(session)
        if version != self._version:
            self._by_prefix = {e.prefix: e for e in load_entries(session)}
            self._version = version

    def authenticate(self, key: str | None, now: dt.datetime) -> KeyEntry:
        """The key's entry, or a 401 GatewayError (from memory only)."""
        if not key:
            raise MISSING
        prefix = prefix_of(key)
        entry = self._by_prefix.get(prefix) if prefix else None
        if entry is None or not entry.accepts(self.secret, key, now):
            raise INVALID
        return entry

    async def resolve(self, key: str | None, now: dt.datetime) -> KeyEntry:
        """`authenticate`, reloading once first when a well-formed key is not known yet."""
        prefix = prefix_of(key) if key else None
        if prefix is not None and prefix not in self._by_prefix:
            if self._reloading is None:  # a burst of new-key requests shares one reload
                self._reloading = asyncio.ensure_future(self._early_refresh())
                self._reloading.add_done_callback(self._reloaded)
            with contextlib.suppress(Exception):  # the database is down: refuse, never 500
                await asyncio.shield(self._reloading)
        return self.authenticate(key, now)

    async def _early_refresh(self) -> None:
        """At most four reloads a second, however many unknown keys arrive."""
        wait = self._early_reload + EARLY_RELOAD_GAP - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._early_reload = time.monotonic()
        await self.refresh()

    def _reloaded(self, task: asyncio.Task[None]) -> None:
        self._reloading = None
        if not task.cancelled():
            task.exception()  # a failed reload is retried by the poll; the key is refused
