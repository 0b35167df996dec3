"""Health history in the database: samples, hourly roll-ups, transitions and mutes.

Every function takes a `Session` (run it through `Database.run`, off the event loop) and
hands out frozen views, never rows.

Compactness: one `health_samples` row per (at, name, subject) per poll, kept
`history_fine_hours`; `roll_up` folds each complete hour into one `health_hourly` row per
(name, subject) with min/avg/max, kept `history_hourly_days`. `prune` rolls up first, so a
sample is never deleted before its hour is summarised. Rolling up is idempotent (an hour
already summarised is skipped), so a missed or repeated prune job loses and doubles nothing.

Reading: `series` returns fine samples where they exist and hourly averages (at the hour's
start) for the part of the range older than the oldest fine sample of that series: the
boundary is the data itself, so it needs no clock and follows pruning.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Delete, delete, func, or_, select
from sqlalchemy.orm import Session

from appliance.db.models import as_utc
from appliance.errors import ApplianceError
from appliance.health import model
from appliance.health.model import HealthSnapshot, Level, Sample
from appliance.health.rows import (
    HealthHourlyRow,
    HealthMuteRow,
    HealthSampleRow,
    HealthTransitionRow,
)
from appliance.health.transitions import Transition, kind_of

HOUR = dt.timedelta(hours=1)
Point = tuple[dt.datetime, float]


def hour_of(at: dt.datetime) -> dt.datetime:
    """The start of the UTC hour holding `at`."""
    return as_utc(at).replace(minute=0, second=0, microsecond=0)


# --- what is kept -------------------------------------------------------------------------


def samples_of(snapshot: HealthSnapshot) -> list[Sample]:
    """The readings of `snapshot` kept as history (unknown values are skipped, not zero):
    per answering GPU temperature, power, utilisation and memory used (subject: its index);
    the engine's token usage, throughput, running and queued requests, cache hit rate and
    TTFT p50; the models volume's free bytes and available memory."""
    out: list[Sample] = []

    def keep(name: str, subject: str, value: float | None) -> None:
        if value is not None:
            out.append(Sample(name, subject, float(value)))

    if snapshot.gpus is not None:
        for gpu in snapshot.gpus.gpus:
            if gpu.error is None:
                subject = str(gpu.index)
                keep(model.GPU_TEMPERATURE, subject, gpu.temperature_c)
                keep(model.GPU_POWER, subject, gpu.power_w)
                keep(model.GPU_UTILIZATION, subject, gpu.utilization_pct)
                keep(model.GPU_MEMORY_USED, subject, gpu.memory_used_bytes)
                keep(model.GPU_ECC_UNCORRECTED, subject, gpu.ecc_uncorrected_volatile)
    engine = snapshot.engine
    if engine is not None:
        keep(model.ENGINE_TOKEN_USAGE, "", engine.token_usage)
        keep(model.ENGINE_STATE_USAGE, "", engine.state_usage)
        keep(model.ENGINE_THROUGHPUT, "", engine.generation_tokens_per_second)
        keep(model.ENGINE_RUNNING, "", engine.running_requests)
        keep(model.ENGINE_QUEUED, "", engine.queued_requests)
        keep(model.ENGINE_CACHE_HIT, "", engine.cache_hit_rate)
        keep(model.ENGINE_TTFT_P50, "", engine.ttft_p50_seconds)
    if snapshot.host is not None:
        keep(model.HOST_MODELS_FREE, "", snapshot.host.models_free_bytes)
        keep(model.HOST_MEMORY_AVAILABLE, "", snapshot.host.memory_available_bytes)
    return out


# --- writing ------------------------------------------------------------------------------


def record_samples(session: Session, at: dt.datetime, samples: Iterable[Sample]) -> int:
    rows = [HealthSampleRow(at=as_utc(at), name=s.name, subject=s.subject, value=s.value)
            for s in samples]
    session.add_all(rows)
    return len(rows)


def record_transitions(session: Session, changes: Iterable[Transition],
                       muted: frozenset[str]) -> None:
    for change in changes:
        r = change.result
        session.add(HealthTransitionRow(
            at=as_utc(change.at), check_id=r.id[:128], check_group=r.group, title=r.title[:128],
            level=r.level.label, previous_level=change.previous.label, summary=r.summary,
            hint=r.hint, muted=r.id in muted))


