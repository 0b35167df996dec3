"""The health monitor's tables (SQLAlchemy rows on the project's `Base`).

Rows stay inside `appliance.health.history`, which hands out frozen views. The schema is owned
by migration `0007_health`; these classes must match it (`tests/test_migrations.py` compares).
Importing `appliance.runtime` imports this module, so `Base.metadata` holds these tables
wherever a runtime can be built; `migrations/env.py` imports it for Alembic run alone.

- `health_samples`: one row per (at, name, subject) reading at each poll, kept
  `health.history_fine_hours`;
- `health_hourly`: min/avg/max (and count) per (hour, name, subject), kept
  `health.history_hourly_days`; one row per key (unique), so rolling up twice is harmless;
- `health_transitions`: a check's level change (failure, level change, recovery), kept with
  the hourly roll-ups;
- `health_mutes`: at most one mute per check id; an expired one is ignored and pruned.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from appliance.db.models import Base, UTCDateTime


class HealthSampleRow(Base):
    __tablename__ = "health_samples"
    __table_args__ = (Index("ix_health_samples_series", "name", "subject", "at"),
                      Index("ix_health_samples_at", "at"))

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    subject: Mapped[str] = mapped_column(String(32), nullable=False, default="")
    value: Mapped[float] = mapped_column(Float, nullable=False)


class HealthHourlyRow(Base):
    __tablename__ = "health_hourly"
    __table_args__ = (UniqueConstraint("name", "subject", "bucket", name="uq_health_hourly"),
                      Index("ix_health_hourly_bucket", "bucket"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)  # hour start
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    subject: Mapped[str] = mapped_column(String(32), nullable=False, default="")
    count: Mapped[int] = mapped_column(Integer, nullable=False)
    min: Mapped[float] = mapped_column(Float, nullable=False)
    avg: Mapped[float] = mapped_column(Float, nullable=False)
    max: Mapped[float] = mapped_column(Float, nullable=False)


class HealthTransitionRow(Base):
    __tablename__ = "health_transitions"
    __table_args__ = (Index("ix_health_transitions_check", "check_id", "at"),
                      Index("ix_health_transitions_at", "at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    check_id: Mapped[str] = mapped_column(String(128), nullable=False)
    check_group: Mapped[str] = mapped_column(String(16), nullable=False)
    title: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    level: Mapped[str] = mapped_column(String(16), nullable=False)
    previous_level: Mapped[str] = mapped_column(String(16), nullable=False)
    summary: Mapped[str] = mapped_column(Text, nullable=False, default="")
    hint: Mapped[str] = mapped_column(Text, nullable=False, default="")
    muted: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)


class HealthMuteRow(Base):
    __tablename__ = "health_mutes"

    check_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    created_by: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    reason: Mapped[str] = mapped_column(Text, nullable=False, default="")
