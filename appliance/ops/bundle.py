"""The support bundle: one `.tar.gz` a vendor or a colleague can read to see what this box is,
how it is configured and what it did — modelled on NVIDIA's `nvidia-bug-report.sh` (gather
everything, never fail as a whole) and GPUStack's diagnostics.

Collection is a list of small collectors (`appliance.ops.collectors`), each returning files
for the archive or raising `Skip` with the reason (the types both share are in
`appliance.ops.parts`, so the collectors never import the builder that runs them). Invariants:

- **Nothing leaves unredacted.** Every file, the README and every skip reason pass through one
  `Redactor` (`appliance.ops.redact`) before they are written.
- **Bounded.** Each collector has a timeout (a hung NVML call or `nvidia-smi` costs its part,
  not the bundle); each file at most `FILE_CAP` bytes (its end kept: logs matter at the end);
  the archive at most `TOTAL_CAP` bytes before compression; logs are tails of `log_lines`.
- **No daemon needed.** It reads the configuration, the database and the files directly; the
  daemon adds what only it knows (the live health snapshot, NVML's Xid history) as `extra`
  (the CLI asks a daemon that answers for it; `daemon_note` says why when none did).
- **Nothing planted is followed.** Files come through `appliance.ops.readsafe`: no link
  below a configured folder is opened, only paths the configuration names are read (never a
  path from a database row), and run as root a service-owned folder is read as its owner;
  each refusal is listed in the README.
- **Audited.** Each bundle writes a `support.bundle` audit entry when the database is there.

`build()` blocks (subprocesses, NVML, disk): the daemon runs it in a worker thread.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import os
import re
import socket
import tarfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.config import Config
from appliance.errors import EX_USAGE, ApplianceError
from appliance.ops.collectors import COLLECTORS
from appliance.ops.parts import (
    COLLECTOR_TIMEOUT_S,
    LOG_LINES,
    RUNS,
    Collector,
    Context,
    Part,
    Skip,
    Skipped,
)
from appliance.ops.redact import Redactor, for_box

if TYPE_CHECKING:
    from appliance.db.database import Database
    from appliance.gpu.port import GpuPort

__all__ = ["LOG_LINES", "RUNS", "Bundle", "Collector", "Context", "Part", "Skip", "Skipped",
           "build", "default_name", "parse_since"]

FILE_CAP = 5 * 1024 * 1024
TOTAL_CAP = 50 * 1024 * 1024
DEFAULT_SINCE = dt.timedelta(hours=24)


@dataclass(frozen=True)
class Bundle:
    """What was written: the archive, its files (path, bytes, about), what was skipped and
    why, and the redaction counts."""

    path: Path
    files: list[tuple[str, int, str]]
    skipped: list[Skipped]
    redactions: list[str]
    size: int
    audit_error: str = ""  # why no audit entry was written (none: it was)


# --- time --------------------------------------------------------------------------------------

_SPAN = re.compile(r"(\d+)\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: dt.datetime) -> dt.datetime:
    """`24h`, `90m`, `7d`, `1d12h` back from `now`, or an ISO date/time (UTC when no zone)."""
    text = text.strip()
    if re.fullmatch(r"(\d+\s*[smhdw]\s*)+", text):
        delta = dt.timedelta()
        for number, unit in _SPAN.findall(text):
            delta += dt.timedelta(**{_UNITS[unit]: int(number)})
        return now - delta
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ApplianceError(
            "since_invalid", f"--since {text!r} is neither a span nor a date",
            "give a span such as 24h, 90m or 7d, or an ISO date such as 2026-05-01T08:00",
            status=400, exit_code=EX_USAGE) from None
    return at if at.tzinfo else at.replace(tzinfo=dt.UTC)


# --- running collectors --------------------------------------------------------------------


def _run_one(collector: Collector, ctx: Context) -> list[Part] | str:
    """The collector's parts, or why there are none (its Skip, its error, or its timeout).
    It runs in a daemon thread, so one that hangs in the kernel is left behind, not waited
    for."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["parts"] = collector.collect(ctx)
        except Skip as exc:
            box["why"] = str(exc)
        except Exception as exc:
            box["why"] = f"failed: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=target, name=f"bundle-{collector.name}", daemon=True)
    thread.start()
    thread.join(collector.timeout_s)
    if thread.is_alive():
        return f"gave no answer within {collector.timeout_s:.0f} s (left behind)"
    if "parts" in box:
        parts: list[Part] = box["parts"]
        return parts
    return str(box.get("why", "nothing collected"))


