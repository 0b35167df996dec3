"""Admission from the qualification ledger (issue 15, "admission measured, not guessed"): how
many requests the gateway lets into the engine at once, and where that figure comes from.

The limit is, first match wins:

1. `gateway.max_concurrency` when the operator set it (source `configured`);
2. the running spec's qualified point less `gateway.qualified_margin` (at least 1, and never
   above the engine's own `max_running_requests`), when the newest finished qualification of
   the spec the engine runs (`ledger.qualification_for`, by the hash the daemon publishes)
   found one (source `qualified`);
3. the engine's `max_running_requests` from `/server_info` (source `unqualified: engine
   max_running_requests`): what the engine can hold, not what it can serve at the floor.

On the head of a prefill/decode cell the gateway forwards to the cell's router and the rules
are the cell's (`cell_limit`): the override, else the capacity the head's daemon published
(source `cell: decode members' max_running_requests`).

A request refused because the queue is full or its wait ran out is told when to retry
(`retry_after`): the batches ahead of it, each taking as long as a full batch at the
qualified point took in the qualification (the median over its repeats), never less than the
median duration the gateway has seen lately.

While a qualification runs the gateway refuses every user whatever the limit
(`qualifying_until`: until the run's expected end). `AdmissionLimit.refusing_until` carries
that into the one value every place that states admission says (`/health`, the dashboard,
the Usage page, `/api/v1/engine`, `appliance doctor`): the refusal, why and until when first,
then the limit that applies once it ends.

Pure, except `QualifiedReader.read`, which the gateway's poll calls inside its transaction.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.db.models import Qualification
from appliance.engine.publish import Published
from appliance.qualify.ledger import Record, get_qualification
from appliance.qualify.verdict import percentile

QUALIFIED = "qualified"
UNQUALIFIED = "unqualified: engine max_running_requests"
CONFIGURED = "configured"
CELL = "cell: decode members' max_running_requests"
CELL_UNKNOWN = "cell: capacity not published"
FALLBACK_LIMIT = 32  # the engine did not say (an old or odd build): a cautious guess
RETRY_MAX = 600  # seconds; a longer Retry-After is a guess no client should sleep on
UNQUALIFIED_RETRY_MAX = 60
QUALIFYING_REASON = "a qualification is running"


def qualifying_until(published: Published | None, now: dt.datetime) -> dt.datetime | None:
    """Until when the gateway refuses every user because the box is being qualified: the
    run's expected end when the daemon published one, the lease's end once the run has gone
    past its estimate (the daemon keeps renewing it); None when no qualification holds the
    gateway closed (none runs, or its lease lapsed: the daemon that ran it is gone)."""
    if published is None or not published.qualifying(now):
        return None
    lease = published.qualifying_until
    until = published.qualifying_ends_at or lease or now
    return lease if lease is not None and until < lease else until


def refusal_words(until: dt.datetime) -> str:
    """The refusal while a qualification runs, as every place that states admission says it."""
    return (f"refusing every user until about {until:%H:%M:%S} UTC: {QUALIFYING_REASON} "
            "(the box's capacity is measured without users)")


@dataclass(frozen=True)
class QualifiedPoint:
    """What admission needs from one finished qualification that found a point."""

    qid: int
    point: int
    floor: float
    at: dt.datetime  # when it finished
    batch_seconds: float | None  # a full batch at the point, start to last token (median)
    lower_bound: bool = False  # no step failed: the ladder stopped here, more may pass
    # The TTFT SLO (p90, seconds) the point was held to (None: the floor alone). The point is
    # the total the engine serves at both promises; each class's share caps its part of it.
    ttft_slo: float | None = None

    def words(self) -> str:
        bound = (f"; at least {self.point}: the ladder stopped there with no step failing, "
                 "continue it to admit more" if self.lower_bound else "")
        first = (f", first token within {self.ttft_slo:g} s" if self.ttft_slo is not None
                 else "")
        return (f"qualified {self.at:%Y-%m-%d %H:%M:%S} UTC, floor {self.floor:g} tokens/s"
                f"{first}{bound}")


def point_of(record: Record) -> QualifiedPoint | None:
    """The qualified point of a finished qualification (None: it found none)."""
    if record.state != "done" or record.qualified is None:
        return None
    step = next((s for s in record.steps if s.concurrency == record.qualified), None)
    batches = [r.seconds for r in step.rounds if r.seconds > 0] if step else []
    return QualifiedPoint(record.id, record.qualified, record.settings.floor,
                          record.ended_at or record.started_at, percentile(batches, 50),
                          record.lower_bound, record.settings.ttft_p90_max)


class QualifiedReader:
    """The running spec's qualified point, read in the poll's transaction. Each poll costs one
    indexed look-up of the newest finished qualification's id; its steps are read and parsed
    only when that id changes (a new qualification, or another spec running)."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._point: QualifiedPoint | None = None

    def read(self, session: Session, spec_hash: str | None) -> QualifiedPoint | None:
        if spec_hash is None:
            self._key, self._point = None, None
            return None
        qid = session.scalar(
            select(Qualification.id)
            .where(Qualification.spec_hash == spec_hash, Qualification.state == "done")
            .order_by(Qualification.id.desc()).limit(1))
        if qid is None:
            self._key, self._point = None, None
            return None
        if self._key != (spec_hash, qid):
            record = get_qualification(session, qid)
            self._point = None if record is None else point_of(record)
            self._key = (spec_hash, qid)
        return self._point


