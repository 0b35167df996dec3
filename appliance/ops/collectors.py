"""What a support bundle holds: one small collector per part (see `appliance.ops.bundle`).

Each takes the `Context` and returns `Part`s, or raises `Skip` saying why there is nothing
(no `nvidia-smi`, not under systemd, no database). Database parts use the typed queries of
the modules that own the tables, read only; they never select a secret column (password
hashes, session ids, token and key hashes) and gateway usage only as aggregate counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from appliance import __version__
from appliance.ops.parts import RUNS, Collector, Context, Part, Skip
from appliance.sizes import bytes_text

SUBPROCESS_TIMEOUT_S = 45.0
JOURNAL_UNITS = ("appliance", "appliance-gateway")
UNITS = ("appliance", "appliance-gateway", "appliance-engine", "appliance-router")
QUARANTINE_LISTED = 1000
FILE_SPEC_CAP = 4 * 1024 * 1024  # a launch spec or a configuration file: whole, or refused


def _json(value: Any) -> bytes:
    def default(obj: Any) -> Any:
        if isinstance(obj, dt.datetime):
            return obj.isoformat()
        if isinstance(obj, Path):
            return str(obj)
        if isinstance(obj, enum.Enum):
            return obj.value
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if isinstance(obj, tuple | set | frozenset):
            return list(obj)
        return str(obj)

    return (json.dumps(value, indent=2, default=default, sort_keys=False) + "\n").encode()


def _run(argv: list[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> bytes:
    """A command's output (stdout, then stderr), with its exit status when not 0."""
    if shutil.which(argv[0]) is None:
        raise Skip(f"{argv[0]} not found")
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Skip(f"`{' '.join(argv)}` gave no answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise Skip(f"`{argv[0]}` could not run: {exc.strerror or exc}") from None
    out = done.stdout + (b"\n--- stderr ---\n" + done.stderr if done.stderr.strip() else b"")
    if done.returncode != 0:
        out += f"\n--- exit status {done.returncode} ---\n".encode()
    return out


def _under_systemd() -> None:
    if not Path("/run/systemd/system").is_dir():
        raise Skip("not running under systemd (no /run/systemd/system)")


def tail(path: Path, lines: int, cap: int = 8 * 1024 * 1024, *, root: Path | None = None,
         ctx: Context | None = None) -> bytes:
    """The last `lines` lines of `path`, reading at most `cap` bytes from its end (a 100 GB
    log costs the same as a small one). Read through `readsafe`: no link below `root` (the
    configured folder it lies in; default its own folder) is followed, and run as root the
    read is the folder owner's. A refusal is noted in `ctx` (the README lists it) and skips
    the file."""
    from appliance.ops.readsafe import Refused, read_as_owner

    if ctx is not None:
        from appliance.ops.redact import never_collected

        if path.resolve() in never_collected(ctx.config):  # wherever it lies, e.g. *.log
            ctx.refused.append(f"{path}: a configured secret file (a passphrase, a token or "
                               "a private key); a bundle never reads one")
            raise Skip(f"{path} is a secret file")
    root = root or path.parent
    try:
        data = read_as_owner(root, path.relative_to(root).as_posix(), cap)
    except Refused as exc:
        if ctx is not None and "does not exist" not in str(exc):
            ctx.refused.append(str(exc))
        raise Skip(str(exc)) from None
    kept = data.splitlines(keepends=True)
    if len(data) >= cap and kept:
        kept = kept[1:]  # the first line was cut by the cap
    return b"".join(kept[-lines:])


def _since(ctx: Context) -> str:
    return ctx.since.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# --- the box -------------------------------------------------------------------------------


def _sglang_installed(ctx: Context) -> str:
    venv = ctx.config.engine.venv
    if venv is None:
        return "no engine.venv configured"
    found = sorted(venv.glob("lib/python*/site-packages/sglang-*.dist-info"))
    if not found:
        return f"no sglang in {venv}"
    return ", ".join(p.name.removeprefix("sglang-").removesuffix(".dist-info") for p in found)


def _first_line(path: Path) -> str:
    try:
        return path.read_text(errors="replace").splitlines()[0].strip()
    except (OSError, IndexError):
        return "(not present)"


def _os_release() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip('"')
    except OSError:
        pass
    return "(no /etc/os-release)"


def versions(ctx: Context) -> list[Part]:
    from appliance.engine.flags import SGLANG_VERSION

    gpu = ctx.gpu_snapshot()
    uname = platform.uname()
    rows = [
        ("appliance", __version__),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("sglang (pinned)", SGLANG_VERSION),
        ("sglang (installed)", _sglang_installed(ctx)),
        ("nvidia driver", gpu.driver_version or f"unknown ({gpu.error or 'no NVML'})"),
        ("cuda (driver)", gpu.cuda_version or "unknown"),
        ("nvidia kernel module", _first_line(Path("/proc/driver/nvidia/version"))),
        ("kernel", f"{uname.system} {uname.release} {uname.version} {uname.machine}"),
        ("os", _os_release()),
        ("host", uname.node),
    ]
    width = max(len(k) for k, _ in rows)
    text = "".join(f"{k.ljust(width)}  {v}\n" for k, v in rows)
    return [Part("versions.txt", text.encode(),
                 "versions: appliance, SGLang, Python, driver, CUDA, kernel, OS")]


def configuration(ctx: Context) -> list[Part]:
    from appliance.config import describe

    config = ctx.config
    width = max(len(k) for k, _, _ in describe(config))
    rows = "".join(f"{k.ljust(width)}  {v}\n" for k, v, _ in describe(config))
    parts = [Part("config/settings.txt",
                  f"# from {config.source} and APPLIANCE_* overrides (as this command saw "
                  f"them)\n{rows}".encode(), "the configuration in force, secrets masked")]
    source = Path(config.source)
    if source.is_absolute() and source.is_file():
        try:
            parts.append(Part("config/appliance.toml",
                              tail(source, 1 << 30, cap=FILE_SPEC_CAP, ctx=ctx),
                              f"the configuration file {source}, secrets redacted"))
        except Skip as exc:
            parts.append(Part("config/appliance.toml", f"# not read: {exc}\n".encode(),
                              "the configuration file could not be read"))
    names = sorted(k for k in os.environ if k.startswith("APPLIANCE_") or k == "HF_TOKEN")
    parts.append(Part("config/environment.txt",
                      "".join(f"{k} (set)\n" for k in names).encode() or b"(none)\n",
                      "names of the APPLIANCE_* variables this command saw (values are in "
                      "settings.txt)"))
    return parts


def resources(ctx: Context) -> list[Part]:
    import psutil

    from appliance.volumes import nearest_existing

    paths = ctx.config.paths
    lines = []
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    lines.append(f"memory   total {bytes_text(memory.total)}, available "
                 f"{bytes_text(memory.available)} ({memory.percent}% used)")
    lines.append(f"swap     total {bytes_text(swap.total)}, used {bytes_text(swap.used)}")
    lines.append(f"cpus     {psutil.cpu_count()} logical, load {os.getloadavg()}")
    boot = dt.datetime.fromtimestamp(psutil.boot_time(), dt.UTC)
    lines.append(f"booted   {boot.isoformat(timespec='seconds')}")
    lines.append("")
    named = [("state", paths.state_dir), ("models", paths.models_dir), ("logs", paths.log_dir),
             ("shm", Path("/dev/shm"))]  # noqa: S108 - read, not written
    for name, path in named:
        try:
            where = nearest_existing(path)
            usage = psutil.disk_usage(str(where))
            lines.append(f"{name:<8} {path}: {bytes_text(usage.free)} free of "
                         f"{bytes_text(usage.total)} ({usage.percent}% used)")
        except OSError as exc:
            lines.append(f"{name:<8} {path}: {exc.strerror or exc}")
    lines.append("")
    lines.append("mounts:")
    for mount in psutil.disk_partitions(all=False):
        lines.append(f"  {mount.device} on {mount.mountpoint} type {mount.fstype} "
                     f"({mount.opts})")
    return [Part("host/resources.txt", ("\n".join(lines) + "\n").encode(),
                 "memory, CPUs, disk space of the appliance's volumes, mounts")]


def uname(ctx: Context) -> list[Part]:
    parts = [Part("host/uname.txt", _run(["uname", "-a"]), "uname -a")]
    with contextlib.suppress(OSError):
        parts.append(Part("host/os-release.txt", Path("/etc/os-release").read_bytes(),
                          "/etc/os-release"))
    return parts


def units(ctx: Context) -> list[Part]:
    _under_systemd()
    out = _run(["systemctl", "status", "--no-pager", "--full", "--lines=0", *UNITS])
    return [Part("systemd/units.txt", out, "systemctl status of the appliance's units")]


def journal(ctx: Context) -> list[Part]:
    _under_systemd()
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "--since", _since(ctx),
            "-n", str(ctx.log_lines)]
    for unit in JOURNAL_UNITS:
        argv += ["-u", unit]
    return [Part("logs/journal.txt", _run(argv),
                 "the daemon's and the gateway's journal since --since (last lines)")]