def _bounded(data: bytes, cap: int) -> tuple[bytes, bool]:
    if len(data) <= cap:
        return data, False
    cut = data[-cap:]
    newline = cut.find(b"\n")
    if 0 <= newline < 4096:
        cut = cut[newline + 1:]  # start on a whole line
    return cut, True


def _open_db(config: Config) -> tuple[Database | None, str]:
    """The database, or why not. A SQLite file that is not there is not created."""
    from sqlalchemy.engine import make_url

    from appliance.db.database import Database

    try:
        url = make_url(config.database_url)
        if url.drivername.startswith("sqlite") and url.database and not Path(
                url.database).exists():
            return None, f"no database at {url.database} (never started, or moved)"
        return Database(config.database_url), ""
    except Exception as exc:
        return None, f"the database could not be opened: {type(exc).__name__}: {exc}"


def collect(ctx: Context, collectors: Sequence[Collector], redactor: Redactor,
            ) -> tuple[list[Part], list[Skipped]]:
    """Run every collector; redact and bound what they return."""
    parts: list[Part] = []
    skipped: list[Skipped] = []
    total = 0
    for collector in collectors:
        found = _run_one(collector, ctx)
        if isinstance(found, str):
            skipped.append(Skipped(collector.name, redactor(found)))
            continue
        for part in found:
            text = redactor.structured(part.path, part.data.decode("utf-8", errors="replace"))
            data, cut = _bounded(text.encode(), FILE_CAP)
            about = part.about + (f" (truncated to its last {FILE_CAP // 2**20} MB)"
                                  if cut else "")
            if total + len(data) > TOTAL_CAP:
                skipped.append(Skipped(part.path, f"left out: the bundle's "
                                                  f"{TOTAL_CAP // 2**20} MB cap was reached"))
                continue
            total += len(data)
            parts.append(Part(part.path, data, redactor(about)))
    return parts, skipped


# --- the archive ---------------------------------------------------------------------------


def default_name(now: dt.datetime) -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "box"
    return f"appliance-support-{host}-{now:%Y%m%dT%H%M%SZ}"


def readme(config: Config, ctx: Context, parts: Sequence[Part], skipped: Sequence[Skipped],
           redactor: Redactor, actor: str) -> str:
    from appliance.ops.redact import PATTERNS, secret_files, secret_keys

    width = max([len(p.path) for p in parts] + [len("README.txt")])
    lines = [
        "Appliance support bundle",
        "========================",
        "",
        f"appliance {__version__}, host {socket.gethostname()}",
        f"created {ctx.now.isoformat(timespec='seconds')} by {actor}",
        f"covers  {ctx.since.isoformat(timespec='seconds')} to now (--since); log files are "
        f"their last {ctx.log_lines} lines",
        f"config  {config.source}",
        "",
        "Files",
        "-----",
        f"{'README.txt'.ljust(width)}  this index",
        *(f"{p.path.ljust(width)}  {p.about}" for p in parts),
        "",
        "Not collected",
        "-------------",
        *(f"{s.what}: {s.reason}" for s in skipped),
        *(["(everything was collected)"] if not skipped else []),
        "",
        "Refused (never read)",
        "--------------------",
        "A bundle opens no link in the appliance's folders, reads only the files the",
        "configuration names, and run as root reads a service-owned folder as its owner.",
        *(ctx.refused or ["(nothing was refused)"]),
        "",
        "Redaction",
        "---------",
        "Every file above was redacted before it was written. A removed value reads",
        "[redacted: <what>]. Removed by value: server.key, engine-api.key, the",
        "configuration's secret values (" + (", ".join(k for k, _ in secret_keys(config))
                                             or "none set") + ") and the contents of its",
        "secret files (" + (", ".join(k for k, _ in secret_files(config)) or "none set") + ").",
        "Removed by pattern: " + ", ".join(sorted({p.label for p in PATTERNS})) + ".",
        "Not included at all: password hashes, session and token tables, API key hashes,",
        "request bodies; gateway counters are aggregates, without keys or prompts.",
        "",
        "Redacted in this bundle: " + (", ".join(redactor.summary()) or "nothing"),
        f"Bounds: {FILE_CAP // 2**20} MB per file, {TOTAL_CAP // 2**20} MB in all, "
        f"{COLLECTOR_TIMEOUT_S:.0f} s per part.",
        "",
    ]
    return "\n".join(lines)