def roll_up(session: Session, now: dt.datetime) -> int:
    """Summarise every complete hour (before `now`'s) not summarised yet; rows written."""
    current = hour_of(now)
    last = session.scalar(select(func.max(HealthHourlyRow.bucket)))
    start_filter = [HealthSampleRow.at < current]
    if last is not None:
        start_filter.append(HealthSampleRow.at >= last + HOUR)
    first = session.scalar(select(func.min(HealthSampleRow.at)).where(*start_filter))
    if first is None:
        return 0
    written = 0
    hour = hour_of(first)
    while hour < current:  # bounded: at most the fine window's hours, plus a stopped clock's
        nxt = hour + HOUR
        groups = session.execute(
            select(HealthSampleRow.name, HealthSampleRow.subject, func.count(),
                   func.min(HealthSampleRow.value), func.avg(HealthSampleRow.value),
                   func.max(HealthSampleRow.value))
            .where(HealthSampleRow.at >= hour, HealthSampleRow.at < nxt)
            .group_by(HealthSampleRow.name, HealthSampleRow.subject)
        ).all()
        for name, subject, count, low, mean, high in groups:
            session.add(HealthHourlyRow(bucket=hour, name=name, subject=subject, count=count,
                                        min=low, avg=mean, max=high))
            written += 1
        hour = nxt
    return written


@dataclass(frozen=True)
class Pruned:
    rolled_up: int
    samples: int
    hourly: int
    transitions: int
    mutes: int


def prune(session: Session, now: dt.datetime, *, fine_hours: int,
          hourly_days: int) -> Pruned:
    """Roll up, then drop fine samples older than `fine_hours`, roll-ups and transitions
    older than `hourly_days`, and mutes that have expired."""
    now = as_utc(now)
    rolled = roll_up(session, now)
    session.flush()
    fine_cut = now - dt.timedelta(hours=fine_hours)
    long_cut = now - dt.timedelta(days=hourly_days)

    def gone(statement: Delete) -> int:
        result = session.execute(statement)
        return int(getattr(result, "rowcount", 0) or 0)

    return Pruned(
        rolled_up=rolled,
        samples=gone(delete(HealthSampleRow).where(HealthSampleRow.at < fine_cut)),
        hourly=gone(delete(HealthHourlyRow).where(HealthHourlyRow.bucket < long_cut)),
        transitions=gone(delete(HealthTransitionRow).where(HealthTransitionRow.at < long_cut)),
        mutes=gone(delete(HealthMuteRow).where(HealthMuteRow.until.is_not(None),
                                               HealthMuteRow.until <= now)),
    )


# --- reading ------------------------------------------------------------------------------


def series(session: Session, name: str, subject: str, since: dt.datetime,
           until: dt.datetime) -> list[Point]:
    """(time, value) for one series between `since` and `until` (inclusive), oldest first:
    fine samples where kept, hourly averages (at the hour's start) before them."""
    since, until = as_utc(since), as_utc(until)
    fine = session.execute(
        select(HealthSampleRow.at, HealthSampleRow.value)
        .where(HealthSampleRow.name == name, HealthSampleRow.subject == subject,
               HealthSampleRow.at >= since, HealthSampleRow.at <= until)
        .order_by(HealthSampleRow.at, HealthSampleRow.id)
    ).all()
    oldest_fine = session.scalar(
        select(func.min(HealthSampleRow.at))
        .where(HealthSampleRow.name == name, HealthSampleRow.subject == subject))
    query = (select(HealthHourlyRow.bucket, HealthHourlyRow.avg)
             .where(HealthHourlyRow.name == name, HealthHourlyRow.subject == subject,
                    HealthHourlyRow.bucket >= since, HealthHourlyRow.bucket <= until)
             .order_by(HealthHourlyRow.bucket))
    if oldest_fine is not None:  # only whole hours before the fine samples begin
        query = query.where(HealthHourlyRow.bucket <= oldest_fine - HOUR)
    hourly = session.execute(query).all()
    return [(at, float(v)) for at, v in hourly] + [(at, float(v)) for at, v in fine]


def recent_series(session: Session, wanted: Iterable[tuple[str, str]], since: dt.datetime,
                  until: dt.datetime) -> dict[tuple[str, str], list[Point]]:
    """Several series at once from the fine samples alone, oldest first, in one query: for
    windows inside `health.history_fine_hours` (the dashboard's last hour), which fine
    samples always cover; `series` is the one that falls back to hourly roll-ups."""
    keys = set(wanted)
    found: dict[tuple[str, str], list[Point]] = {key: [] for key in keys}
    if not keys:
        return found
    rows = session.execute(
        select(HealthSampleRow.name, HealthSampleRow.subject, HealthSampleRow.at,
               HealthSampleRow.value)
        .where(HealthSampleRow.name.in_({name for name, _ in keys}),
               HealthSampleRow.at >= as_utc(since), HealthSampleRow.at <= as_utc(until))
        .order_by(HealthSampleRow.at, HealthSampleRow.id))
    for name, subject, at, value in rows:
        if (name, subject) in found:
            found[(name, subject)].append((at, float(value)))
    return found


