"""Critical Xid errors from NVML's event API, kept for an hour per GPU.

NVML reports an Xid only to an event set registered before it happened, and only once: a
poll that missed it never sees it again. `XidWatch` registers every GPU when NVML is
initialised and drains whatever arrived at each snapshot, without waiting (timeout 0), then
reports each GPU's events of the last `XID_WINDOW`, so a check run every few seconds still
sees an Xid for a while instead of for one poll only.

Events are matched to GPUs by handle, not by asking the event's device for its UUID: the
most important one, Xid 79, comes from a GPU that no longer answers such questions.

Called with NvmlGpus' binding from the snapshot thread; like the rest of NVML it may block
on a sick GPU, which `snapshot_with_timeout` guards against.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import logging
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from appliance.clock import Clock
from appliance.gpu.nvml_telemetry import text
from appliance.gpu.port import XidEvent

log = logging.getLogger(__name__)

XID_WINDOW = dt.timedelta(hours=1)
XID_CRITICAL_EVENT = 0x8  # nvmlEventTypeXidCriticalError (nvml.h)
_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: nothing (more) to read
_MAX_DRAIN = 256  # events read per snapshot; an Xid storm must not stall the poll
_MAX_KEPT = 100  # per GPU


def handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer, or whatever a
    stand-in binding uses)."""
    if isinstance(handle, int):
        return handle
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


class XidWatch:
    """One NVML event set for critical Xids on every GPU that supports it."""

    def __init__(self, clock: Clock, window: dt.timedelta = XID_WINDOW) -> None:
        self._clock = clock
        self._window = window.total_seconds()
        self._lock = threading.Lock()
        self._set: Any = None
        self._uuid_of: dict[Any, str] = {}  # handle_key -> uuid, for watched GPUs
        self._events: dict[str, deque[tuple[float, XidEvent]]] = {}

    def start(self, nv: Any, count: int) -> None:
        """Register every GPU that supports Xid events. A GPU (or a driver) that refuses is
        simply not watched: its `xid_events` reads None. Never raises for NVML's sake."""
        with self._lock:
            self._uuid_of.clear()
            try:
                self._set = nv.nvmlEventSetCreate()
            except Exception as exc:  # NVML's refusal, or a binding without events
                log.warning("Xid events are not watched: NVML refused an event set (%s)", exc)
                self._set = None
                return
            for index in range(count):
                try:
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    uuid = text(nv.nvmlDeviceGetUUID(handle))
                    if not nv.nvmlDeviceGetSupportedEventTypes(handle) & XID_CRITICAL_EVENT:
                        continue
                    nv.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_EVENT, self._set)
                except Exception as exc:  # a lost GPU, no permission, an old binding
                    log.warning("Xid events on GPU %d are not watched (%s)", index, exc)
                    continue
                self._uuid_of[handle_key(handle)] = uuid
                self._events.setdefault(uuid, deque(maxlen=_MAX_KEPT))

    def collect(self, nv: Any) -> Mapping[str, tuple[XidEvent, ...]]:
        """uuid -> its Xids of the last window, oldest first, for every watched GPU."""
        with self._lock:
            if self._set is not None:
                self._drain(nv)
            cutoff = self._clock.monotonic() - self._window
            recent = {}
            for uuid in self._uuid_of.values():
                kept = self._events[uuid]
                while kept and kept[0][0] < cutoff:
                    kept.popleft()
                recent[uuid] = tuple(event for _, event in kept)
            return recent

    def _drain(self, nv: Any) -> None:
        for _ in range(_MAX_DRAIN):
            try:
                data = nv.nvmlEventSetWait_v2(self._set, 0)
            except nv.NVMLError as exc:
                if exc.value != _TIMEOUT:
                    log.warning("Xid events are no longer watched: NVML's event set failed "
                                "(%s)", exc)
                    self._set = None  # unusable; Xids go unwatched until NVML is reopened
                    self._uuid_of.clear()
                return
            if not int(data.eventType) & XID_CRITICAL_EVENT:
                continue
            uuid = self._uuid_of.get(handle_key(data.device))
            if uuid is not None:
                self._events[uuid].append((self._clock.monotonic(), XidEvent(
                    xid=int(data.eventData), at=self._clock.now())))

    def close(self, nv: Any) -> None:
        with self._lock:
            if self._set is not None:
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlEventSetFree(self._set)
            self._set = None
            self._uuid_of.clear()
