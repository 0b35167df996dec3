"""The head's memory of each engine's KV layout (appliance.cell.layout), and the three places
that use it: every poll of the watch (an event when the cell's mismatches change), a join (a
member whose layout mismatches is refused and its new credential given back) and an engine
start or restart the head asks of a member (refused while that member mismatches: SGLang
would load for 90 minutes and then refuse every transfer).

Each box reports the layout of the spec its next launch uses (its peer status and its join
answer carry `layout`): the one that matters before a restart, and the running one's unless
its configuration changed since. A member that stops answering keeps its last layout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from appliance.cell import layout
from appliance.cell.local import LocalEngine
from appliance.cell.membership import Member
from appliance.errors import ApplianceError

OWN = "this box (the head)"
FIX = ("set the same flags on the prefill and the decode boxes (engine.extra_args, the tuning "
       "profile)")
Event = Callable[[str, str, dict[str, Any] | None], Awaitable[None]]


def member_name(member: Member) -> str:
    return f"member {member.id} ({member.address})"


class LayoutGuard:
    def __init__(self) -> None:
        self.boxes: dict[str, layout.Box] = {}
        self.mismatches: tuple[layout.Mismatch, ...] = ()
        self._said = ""

    async def poll(self, local: LocalEngine, observed: Sequence[Any], event: Event) -> None:
        """After each read of the members (`observed`: the watch's Observed, with `member`
        and `answer`): keep what each said, compare, and record one event per change."""
        boxes = {OWN: layout.Box(OWN, local.role, local.layout())}
        for seen in observed:
            name = member_name(seen.member)
            answer = seen.answer
            if answer is not None:
                boxes[name] = layout.Box(name, str(answer.get("role") or seen.member.role),
                                         layout.from_json(answer.get("layout")))
            elif name in self.boxes:
                boxes[name] = self.boxes[name]
        self.boxes = boxes
        self.mismatches = layout.cell_mismatches(list(boxes.values()))
        text = layout.summary(self.mismatches)
        if text == self._said:
            return
        self._said = text
        if self.mismatches:
            await event("error", "the cell's prefill and decode engines cannot exchange KV: "
                        f"{text}; {FIX}, then restart the one that differs",
                        {"mismatches": [m.message for m in self.mismatches]})
        else:
            await event("info", "the cell's prefill and decode engines have matching KV "
                        "layouts again", None)

    def joining(self, local: LocalEngine, address: str, role: str,
                reported: Mapping[str, Any] | None) -> tuple[layout.Mismatch, ...]:
        """What a box joining as `role` would mismatch, against the head's own engine now and
        the members as last read (nothing when it reported no layout: a member of an older
        release, compared at the first poll instead)."""
        name = f"the joining box ({address})"
        found = layout.from_json(reported)
        if found is None:
            return ()
        boxes = [*self.boxes.values(), layout.Box(OWN, local.role, local.layout()),
                 layout.Box(name, role, found)]
        known = {b.name: b for b in boxes}  # the head's own, read now, over its last poll's
        return layout.involving(layout.cell_mismatches(list(known.values())), name)

    def check_restart(self, member: Member, action: str) -> None:
        """Raise when the head would start or restart `member`'s engine into a mismatch."""
        if action not in ("start", "restart"):
            return
        found = layout.involving(self.mismatches, member_name(member))
        if found:
            raise ApplianceError(
                "kv_layout_mismatch", f"{member_name(member)} would {action} into a KV layout "
                f"the cell cannot use: {layout.summary(found)}", f"{FIX}, then start it",
                status=409)