@dataclass(frozen=True)
class TransitionView:
    id: int
    at: dt.datetime
    check_id: str
    group: str
    title: str
    level: Level
    previous_level: Level
    summary: str
    hint: str
    muted: bool

    @property
    def kind(self) -> str:
        """"failure", "recovery" or "change", as `transitions.Transition.kind`."""
        return kind_of(self.previous_level, self.level)


def latest_by_subject(session: Session, name: str) -> dict[str, tuple[dt.datetime, float]]:
    """The newest fine sample of series `name` for each subject (e.g. each GPU index)."""
    rows = session.execute(
        select(HealthSampleRow.subject, HealthSampleRow.at, HealthSampleRow.value)
        .where(HealthSampleRow.name == name).order_by(HealthSampleRow.at.desc()).limit(512)
    ).all()
    out: dict[str, tuple[dt.datetime, float]] = {}
    for subject, at, value in rows:
        out.setdefault(subject, (as_utc(at), float(value)))
    return out


def transitions(session: Session, check_id: str | None = None,
                since: dt.datetime | None = None, limit: int = 100) -> list[TransitionView]:
    """Recorded transitions, newest first; of one check when `check_id` is given."""
    query = select(HealthTransitionRow).order_by(HealthTransitionRow.at.desc(),
                                                 HealthTransitionRow.id.desc())
    if check_id is not None:
        query = query.where(HealthTransitionRow.check_id == check_id)
    if since is not None:
        query = query.where(HealthTransitionRow.at >= as_utc(since))
    return [
        TransitionView(r.id, r.at, r.check_id, r.check_group, r.title, Level.parse(r.level),
                       Level.parse(r.previous_level), r.summary, r.hint, r.muted)
        for r in session.scalars(query.limit(limit))
    ]


def last_levels(session: Session) -> dict[str, Level]:
    """Each check's level at its newest recorded transition (checks never recorded: absent,
    meaning OK). Seeds the monitor's memory at start."""
    newest = (select(HealthTransitionRow.check_id, func.max(HealthTransitionRow.id).label("id"))
              .group_by(HealthTransitionRow.check_id).subquery())
    rows = session.execute(
        select(HealthTransitionRow.check_id, HealthTransitionRow.level)
        .join(newest, HealthTransitionRow.id == newest.c.id))
    return {check_id: Level.parse(level) for check_id, level in rows}


# --- mutes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MuteView:
    check_id: str
    until: dt.datetime | None  # None: until unmuted
    created_at: dt.datetime
    created_by: str
    reason: str

    def active(self, now: dt.datetime) -> bool:
        return self.until is None or self.until > now


def mutes(session: Session, now: dt.datetime | None = None) -> list[MuteView]:
    """Mutes by check id; with `now`, only those still in force (expired ones are pruned by
    the hourly job and ignored by the monitor as soon as they expire)."""
    query = select(HealthMuteRow).order_by(HealthMuteRow.check_id)
    if now is not None:
        query = query.where(or_(HealthMuteRow.until.is_(None), HealthMuteRow.until > as_utc(now)))
    return [MuteView(r.check_id, r.until, r.created_at, r.created_by, r.reason)
            for r in session.scalars(query)]


def check_mute(check_id: str, until: dt.datetime | None, now: dt.datetime) -> None:
    """Refuse a mute that cannot be stored or would already be over (pure)."""
    if not check_id or len(check_id) > 128:
        raise ApplianceError("health_mute_invalid", "a check id of 1 to 128 characters is "
                             "needed to mute a check", "pick a check on the Health page",
                             status=422)
    if until is not None and (until.tzinfo is None or until <= now):
        raise ApplianceError(
            "health_mute_invalid",
            f"a mute must end in the future, with a time zone (got {until.isoformat()})",
            "give a later time with its offset, or no end to mute until unmuted", status=422)


def set_mute(session: Session, check_id: str, *, until: dt.datetime | None, at: dt.datetime,
             by: str, reason: str) -> MuteView:
    """Mute `check_id` (replacing a mute it already has)."""
    row = session.get(HealthMuteRow, check_id)
    if row is None:
        row = HealthMuteRow(check_id=check_id)
        session.add(row)
    row.until = None if until is None else as_utc(until)
    row.created_at, row.created_by, row.reason = as_utc(at), by[:128], reason
    return MuteView(check_id, row.until, row.created_at, row.created_by, reason)


def clear_mute(session: Session, check_id: str) -> bool:
    """Unmute; False when it was not muted."""
    row = session.get(HealthMuteRow, check_id)
    if row is None:
        return False
    session.delete(row)
    return True
