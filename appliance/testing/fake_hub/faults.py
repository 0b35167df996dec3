"""Faults the fake Hub injects on demand: parsing the specs, and the counters that expire them.

Part of a test and demo instrument (`appliance.testing.fake_hub`), not production code. The
spec grammar is documented in the package docstring; `FORMS` is the one table it comes from.

Invariants: a spec that does not parse raises `FaultSpecError` (a `ValueError` naming the spec
and its expected form) and leaves the active set untouched, so a test never runs silently
without the fault it asked for. A counted fault is consumed under a lock by the request it
applies to, so COUNT concurrent GETs get exactly COUNT faults; at zero it leaves the set.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

# The expected form of every spec; the number of required and optional fields is read off it.
FORMS = {
    "stall": "stall:FILE:AFTER_BYTES[:SECONDS[:COUNT]]",
    "close": "close:FILE:AFTER_BYTES[:COUNT]",
    "reset": "reset:FILE:AFTER_BYTES[:COUNT]",
    "corrupt": "corrupt:FILE[:COUNT]",
    "trickle": "trickle:FILE:BYTES_PER_SEC[:AFTER_BYTES[:COUNT]]",
    "5xx": "5xx:COUNT[:STATUS[:RETRY_AFTER]]",
    "429": "429:COUNT[:RETRY_AFTER]",
    "redirect": "redirect",
    "rate": "rate:BYTES_PER_SEC",
    "hang-api": "hang-api",
    "no-range": "no-range",
}
DEFAULT_STALL_SECONDS = 3600.0
ANY_LFS_FILE = "*"
_BYTES = re.compile(r"(\d+)(k|K|KiB|M|MiB|G|GiB)?")
_SCALE = {None: 1, "k": 1 << 10, "K": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "MiB": 1 << 20,
          "G": 1 << 30, "GiB": 1 << 30}

CutKind = Literal["stall", "close", "reset"]
SwitchKind = Literal["redirect", "hang-api", "no-range"]


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the spec and the expected form."""


@dataclass(frozen=True)
class Cut:
    """Stop the body after `after` bytes: stall (silence for `seconds`, then close), close
    (a clean FIN: the client sees a short body) or reset (a TCP RST)."""

    text: str
    kind: CutKind
    file: str
    after: int
    seconds: float
    count: int


@dataclass(frozen=True)
class Corrupt:
    text: str
    file: str
    count: int


@dataclass(frozen=True)
class Trickle:
    text: str
    file: str
    rate: float
    after: int
    count: int


@dataclass(frozen=True)
class StatusFault:
    text: str
    status: int
    retry_after: str | None
    count: int


@dataclass(frozen=True)
class Rate:
    text: str
    rate: float


@dataclass(frozen=True)
class Switch:
    text: str
    kind: SwitchKind


Fault = Cut | Corrupt | Trickle | StatusFault | Rate | Switch
Counted = Cut | Corrupt | Trickle | StatusFault


@dataclass(frozen=True)
class BodyPlan:
    """What to do to one response body. `plain` means none of it: send at full speed."""

    cut: Cut | None = None
    corrupt: bool = False
    trickle: Trickle | None = None
    rate: float | None = None

    @property
    def plain(self) -> bool:
        return self.cut is None and not self.corrupt and self.trickle is None \
            and self.rate is None


def parse_fault(text: str) -> Fault:
    """One spec (see `FORMS`) as a value; raises `FaultSpecError`."""
    kind, *args = text.strip().split(":")
    form = FORMS.get(kind)
    if form is None:
        raise FaultSpecError(f"unknown fault spec {text!r}: expected one of "
                             + ", ".join(FORMS.values()))
    required = form.split("[")[0].count(":")
    if not required <= len(args) <= form.count(":"):
        raise FaultSpecError(f"bad fault spec {text!r}: expected {form}")
    field = _Fields(text, form, args)
    if kind in ("stall", "close", "reset"):
        cut: CutKind = kind  # type: ignore[assignment]  # narrowed by the membership test
        seconds = field.seconds(2, DEFAULT_STALL_SECONDS) if kind == "stall" else 0.0
        count = field.count(3 if kind == "stall" else 2)
        return Cut(text, cut, field.file(0), field.size(1, None), seconds, count)
    if kind == "corrupt":
        return Corrupt(text, field.file(0), field.count(1))
    if kind == "trickle":
        return Trickle(text, field.file(0), field.rate(1), field.size(2, 0), field.count(3))
    if kind == "5xx":
        status = field.integer(1, 503)
        if not 500 <= status <= 599:
            raise FaultSpecError(f"bad fault spec {text!r}: STATUS must be 500..599; "
                                 f"expected {form}")
        return StatusFault(text, status, field.retry_after(2), field.count(0))
    if kind == "429":
        return StatusFault(text, 429, field.retry_after(1), field.count(0))
    if kind == "rate":
        return Rate(text, field.rate(0))
    switch: SwitchKind = kind  # type: ignore[assignment]  # the remaining FORMS keys
    return Switch(text, switch)