def own_logs(ctx: Context) -> list[Part]:
    """Files in the log directory other than the engine's (a dev or demo daemon's output).
    Listed without following links; a link or anything but a plain file is refused."""
    log_dir = ctx.config.paths.log_dir
    try:
        found = sorted(p for p in log_dir.glob("*.log") if p.name != "engine.log")
    except OSError as exc:
        raise Skip(f"{log_dir} cannot be listed: {exc.strerror or exc}") from None
    parts = []
    for path in found:
        with contextlib.suppress(Skip):  # the refusal is in ctx.refused
            parts.append(Part(f"logs/{path.name}", tail(path, ctx.log_lines, ctx=ctx),
                              f"last lines of {path}"))
    if not parts:
        raise Skip(f"no daemon or gateway log files in {log_dir} (under systemd they are in "
                   "the journal)")
    return parts


# --- the engine ----------------------------------------------------------------------------


def launch_spec(ctx: Context) -> list[Part]:
    """The spec the engine was launched with: the file the systemd runner writes (its unit
    reads it), else the last run's spec as the database records it (the process runner
    writes no file)."""
    from appliance.engine.records import list_runs

    state_dir = ctx.config.paths.state_dir
    path = state_dir / "engine" / "launch-spec.json"
    try:
        data = tail(path, 1 << 30, cap=FILE_SPEC_CAP, root=state_dir, ctx=ctx)
        return [Part("engine/launch-spec.json", data,
                     f"the engine's launch spec ({path}): argv, environment, each flag's "
                     "origin")]
    except Skip as exc:
        why = str(exc)
    runs = ctx.need_db().call(lambda s: list_runs(s, 1))
    if not runs:
        raise Skip(f"no launch spec: the engine was never launched ({why})")
    run = runs[0]
    return [Part("engine/launch-spec.json", run.spec_json.encode(),
                 f"the launch spec of the last engine run (run {run.id}, "
                 f"{run.started_at:%Y-%m-%d %H:%M:%S}), from the database: the "
                 f"{run.runner} runner keeps no spec file")]


