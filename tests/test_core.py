"""Small pure pieces: sd_notify datagrams, the scheduler's defaults, the Host parser,
the login throttle on a fake clock, the instance lock."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from appliance.auth.throttle import LoginThrottle
from appliance.errors import AlreadyRunning
from appliance.hostguard import host_name
from appliance.lock import InstanceLock
from appliance.runtime import new_scheduler
from appliance.sdnotify import child_environment, notify, watchdog_interval
from appliance.testing.clock import FakeClock


def test_notify_is_a_no_op_without_systemd() -> None:
    assert notify("READY=1", env={}) is False


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_reaches_path_and_abstract_sockets(tmp_path: Path, abstract: bool) -> None:
    name = f"@appliance-test-{os.getpid()}" if abstract else str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name[1:] if abstract else name)
        assert notify("READY=1\nSTATUS=hi", env={"NOTIFY_SOCKET": name}) is True
        assert sock.recv(100) == b"READY=1\nSTATUS=hi"


def test_watchdog_interval_is_half_the_period_and_respects_the_pid() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_children_never_inherit_the_notify_socket() -> None:
    env = child_environment({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_scheduler_jobs_coalesce_and_tolerate_slow_ticks() -> None:
    scheduler = new_scheduler()
    defaults = scheduler._job_defaults  # APScheduler 3 keeps them here
    assert defaults["coalesce"] is True
    assert defaults["max_instances"] == 1
    assert defaults["misfire_grace_time"] is None


def test_clock_stepped_forward_runs_a_late_job_once_without_a_missed_event() -> None:
    """Fault 20: a job whose time passed long ago (as after a forward clock step, or a
    suspended box) runs exactly once, coalesced, and is not reported as missed."""
    import asyncio
    import datetime as dt

    from apscheduler.events import EVENT_JOB_MISSED

    async def scenario() -> tuple[int, int]:
        runs: list[int] = []
        missed: list[object] = []
        scheduler = new_scheduler()
        scheduler.add_listener(missed.append, EVENT_JOB_MISSED)
        late = dt.datetime.now(dt.UTC) - dt.timedelta(hours=3, seconds=150)  # between ticks
        scheduler.add_job(lambda: runs.append(1), "interval", minutes=5, id="late",
                          next_run_time=late)
        scheduler.start()
        for _ in range(100):
            if runs:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        scheduler.shutdown(wait=False)
        return len(runs), len(missed)

    assert asyncio.run(scenario()) == (1, 0)


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8080", "localhost"), ("[::1]:8080", "::1"), ("::1", "::1"),
    ("Box.Example", "box.example"), ("10.0.0.5", "10.0.0.5"), ("", ""),
])
def test_host_name_strips_ports(header: str, name: str) -> None:
    assert host_name(header) == name


def test_throttle_counts_per_user_and_address_on_the_monotonic_clock() -> None:
    clock = FakeClock()
    throttle = LoginThrottle(clock, max_failures=3, window=60)
    for _ in range(3):
        throttle.failed("Alice", "10.0.0.1")
    assert throttle.retry_after("alice", "10.0.0.1") == 60
    assert throttle.retry_after("alice", "10.0.0.2") == 0
    assert throttle.retry_after("bob", "10.0.0.1") == 0
    clock.jump_wall(-86400)
    clock.advance(30)
    assert throttle.retry_after("alice", "10.0.0.1") == 30
    clock.advance(30)
    assert throttle.retry_after("alice", "10.0.0.1") == 0


def test_throttle_memory_is_bounded() -> None:
    from appliance.auth import throttle as module

    clock = FakeClock()
    limiter = LoginThrottle(clock)
    for i in range(module.MAX_TRACKED + 50):
        limiter.failed(f"user{i}", "10.0.0.1")
    assert len(limiter._failures) <= module.MAX_TRACKED


def test_instance_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path)
    first.acquire()
    with pytest.raises(AlreadyRunning) as caught:
        InstanceLock(tmp_path).acquire()
    assert f"pid {os.getpid()}" in caught.value.message
    first.release()
    second = InstanceLock(tmp_path)
    second.acquire()
    second.release()
