"""What the console, the API and the CLI show about the weights: frozen values, JSON-ready.

Built by the service from the database (what is proven) and its live counters (rates, the
job in flight), so a hung network call can never freeze the status.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# bytes_text is re-exported: the weights modules (and their tests) import it from here
from appliance.sizes import bytes_text as bytes_text
from appliance.sizes import when_text


class FileState(StrEnum):
    QUEUED = "queued"
    DOWNLOADING = "downloading"
    STALLED = "stalled"
    RETRYING = "retrying"
    VERIFYING = "verifying"
    VERIFIED = "verified"
    FAILED = "failed"
    MISSING = "missing"  # an import found no usable copy and has no source to fetch it from


class Activity(StrEnum):
    IDLE = "idle"
    RESOLVING = "resolving"
    DOWNLOADING = "downloading"
    IMPORTING = "importing"
    VERIFYING = "verifying"
    PREWARMING = "prewarming"
    PAUSED = "paused"   # waiting for something the operator must fix (disk space)
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    """The engine's question answered before a launch: may these weights be used?"""

    verified: bool | None  # None: no manifest recorded for the engine's model
    message: str
    hint: str = ""
    # The weights are on their way (a pull runs and nothing is damaged): the normal first
    # start of a fresh box, which waits for them instead of failing.
    waiting: bool = False


def waiting_text(view: WeightsView) -> str:
    """"waiting for the weights: 3 of 96 files, 2.10 TB to go" — what the dashboard says while
    a pull brings the weights the engine needs."""
    if not view.files:
        return "waiting for the weights: the pull is reading the file list"
    proven = sum(1 for f in view.files if f.state == FileState.VERIFIED.value)
    left = max(0, view.total_bytes - view.done_bytes)
    return (f"waiting for the weights: {proven} of {len(view.files)} file"
            f"{'s' if len(view.files) != 1 else ''} proven, {bytes_text(left)} to go")


def stamp(value: dt.datetime) -> str:
    """A time as every weights message writes it (UTC, to the second: `sizes.when_text`)."""
    return when_text(value)


@dataclass(frozen=True)
class Mismatch:
    """One file a full verification found wrong: what the manifest expects, what is on disk,
    and where the file went (quarantine moves, never deletes)."""

    path: str
    algorithm: str
    expected: str
    found: str          # the digest on disk, or what stood in for it ("missing", a size)
    moved_to: str | None

    def sentence(self) -> str:
        moved = (f"; moved to {self.moved_to}" if self.moved_to else
                 "; nothing to move")
        return (f"{self.path}: expected {self.algorithm} {self.expected}, found "
                f"{self.found}{moved}")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "algorithm": self.algorithm, "expected": self.expected,
                "found": self.found, "moved_to": self.moved_to}


@dataclass(frozen=True)
class VerifyOutcome:
    """The verdict of the last full verification of the active set, in the operator's words.

    `hashed` files were read now; `unchanged` ones were not (same size and mtime as when
    they were last hashed, `unchanged_since` the oldest such hash). Only reading bytes proves
    them, so a run that read nothing never says "match"."""

    at: dt.datetime
    files: int
    hashed: int
    unchanged: int
    unchanged_since: dt.datetime | None
    mismatches: tuple[Mismatch, ...]
    rate_text: str = ""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def summary(self) -> str:
        if self.mismatches:
            names = ", ".join(m.path for m in self.mismatches[:5])
            more = len(self.mismatches) - 5
            return (f"{len(self.mismatches)} of {self.files} files do not match the manifest "
                    f"and were moved out of the engine's way: {names}"
                    + (f" and {more} more" if more > 0 else ""))
        since = (f" on {stamp(self.unchanged_since)}" if self.unchanged_since else "")
        unchanged = (f"{self.unchanged} file{'s' * (self.unchanged != 1)} unchanged since "
                     f"their last full hash{since}")
        if self.hashed == 0:
            return f"{unchanged}; no bytes were read (--rehash reads every file)"
        rate = f" at {self.rate_text}" if self.rate_text else ""
        if self.unchanged == 0:
            return f"all {self.files} files match the manifest ({self.hashed} hashed{rate})"
        return (f"{self.hashed} file{'s' * (self.hashed != 1)} hashed{rate} and match the "
                f"manifest; {unchanged}")

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at.isoformat(), "ok": self.ok, "summary": self.summary,
                "files": self.files, "hashed": self.hashed, "unchanged": self.unchanged,
                "unchanged_since": _iso(self.unchanged_since),
                "mismatches": [m.to_dict() for m in self.mismatches]}


