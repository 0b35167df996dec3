"""The composition root: the only place concrete adapters are chosen.

`build_runtime(config, **overrides)` returns every long-lived object the daemon needs. Tests and
the demo swap adapters by passing them here (a fake clock, another database), never by
patching import paths. Building a runtime opens nothing expensive; `serve` starts what runs.
"""

from __future__ import annotations

import datetime as dt
import socket
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from appliance import __version__
from appliance.auditing import audit
from appliance.auth.sessions import SessionPolicy
from appliance.auth.throttle import LoginThrottle
from appliance.cell.engine_key import EngineKeys, KeyedTransport
from appliance.cell.local import LocalEngine
from appliance.cell.role_choice import stored_role
from appliance.cell.router_metrics import RouterFigures
from appliance.cell.router_runner import ProcessRouterRunner, RouterRunner, SystemdRouterRunner
from appliance.cell.watch import CellWatch
from appliance.clock import Clock, SystemClock
from appliance.config import Config, engine_url
from appliance.db.database import Database
from appliance.engine.client import EngineClient
from appliance.engine.publish import StatusPublisher
from appliance.engine.runner import EngineRunner, ProcessRunner
from appliance.engine.supervisor import Supervisor
from appliance.engine.systemd_runner import UNIT_LOG, SystemdRunner
from appliance.gateway.auth_throttle import AuthFailures
from appliance.gpu.nvml import NvmlGpus
from appliance.gpu.port import GpuPort
from appliance.health.alerts import Alerts
from appliance.health.engine_probe import EngineProbe, EngineWatcher
from appliance.health.host_checks import read_host
from appliance.health.monitor import HealthMonitor
from appliance.qualify.service import QualifyService
from appliance.resources import migrations_dir
from appliance.secrets import server_secret, write_engine_auth
from appliance.tuning.service import TuningService
from appliance.weights.service import WeightsService


@dataclass
class Runtime:
    config: Config
    clock: Clock
    db: Database
    throttle: LoginThrottle
    secret: bytes
    scheduler: AsyncIOScheduler
    migrations: Path
    gpus: GpuPort
    supervisor: Supervisor
    weights: WeightsService
    tuning: TuningService
    publisher: StatusPublisher
    health: HealthMonitor
    qualify: QualifyService
    # The keys this box's engine may run with (a cell head hands its key over: cell/engine_key).
    engine_keys: EngineKeys
    # The cell watch (appliance.cell.watch): on a head, `cell.view` is its latest CellView.
    cell: CellWatch = field(init=False)
    # Failed unauthenticated cell attempts per address (bad join tokens, forged peer
    # credentials): appliance.cell.peer_auth answers 429 past the gateway's failed-key limits.
    cell_attempts: AuthFailures = field(default_factory=AuthFailures)
    version: str = __version__
    started_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    started_monotonic: float = 0.0

    @property
    def session_policy(self) -> SessionPolicy:
        auth = self.config.auth
        return SessionPolicy(
            idle=dt.timedelta(minutes=auth.session_idle_minutes),
            absolute=dt.timedelta(hours=auth.session_max_hours),
        )

    @property
    def state_dir(self) -> Path:
        return self.config.paths.state_dir


def new_scheduler() -> AsyncIOScheduler:
    """APScheduler with defaults that survive restarts and slow ticks.

    One instance per job and missed runs coalesced into one. No misfire deadline: APScheduler 3
    schedules on the wall clock, so a clock stepped forward makes every job look late; with a
    grace time (the default is 1 s) it would skip them and report "missed". Our jobs are
    idempotent housekeeping, so late is always better than skipped.
    """
    return AsyncIOScheduler(
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        timezone=dt.UTC,
    )


def engine_runner(config: Config) -> EngineRunner:
    """The runner the configuration asks for (production: systemd; dev, demo, CI: process)."""
    state_dir = config.paths.state_dir
    if config.engine.runner == "systemd":
        return SystemdRunner(state_dir, UNIT_LOG)
    return ProcessRunner(state_dir)


def router_runner(config: Config) -> RouterRunner:
    """How a cell head runs its router, as the engine runs (systemd unit, or a process)."""
    if config.engine.runner == "systemd":
        return SystemdRouterRunner()
    return ProcessRouterRunner(config.paths.state_dir)


