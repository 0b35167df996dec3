"""Critical Xid errors from NVML's event API, kept for an hour per GPU.

NVML reports an Xid only to an event set registered before it happened, and only once: a
poll that missed it never sees it again. `XidWatch` keeps one event set with every GPU that
supports Xid events registered, and at each snapshot drains whatever arrived without waiting
(timeout 0), then reports each GPU's events of the last `XID_WINDOW`, so a check run every
few seconds still sees an Xid for a while instead of for one poll only.

The watch mends itself at each read, at most once per read: a set that failed (anything but
"nothing waiting") is freed and built again, and a GPU not registered yet (refused earlier,
or lost for a while) is asked again, so one lost GPU never leaves the others unwatched. A
GPU that does not support Xid events is not asked again until NVML is initialised anew.

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
# `_warned` keys of the event set's own failures (GPUs are keyed by their index).
_CREATE, _WAIT = "create", "wait"


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
    """One NVML event set for critical Xids on every GPU that supports it.

    A GPU is watched while it is registered in the current set; its `xid_events` read None
    otherwise, unless Xids it reported earlier are still within the window (those are real
    and stay reported)."""

    def __init__(self, clock: Clock, window: dt.timedelta = XID_WINDOW) -> None:
        self._clock = clock
        self._window = window.total_seconds()
        self._lock = threading.Lock()
        self._set: Any = None
        self._uuid_of: dict[Any, str] = {}  # handle_key -> uuid, GPUs in the current set
        self._registered: set[int] = set()  # their indexes
        self._unsupported: set[int] = set()  # GPUs without Xid events: not asked again
        self._warned: set[int | str] = set()  # failures logged once until they recover
        self._events: dict[str, deque[tuple[float, XidEvent]]] = {}

    def start(self) -> None:
        """NVML was (re)initialised: forget the previous session's set and registrations
        (its handles are stale; they are dropped, not freed). The next `collect` registers
        the GPUs. Xids already kept stay kept for their window."""
        with self._lock:
            self._set = None
            self._forget_registrations()
            self._unsupported.clear()
            self._warned.clear()

    def collect(self, nv: Any, count: int) -> Mapping[str, tuple[XidEvent, ...]]:
        """uuid -> its Xids of the last window, oldest first, for every watched GPU (and
        any GPU with Xids still in the window). Mends the set first; never raises for
        NVML's sake."""
        with self._lock:
            if self._set is None:
                self._create_set(nv)
            if self._set is not None:
                self._register_missing(nv, count)
                if not self._drain(nv):
                    self._drop_set(nv)  # built again on the next read
            cutoff = self._clock.monotonic() - self._window
            watched = set(self._uuid_of.values())
            recent = {}
            for uuid, kept in self._events.items():
                while kept and kept[0][0] < cutoff:
                    kept.popleft()
                if kept or uuid in watched:
                    recent[uuid] = tuple(event for _, event in kept)
            return recent

    def close(self, nv: Any) -> None:
        with self._lock:
            if self._set is not None:
                self._drop_set(nv)

    def _create_set(self, nv: Any) -> None:
        try:
            self._set = nv.nvmlEventSetCreate()
        except Exception as exc:  # NVML's refusal, or a binding without events
            self._warn_once(_CREATE, "Xid events are not watched: NVML refused an event set "
                            "(%s); asking again at the next poll", exc)
            return
        self._warned.discard(_CREATE)

    def _register_missing(self, nv: Any, count: int) -> None:
        for index in range(count):
            if index in self._registered or index in self._unsupported:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = text(nv.nvmlDeviceGetUUID(handle))
                if not nv.nvmlDeviceGetSupportedEventTypes(handle) & XID_CRITICAL_EVENT:
                    self._unsupported.add(index)
                    continue
                nv.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_EVENT, self._set)
            except Exception as exc:  # a lost GPU, no permission, an old binding
                self._warn_once(index, "Xid events on GPU %d are not watched (%s); asking "
                                "again at the next poll", index, exc)
                continue
            self._warned.discard(index)
            self._registered.add(index)
            self._uuid_of[handle_key(handle)] = uuid
            self._events.setdefault(uuid, deque(maxlen=_MAX_KEPT))

    def _drain(self, nv: Any) -> bool:
        """Read what is waiting; False when the set failed (it is then unusable)."""
        for _ in range(_MAX_DRAIN):
            try:
                data = nv.nvmlEventSetWait_v2(self._set, 0)
            except Exception as exc:  # NVML's error, or a binding without the call
                if isinstance(exc, nv.NVMLError) and exc.value == _TIMEOUT:
                    self._warned.discard(_WAIT)
                    return True
                self._warn_once(_WAIT, "NVML's Xid event set failed (%s); building it again "
                                "at the next poll", exc)
                return False
            if not int(data.eventType) & XID_CRITICAL_EVENT:
                continue
            uuid = self._uuid_of.get(handle_key(data.device))
            if uuid is not None:
                self._events[uuid].append((self._clock.monotonic(), XidEvent(
                    xid=int(data.eventData), at=self._clock.now())))
        self._warned.discard(_WAIT)
        return True

    def _drop_set(self, nv: Any) -> None:
        with contextlib.suppress(Exception):  # a failed set may refuse to be freed too
            nv.nvmlEventSetFree(self._set)
        self._set = None
        self._forget_registrations()

    def _forget_registrations(self) -> None:
        self._uuid_of.clear()
        self._registered.clear()

    def _warn_once(self, key: int | str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
