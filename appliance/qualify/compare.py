"""A tuning change judged by measurement (issue 15, "tuning with evidence"): the running
spec's qualified point beside the one before it, as the Tuning page shows them after an apply
("ratio 0.9: 16 at 32 tok/s → ratio 2.2: 22 at 32 tok/s"), and beside the tuning
calculator's predicted concurrency. Pure over ledger records.

"Before" is the newest qualification that found a point for another spec, older than the
running spec's own: the split (or engine) the box ran before the change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.qualify.ledger import Record

RATIO_RE = re.compile(r"--mamba-full-memory-ratio (\S+)")
PIN_RE = re.compile(r"pinned at (\d+) slots")


def split_label(tuning: str) -> str:
    """The split a qualification ran with, short: "ratio 0.9", "pinned 120 slots", or
    "defaults" (from the ledger's `tuning` words)."""
    if found := PIN_RE.search(tuning):
        return f"pinned {found.group(1)} slots"
    if found := RATIO_RE.search(tuning):
        return f"ratio {found.group(1)}"
    return "defaults"


def point_words(record: Record) -> str:
    return (f"{split_label(record.tuning)}: {record.qualified} at "
            f"{record.settings.floor:g} tok/s")


@dataclass(frozen=True)
class Measured:
    """The running spec's qualification (None: unqualified) and the previous spec's."""

    current: Record | None
    before: Record | None

    @property
    def change(self) -> str:
        """"before → now" once both exist, else ""."""
        if self.current is None or self.before is None:
            return ""
        return f"{point_words(self.before)} → {point_words(self.current)}"


def measured(records: Sequence[Record], running_spec: str | None) -> Measured:
    """From the ledger's newest records first (`ledger.list_qualifications`)."""
    qualified = [r for r in records if r.state == "done" and r.qualified is not None]
    current = next((r for r in qualified if r.spec_hash == running_spec), None)
    if current is None:
        return Measured(None, None)
    before = next((r for r in qualified if r.spec_hash != running_spec and r.id < current.id),
                  None)
    return Measured(current, before)
