"""`appliance doctor`: every check once, in this process, without the daemon.

The first thing to run on a new box, and what to attach to a support request. It runs:

- the appliance's own checks (group "appliance", never part of a `HealthSnapshot`): the
  configuration loaded (it did, or there would be no report), the daemon (running or not),
  the database (opens, schema at head), the state, models and log directories (exist and
  are writable by this user), the weights (a verified set recorded, no file of it damaged
  or quarantined, which is critical, and the quick tier of `appliance.weights.quick`
  passing now); for a prefill or decode box, the KV transfer library, the RDMA devices of
  `cell.ib_device` with a port up and the engine unit's RDMA drop-in (`pd_checks`);
- the GPU checks over NVML (`NvmlGpus`, in a thread, with `health.nvml_timeout_seconds`):
  a compute process outside the engine's process tree (the runner's record: none when no
  engine of ours runs) is a stranger, a WARN with its pid, GPU and memory; uncorrectable ECC
  errors are judged against the monitor's last recorded reading when there is one;
- the engine checks, on the state the daemon published (`engine.publish`): the engine is
  probed only when that state is serving, and `EngineWatcher` sends a generation only to an
  idle engine — never to a busy or loading one;
- the host checks (disks, memory, /dev/shm, load; not the daemon's own memory, which here
  would be this process's).

The report's overall level is the worst of all; `appliance doctor` exits 1 when it is
CRITICAL, 0 otherwise. Ports are parameters (fake GPUs, an engine transport) so tests can
run it without hardware.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance import __version__
from appliance.clock import Clock, SystemClock
from appliance.config import Config, engine_url
from appliance.db.database import Database
from appliance.engine.states import EngineState
from appliance.gpu.port import GpuPort, GpuSnapshot, snapshot_with_timeout
from appliance.health.model import CheckResult, Level

GROUP = "appliance"
GROUP_ORDER = (GROUP, "gpu", "engine", "host")
GROUP_TITLES = {GROUP: "Appliance", "gpu": "GPUs", "engine": "Engine", "host": "Host"}
LEFT_OUT = frozenset({"host.daemon_memory"})  # this process's memory says nothing here
JSON_FORMAT = 1  # bumped if the JSON document's shape ever changes incompatibly


def _result(check_id: str, title: str, level: Level, summary: str,
            hint: str = "") -> CheckResult:
    return CheckResult(check_id, GROUP, title, level, summary,
                       hint if level is not Level.OK else "")


@dataclass(frozen=True)
class Report:
    at: dt.datetime
    results: tuple[CheckResult, ...]

    @property
    def overall(self) -> Level:
        return max((r.level for r in self.results), default=Level.OK)

    def counts(self) -> dict[str, int]:
        return {level.label: sum(r.level is level for r in self.results) for level in Level}

    def to_json(self) -> dict[str, Any]:
        """The stable document `--json` prints: checks in report order, keys fixed."""
        return {"format": JSON_FORMAT, "version": __version__, "at": self.at.isoformat(),
                "overall": self.overall.label, "counts": self.counts(),
                "checks": [{"id": r.id, "group": r.group, "title": r.title,
                            "level": r.level.label, "summary": r.summary, "hint": r.hint}
                           for r in self.results]}


def render(report: Report) -> str:
    """The readable report: a heading per group, a line per check, hints indented."""
    lines = [f"appliance doctor {__version__}, "
             f"{report.at.astimezone(dt.UTC):%Y-%m-%d %H:%M:%S} UTC"]
    for group in GROUP_ORDER:
        rows = [r for r in report.results if r.group == group]
        if not rows:
            continue
        lines += ["", GROUP_TITLES[group]]
        for r in rows:
            lines.append(f"  {r.level.label.upper():<8}  {r.title}: {r.summary}")
            if r.hint and r.level is not Level.OK:
                lines.append(f"  {'':<8}  what to do: {r.hint}")
    counts = report.counts()
    warnings = f"{counts['warn']} warning{'s' if counts['warn'] != 1 else ''}"
    lines += ["", f"Overall: {report.overall.label.upper()} ({counts['critical']} critical, "
              f"{warnings}, {counts['ok']} ok)"]
    return "\n".join(lines)


# --- the appliance's own checks ---------------------------------------------------------------


def daemon_check(state_dir: Path) -> CheckResult:
    """Whether a daemon holds the instance lock (`appliance.lock`); never takes it for long:
    a shared lock is tried and let go at once."""
    path = state_dir / "appliance.lock"
    try:
        with path.open("r") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = handle.read().strip() or "unknown"
                return _result("appliance.daemon", "Daemon", Level.OK,
                               f"the daemon is running (pid {pid})")
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return _result("appliance.daemon", "Daemon", Level.WARN,
                       f"cannot tell whether the daemon runs ({path}: {exc.strerror or exc})",
                       "run the doctor as the daemon's user, or check `systemctl status "
                       "appliance`")
    return _result("appliance.daemon", "Daemon", Level.WARN,
                   "the daemon is not running: no console, no health monitor, no engine "
                   "supervision", "start it (`systemctl start appliance`); its log is "
                   "`journalctl -u appliance`")


def directory_checks(config: Config) -> list[CheckResult]:
    out = []
    paths = config.paths
    for name, path, missing in (
            ("state", paths.state_dir, Level.CRITICAL),
            ("models", paths.models_dir, Level.WARN),
            ("log", paths.log_dir, Level.CRITICAL)):
        check_id, title = f"appliance.{name}_dir", f"{name.capitalize()} directory"
        if not path.is_dir():
            out.append(_result(check_id, title, missing, f"{path} does not exist",
                               "the first weights pull creates it; or create it, owned by "
                               "the daemon's user" if name == "models" else
                               "create it, owned by the daemon's user (the installer does)"))
        elif not os.access(path, os.W_OK | os.X_OK):
            out.append(_result(check_id, title, Level.CRITICAL,
                               f"{path} is not writable by this user (uid {os.getuid()})",
                               "run the doctor as the daemon's user (`sudo -u appliance "
                               "appliance doctor`), or give that user the directory"))
        else:
            out.append(_result(check_id, title, Level.OK, f"{path} is writable"))
    return out


def database_check(db: Database) -> CheckResult:
    """Opens the database and compares its schema with the migrations shipped."""
    from appliance.db.schema import schema_state
    from appliance.resources import migrations_dir

    kind = "SQLite" if db.is_sqlite else "PostgreSQL"
    try:
        state = schema_state(db, migrations_dir())
    except Exception as exc:
        return _result("appliance.database", "Database", Level.CRITICAL,
                       f"the {kind} database cannot be opened: {type(exc).__name__}: {exc}",
                       "check database.url (`appliance` settings) and that the database "
                       "server runs; for SQLite, that the state directory is readable")
    if state.current is None:
        return _result("appliance.database", "Database", Level.CRITICAL,
                       f"the {kind} database is empty", "run `appliance migrate`")
    if not state.at_head:
        return _result("appliance.database", "Database", Level.CRITICAL,
                       f"the {kind} database schema is {state.current}, this appliance "
                       f"needs {state.head}", "run `appliance migrate` (with the daemon "
                       "stopped)")
    return _result("appliance.database", "Database", Level.OK,
                   f"{kind}, schema {state.current} (current)")


def weights_check(db: Database, config: Config) -> CheckResult:
    """The active weight set: recorded, fully verified once, no file damaged or quarantined,
    and the quick tier passing now; the Health page's verdict under the doctor's id."""
    from appliance.health.weights_checks import weights_check as verdict

    return verdict(db, config, check_id="appliance.weights", group=GROUP)


def _engine(level: Level, summary: str, hint: str = "") -> CheckResult:
    return CheckResult("engine.state", "engine", "Engine state", level, summary,
                       hint if level is not Level.OK else "")


def engine_state_check(published: Any, daemon_running: bool, known: bool = True,
                       now: dt.datetime | None = None) -> CheckResult:
    """What the supervisor last published (`engine.publish.Published`, or None); `known`
    is False when the database could not be read. A qualification holding the gateway
    closed (at `now`) is a warning: the engine serves, but no user gets in until it ends."""
    from appliance.gateway.qualified import qualifying_until, refusal_words

    if not known:
        return _engine(Level.WARN, "not known: the database cannot be read",
                       "fix the database first (see above)")
    if published is None:
        return _engine(Level.OK, "the engine has not run on this box yet")
    state = published.state.replace("_", " ")
    when = f"{published.updated_at.astimezone(dt.UTC):%Y-%m-%d %H:%M} UTC"
    stale = "" if daemon_running else " (the daemon is not running: this is its last word)"
    summary = f"{state}, published {when}{stale}: {published.message}".rstrip(": ")
    if published.state == EngineState.FAILED.value:
        return _engine(Level.CRITICAL, summary, "see why on the Engine page or `appliance "
                       "engine status`; fix it, then start the engine again")
    if published.state == EngineState.BACKOFF.value:
        return _engine(Level.WARN, summary,
                       "it crashed and the supervisor retries; see the Engine page")
    until = qualifying_until(published, now or dt.datetime.now(dt.UTC))
    if until is not None:
        return _engine(Level.WARN, f"{summary}; the gateway is {refusal_words(until)}",
                       "wait for it to end, or cancel it on the Qualification page or with "
                       "`appliance qualify cancel`")
    return _engine(Level.OK, summary)


def pd_checks(config: Config, ib_sysfs: Path | None = None) -> list[CheckResult]:
    """A prefill or decode box's own needs (appliance.engine.pd_host: the KV transfer
    library's import in the engine's python, the RDMA devices and their links, the unit's
    RDMA drop-in), in the role its next launch uses; none for a unified box. What would stop
    a launch is CRITICAL, so a new box learns it before a 90-minute load, not after. Blocks
    (a child python): run it in a thread."""
    from appliance.cell.role_choice import effective_role
    from appliance.engine import pd_host
    from appliance.engine.preflight import pd_facts

    facts = pd_facts(config, effective_role(config), ib_sysfs or pd_host.IB_SYSFS)
    if facts is None:
        return []
    return [_result(f"appliance.{f.name}", PD_TITLES.get(f.name, f.name),
                    Level.OK if f.ok else Level.CRITICAL if f.blocking else Level.WARN,
                    f.message, f.hint) for f in pd_host.evaluate(facts)]


PD_TITLES = {"kv_transfer": "KV transfer library", "ib_devices": "RDMA devices",
             "rdma_unit": "Engine unit RDMA access"}


# --- the run ----------------------------------------------------------------------------------


def _guarded(check_id: str, title: str, check: Any, *args: Any) -> CheckResult:
    """`check(*args)`, or a CRITICAL result naming what went wrong (a broken file, a bug):
    the doctor reports, it never stops half-way."""
    try:
        result: CheckResult = check(*args)
    except Exception as exc:
        return _result(check_id, title, Level.CRITICAL,
                       f"could not be checked: {type(exc).__name__}: {exc}",
                       "run `appliance doctor --json` and report it with the output")
    return result


async def engine_results(config: Config, db: Database | None, daemon_running: bool,
                         clock: Clock,
                         transport: httpx.AsyncBaseTransport | None) -> list[CheckResult]:
    from appliance.engine.publish import read_published
    from appliance.health.engine_checks import engine_checks
    from appliance.health.engine_probe import EngineProbe, EngineWatcher
    from appliance.secrets import read_engine_api_key

    published = await asyncio.to_thread(db.call, read_published) if db else None
    try:
        state = EngineState(published.state) if published else EngineState.STOPPED
    except ValueError:
        state = EngineState.STOPPED
    probe = EngineProbe(engine_url(config), transport=transport,
                        api_key=read_engine_api_key(config.paths.state_dir))
    try:
        watcher = EngineWatcher(probe, config.health, config.engine.served_model_name, clock)
        figures = await watcher.poll(state, clock.now())
    finally:
        await probe.aclose()
    return [engine_state_check(published, daemon_running, known=db is not None,
                               now=clock.now()),
            *engine_checks(figures, config.health)]


def engine_pids(config: Config) -> frozenset[int] | None:
    """The processes of the engine this appliance runs (its whole tree); empty when no engine
    of ours runs, so any compute process on the GPUs is a stranger; None when it cannot be
    told (the runner could not be asked): processes are then listed, not judged."""
    from appliance.engine.runner import tree_pids
    from appliance.errors import ApplianceError
    from appliance.runtime import engine_runner

    try:
        ident = engine_runner(config).find()
    except (ApplianceError, OSError):
        return None
    return frozenset(tree_pids(ident.pid)) if ident is not None else frozenset()


def _recorded_ecc(db: Database) -> dict[str, tuple[dt.datetime, float]]:
    from appliance.health import history, model

    try:
        return db.call(lambda s: history.latest_by_subject(s, model.GPU_ECC_UNCORRECTED))
    except Exception:  # an older schema or a locked database: judge without the reading
        return {}


def last_recorded(snapshot: GpuSnapshot,
                  recorded: dict[str, tuple[dt.datetime, float]]) -> GpuSnapshot | None:
    """The monitor's last uncorrectable-ECC reading of each GPU as a "before" snapshot, so a
    one-off doctor run sees errors that are new since then (None when nothing was recorded)."""
    import dataclasses

    if snapshot.error is not None or not recorded:
        return None
    before = tuple(dataclasses.replace(g, ecc_uncorrected_volatile=int(recorded[str(g.index)][1]))
                   for g in snapshot.gpus if str(g.index) in recorded)
    return dataclasses.replace(snapshot, gpus=before) if before else None


async def run_doctor(config: Config, *, gpus: GpuPort | None = None, clock: Clock | None = None,
                     engine_transport: httpx.AsyncBaseTransport | None = None,
                     ib_sysfs: Path | None = None) -> Report:
    """Every check once (see the module docstring); never raises for what it finds."""
    from appliance.gpu.nvml import NvmlGpus
    from appliance.health.gpu_checks import gpu_checks
    from appliance.health.host_checks import host_checks, read_host

    clock = clock or SystemClock()
    now = clock.now()
    port = gpus or NvmlGpus()
    gpu_snapshot = asyncio.create_task(asyncio.to_thread(
        snapshot_with_timeout, port, float(config.health.nvml_timeout_seconds)))
    daemon = daemon_check(config.paths.state_dir)
    own = [_result("appliance.config", "Configuration", Level.OK,
                   f"loaded from {config.source}"), daemon, *directory_checks(config),
           *await asyncio.to_thread(pd_checks, config, ib_sysfs)]
    db = Database(config.database_url)
    recorded_ecc: dict[str, tuple[dt.datetime, float]] = {}
    try:
        database = await asyncio.to_thread(database_check, db)
        own.append(database)
        usable = db if database.level is Level.OK else None
        if usable is not None:
            recorded_ecc = await asyncio.to_thread(_recorded_ecc, usable)
        if usable is None:
            own.append(_result("appliance.weights", "Weights", Level.WARN,
                               "not checked: the database cannot be read",
                               "fix the database first (see above)"))
        else:
            own.append(await asyncio.to_thread(_guarded, "appliance.weights", "Weights",
                                               weights_check, usable, config))
        engine = await engine_results(config, usable, daemon.level is Level.OK, clock,
                                      engine_transport)
    finally:
        db.dispose()
    host = await asyncio.to_thread(read_host, config.paths, now)
    snapshot = await gpu_snapshot
    own_pids = await asyncio.to_thread(engine_pids, config)
    gpu = gpu_checks(snapshot, config.gpu, last_recorded(snapshot, recorded_ecc), own_pids)
    results = [*own, *gpu, *engine,
               *(r for r in host_checks(host, config.health, config.paths)
                 if r.id not in LEFT_OUT)]
    return Report(now, tuple(results))
