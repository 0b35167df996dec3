"""The host's readings (`read_host`, psutil) and checks (`host_checks`, pure).

    host.models_disk    free space on the models volume: WARN / CRITICAL under the lines
    host.state_disk     free space on the state volume (database, launch specs, backups)
    host.memory         available RAM under memory_available_warn_percent → WARN
    host.shm            free /dev/shm under shm_free_warn_gib, or no /dev/shm → WARN
    host.load           5-minute load over twice the CPU count → WARN
    host.daemon_memory  this daemon's RSS over daemon_rss_warn_mib → WARN

`read_host` blocks (statvfs, /proc): call it through `asyncio.to_thread`. It never raises for
a path: a directory that does not exist yet is measured on its nearest existing parent (the
volume it will live on), and one that cannot be read at all is None, which its check reports.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from pathlib import Path

import psutil

from appliance.config import HealthConfig, PathsConfig
from appliance.health.model import CheckResult, HostFigures, Level
from appliance.sizes import GIB, bytes_text
from appliance.volumes import disk_space

GROUP = "host"
MIB = 1 << 20
SHM_PATH = "/dev/shm"  # noqa: S108 - measured with statvfs, never written to
SHM = Path(SHM_PATH)
LOAD_PER_CPU_WARN = 2.0
K3_WEIGHTS = "a Kimi K3 weight set needs about 1.56 TB"


def read_host(paths: PathsConfig, now: dt.datetime, *, shm: Path = SHM) -> HostFigures:
    """One reading of the host (blocking)."""
    models_free, models_total = disk_space(paths.models_dir) or (None, None)
    state_free, state_total = disk_space(paths.state_dir) or (None, None)
    shm_free, shm_total = disk_space(shm, nearest_parent=False) or (None, None)
    memory = psutil.virtual_memory()
    load1, load5 = 0.0, None
    with contextlib.suppress(OSError):
        load1, load5, _ = os.getloadavg()
    return HostFigures(
        at=now, models_free_bytes=models_free, models_total_bytes=models_total,
        state_free_bytes=state_free, state_total_bytes=state_total,
        shm_free_bytes=shm_free, shm_total_bytes=shm_total,
        memory_available_bytes=memory.available, memory_total_bytes=memory.total,
        load1=load1, cpu_count=psutil.cpu_count() or 1,
        daemon_rss_bytes=psutil.Process().memory_info().rss, load5=load5)


def _share(part: int, whole: int | None) -> str:
    return f" ({part / whole:.0%} free)" if whole else ""


def _result(check_id: str, title: str, level: Level, summary: str, hint: str) -> CheckResult:
    return CheckResult(check_id, GROUP, title, level, summary, hint if level is not Level.OK
                       else "")


def _warn_line(check_id: str, title: str, summary: str, *, crossed: bool, line: str,
               hint: str) -> CheckResult:
    """WARN when the reading crossed its warning line (`line` says which, after the summary),
    otherwise OK."""
    if crossed:
        return _result(check_id, title, Level.WARN, f"{summary}, {line}", hint)
    return _result(check_id, title, Level.OK, summary, hint)


def _gib_line(gib: int, kind: str) -> str:
    """A line configured in GiB, said in the console's SI bytes with the setting's own figure:
    "under the 107.37 GB warning line (100 GiB as configured)", so the Settings page's 100
    and the Health page's 107.37 read as the same line."""
    return f"under the {bytes_text(gib * GIB)} {kind} line ({gib:,} GiB as configured)"


def _disk(check_id: str, title: str, name: str, free: int | None, total: int | None,
          warn_gib: int, critical_gib: int, hint: str) -> CheckResult:
    if free is None:
        return _result(check_id, title, Level.WARN, f"the {name} volume could not be read",
                       "check that the directory in the configuration exists and that the "
                       "appliance user may read it")
    # Disks in SI units, as their vendors and `df -H` say; the lines are configured in GiB.
    summary = (f"the {name} volume has {bytes_text(free)} free of {bytes_text(total or 0)}"
               f"{_share(free, total)}")
    if free < critical_gib * GIB:
        return _result(check_id, title, Level.CRITICAL,
                       f"{summary}, {_gib_line(critical_gib, 'critical')}",
                       hint)
    if free < warn_gib * GIB:
        return _result(check_id, title, Level.WARN,
                       f"{summary}, {_gib_line(warn_gib, 'warning')}", hint)
    return _result(check_id, title, Level.OK, summary, hint)