def engine_runs(ctx: Context) -> list[Part]:
    from appliance.engine.publish import read_published
    from appliance.engine.records import get_desired, list_runs

    db = ctx.need_db()
    runs, desired, published = db.call(
        lambda s: (list_runs(s, RUNS), get_desired(s), read_published(s)))
    shown = [{
        "id": r.id, "started_at": r.started_at, "runner": r.runner, "spec_hash": r.spec_hash,
        "attempt": r.attempt, "adopted": r.adopted, "state": r.state,
        "phases": r.phases, "ready_at": r.ready_at, "ready_seconds": r.ready_seconds,
        "ended_at": r.ended_at, "exit_code": r.exit_code, "reason": r.reason, "hint": r.hint,
        "figures": r.figures, "log_path": r.log_path,
    } for r in runs]
    body = {"desired": {"running": desired.running, "updated_at": desired.updated_at,
                        "updated_by": desired.updated_by},
            "published": published, "runs": shown}
    return [Part("engine/runs.json", _json(body),
                 f"the last {RUNS} engine runs (states, reasons, timings), the desired state, "
                 "the state the gateway sees")]


def engine_logs(ctx: Context) -> list[Part]:
    """The tail of the engine log the configuration names (the runner's one file). A run's
    recorded `log_path` is a row a compromised daemon could rewrite, so it is never opened:
    one that names another file is noted in the README instead."""
    from appliance.runtime import engine_runner

    path = engine_runner(ctx.config).engine_log(ctx.config.paths.log_dir)
    if ctx.db is not None:
        from appliance.engine.records import list_runs

        with contextlib.suppress(Exception):  # engine_runs reports the database's trouble
            named = {r.log_path for r in ctx.db.call(lambda s: list_runs(s, RUNS))
                     if r.log_path and Path(r.log_path) != path}
            ctx.refused.extend(
                f"{other}: an engine run's record names this log, not the configuration "
                f"({path}); not read (a bundle reads only paths the configuration names)"
                for other in sorted(named))
    from appliance.engine.logsecrets import redact_bytes  # the engine key in server_args=

    data = redact_bytes(tail(path, ctx.log_lines, ctx=ctx))
    return [Part(f"engine/logs/0-{path.name}", data, f"last {ctx.log_lines} lines of {path}")]