def _write_archive(out: Path, folder: str, members: Sequence[tuple[str, bytes]],
                   now: dt.datetime) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # not for everyone's eyes
    try:
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w:gz") as tar:
            for name, data in members:
                info = tarfile.TarInfo(f"{folder}/{name}")
                info.size = len(data)
                info.mtime = int(now.timestamp())
                info.mode = 0o640
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out.stat().st_size


def build(
    config: Config, out: Path, *, actor: str, address: str = "",
    since: dt.timedelta | dt.datetime = DEFAULT_SINCE, now: dt.datetime | None = None,
    db: Database | None = None, gpus: GpuPort | None = None, extra: Sequence[Part] = (),
    daemon_note: str = "", log_lines: int = LOG_LINES,
    collectors: Sequence[Collector] | None = None,
) -> Bundle:
    """Collect, redact and write the bundle to `out` (atomically, 0600); audit it.

    `db`: the daemon's database (else it is opened here, and closed); `gpus`: the daemon's
    GPU port (else NVML is opened here); `extra`: parts only the daemon has (`daemon_note`:
    why there are none, when there are none)."""
    now = now or dt.datetime.now(dt.UTC)
    start = since if isinstance(since, dt.datetime) else now - since
    own_db = db is None
    db_error = ""
    if db is None:
        db, db_error = _open_db(config)
    try:
        ctx = Context(config, now, start, db, db_error, gpus, log_lines, tuple(extra),
                      daemon_note)
        redactor = for_box(config)
        parts, skipped = collect(ctx, COLLECTORS if collectors is None else collectors,
                                 redactor)
        text = redactor(readme(config, ctx, parts, skipped, redactor, actor))
        folder = out.name.removesuffix(".tar.gz").removesuffix(".tgz") or default_name(now)
        members = [("README.txt", text.encode()), *((p.path, p.data) for p in parts)]
        size = _write_archive(out, folder, members, now)
        bundle = Bundle(out, [(p.path, len(p.data), p.about) for p in parts], skipped,
                        redactor.summary(), size)
        audit_error = _audit(db, db_error, now, actor, address, bundle, start)
        return dataclasses.replace(bundle, audit_error=redactor(audit_error))
    finally:
        if own_db and db is not None:
            db.dispose()


def _audit(db: Database | None, db_error: str, now: dt.datetime, actor: str, address: str,
           bundle: Bundle, since: dt.datetime) -> str:
    """Record who took a bundle of what; "" when recorded, else why not. A database that
    cannot be written costs the entry, not the bundle (the box may be broken in exactly that
    way)."""
    from appliance.db.journal import add_audit

    if db is None:
        return db_error or "no database"
    detail = {"file": bundle.path.name, "bytes": bundle.size, "files": len(bundle.files),
              "skipped": len(bundle.skipped), "since": since.isoformat()}
    try:
        db.call(lambda s: add_audit(s, at=now, actor=actor, address=address,
                                    action="support.bundle", target=bundle.path.name,
                                    detail=detail))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""