class _Fields:
    """The colon-separated fields after the kind, each parsed with a clear error."""

    def __init__(self, text: str, form: str, args: list[str]) -> None:
        self.text, self.form, self.args = text, form, args

    def _fail(self, why: str) -> FaultSpecError:
        return FaultSpecError(f"bad fault spec {self.text!r}: {why}; expected {self.form}")

    def _get(self, index: int) -> str | None:
        return self.args[index] if index < len(self.args) and self.args[index] != "" else None

    def file(self, index: int) -> str:
        value = self._get(index)
        if value is None:
            raise self._fail("FILE is empty (a repo-relative path, or * for any LFS file)")
        return value

    def size(self, index: int, default: int | None) -> int:
        value = self._get(index)
        if value is None:
            if default is None:
                raise self._fail("a byte count is missing")
            return default
        match = _BYTES.fullmatch(value)
        if match is None:
            raise self._fail(f"{value!r} is not a byte count (e.g. 1048576 or 1MiB)")
        return int(match[1]) * _SCALE[match[2]]

    def rate(self, index: int) -> float:
        rate = self.size(index, None)
        if rate <= 0:
            raise self._fail("BYTES_PER_SEC must be positive")
        return float(rate)

    def integer(self, index: int, default: int) -> int:
        value = self._get(index)
        if value is None:
            return default
        if not value.isdigit():
            raise self._fail(f"{value!r} is not a whole number")
        return int(value)

    def count(self, index: int) -> int:
        count = self.integer(index, 1)
        if count < 1:
            raise self._fail("COUNT must be at least 1")
        return count

    def seconds(self, index: int, default: float) -> float:
        value = self._get(index)
        if value is None:
            return default
        try:
            seconds = float(value)
        except ValueError:
            raise self._fail(f"{value!r} is not a number of seconds") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise self._fail("SECONDS must be a non-negative number")
        return seconds

    def retry_after(self, index: int) -> str | None:
        value = self._get(index)
        if value is not None and not value.isdigit():
            raise self._fail(f"RETRY_AFTER {value!r} is not a whole number of seconds")
        return value


def _matches(fault: Cut | Corrupt | Trickle, path: str, lfs: bool) -> bool:
    return fault.file == path or (fault.file == ANY_LFS_FILE and lfs)


class FaultSet:
    """The active faults of one fake Hub, shared by its request threads."""

    def __init__(self, specs: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._active: list[tuple[Fault, list[int]]] = []
        self.replace(specs)

    def replace(self, specs: Iterable[str]) -> None:
        """Parse every spec first, then swap the whole set (all or nothing)."""
        parsed = [parse_fault(spec) for spec in specs]
        with self._lock:
            self._active = [(f, [f.count] if isinstance(f, Counted) else []) for f in parsed]

    def clear(self) -> None:
        self.replace(())

    def describe(self) -> list[dict[str, Any]]:
        """The active faults as `{"spec", "remaining"}` (remaining is None for switches)."""
        with self._lock:
            return [{"spec": f.text, "remaining": left[0] if left else None}
                    for f, left in self._active]

    def switch(self, kind: SwitchKind) -> bool:
        with self._lock:
            return any(isinstance(f, Switch) and f.kind == kind for f, _ in self._active)

    def take_status(self) -> StatusFault | None:
        """Consume one count of the first 5xx/429 fault, if any."""
        with self._lock:
            for fault, left in self._active:
                if isinstance(fault, StatusFault):
                    self._consume(fault, left)
                    return fault
        return None

    def take_body(self, path: str, lfs: bool) -> BodyPlan:
        """Consume what applies to one GET of `path`'s body: the first matching cut, corrupt
        and trickle fault (one count each), plus the global rate if set."""
        cut: Cut | None = None
        corrupt: Corrupt | None = None
        trickle: Trickle | None = None
        rate: float | None = None
        with self._lock:
            for fault, left in list(self._active):
                if isinstance(fault, Rate):
                    rate = fault.rate if rate is None else min(rate, fault.rate)
                elif isinstance(fault, Cut) and cut is None and _matches(fault, path, lfs):
                    cut = fault
                    self._consume(fault, left)
                elif isinstance(fault, Corrupt) and corrupt is None \
                        and _matches(fault, path, lfs):
                    corrupt = fault
                    self._consume(fault, left)
                elif isinstance(fault, Trickle) and trickle is None \
                        and _matches(fault, path, lfs):
                    trickle = fault
                    self._consume(fault, left)
        return BodyPlan(cut, corrupt is not None, trickle, rate)

    def _consume(self, fault: Fault, left: list[int]) -> None:
        left[0] -= 1
        if left[0] <= 0:
            self._active = [(f, n) for f, n in self._active if f is not fault]