def _memory(figures: HostFigures, health: HealthConfig) -> CheckResult:
    total = figures.memory_total_bytes
    percent = 100 * figures.memory_available_bytes / total if total else 100.0
    summary = (f"{bytes_text(figures.memory_available_bytes)} of {bytes_text(total)} RAM available "
               f"({percent:.1f}%)")
    limit = health.memory_available_warn_percent
    return _warn_line(
        "host.memory", "Host memory", summary, crossed=percent < limit,
        line=f"under the {limit}% warning line",
        hint="find what holds the memory (`ps aux --sort=-rss | head`); the kernel's OOM "
        "killer would pick the largest process, which is the engine")


def _shm(figures: HostFigures, health: HealthConfig) -> CheckResult:
    free, total = figures.shm_free_bytes, figures.shm_total_bytes
    if free is None:
        return _result("host.shm", "Shared memory", Level.WARN,
                       "there is no readable /dev/shm on this host",
                       "SGLang's processes and NCCL share memory through /dev/shm: mount it "
                       "(tmpfs) before starting the engine")
    summary = f"{SHM_PATH} has {bytes_text(free)} free of {bytes_text(total or 0)}"
    limit = health.shm_free_warn_gib
    return _warn_line(
        "host.shm", "Shared memory", summary, crossed=free < limit * GIB,
        line=_gib_line(limit, "warning"),
        hint="find what fills it (`ls -la --sort=size /dev/shm`): segments left by a killed "
        "engine (torch_*, nccl-*) can be removed while no engine runs; /dev/shm lives in RAM")


def _load(figures: HostFigures) -> CheckResult:
    # The 5-minute average: a busy minute (a hash, a burst of tokenizing) would otherwise
    # warn and recover over and over, an alert each time.
    line = LOAD_PER_CPU_WARN * figures.cpu_count
    load, over = ((figures.load5, "5 minutes") if figures.load5 is not None
                  else (figures.load1, "1 minute"))
    summary = f"load average {load:.1f} over {over} on {figures.cpu_count} CPUs"
    return _warn_line(
        "host.load", "Host load", summary, crossed=load > line, line=f"over {line:g}",
        hint="find what keeps the CPUs busy (`top`); a weight hash or download runs hot, but "
        "the engine's tokenizer and schedulers need CPU time to keep the GPUs fed")


def _daemon(figures: HostFigures, health: HealthConfig) -> CheckResult:
    rss = figures.daemon_rss_bytes
    summary = f"the appliance daemon uses {bytes_text(rss)} of memory"
    limit = health.daemon_rss_warn_mib * MIB  # configured in MiB, shown in SI like all RAM
    return _warn_line(
        "host.daemon_memory", "Daemon memory", summary, crossed=rss > limit,
        line=f"over the {bytes_text(limit)} warning line",
        hint="restart the control plane (`systemctl restart appliance`): the engine keeps "
        "serving through it; if it grows again, report it with `appliance doctor --json`")


def host_checks(figures: HostFigures, health: HealthConfig,
                paths: PathsConfig | None = None) -> list[CheckResult]:
    """Every host check, in a stable order. `paths` only makes the hints name directories."""
    models_dir = str(paths.models_dir) if paths else "the models directory"
    state_dir = str(paths.state_dir) if paths else "the state directory"
    return [
        _disk("host.models_disk", "Models disk", "models", figures.models_free_bytes,
              figures.models_total_bytes, health.models_free_warn_gib,
              health.models_free_critical_gib,
              f"remove weight sets and abandoned partial downloads you no longer need under "
              f"{models_dir} (the Weights page shows the one in use; `appliance weights "
              f"status` too), or grow the volume; {K3_WEIGHTS}"),
        _disk("host.state_disk", "State disk", "state", figures.state_free_bytes,
              figures.state_total_bytes, health.state_free_warn_gib,
              health.state_free_critical_gib,
              f"prune old database backups in {state_dir}/backups (each migration keeps "
              "one), or grow the volume: the database stops taking writes when it is full"),
        _memory(figures, health),
        _shm(figures, health),
        _load(figures),
        _daemon(figures, health),
    ]