@dataclass(frozen=True)
class AdmissionLimit:
    """The global limit and why it is that (`source`: QUALIFIED, UNQUALIFIED or CONFIGURED;
    through a cell's router (`cell`): CELL, CELL_UNKNOWN or CONFIGURED)."""

    limit: int
    source: str
    qualified: QualifiedPoint | None = None
    cell: bool = False
    refusing_until: dt.datetime | None = None  # a qualification refuses everyone until then

    @property
    def admitting(self) -> bool:
        """False while a qualification refuses every user (the limit applies after it)."""
        return self.refusing_until is None

    def during(self, published: Published | None, now: dt.datetime) -> AdmissionLimit:
        """This limit as it stands now: refusing while a qualification runs."""
        until = qualifying_until(published, now)
        return self if until == self.refusing_until else replace(self, refusing_until=until)

    def words(self) -> str:
        """What the dashboard, the Usage page, `/health` and the doctor say."""
        if self.refusing_until is not None:
            after = replace(self, refusing_until=None).words()
            return f"{refusal_words(self.refusing_until)}; then {after}"
        if self.cell:
            ground = {CONFIGURED: "gateway.max_concurrency",
                      CELL: "the sum of its ready decode members' running-request limits"
                      }.get(self.source, "a cautious guess: the head has not published the "
                            "cell's capacity yet")
            return f"admitting up to {self.limit} at a time through the cell's router ({ground})"
        if self.source == QUALIFIED and self.qualified is not None:
            return f"admitting up to {self.limit} at a time ({self.qualified.words()})"
        if self.source == CONFIGURED:
            return (f"admitting up to {self.limit} at a time (gateway.max_concurrency; "
                    + (f"the running spec is qualified at {self.qualified.point})"
                       if self.qualified else "the running spec is unqualified)"))
        return (f"unqualified: admitting up to {self.limit} at a time, the engine's "
                "running-request limit, which says what the engine can hold, not what it can "
                "serve at the floor speed; qualify the box to admit at a measured point")

    def to_dict(self) -> dict[str, object]:
        body: dict[str, object] = {"limit": self.limit, "source": self.source,
                                   "admitting": self.admitting, "words": self.words()}
        if self.refusing_until is not None:
            body["refusal"] = {"reason": QUALIFYING_REASON,
                               "until": self.refusing_until.isoformat()}
        if self.qualified is not None:
            q = self.qualified
            held: dict[str, object] = {"id": q.qid, "point": q.point, "floor": q.floor,
                                       "at": q.at.isoformat(), "batch_seconds": q.batch_seconds}
            if q.ttft_slo is not None:
                held["ttft_slo"] = q.ttft_slo
            body["qualification"] = held
        return body


def after_new_spec(override: int = 0) -> str:
    """How the gateway admits once the engine runs a new launch spec (another memory split):
    the spec is unqualified, so it admits up to the new engine's own slot count until it is
    qualified, unless the operator's `gateway.max_concurrency` (`override`) holds."""
    if override > 0:
        return (f"the new configuration is unqualified; the gateway keeps admitting up to "
                f"{override} at a time (gateway.max_concurrency)")
    return ("the new configuration is unqualified: until it is qualified the gateway admits "
            "up to the new engine's own slot count (what it can hold, "
            "not a measured point), and no longer at this configuration's qualified point")


def admission_limit(engine_limit: int | None, qualified: QualifiedPoint | None, *,
                    margin: int = 0, override: int = 0) -> AdmissionLimit:
    """The limit by the rules of the module doc."""
    if override > 0:
        return AdmissionLimit(override, CONFIGURED, qualified)
    if qualified is not None:
        limit = max(1, qualified.point - max(0, margin))
        if engine_limit:
            limit = min(limit, engine_limit)
        return AdmissionLimit(limit, QUALIFIED, qualified)
    return AdmissionLimit(engine_limit or FALLBACK_LIMIT, UNQUALIFIED)


def cell_limit(capacity: int | None, *, override: int = 0) -> AdmissionLimit:
    """The limit through a cell's router: the operator's override, else the capacity the
    head published (the sum over READY decode members of their effective
    max_running_requests), else a guess.

    The head's qualified point does not apply: it measured the head's engine alone, serving
    whole requests (prefill and decode on one box) at the floor speed, which is not what the
    cell is: its prefills and decodes run on other boxes, and its capacity is held by the
    decode members' running slots."""
    if override > 0:
        return AdmissionLimit(override, CONFIGURED, cell=True)
    if capacity is not None and capacity > 0:
        return AdmissionLimit(capacity, CELL, cell=True)
    return AdmissionLimit(FALLBACK_LIMIT, CELL_UNKNOWN, cell=True)


def retry_after(ahead: int, limit: int, qualified: QualifiedPoint | None,
                durations: Sequence[float], fallback_seconds: float) -> int:
    """Seconds a refused request should wait: `ahead` requests (itself included) before it
    get `limit` slots, batch after batch (module doc). Without a measured batch, the old
    estimate: the recent mean duration (`fallback_seconds`) times the batches, up to 60 s."""
    median = percentile(durations, 50) or 0.0
    batches = math.ceil(max(1, ahead) / max(1, limit))
    if qualified is not None and qualified.batch_seconds:
        estimate = max(batches * qualified.batch_seconds, median)
        return max(1, min(RETRY_MAX, math.ceil(estimate)))
    estimate = max(fallback_seconds * ahead / max(1, limit), median)
    return max(1, min(UNQUALIFIED_RETRY_MAX, round(estimate)))
