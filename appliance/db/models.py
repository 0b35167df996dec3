"""SQLAlchemy models. Portable SQL only: the same schema runs on SQLite and PostgreSQL.

Timestamps are stored as UTC and always come back timezone-aware (see `UTCDateTime`).
The schema itself is owned by Alembic (`migrations/`); these classes must match it, and
`tests/test_migrations.py` checks that they do.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def as_utc(value: dt.datetime) -> dt.datetime:
    """`value` in UTC; a naive datetime (no zone, so no known instant) is a `ValueError`."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(
            f"naive datetime {value.isoformat()} given to the database; use an aware UTC "
            "value such as datetime.now(datetime.UTC)"
        )
    return value.astimezone(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A datetime stored in UTC that is always returned timezone-aware.

    SQLite has no time zones and hands back naive values; PostgreSQL returns aware ones.
    Normalising here means no caller ever compares naive with aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        # SQLAlchemy wraps this ValueError in a StatementError at flush time; the journal's
        # writers call `as_utc` first so their callers get the plain ValueError.
        return None if value is None else as_utc(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        assert isinstance(value, dt.datetime)
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    pass


class AdminUser(Base):
    __tablename__ = "admin_users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    username: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    password_hash: Mapped[str] = mapped_column(String(255), nullable=False)
    must_change_password: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    password_changed_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    # viewer, operator or admin (appliance.auth.roles); accounts from before roles are admins.
    role: Mapped[str] = mapped_column(String(16), nullable=False, server_default="admin")
    # "local" (a password here) or "oidc" (a shadow of a single sign-on user, found by issuer
    # and subject, its role rewritten from the groups at each sign-in; no usable password).
    source: Mapped[str] = mapped_column(String(16), nullable=False, server_default="local")
    external_issuer: Mapped[str | None] = mapped_column(String(255), nullable=True)
    external_subject: Mapped[str | None] = mapped_column(String(255), nullable=True)

    __table_args__ = (
        UniqueConstraint("external_issuer", "external_subject", name="uq_admin_users_external"),
    )


class AdminSession(Base):
    __tablename__ = "admin_sessions"

    # sha256 of the cookie value: a stolen database does not yield live sessions.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(
        ForeignKey("admin_users.id", ondelete="CASCADE"), nullable=False, index=True
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    last_seen_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False, index=True)
    address: Mapped[str] = mapped_column(String(64), nullable=False, default="")
    user_agent: Mapped[str] = mapped_column(String(255), nullable=False, default="")


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    prefix: Mapped[str] = mapped_column(String(16), unique=True, nullable=False)
    token_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    user_id: Mapped[int] = mapped_column(
        ForeignKey("admin_users.id", ondelete="CASCADE"), nullable=False
    )
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # At most the owner's role when created; a request acts with the lower of the two.
    role: Mapped[str] = mapped_column(String(16), nullable=False, server_default="admin")


class AuditEntry(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_at", "at"), Index("ix_audit_log_action", "action"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    actor: Mapped[str] = mapped_column(String(128), nullable=False)
    address: Mapped[str] = mapped_column(String(64), nullable=False, default="")
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target: Mapped[str] = mapped_column(String(255), nullable=False, default="")
    outcome: Mapped[str] = mapped_column(String(16), nullable=False)
    detail: Mapped[str] = mapped_column(Text, nullable=False, default="{}")


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_at", "at"), Index("ix_events_severity", "severity"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    severity: Mapped[str] = mapped_column(String(16), nullable=False)
    source: Mapped[str] = mapped_column(String(64), nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False)
    detail: Mapped[str] = mapped_column(Text, nullable=False, default="{}")


class EngineRun(Base):
    """One launch (or adoption) of the engine, from preflight to exit."""

    __tablename__ = "engine_runs"
    __table_args__ = (Index("ix_engine_runs_started_at", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    runner: Mapped[str] = mapped_column(String(16), nullable=False)
    spec_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    spec_json: Mapped[str] = mapped_column(Text, nullable=False)
    identity_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    adopted: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    state: Mapped[str] = mapped_column(String(32), nullable=False)
    phases: Mapped[str] = mapped_column(Text, nullable=False, default="[]")
    ready_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ready_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    hint: Mapped[str] = mapped_column(Text, nullable=False, default="")
    figures: Mapped[str] = mapped_column(Text, nullable=False, default="{}")
    log_path: Mapped[str] = mapped_column(String(1024), nullable=False, default="")


class EngineControl(Base):
    """The operator's desired engine state (one row), and the last spec that reached READY."""

    __tablename__ = "engine_control"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    desired: Mapped[str] = mapped_column(String(16), nullable=False)
    last_good_spec_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    updated_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class ScheduledAction(Base):
    """An engine action an operator chose to run in a maintenance window."""

    __tablename__ = "scheduled_actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    command: Mapped[str] = mapped_column(String(16), nullable=False)
    run_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    created_by: Mapped[str] = mapped_column(String(128), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # pending|done|failed|...
    outcome: Mapped[str] = mapped_column(Text, nullable=False, default="")
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class WeightsSet(Base):
    """A manifest: one repo pinned to one commit. Immutable once written; a new revision is
    a new set."""

    __tablename__ = "weights_sets"
    __table_args__ = (UniqueConstraint("repo_id", "commit_id", name="uq_weights_sets_commit"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    repo_id: Mapped[str] = mapped_column(String(200), nullable=False)
    revision: Mapped[str] = mapped_column(String(255), nullable=False)
    commit_id: Mapped[str] = mapped_column(String(128), nullable=False)
    source: Mapped[str] = mapped_column(String(1024), nullable=False)
    manifest_digest: Mapped[str] = mapped_column(String(64), nullable=False)
    total_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    full_verified_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class WeightsFile(Base):
    """One file of a set: what the manifest expects and what is known about the copy on disk.
    `verified_size`/`verified_mtime_ns` let a full verification skip a file that has not
    changed since it was hashed."""

    __tablename__ = "weights_files"
    __table_args__ = (UniqueConstraint("set_id", "path", name="uq_weights_files_path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_id: Mapped[int] = mapped_column(
        ForeignKey("weights_sets.id", ondelete="CASCADE"), nullable=False, index=True)
    path: Mapped[str] = mapped_column(String(1024), nullable=False)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    git_oid: Mapped[str | None] = mapped_column(String(40), nullable=True)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    bytes_done: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_error: Mapped[str] = mapped_column(Text, nullable=False, default="")
    verified_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    verified_size: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    verified_mtime_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class WeightsControl(Base):
    """The operator's wish for the weights (one row): which set is active, and which job
    (pull, verify, import) should be running, so a restarted daemon carries on by itself."""

    __tablename__ = "weights_control"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    active_set_id: Mapped[int | None] = mapped_column(
        ForeignKey("weights_sets.id", ondelete="SET NULL"), nullable=True)
    job: Mapped[str] = mapped_column(String(16), nullable=False, default="")
    job_args: Mapped[str] = mapped_column(Text, nullable=False, default="{}")
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    updated_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class TuningProfile(Base):
    """A custom workload profile (the built-ins live in code, `appliance.tuning.profiles`).
    `lengths_json` is a `LengthDistribution.to_json()` document."""

    __tablename__ = "tuning_profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    title: Mapped[str] = mapped_column(String(128), nullable=False)
    description: Mapped[str] = mapped_column(Text, nullable=False, default="")
    lengths_json: Mapped[str] = mapped_column(Text, nullable=False)
    target_concurrency: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    updated_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")


class TuningChoice(Base):
    """The applied memory split (one row): the profile it came from, the ratio and the optional
    `--max-mamba-cache-size` pin the engine's launch spec uses, and who applied it."""

    __tablename__ = "tuning_choice"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    profile: Mapped[str] = mapped_column(String(64), nullable=False)
    ratio: Mapped[float] = mapped_column(Float, nullable=False)
    pin: Mapped[int | None] = mapped_column(Integer, nullable=True)
    applied_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    applied_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    spec_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)


class EngineStatusRow(Base):
    """The engine's state as the control plane last published it (one row), for the gateway,
    which runs in a process of its own: READY/DEGRADED admit requests; anything else is a 503
    carrying `message` and `eta_seconds`. `max_running_requests` and `context_len` come from
    the engine's /server_info once it is ready (None before)."""

    __tablename__ = "engine_status"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(32), nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False, default="")
    eta_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    # While a qualification runs (appliance.qualify): the gateway refuses users (503) until
    # this instant. A lease the daemon renews, so a daemon that dies leaves it to lapse.
    qualifying_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # When the running qualification is expected to end (what the gateway's 503 says).
    qualifying_ends_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The launch spec of the engine followed (the gateway finds its qualification by it).
    spec_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)


class GatewayKey(Base):
    """An API key of the gateway: the box's users' credential. Only an HMAC of the key (keyed
    with the server secret) and an 8-character prefix are stored. `changed_at` moves on every
    edit (revoke, limits), which is how the gateway notices a change within its poll."""

    __tablename__ = "gateway_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    owner: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    prefix: Mapped[str] = mapped_column(String(8), unique=True, nullable=False)
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    changed_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    max_concurrency: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    service_class: Mapped[str] = mapped_column(String(32), nullable=False,
                                               default="interactive",
                                               server_default="interactive")


class UsageRequest(Base):
    """One request the gateway answered (forwarded or refused). Kept for
    `gateway.usage_retention_days`; the roll-ups below keep the sums for good."""

    __tablename__ = "usage_requests"
    __table_args__ = (Index("ix_usage_requests_started_at", "started_at"),
                      Index("ix_usage_requests_key_started", "key_id", "started_at"))

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    key_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    model: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    endpoint: Mapped[str] = mapped_column(String(32), nullable=False)
    stream: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    status: Mapped[int] = mapped_column(Integer, nullable=False)
    outcome: Mapped[str] = mapped_column(String(32), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    ended_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    queue_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    duration_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    history: Mapped[str] = mapped_column(String(16), nullable=False, default="")
    # the key's service class and what the request got of its promise (appliance.gateway.slo)
    service_class: Mapped[str] = mapped_column(String(32), nullable=False, default="",
                                               server_default=text("''"))
    slo: Mapped[str] = mapped_column(String(16), nullable=False, default="",
                                     server_default=text("''"))


def _count() -> Mapped[int]:
    return mapped_column(Integer, nullable=False, default=0, server_default=text("0"))


class _UsageRollup:
    """Columns shared by the hourly and daily roll-ups: sums over one key, model and service
    class (the key's class when it was served: "" before routing, and for every request
    rolled up before migration 0016 whose per-request row was gone by then).

    The `slo_*` counts are what the class's requests got of its promise
    (`appliance.gateway.slo.RESULTS`); the `refused_*` ones split `slo_refused` by the
    gateway's reason (`appliance.gateway.usage.REFUSAL_COLUMNS`). They let the per-class
    counts outlive `gateway.usage_retention_days`."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_id: Mapped[int] = mapped_column(Integer, nullable=False)  # 0: no key (refused)
    model: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    service_class: Mapped[str] = mapped_column(String(32), nullable=False, default="",
                                               server_default=text("''"))
    requests: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    errors: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    duration_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    ttft_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    ttft_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    appended: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    rewritten: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    slo_met: Mapped[int] = _count()
    slo_refused: Mapped[int] = _count()
    slo_missed_ttft: Mapped[int] = _count()
    slo_missed_decode: Mapped[int] = _count()
    refused_predicted_miss: Mapped[int] = _count()
    refused_queue_full: Mapped[int] = _count()
    refused_queue_timeout: Mapped[int] = _count()


ROLLUP_GRAIN = ("bucket", "key_id", "model", "service_class")  # one roll-up row each


class UsageHourly(_UsageRollup, Base):
    __tablename__ = "usage_hourly"
    __table_args__ = (UniqueConstraint(*ROLLUP_GRAIN, name="uq_usage_hourly"),)

    bucket: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False, index=True)


class UsageDaily(_UsageRollup, Base):
    __tablename__ = "usage_daily"
    __table_args__ = (UniqueConstraint(*ROLLUP_GRAIN, name="uq_usage_daily"),)

    bucket: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False, index=True)


class Qualification(Base):
    """One qualification of the box (`appliance.qualify`): the launch spec it ran on (its
    hash), what it ran with, every step measured (JSON, `verdict.Step.to_dict`) and the
    verdict. `state`: running, done, cancelled, failed or interrupted (a daemon restart)."""

    __tablename__ = "qualifications"
    __table_args__ = (Index("ix_qualifications_spec", "spec_hash", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    engine_version: Mapped[str] = mapped_column(String(64), nullable=False, default="")
    tuning: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    settings_json: Mapped[str] = mapped_column(Text, nullable=False)
    steps_json: Mapped[str] = mapped_column(Text, nullable=False, default="[]")
    qualified: Mapped[int | None] = mapped_column(Integer, nullable=True)
    verdict: Mapped[str] = mapped_column(Text, nullable=False, default="")
    error: Mapped[str] = mapped_column(Text, nullable=False, default="")