@dataclass(frozen=True)
class LatestCheck:
    """The newest verdict on the set: which kind ran, when, and what it found."""

    kind: str  # "full verification" or "quick check"
    at: dt.datetime
    ok: bool
    summary: str

    def sentence(self) -> str:
        """"full verification at 2026-12-02 03:44:20 UTC: FAILED: …" — one line."""
        return f"{self.kind} at {stamp(self.at)}: {'passed' if self.ok else 'FAILED'}: " \
            f"{self.summary}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "at": self.at.isoformat(), "ok": self.ok,
                "summary": self.summary, "sentence": self.sentence()}


@dataclass(frozen=True)
class FileView:
    path: str
    size: int
    bytes_done: int
    state: str
    rate_bps: float
    eta_seconds: float | None
    attempts: int
    last_error: str
    verified_at: dt.datetime | None

    @property
    def percent(self) -> float:
        return 100.0 if self.size == 0 else min(100.0, 100.0 * self.bytes_done / self.size)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "bytes_done": self.bytes_done,
                "percent": round(self.percent, 2), "state": self.state,
                "rate_bps": round(self.rate_bps), "eta_seconds": _round(self.eta_seconds),
                "attempts": self.attempts, "last_error": self.last_error,
                "verified_at": self.verified_at.isoformat() if self.verified_at else None}


@dataclass(frozen=True)
class WeightsView:
    """The whole picture: the active set (if any), the job in flight, every file."""

    repo_id: str | None
    revision: str | None
    commit: str | None
    source: str | None
    model_dir: str
    activity: str
    message: str
    hint: str
    total_bytes: int
    done_bytes: int
    rate_bps: float
    eta_seconds: float | None
    files: tuple[FileView, ...]
    full_verified_at: dt.datetime | None
    quick_checked_at: dt.datetime | None
    quick_ok: bool | None
    quick_problems: tuple[str, ...]
    ready_for_engine: bool
    job: str = ""                              # the job running now ("" when none)
    verification: VerifyOutcome | None = None  # the last full verification's verdict
    disk_problems: tuple[str, ...] = ()        # files gone or resized since proven
    refetchable: bool = False                  # damaged files a pull can fetch again

    @property
    def percent(self) -> float:
        return 0.0 if not self.total_bytes else min(
            100.0, 100.0 * self.done_bytes / self.total_bytes)

    @property
    def counts(self) -> dict[str, int]:
        counted = {state.value: 0 for state in FileState}
        for item in self.files:
            counted[item.state] = counted.get(item.state, 0) + 1
        return counted

    @property
    def busy(self) -> bool:
        return self.activity not in (Activity.IDLE, Activity.FAILED)

    @property
    def latest_check(self) -> LatestCheck | None:
        """The newest verdict of either kind (full verification or quick check), so a quick
        pass from before never stands for a full verification that found damage since."""
        verification, quick_at = self.verification, self.quick_checked_at
        if verification is not None and (quick_at is None or verification.at >= quick_at):
            return LatestCheck("full verification", verification.at, verification.ok,
                               verification.summary)
        if quick_at is not None and self.quick_ok is not None:
            return LatestCheck("quick check", quick_at, self.quick_ok,
                               "; ".join(self.quick_problems[:3]) if not self.quick_ok else
                               "sizes and headers match the manifest")
        return None

    def to_dict(self, *, files: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
            "source": self.source, "model_dir": self.model_dir, "activity": self.activity,
            "message": self.message, "hint": self.hint, "total_bytes": self.total_bytes,
            "done_bytes": self.done_bytes, "percent": round(self.percent, 2),
            "rate_bps": round(self.rate_bps), "eta_seconds": _round(self.eta_seconds),
            "counts": self.counts,
            "full_verified_at": _iso(self.full_verified_at),
            "quick_checked_at": _iso(self.quick_checked_at), "quick_ok": self.quick_ok,
            "quick_problems": list(self.quick_problems),
            "ready_for_engine": self.ready_for_engine, "job": self.job,
            "verification": self.verification.to_dict() if self.verification else None,
            "disk_problems": list(self.disk_problems), "refetchable": self.refetchable,
            "latest_check": self.latest_check.to_dict() if self.latest_check else None,
        }
        if files:
            body["files"] = [f.to_dict() for f in self.files]
        return body


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