# --- GPUs ----------------------------------------------------------------------------------


def nvml(ctx: Context) -> list[Part]:
    snapshot = ctx.gpu_snapshot()
    if snapshot.error:
        raise Skip(f"NVML: {snapshot.error} ({snapshot.hint})")
    return [Part("gpu/nvml.json", _json(snapshot),
                 "NVML snapshot: every GPU's memory, ECC, remapped rows, clocks, links, Xids")]


def nvidia_smi(ctx: Context) -> list[Part]:
    return [Part("gpu/nvidia-smi-q.txt", _run(["nvidia-smi", "-q"]), "nvidia-smi -q")]


def xids(ctx: Context) -> list[Part]:
    """Xid history from every place it is kept: NVML's recent events (the daemon's watch),
    the health checks' recorded changes, and the kernel log."""
    lines: list[str] = []
    snapshot = ctx.gpu_snapshot()
    for gpu in snapshot.gpus:
        for event in gpu.xid_events or ():
            lines.append(f"{event.at.isoformat()}  GPU {gpu.index}  Xid {event.xid}  (NVML)")
    if ctx.db is not None:
        from appliance.health.history import transitions

        try:
            found = ctx.db.call(lambda s: transitions(s, since=ctx.since, limit=1000))
            for t in found:
                if t.check_id.endswith(".xid"):
                    lines.append(f"{t.at.isoformat()}  {t.check_id}  {t.previous_level.name} -> "
                                 f"{t.level.name}: {t.summary}  (health history)")
        except Exception as exc:
            lines.append(f"(health history not read: {exc})")
    if Path("/run/systemd/system").is_dir() and shutil.which("journalctl"):
        kernel = _run(["journalctl", "-k", "--no-pager", "-o", "short-iso", "--since",
                       _since(ctx), "--grep", "NVRM: Xid"])
        lines.append("--- kernel log (journalctl -k --grep 'NVRM: Xid') ---")
        lines.append(kernel.decode(errors="replace").rstrip())
    else:
        lines.append("(kernel log not read: not under systemd; see `dmesg | grep Xid`)")
    if not snapshot.gpus and snapshot.error:
        lines.append(f"(NVML not available: {snapshot.error})")
    return [Part("gpu/xid.txt", ("\n".join(lines) + "\n").encode(),
                 "Xid history: NVML events, health transitions, kernel log")]


# --- health, weights, tuning, gateway ---------------------------------------------------------


def health(ctx: Context) -> list[Part]:
    from appliance.health.history import last_levels, mutes, transitions

    db = ctx.need_db()
    found, levels, muted = db.call(lambda s: (
        transitions(s, since=ctx.since, limit=1000), last_levels(s), mutes(s, ctx.now)))
    changes = [{"at": t.at, "check": t.check_id, "kind": t.kind, "from": t.previous_level.name,
                "to": t.level.name, "summary": t.summary, "hint": t.hint, "muted": t.muted}
               for t in found]
    return [
        Part("health/transitions.json", _json(changes),
             "health transitions since --since, newest first"),
        Part("health/recorded-levels.json",
             _json({check: level.name for check, level in sorted(levels.items())}),
             "each check's level at its last recorded change (when the daemon is down, the "
             "best view of its health)"),
        Part("health/mutes.json", _json(muted), "muted health checks"),
    ]


def weights(ctx: Context) -> list[Part]:
    from appliance.weights.records import get_control, list_sets, set_files

    db = ctx.need_db()

    def read(s: Any) -> dict[str, Any]:
        sets = []
        for record in list_sets(s):
            files = set_files(s, record.id)
            sets.append({"set": record,
                         "states": dict(Counter(f.state for f in files)),
                         "files": [{"path": f.path, "size": f.size, "state": f.state,
                                    "bytes_done": f.bytes_done, "attempts": f.attempts,
                                    "last_error": f.last_error, "verified_at": f.verified_at}
                                   for f in files]})
        return {"control": get_control(s), "sets": sets}

    body = db.call(read)
    body["quarantine"] = _quarantine(ctx.config.paths.models_dir)
    return [Part("weights/status.json", _json(body),
                 "weights sets: manifest, file states, verification times, quarantine")]


