"""The cell's tables (SQLAlchemy rows on the project's `Base`).

Rows stay inside `appliance.cell.tokens` and `appliance.cell.membership`, which hand out frozen
views. The schema is owned by migration `0011_cell`; these classes must match it
(`tests/test_migrations.py` compares). The admin app imports this module (its auth
middleware checks peer credentials), so `Base.metadata` holds these tables wherever the app
can be built; `migrations/env.py` imports it for Alembic run alone.

On a member:
- `cell_join_tokens`: one-time tokens an admin made for a head to join with; only the keyed
  hash is stored; `used_at` set once, when redeemed.
- `cell_peer_credentials`: what a head presents on the member's peer API (scope "cell"); only
  the keyed hash is stored; `revoked_at` set when the member leaves or the head gives it up.

On a head:
- `cell_members`: the members it drives. The credential itself is not here but in a 0600 file
  under `state_dir/secrets/cell/` (a copy of the database alone cannot call a member). What
  the head last saw of each member's engine through the peer API (`engine_url`,
  `bootstrap_port`, `reported_role`, `engine_state`, `capacity`, `seen_at`; migration
  `0013_cell_watch`) is kept too: the router's spec is built from it, so a member that stops
  answering keeps its place in the router (whose health checks take it out) instead of
  forcing a router restart.
- `cell_status`: one row the head's daemon writes for its gateway (appliance.cell.published).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Boolean, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from appliance.db.models import Base, UTCDateTime


class CellJoinTokenRow(Base):
    __tablename__ = "cell_join_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    created_by: Mapped[str] = mapped_column(String(64), nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    used_by: Mapped[str] = mapped_column(String(255), nullable=False, default="")


class CellPeerCredentialRow(Base):
    __tablename__ = "cell_peer_credentials"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    prefix: Mapped[str] = mapped_column(String(16), nullable=False, unique=True)
    credential_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    scope: Mapped[str] = mapped_column(String(16), nullable=False)
    head: Mapped[str] = mapped_column(String(255), nullable=False)  # its address, as it called
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class CellMemberRow(Base):
    __tablename__ = "cell_members"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    address: Mapped[str] = mapped_column(String(255), nullable=False, unique=True)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    verify_tls: Mapped[bool] = mapped_column(Boolean, nullable=False)
    credential_prefix: Mapped[str] = mapped_column(String(16), nullable=False)
    added_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    added_by: Mapped[str] = mapped_column(String(64), nullable=False)
    engine_url: Mapped[str | None] = mapped_column(String(300), nullable=True)
    bootstrap_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reported_role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    engine_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    capacity: Mapped[int | None] = mapped_column(Integer, nullable=True)
    seen_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class CellStatusRow(Base):
    __tablename__ = "cell_status"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    active: Mapped[bool] = mapped_column(Boolean, nullable=False)
    upstream_url: Mapped[str] = mapped_column(String(300), nullable=False)
    serving: Mapped[bool] = mapped_column(Boolean, nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False)
    eta_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    capacity: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
