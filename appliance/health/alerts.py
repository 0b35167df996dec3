"""Alerts: every recorded transition goes to the event log and, optionally, to a webhook.

- Event log: one event per transition (source "health"), severity from the new level
  (CRITICAL -> critical, WARN -> warning, a recovery -> info). Written by `record` inside the
  monitor's own transaction, so a transition and its event are stored together or not at all.
- Webhook (`health.webhook_url`; empty: none): a JSON POST per transition,

      {"check", "group", "title", "level", "previous_level", "kind", "summary", "hint",
       "at", "box", "version"}

  delivered by one background task, in order (a recovery never overtakes its failure), never
  on the poll's path. A delivery is retried `webhook_retries` times with a doubling delay
  (`base_delay`, 2x, 4x, ...) on a connection error, a timeout, a 5xx, 408 or 429; any other
  status is final (a wrong URL does not fix itself). A delivery that fails is recorded as
  one warning event when the webhook *starts* failing; later failures while it stays down
  only go to the log, and the first success after that is one info event.
- The URL is a secret (Slack, Teams and ntfy URLs carry their token in the path or query,
  some receivers a user:password@): events and the log name the webhook by
  `config.mask_webhook` (scheme://host[:port]/***) only, and a transport error's text is
  scrubbed of the URL's parts before it is shown. Viewers read events; the log goes to the
  journal.
- A muted check sends nothing and writes no event; its transition is still kept in history
  (the monitor stores it with `muted` set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.config import mask_webhook
from appliance.db.database import Database
from appliance.db.journal import add_event
from appliance.health.model import Level
from appliance.health.transitions import Transition

log = logging.getLogger(__name__)

SOURCE = "health"
QUEUE_LIMIT = 1000  # alerts waiting for a dead webhook; older ones are dropped past this
RETRYABLE_STATUS = frozenset({408, 429})


def severity_of(change: Transition) -> str:
    if change.level is Level.OK:
        return "info"
    return "critical" if change.level is Level.CRITICAL else "warning"


def message_of(change: Transition) -> str:
    """One line for the event log: what changed, then the check's own summary."""
    r = change.result
    if change.kind == "recovery":
        return f"{r.title} recovered: {r.summary}"
    words = {Level.WARN: "warning", Level.CRITICAL: "critical"}
    if change.kind == "change":
        return (f"{r.title} went from {words.get(change.previous, 'ok')} to "
                f"{words.get(r.level, 'ok')}: {r.summary}")
    return f"{r.title} {words.get(r.level, 'failing')}: {r.summary}"


def payload_of(change: Transition, *, box: str, version: str) -> dict[str, Any]:
    r = change.result
    return {"check": r.id, "group": r.group, "title": r.title, "level": r.level.label,
            "previous_level": change.previous.label, "kind": change.kind,
            "summary": r.summary, "hint": r.hint, "at": change.at.isoformat(),
            "box": box, "version": version}


