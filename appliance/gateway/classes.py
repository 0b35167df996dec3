"""Service classes: what the gateway promises each kind of user (issue 24). Pure.

A class is an operator's promise and its price: `interactive` people at a chat window get a
time-to-first-token SLO and the decode floor, and are refused at once rather than kept
waiting past it; `batch` work may wait up to its deadline and may be preempted. Each class has
a share of the admitted slots (the most of them it may hold at once) and a priority (an int,
larger first, the value SGLang's per-request `priority` takes once the engine runs with
priority scheduling). Every API key belongs to one class, `interactive` by default.

Invariants: `interactive` always exists; every share is in (0, 1]; the shares of the other
classes add up to less than 1, so some slots always remain for interactive work. Unconfigured,
the classes promise nothing new: interactive has no TTFT SLO (it waits up to
`gateway.queue_wait_seconds`, as before classes) and may take every slot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

INTERACTIVE = "interactive"
BATCH = "batch"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
FIELDS = ("ttft_slo_seconds", "decode_floor_tps", "deadline_seconds", "share", "priority",
          "preemptible")
DOC = "docs/configuration.md, Service classes"


class ClassProblem(ValueError):
    """A configuration problem: the dotted key, what was found, what is expected."""

    def __init__(self, key: str, found: str, expected: str) -> None:
        super().__init__(f"{key}: {found}; expected {expected}")
        self.key, self.found, self.expected = key, found, expected


@dataclass(frozen=True)
class ServiceClass:
    """One class. `ttft_slo_seconds`: the first token's promise (None: none, no early
    refusal); `decode_floor_tps`: each stream's speed promise (None: none); `deadline_seconds`:
    how long a request may wait for a slot (None: its TTFT SLO, else the gateway's
    queue_wait_seconds)."""

    name: str
    ttft_slo_seconds: float | None = None
    decode_floor_tps: float | None = None
    deadline_seconds: float | None = None
    share: float = 1.0
    priority: int = 0
    preemptible: bool = False

    def slots(self, limit: int) -> int:
        """The admitted slots this class may hold at once under `limit` (at least 1)."""
        return max(1, math.floor(self.share * limit + 1e-9))

    def wait_allowance(self, queue_wait_seconds: float) -> float:
        """The longest a request of this class may wait in the gateway for a slot."""
        if self.deadline_seconds is not None:
            return self.deadline_seconds
        if self.ttft_slo_seconds is not None:
            return min(self.ttft_slo_seconds, queue_wait_seconds)
        return queue_wait_seconds

    def words(self) -> str:
        """The class's promise in the operator's words (the Keys page, the CLI)."""
        parts = []
        if self.ttft_slo_seconds is not None:
            parts.append(f"first token within {self.ttft_slo_seconds:g} s")
        if self.decode_floor_tps is not None:
            parts.append(f"at least {self.decode_floor_tps:g} tokens/s")
        if self.deadline_seconds is not None:
            parts.append(f"may wait up to {self.deadline_seconds:g} s")
        if self.share < 1:
            parts.append(f"at most {self.share:.0%} of the slots")
        if self.preemptible:
            parts.append("preemptible")
        return ", ".join(parts) or "no promise beyond the gateway's queue"


DEFAULT_CLASSES: Mapping[str, ServiceClass] = MappingProxyType({
    INTERACTIVE: ServiceClass(INTERACTIVE, priority=10),
    BATCH: ServiceClass(BATCH, deadline_seconds=600.0, share=0.5, priority=0, preemptible=True),
})


def _number(key: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ClassProblem(key, repr(value), "a positive number")
    return float(value)


def _one(name: str, body: Any, base: ServiceClass | None) -> ServiceClass:
    prefix = f"gateway.classes.{name}"
    if not name or not set(name) <= NAME_CHARS or len(name) > 32:
        raise ClassProblem(prefix, repr(name), "a class name of 1-32 lowercase letters, "
                           f"digits, _ or - ({DOC})")
    if not isinstance(body, Mapping):
        raise ClassProblem(prefix, type(body).__name__, f"a [{prefix}] table ({DOC})")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ClassProblem(f"{prefix}.{unknown[0]}", "an unknown key",
                           "one of " + ", ".join(FIELDS))
    values: dict[str, Any] = {}
    for field in ("ttft_slo_seconds", "decode_floor_tps", "deadline_seconds"):
        if field in body:
            values[field] = _number(f"{prefix}.{field}", body[field])
    if "share" in body:
        share = _number(f"{prefix}.share", body["share"])
        if share > 1:
            raise ClassProblem(f"{prefix}.share", repr(body["share"]),
                               "a fraction of the admitted slots above 0 and at most 1")
        values["share"] = share
    if "priority" in body:
        # SGLang 0.5.23 refuses every request whose priority is outside a signed 64-bit int
        if isinstance(body["priority"], bool) or not isinstance(body["priority"], int) \
                or not -(2**63) <= body["priority"] < 2**63:
            raise ClassProblem(f"{prefix}.priority", repr(body["priority"]),
                               "an integer (larger runs first) within ±9,223,372,036,854,775,807")
        values["priority"] = body["priority"]
    if "preemptible" in body:
        if not isinstance(body["preemptible"], bool):
            raise ClassProblem(f"{prefix}.preemptible", repr(body["preemptible"]),
                               "true or false")
        values["preemptible"] = body["preemptible"]
    start = base or ServiceClass(name)
    return ServiceClass(name, **{f: values.get(f, getattr(start, f)) for f in FIELDS})


def parse_classes(raw: Any) -> Mapping[str, ServiceClass]:
    """The classes from `[gateway.classes.NAME]` tables, over the defaults (a table for
    `interactive` or `batch` changes only the keys it names). Raises ClassProblem."""
    if not isinstance(raw, Mapping):
        raise ClassProblem("gateway.classes", type(raw).__name__,
                           f"[gateway.classes.NAME] tables ({DOC})")
    classes = dict(DEFAULT_CLASSES)
    for name, body in raw.items():
        classes[name] = _one(name, body, DEFAULT_CLASSES.get(name))
    if classes[INTERACTIVE].preemptible:
        raise ClassProblem("gateway.classes.interactive.preemptible", "true",
                           "false: interactive work is the work that is never preempted")
    others = sum(c.share for n, c in classes.items() if n != INTERACTIVE)
    if others >= 1:
        raise ClassProblem(
            "gateway.classes", f"shares of the classes other than interactive adding up to "
            f"{others:g}", f"less than 1, so some slots always remain for interactive work: "
            f"lower a share ({DOC})")
    return MappingProxyType(classes)


def show_classes(classes: Mapping[str, ServiceClass]) -> str:
    """The classes on one line for the Settings page."""
    return "; ".join(f"{c.name}: {c.words()}" for c in effective(classes).values())


def class_of(classes: Mapping[str, ServiceClass], name: str) -> ServiceClass:
    """A key's class; a key naming a class no longer configured is served as interactive."""
    return classes.get(name) or classes[INTERACTIVE]


def effective(configured: Mapping[str, ServiceClass]) -> Mapping[str, ServiceClass]:
    """The classes in force: the built-in ones, with the operator's (already validated by the
    configuration's loader) over them."""
    return MappingProxyType({**DEFAULT_CLASSES, **configured})
