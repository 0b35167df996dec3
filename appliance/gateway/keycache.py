"""The gateway's in-memory copy of the API keys, so authenticating costs one dict lookup and
one HMAC, never a database query.

The gateway's poll (every half second) calls `refresh_in`, which reads a cheap fingerprint of
the key table and reloads only when it moved, so a key revoked in the console stops working
here within a second. Expiry needs no reload: it is checked against the clock on every request.

A key that fails is never an occasion to query the database: a request can trigger no
reload, and a wrong key costs the same whatever it is. A key with an unknown prefix is hashed
like a known one, and every well-formed key that fails is checked once more after the next
poll that starts after it arrived (a key created a moment ago works then, within a poll),
and only then refused. So an unknown prefix and a known prefix with a wrong secret take the
same path and about the same time, the 401 body is the same, and a flood of bad keys costs
the database nothing beyond the poll it runs anyway. `appliance.gateway.auth_throttle`
limits how many a client address may send.
"""

from __future__ import annotations

import datetime as dt
import hmac

from sqlalchemy.orm import Session

from appliance.db.database import Database
from appliance.gateway.errors import GatewayError
from appliance.gateway.keys import KeyEntry, keys_version, load_entries, prefix_of
from appliance.gateway.polls import PollCount
from appliance.secrets import keyed_hash

MISSING = GatewayError(401, "invalid_api_key",
                       "no API key: send `Authorization: Bearer <key>` (ask the box's "
                       "administrator for a key)")
INVALID = GatewayError(401, "invalid_api_key",
                       "the API key is not valid: it is unknown, revoked or expired; ask the "
                       "box's administrator for a new one")
# How long a failing key waits at most for the next poll (it runs every 0.5 s; a stalled
# database must not hold refusals longer than this).
FAILED_WAIT_MAX = 2.0
_DUMMY_KEY = "sk-00000000-" + "0" * 43


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
    def __init__(self, db: Database, secret: bytes, *,
                 failed_wait: float = FAILED_WAIT_MAX) -> None:
        self.db, self.secret, self.failed_wait = db, secret, failed_wait
        self._by_prefix: dict[str, KeyEntry] = {}
        self._version: tuple[int, dt.datetime | None] | None = None
        self._dummy_hash = keyed_hash(secret, _DUMMY_KEY)
        self._polls_started = 0
        self._polls_done = PollCount()

    async def refresh(self) -> None:
        ticket = self.poll_started()
        try:
            await self.db.run(self.refresh_in)
        finally:
            self.poll_done(ticket)

    def refresh_in(self, session: Session) -> None:
        """Reload inside the caller's transaction (the poll shares one with the engine state)
        when the key table's fingerprint moved. Runs on a worker thread: the dict is
        replaced whole, never edited, so the event loop always sees a complete one. The
        caller brackets it with `poll_started` and `poll_done` (on the event loop)."""
        version = keys_version(session)
        if version != self._version:
            self._by_prefix = {e.prefix: e for e in load_entries(session)}
            self._version = version

    def poll_started(self) -> int:
        """A poll begins; its ticket goes back to `poll_done`."""
        self._polls_started += 1
        return self._polls_started

    def poll_done(self, ticket: int) -> None:
        """A poll ended (read the keys, or failed): wake the keys waiting for it."""
        self._polls_done.advance(to=ticket)

    def authenticate(self, key: str | None, now: dt.datetime) -> KeyEntry:
        """The key's entry, or a 401 GatewayError (from memory only)."""
        if not key:
            raise MISSING
        prefix = prefix_of(key)
        entry = self._by_prefix.get(prefix) if prefix else None
        if entry is None:
            # The HMAC a known prefix costs, so the answer's time does not tell them apart.
            hmac.compare_digest(self._dummy_hash, keyed_hash(self.secret, key))
            raise INVALID
        if not entry.accepts(self.secret, key, now):
            raise INVALID
        return entry

    async def resolve(self, key: str | None, now: dt.datetime) -> KeyEntry:
        """`authenticate`; a well-formed key that fails is checked again after the next poll
        (see the module docstring), never by a database query of its own."""
        try:
            return self.authenticate(key, now)
        except GatewayError:
            if not key or prefix_of(key) is None:
                raise
        await self._next_poll()
        return self.authenticate(key, now)

    async def _next_poll(self) -> None:
        """Until a poll that starts after this call has ended, or `failed_wait` passed."""
        await self._polls_done.wait_past(self._polls_started + 1, self.failed_wait)