class Alerts:
    """Turns transitions into events and webhook deliveries. `transport` swaps the HTTP
    transport (tests); `base_delay` is the first retry's wait in seconds."""

    def __init__(self, *, db: Database, clock: Clock, url: str, retries: int, box: str,
                 version: str, transport: httpx.AsyncBaseTransport | None = None,
                 base_delay: float = 2.0, timeout: float = 10.0) -> None:
        self.db, self.clock, self.url, self.retries = db, clock, url, retries
        self.box, self.version = box, version
        self.shown = mask_webhook(url)  # the only form of the URL that leaves this object
        self.transport, self.base_delay, self.timeout = transport, base_delay, timeout
        self._queue: asyncio.Queue[dict[str, Any]] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._failing = False
        self._undelivered = 0

    # --- events (inside the caller's transaction) -------------------------------------

    def record(self, session: Session, changes: Iterable[Transition],
               muted: frozenset[str]) -> list[Transition]:
        """Write one event per transition of a check that is not muted; those are returned,
        for `send`."""
        loud = [c for c in changes if c.check_id not in muted]
        for change in loud:
            add_event(session, at=change.at, severity=severity_of(change), source=SOURCE,
                      message=message_of(change),
                      detail={"check": change.check_id, "kind": change.kind,
                              "level": change.level.label,
                              "previous_level": change.previous.label,
                              "hint": change.result.hint})
        return loud

    # --- webhook ----------------------------------------------------------------------

    def send(self, changes: Iterable[Transition]) -> None:
        """Queue a webhook delivery per transition (no-op without a URL). Call on the loop."""
        if not self.url:
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._deliver_all(self._queue),
                                               name="health-webhook")
        for change in changes:
            if self._queue.qsize() >= QUEUE_LIMIT:
                dropped = self._queue.get_nowait()
                self._queue.task_done()
                log.warning("webhook queue full; dropped the alert for %s", dropped["check"])
            self._queue.put_nowait(payload_of(change, box=self.box, version=self.version))

    async def drain(self) -> None:
        """Wait until every queued alert was delivered or given up on."""
        if self._queue is not None:
            await self._queue.join()

    async def close(self) -> None:
        """Stop delivering (the daemon is stopping; alerts still queued are dropped: their
        events are in the log)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._queue, self._worker = None, None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _deliver_all(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            body = await queue.get()
            try:
                await self._deliver(body)
            except Exception:  # never let one alert stop the ones after it
                log.exception("webhook delivery crashed")
            finally:
                queue.task_done()

    async def _deliver(self, body: dict[str, Any]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self.transport, timeout=self.timeout,
                                             trust_env=False)
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.base_delay * 2 ** (attempt - 1))
            try:
                response = await self._client.post(self.url, json=body)
            except httpx.HTTPError as exc:
                problem = self._scrub(f"{type(exc).__name__}: {exc}".rstrip(": "))
                continue
            if response.is_success:
                await self._delivered()
                return
            problem = f"HTTP {response.status_code}"
            if response.status_code < 500 and response.status_code not in RETRYABLE_STATUS:
                break
        await self._failed(body, problem, attempt + 1)

    async def _delivered(self) -> None:
        if not self._failing:
            return
        self._failing, missed = False, self._undelivered
        self._undelivered = 0
        await self._event("info", f"the alert webhook {self.shown} accepts alerts again "
                                  f"({missed} alert(s) could not be delivered meanwhile; "
                                  "they are in the event log)")

    async def _failed(self, body: dict[str, Any], problem: str, attempts: int) -> None:
        self._undelivered += 1
        log.warning("webhook: alert for %s not delivered to %s after %d attempt(s): %s",
                    body["check"], self.shown, attempts, problem)
        if self._failing:
            return
        self._failing = True
        await self._event(
            "warning",
            f"the alert for {body['check']} ({body['level']}) could not be delivered to the "
            f"webhook {self.shown} after {attempts} attempt(s): {problem}; check that the "
            "receiver is up and health.webhook_url is right (alerts stay in the event log; "
            "the next success is reported here)")

    def _scrub(self, text: str) -> str:
        """`text` (an HTTP library's error) without the URL or any of its secret parts: some
        errors quote the URL they were given."""
        text = text.replace(self.url, self.shown)
        try:
            parts = urlsplit(self.url)
            secrets = [parts.path if parts.path not in ("", "/") else "", parts.query,
                       parts.fragment, parts.username or "", parts.password or ""]
        except ValueError:
            return text
        for part in sorted(filter(None, secrets), key=len, reverse=True):
            text = text.replace(part, "***")
        return text

    async def _event(self, severity: str, message: str) -> None:
        at = self.clock.now()
        try:
            await self.db.run(lambda s: add_event(s, at=at, severity=severity, source=SOURCE,
                                                  message=message))
        except Exception:
            log.exception("could not record a webhook event")