def _quarantine(models_dir: Path) -> list[dict[str, Any]]:
    from appliance.weights.quarantine import QUARANTINE

    found: list[dict[str, Any]] = []
    try:
        roots = sorted(models_dir.glob(f"*/{QUARANTINE}"))
    except OSError:
        return found
    for root in roots:
        for path in sorted(root.rglob("*")):
            if len(found) >= QUARANTINE_LISTED:
                return found
            st = path.lstat()  # a link planted here is listed as one, never followed
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                found.append({"path": str(path), "bytes": st.st_size,
                              "moved_at": dt.datetime.fromtimestamp(st.st_mtime, dt.UTC)})
    return found


def tuning(ctx: Context) -> list[Part]:
    from appliance.qualify.ledger import list_qualifications
    from appliance.tuning.store import get_choice, list_custom

    db = ctx.need_db()
    choice, custom, quals = db.call(lambda s: (get_choice(s), list_custom(s),
                                               list_qualifications(s, 10)))
    body = {
        "choice": choice.to_dict() if choice else None,
        "custom_profiles": [{"name": p.profile.name, "title": p.profile.title,
                             "updated_at": p.updated_at, "updated_by": p.updated_by}
                            for p in custom],
        "qualifications": [q.to_dict() for q in quals],
    }
    return [Part("tuning/state.json", _json(body),
                 "the applied memory split, custom profiles, recent qualifications")]


def gateway(ctx: Context) -> list[Part]:
    """Aggregates only: how many keys in which state, and requests since --since by
    endpoint and outcome. No key, prefix, owner, name or request content."""
    from sqlalchemy import func, select

    from appliance.db.models import GatewayKey, UsageRequest

    db = ctx.need_db()

    def read(s: Any) -> dict[str, Any]:
        now = ctx.now
        keys = Counter[str]()
        for revoked, expires in s.execute(select(GatewayKey.revoked_at, GatewayKey.expires_at)):
            keys["revoked" if revoked else "expired" if expires and expires <= now
                 else "active"] += 1
        rows = s.execute(
            select(UsageRequest.endpoint, UsageRequest.outcome, UsageRequest.status,
                   func.count(), func.sum(UsageRequest.prompt_tokens),
                   func.sum(UsageRequest.completion_tokens), func.avg(UsageRequest.ttft_ms),
                   func.max(UsageRequest.queue_ms))
            .where(UsageRequest.started_at >= ctx.since)
            .group_by(UsageRequest.endpoint, UsageRequest.outcome, UsageRequest.status))
        requests = [{"endpoint": e, "outcome": o, "status": st, "count": n,
                     "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0),
                     "avg_ttft_ms": round(t, 1) if t is not None else None,
                     "max_queue_ms": q}
                    for e, o, st, n, p, c, t, q in rows]
        return {"keys": dict(keys), "since": ctx.since, "requests": requests}

    return [Part("gateway/counters.json", _json(db.call(read)),
                 "gateway counters: keys by state, requests by endpoint and outcome (no keys, "
                 "no prompts)")]


def journal_tables(ctx: Context) -> list[Part]:
    from appliance.db.journal import list_audit, list_events

    db = ctx.need_db()
    audit, events = db.call(lambda s: (list_audit(s, per_page=500), list_events(s, per_page=500)))
    return [
        Part("db/audit.json", _json([a for a in audit.items if a.at >= ctx.since]),
             "who did what since --since (the audit log, newest first)"),
        Part("db/events.json", _json([e for e in events.items if e.at >= ctx.since]),
             "what happened by itself since --since (the event log, newest first)"),
    ]


def daemon_extra(ctx: Context) -> list[Part]:
    if not ctx.extra:
        why = ctx.daemon_note or "the bundle was made without the daemon"
        raise Skip(f"the daemon's live state (health snapshot): {why}; "
                   "health/recorded-levels.json has the last recorded levels")
    return list(ctx.extra)


COLLECTORS: tuple[Collector, ...] = (
    Collector("versions", versions),
    Collector("configuration", configuration),
    Collector("launch spec", launch_spec),
    Collector("engine runs", engine_runs),
    Collector("engine logs", engine_logs),
    Collector("daemon and gateway journal", journal),
    Collector("daemon and gateway log files", own_logs),
    Collector("live daemon state", daemon_extra),
    Collector("health history", health),
    Collector("NVML snapshot", nvml),
    Collector("nvidia-smi -q", nvidia_smi, timeout_s=90.0),
    Collector("Xid history", xids),
    Collector("weights", weights),
    Collector("tuning and qualification", tuning),
    Collector("gateway counters", gateway),
    Collector("audit and event log", journal_tables),
    Collector("host resources", resources),
    Collector("uname and OS", uname),
    Collector("unit status", units),
)