def build_runtime(
    config: Config,
    *,
    clock: Clock | None = None,
    db: Database | None = None,
    migrations: Path | None = None,
    gpus: GpuPort | None = None,
    runner: EngineRunner | None = None,
    engine_poll_seconds: float = 1.0,
    engine_backoff_seconds: float = 30.0,
    weights_transport: httpx.AsyncBaseTransport | None = None,
    engine_transport: httpx.AsyncBaseTransport | None = None,
    webhook_transport: httpx.AsyncBaseTransport | None = None,
    webhook_base_delay: float = 2.0,
    router: RouterRunner | None = None,
    cell_poll_seconds: float = 3.0,
    peer_transport: httpx.AsyncBaseTransport | None = None,
    router_options: dict[str, Any] | None = None,
    router_figures: RouterFigures | None = None,
) -> Runtime:
    clock = clock or SystemClock()
    db = db or Database(config.database_url)
    gpus = gpus or NvmlGpus()
    weights = WeightsService(config, db, clock, transport=weights_transport)
    # The engine's key, and its --config file for the next launch (appliance.secrets).
    # Every request to it carries the key it accepts (KeyedTransport: a handed-over key is
    # used from the engine's next start on, without a daemon restart).
    engine_keys = EngineKeys(config.paths.state_dir, write_engine_auth(config.paths.state_dir))
    supervisor = Supervisor(
        config=config, db=db, clock=clock, runner=runner or engine_runner(config), gpus=gpus,
        client=EngineClient(engine_url(config), transport=KeyedTransport(engine_keys)),
        weights=weights,
        poll_interval=engine_poll_seconds, backoff_base=engine_backoff_seconds,
    )
    supervisor.role = stored_role(config.paths.state_dir)  # a head's choice, if it made one
    weights.on_ready = lambda: start_when_waiting(supervisor)
    tuning = TuningService(config, db, clock, gpus, supervisor, weights)
    publisher = StatusPublisher(db, clock)
    supervisor.on_change(publisher.listen)
    health = build_health(config, db=db, clock=clock, gpus=gpus, supervisor=supervisor,
                          engine_transport=engine_transport, engine_keys=engine_keys,
                          webhook_transport=webhook_transport,
                          webhook_base_delay=webhook_base_delay)
    weights.on_job_end = health.check_weights  # a job's end re-judges the weights check
    runtime = Runtime(
        config=config,
        clock=clock,
        db=db,
        throttle=LoginThrottle(
            clock,
            max_failures=config.auth.login_max_failures,
            window=float(config.auth.login_window_seconds),
        ),
        secret=server_secret(config.paths.state_dir),
        scheduler=new_scheduler(),
        migrations=migrations or migrations_dir(),
        gpus=gpus,
        supervisor=supervisor,
        weights=weights,
        tuning=tuning,
        publisher=publisher,
        health=health,
        qualify=QualifyService(config, db, clock, supervisor),
        engine_keys=engine_keys,
        started_at=clock.now(),
        started_monotonic=clock.monotonic(),
    )
    runtime.cell = CellWatch(
        config=config, db=db, clock=clock, local=LocalEngine(config, supervisor, engine_keys),
        runner=router or router_runner(config), alerts=health.alerts,
        audit=partial(audit, runtime), interval=cell_poll_seconds, transport=peer_transport,
        router_options=router_options, router_figures=router_figures)
    return runtime


def build_health(
    config: Config,
    *,
    db: Database,
    clock: Clock,
    gpus: GpuPort,
    supervisor: Supervisor,
    engine_transport: httpx.AsyncBaseTransport | None,
    engine_keys: EngineKeys | None = None,
    webhook_transport: httpx.AsyncBaseTransport | None,
    webhook_base_delay: float,
) -> HealthMonitor:
    """The health monitor and its adapters: the engine probe (its own HTTP client, apart
    from the supervisor's), the host reader and the alert sender."""
    health = config.health
    transport = engine_transport
    if engine_keys is not None:
        transport = KeyedTransport(engine_keys, engine_transport)
    probe = EngineProbe(engine_url(config), transport=transport)
    alerts = Alerts(db=db, clock=clock, url=health.webhook_url, retries=health.webhook_retries,
                    box=socket.gethostname(), version=__version__, transport=webhook_transport,
                    base_delay=webhook_base_delay)
    return HealthMonitor(
        config=config, db=db, clock=clock, gpus=gpus, supervisor=supervisor,
        watcher=EngineWatcher(probe, health, config.engine.served_model_name, clock),
        read_host=partial(read_host, config.paths), alerts=alerts, closing=[probe])


async def start_when_waiting(supervisor: Supervisor) -> None:
    """Weights just became ready: if the operator wants the engine running and only the
    weights stopped it (preflight), start it now — a fresh box serves as soon as its
    download is proven, with no one at the console."""
    from appliance.engine.records import get_desired
    from appliance.engine.states import Command, EngineState

    status = supervisor.status
    desired = await supervisor.db.run(get_desired)
    if desired.running and status.state is EngineState.STOPPED and status.reason in (
            "preflight", "waiting_for_weights"):
        started = supervisor.submit(Command.START, "weights ready")
        started.add_done_callback(lambda f: None if f.cancelled() else f.exception())


def runtime_of(connection: Any) -> Runtime:
    """The runtime `create_app` stored on the app, from any Litestar request or connection."""
    runtime: Runtime = connection.app.state.runtime
    return runtime
