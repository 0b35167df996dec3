"""The Usage page's errors by cause: why the gateway's refused and failed requests ended so.

The roll-ups count errors without their cause; the per-request rows (`usage_requests`, kept
`gateway.usage_retention_days`) record the HTTP status and the error code sent, so the causes
come from them: 503s while a qualification measured the engine apart from 503s while it was
restarting, 401s for a missing, wrong, revoked or expired key (recorded under "No key": a
refused key is not a key the request may be counted against), and so on. A code this table
does not name is still counted, under its status and code.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from appliance.db.models import UsageRequest
from appliance.gateway.usage import OK_OUTCOMES

# The gateway's error codes (appliance/gateway/*.py GatewayError), in the operator's words.
CAUSES: Mapping[str, str] = {
    "engine_qualifying": "refused while a qualification measured the engine",
    "engine_unavailable": "refused while the engine was not serving (starting, restarting, "
                          "draining or stopped)",
    "cell_unavailable": "refused while the cell had no engine to send to",
    "not_served_in_cell": "an Anthropic Messages request, which the cell's router does not "
                          "serve",
    "invalid_api_key": "refused: no API key, or a wrong, revoked or expired one",
    "too_many_failed_keys": "refused: the address had sent too many wrong API keys",
    "queue_full": "refused: the gateway's queue was full",
    "queue_timeout": "waited too long in the gateway's queue",
    "slo_ttft_predicted_miss": "refused at once: the first token would have come later than "
                               "the key's class promises",
    "key_concurrency_limit": "over the key's concurrent-request limit",
    "requests_per_minute_limit": "over the key's requests-per-minute limit",
    "tokens_per_day_limit": "over the key's tokens-per-day limit",
    "max_tokens_over_key_cap": "asked for more tokens than the key's per-request cap",
    "context_length_exceeded": "longer than the model's context",
    "engine_unreachable": "the engine did not answer",
    "engine_timeout": "the engine took too long",
    "stream_interrupted": "the engine's stream broke off",
    "client_closed": "the client went away before the answer",
    "request_too_large": "a request body over the size limit",
}


@dataclass(frozen=True)
class ErrorCause:
    """How many error requests ended with one status and code, and that cause in words."""

    status: int
    code: str
    count: int

    @property
    def words(self) -> str:
        known = CAUSES.get(self.code)
        if known is not None:
            return known
        if 400 <= self.status < 500:
            return "a request the gateway could not accept"
        return "an error"


def error_causes(session: Session, start: dt.datetime, end: dt.datetime,
                 key_id: int | None = None) -> list[ErrorCause]:
    """The error requests that started in [start, end) (of `key_id` only, when given; 0 is
    "No key"), by status and code, most first."""
    query = (select(UsageRequest.status, UsageRequest.outcome, func.count())
             .where(UsageRequest.started_at >= start, UsageRequest.started_at < end,
                    UsageRequest.outcome.not_in(sorted(OK_OUTCOMES)))
             .group_by(UsageRequest.status, UsageRequest.outcome))
    if key_id == 0:
        query = query.where(UsageRequest.key_id.is_(None))
    elif key_id is not None:
        query = query.where(UsageRequest.key_id == key_id)
    found = [ErrorCause(int(status), str(code), int(n))
             for status, code, n in session.execute(query)]
    return sorted(found, key=lambda c: (-c.count, c.status, c.code))
