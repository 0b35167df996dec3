"""What the Health page shows, and what it shares with the dashboard's part
(`appliance.health.dashboard_views`), computed from frozen values. Pure.

The console's adapters (`appliance.ui.pages`, `appliance.ui.health`) read the monitor's
latest `HealthSnapshot`, the mutes, the recorded transitions and the last hour of samples
(`appliance.health.history`), and hand them here; templates only lay the results out.

Invariants:
- a check's `muted` says whether a mute is in force at `now`; a muted check keeps its level
  on every row but never counts in the overall status (as `HealthSnapshot.overall`);
- every figure is a ready-made text: a dash when unknown, never "None" or a zero invented.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from appliance.health.history import MuteView, TransitionView
from appliance.health.model import GROUPS, HealthSnapshot, Level
from appliance.sizes import gib_text

GROUP_TITLES = {"gpu": "GPUs", "engine": "Engine", "host": "Host", "weights": "Weights"}
DASH = "—"


# --- formatting -----------------------------------------------------------------------------


def number(value: float | None, unit: str = "", digits: int = 0) -> str:
    """1234.5 -> "1,235 unit"; a dash when unknown."""
    if value is None:
        return DASH
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}" if unit else text


def share(value: float | None) -> str:
    """A 0..1 fraction as a percentage: 0.423 -> "42.3 %"."""
    return DASH if value is None else f"{value * 100:.1f} %"


def seconds(value: float | None) -> str:
    """0.35 -> "350 ms", 2.5 -> "2.50 s"."""
    if value is None:
        return DASH
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def gib(value: int | None) -> str:
    return DASH if value is None else gib_text(value)


# --- checks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckRow:
    """One check as a row: its verdict, whether it is muted (and how), since when it has
    had this level (None: no change recorded) and its recent changes, newest first."""

    id: str
    group: str
    title: str
    level: Level
    summary: str
    hint: str
    mute: MuteView | None
    since: dt.datetime | None
    changes: tuple[TransitionView, ...] = ()
    judged: bool = True  # False: not checked this time (an engine check while it loads)

    @property
    def muted(self) -> bool:
        return self.mute is not None

    @property
    def shown(self) -> str:
        """The state a person sees: ok, warn, critical, or "not checked" (grey, never a green
        OK: a check that did not run proves nothing)."""
        return "unchecked" if not self.judged and self.level is Level.OK else self.level.label

    @property
    def shown_label(self) -> str:
        return "NOT CHECKED" if self.shown == "unchecked" else self.level.label.upper()

    @property
    def counts(self) -> bool:
        """Whether it counts in the overall status (failing and not muted)."""
        return self.level is not Level.OK and not self.muted


@dataclass(frozen=True)
class Overall:
    level: Level
    checked_at: dt.datetime | None
    failing: tuple[CheckRow, ...]  # counted (unmuted) failures, worst first
    muted: int  # checks muted now
    total: int
    unchecked: int = 0  # checks that did not run this time (shown grey, not as passing)

    @property
    def passing(self) -> int:
        return self.total - len(self.failing) - self.muted - self.unchecked


def active_mutes(mutes: Iterable[MuteView], now: dt.datetime) -> dict[str, MuteView]:
    return {m.check_id: m for m in mutes if m.active(now)}


def check_rows(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView],
               changes: Sequence[TransitionView] = ()) -> list[CheckRow]:
    """Every check of the snapshot, in its order. `changes` are newest first (as
    `history.transitions` returns them); a check's `since` is its newest change."""
    by_check: dict[str, list[TransitionView]] = {}
    for change in changes:
        by_check.setdefault(change.check_id, []).append(change)
    rows = []
    for r in snapshot.results:
        own = by_check.get(r.id, [])
        since = own[0].at if own and own[0].level is r.level else None
        rows.append(CheckRow(r.id, r.group, r.title, r.level, r.summary, r.hint,
                             mutes.get(r.id), since, tuple(own), r.judged))
    return rows


def overall(snapshot: HealthSnapshot, rows: Sequence[CheckRow]) -> Overall:
    failing = sorted((row for row in rows if row.counts), key=lambda row: -row.level)
    level = max((row.level for row in failing), default=Level.OK)
    unchecked = sum(row.shown == "unchecked" and not row.muted for row in rows)
    return Overall(level, snapshot.at, tuple(failing), sum(row.muted for row in rows),
                   len(rows), unchecked)


@dataclass(frozen=True)
class Group:
    name: str
    title: str
    rows: tuple[CheckRow, ...]

    @property
    def level(self) -> Level:
        return max((row.level for row in self.rows if not row.muted), default=Level.OK)

    @property
    def attention(self) -> tuple[CheckRow, ...]:
        """Failing or muted rows, worst first (shown open); the others pass (folded)."""
        return tuple(sorted((r for r in self.rows if r.level is not Level.OK or r.muted),
                            key=lambda r: -r.level))

    @property
    def passing(self) -> tuple[CheckRow, ...]:
        """Passing and not-checked rows, folded: the passing ones first."""
        rest = [r for r in self.rows if r.level is Level.OK and not r.muted]
        return tuple(sorted(rest, key=lambda r: r.shown == "unchecked"))

    @property
    def unchecked(self) -> int:
        return sum(r.shown == "unchecked" for r in self.passing)


def groups(rows: Sequence[CheckRow]) -> list[Group]:
    return [Group(g, GROUP_TITLES[g], tuple(r for r in rows if r.group == g)) for g in GROUPS]


# --- the Health page ----------------------------------------------------------------------


@dataclass(frozen=True)
class HealthPage:
    overall: Overall
    groups: tuple[Group, ...]
    recent: tuple[TransitionView, ...]  # newest first, any check
    titles: Mapping[str, str]  # check id -> title, for the recent changes


def health_page(snapshot: HealthSnapshot, mutes: Mapping[str, MuteView],
                changes: Sequence[TransitionView], recent: int = 50) -> HealthPage:
    rows = check_rows(snapshot, mutes, changes)
    titles = {t.check_id: t.title for t in changes} | {r.id: r.title for r in rows}
    return HealthPage(overall(snapshot, rows), tuple(groups(rows)), tuple(changes[:recent]),
                      titles)
