"""Checks before an engine launch: is this box ready for a 90-minute load?

A pure core and a thin shell. `gather_facts()` does the IO (NVML through the GPU port, a test
bind of the engine port, psutil for the port's holder and for disk and /dev/shm, the model
directory) and returns a frozen `PreflightFacts`; it blocks, so callers run it in a thread.
`evaluate()` turns facts plus the configuration into `Check`s without touching anything, so
every verdict is tested as a table. `blocking()` picks the errors that must stop a launch;
warnings are shown but do not stop it.

What a check never does: kill, stop or signal anything. A process we did not start that holds
a GPU or the engine's port is named, with how to stop it, and the launch is refused.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from appliance.config import Config, engine_host
from appliance.engine import pd_host
from appliance.gpu.port import GpuPort, GpuSnapshot, snapshot_with_timeout
from appliance.sizes import GIB, bytes_text, gib_text
from appliance.volumes import disk_space

# /dev/shm holds NCCL's and SGLang's inter-process buffers for TP8. Bare metal gives it half
# of RAM (1.5 TiB here); it is small only where someone limited it (a container's 64 MiB
# default breaks NCCL outright). 16 GiB is a generous floor, not a measured need: below it
# the launch goes ahead with a warning.
MIN_SHM_FREE_BYTES = 16 * GIB
SHM = Path("/dev/shm")  # noqa: S108 - read for its size, never written
# The models volume also holds downloads in progress and verification records.
MIN_MODELS_FREE_BYTES = 10 * GIB
# Memory in use on a GPU that no listed process accounts for (a process in another PID
# namespace, a context not yet released). NVML counts a few hundred MiB of driver
# reservations as used on an idle GPU, so only more than this is worth a warning.
UNEXPLAINED_GPU_BYTES = 2 * GIB
GPU_TIMEOUT_S = 10.0

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Check:
    """One verdict. `severity` is what a failure means (an error blocks the launch); `message`
    says what was found, `hint` what to do about it."""

    name: str
    ok: bool
    severity: Severity
    message: str
    hint: str = ""


@dataclass(frozen=True)
class PortHolder:
    """Who listens on the engine port, as far as this user may see (pid None: not visible)."""

    pid: int | None
    name: str = ""
    command: str = ""


@dataclass(frozen=True)
class PreflightFacts:
    """What the box looked like when the preflight ran. None means "could not be read"."""

    gpus: GpuSnapshot
    own_pids: frozenset[int]  # processes this appliance started, children included
    engine_port: int
    port_free: bool
    port_holder: PortHolder | None  # set when the port is taken and a holder was found
    port_error: str | None  # the test bind failed for another reason than "in use"
    model_dir: Path
    model_dir_exists: bool
    has_config_json: bool
    safetensors_count: int
    weights_verified: bool | None  # None: no manifest recorded, so nothing can be proven
    models_free_bytes: int | None
    shm_total_bytes: int | None
    shm_free_bytes: int | None
    weights_detail: str = ""  # the weights service's sentence and next step
    weights_hint: str = ""
    engine_host: str = "127.0.0.1"  # the address the engine binds (cell.listen_address)
    pd: pd_host.PdFacts | None = None  # a prefill or decode launch's needs (None: unified)


def model_dir(config: Config) -> Path:
    """Where the engine's model lives: models_dir/<org>--<name> for a Hub repo id."""
    return config.paths.models_dir / config.engine.model.replace("/", "--")


# --- the pure core ----------------------------------------------------------------------------


def evaluate(facts: PreflightFacts, config: Config) -> tuple[Check, ...]:
    """Every check, passed or not, in a stable order (GPUs, port, weights, volumes, and for
    a prefill or decode launch the transfer library, the RDMA devices and the unit's drop-in:
    appliance.engine.pd_host)."""
    return (
        *_gpu_checks(facts, config),
        _port_check(facts),
        *_weights_checks(facts),
        _shm_check(facts),
        _models_volume_check(facts),
        *(Check(f.name, f.ok, "error" if f.blocking else "warning", f.message, f.hint)
          for f in (pd_host.evaluate(facts.pd) if facts.pd is not None else ())),
    )


# The checks about the weights themselves: all a fresh box fails while its pull runs.
WEIGHTS_CHECKS = frozenset({"weights_present", "weights_verified"})


def blocking(checks: Iterable[Check]) -> list[Check]:
    """The failed checks that must stop a launch."""
    return [check for check in checks if not check.ok and check.severity == "error"]


def _gpu_checks(facts: PreflightFacts, config: Config) -> list[Check]:
    snap, expected = facts.gpus, config.gpu.expected_count
    if snap.error is not None:
        if expected == 0:  # a box without GPUs by configuration: note it, do not block
            return [Check("nvml", False, "warning",
                          f"GPUs not readable ({snap.error}); ignored because "
                          "gpu.expected_count is 0", snap.hint)]
        return [Check("nvml", False, "error", f"cannot read the GPUs: {snap.error}", snap.hint)]
    checks = [Check("nvml", True, "error",
                    f"NVML answered (driver {snap.driver_version}, CUDA {snap.cuda_version})")]
    found = len(snap.gpus)
    if expected == 0:
        checks.append(Check("gpu_count", True, "error",
                            f"{found} GPU(s) found; count not checked (gpu.expected_count is 0)"))
    elif found < expected:
        checks.append(Check(
            "gpu_count", False, "error", f"found {found} GPU(s), expected {expected}",
            "see `nvidia-smi -L` and `dmesg` for Xid errors (a GPU that fell off the bus needs "
            "a reset or a reboot); if this box really has fewer GPUs, set gpu.expected_count "
            "and engine.tp_size to match"))
    elif found > expected:
        checks.append(Check(
            "gpu_count", False, "warning", f"found {found} GPUs, expected {expected}",
            "the engine uses the first ones; set gpu.expected_count if the box has more"))
    else:
        checks.append(Check("gpu_count", True, "error", f"{found} GPU(s), as expected"))

    dead = [g for g in snap.gpus if g.error is not None]
    if dead:
        first = dead[0]
        listing = "; ".join(f"GPU {g.index}: {g.error}" for g in dead)
        checks.append(Check("gpus_responding", False, "error",
                            f"{len(dead)} GPU(s) not answering: {listing}", first.hint))
    else:
        checks.append(Check("gpus_responding", True, "error", "every GPU answers"))
    alive = [g for g in snap.gpus if g.error is None]

    model = config.gpu.expected_model
    wrong = [g for g in alive if model and model.lower() not in g.name.lower()]
    if wrong:
        listing = ", ".join(f"GPU {g.index} is {g.name!r}" for g in wrong)
        checks.append(Check(
            "gpu_model", False, "error", f"{listing}; expected {model!r}",
            f"this appliance is sized for {model} GPUs (gpu.expected_model); run it on the box "
            "it was set up for, or change gpu.expected_model if you know the engine fits"))
    elif model:
        checks.append(Check("gpu_model", True, "error", f"every GPU is a {model}"))

    checks.append(_processes_check(facts))
    checks.append(_memory_check(facts))
    return checks


def _processes_check(facts: PreflightFacts) -> Check:
    held: dict[int, list[tuple[int, int]]] = {}  # pid -> [(gpu index, bytes)]
    names: dict[int, str] = {}
    for gpu in facts.gpus.gpus:
        for proc in gpu.processes:
            if proc.pid not in facts.own_pids:
                held.setdefault(proc.pid, []).append((gpu.index, proc.used_bytes))
                names[proc.pid] = names.get(proc.pid) or proc.name
    if not held:
        return Check("gpu_processes", True, "error", "no other compute process on the GPUs")
    parts = []
    for pid, where in sorted(held.items()):
        label = f"pid {pid}" + (f" ({names[pid]})" if names[pid] else "")
        total = sum(b for _, b in where)
        amount = gib_text(total) if total else "memory not reported"
        gpus = ", ".join(str(i) for i, _ in where)
        parts.append(f"{label} on GPU {gpus} ({amount})")
    pids = " ".join(str(pid) for pid in sorted(held))
    return Check(
        "gpu_processes", False, "error",
        "compute processes this appliance did not start hold the GPUs: " + "; ".join(parts),
        f"stop them (see `nvidia-smi`; e.g. `kill {pids}` as their owner) and start again; the "
        "appliance never stops processes it did not start")


def _memory_check(facts: PreflightFacts) -> Check:
    odd = []
    for gpu in facts.gpus.gpus:
        if gpu.error is not None:
            continue
        unexplained = gpu.memory_used_bytes - sum(p.used_bytes for p in gpu.processes)
        if unexplained > UNEXPLAINED_GPU_BYTES:
            odd.append(f"GPU {gpu.index}: {gib_text(gpu.memory_used_bytes)} in use, "
                       f"{gib_text(unexplained)} by no listed process")
    if not odd:
        return Check("gpu_memory", True, "warning", "GPU memory is free")
    return Check(
        "gpu_memory", False, "warning", "; ".join(odd),
        "the engine sizes its caches from free memory, so it would get less: look for "
        "processes in containers (`nvidia-smi` on the host) or wait for exiting ones to finish")


def _port_check(facts: PreflightFacts) -> Check:
    port, host = facts.engine_port, facts.engine_host
    if facts.port_error is not None:
        hint = "choose another engine.port (1024 or above) and start again"
        if host != "127.0.0.1":
            hint += (f", or check that {host} (cell.listen_address) is an address of this "
                     "box (`ip -brief address`)")
        return Check("engine_port", False, "error",
                     f"cannot bind the engine port {port} on {host}: {facts.port_error}", hint)
    if facts.port_free:
        return Check("engine_port", True, "error", f"port {port} on {host} is free")
    holder = facts.port_holder
    if holder is None or holder.pid is None:
        return Check(
            "engine_port", False, "error",
            f"port {port} on {host} is taken by a process this user cannot see",
            f"find it with `sudo ss -ltnp 'sport = :{port}'`, stop it, or set engine.port to a "
            "free port; the appliance never stops processes it did not start")
    who = f"pid {holder.pid}" + (f" ({holder.name})" if holder.name else "")
    shown = f": {holder.command}" if holder.command else ""
    if holder.pid in facts.own_pids:
        return Check(
            "engine_port", False, "error",
            f"port {port} is still held by an engine this appliance started ({who})",
            "wait for it to stop (or stop it from the console) before starting another")
    return Check(
        "engine_port", False, "error",
        f"port {port} on {host} is held by {who}, which this appliance did not start{shown}",
        f"stop that process (e.g. `kill {holder.pid}` as its owner) or set engine.port to a free "
        "port; the appliance never stops processes it did not start")


def _weights_checks(facts: PreflightFacts) -> list[Check]:
    where = facts.model_dir
    get = ("download the weights of engine.model into it (or copy a complete checkpoint "
           "there), then start again")
    if not facts.model_dir_exists:
        return [Check("weights_present", False, "error",
                      f"the model directory {where} does not exist", get)]
    missing = []
    if not facts.has_config_json:
        missing.append("config.json")
    if facts.safetensors_count == 0:
        missing.append("any *.safetensors shard")
    if missing:
        return [Check("weights_present", False, "error",
                      f"{where} lacks " + " and ".join(missing), get)]
    checks = [Check("weights_present", True, "error",
                    f"{where}: config.json and {facts.safetensors_count} safetensors shard(s)")]
    # A damaged shard would only show an hour into the load, so unproven weights block.
    if facts.weights_verified is None:
        checks.append(Check(
            "weights_verified", False, "error",
            facts.weights_detail or f"the weights in {where} have no manifest, so they "
            "cannot be proven", facts.weights_hint or "pull the weights (`appliance weights "
            "pull`) or import them with their manifest, then start again"))
    elif not facts.weights_verified:
        checks.append(Check(
            "weights_verified", False, "error",
            facts.weights_detail or f"the weights in {where} are not verified",
            facts.weights_hint or "download the damaged shards again, verify, then start "
            "again"))
    else:
        checks.append(Check("weights_verified", True, "error",
                            facts.weights_detail or "the weights are verified"))
    return checks


def _shm_check(facts: PreflightFacts) -> Check:
    total, free = facts.shm_total_bytes, facts.shm_free_bytes
    fix = ("NCCL and the engine's processes share memory through /dev/shm: enlarge it (e.g. "
           "`sudo mount -o remount,size=64G /dev/shm`, and in /etc/fstab to keep it) or free "
           "space in it")
    if total is None or free is None:
        return Check("shm", False, "warning", f"{SHM} could not be read", fix)
    if free < MIN_SHM_FREE_BYTES:
        return Check("shm", False, "warning",
                     f"{SHM} has {bytes_text(free)} free of {bytes_text(total)}, below the "
                     f"{bytes_text(MIN_SHM_FREE_BYTES)} the engine should have", fix)
    return Check("shm", True, "warning", f"{SHM} has {bytes_text(free)} free")


def _models_volume_check(facts: PreflightFacts) -> Check:
    free = facts.models_free_bytes
    fix = "free space on the models volume (old revisions, stray downloads) or enlarge it"
    if free is None:
        return Check("models_volume", False, "warning",
                     f"free space on the volume of {facts.model_dir} could not be read", fix)
    if free < MIN_MODELS_FREE_BYTES:
        return Check("models_volume", False, "warning",
                     f"the models volume has only {bytes_text(free)} free", fix)
    return Check("models_volume", True, "warning",
                 f"the models volume has {bytes_text(free)} free")


# --- the IO shell -----------------------------------------------------------------------------


def gather_facts(
    config: Config,
    gpus: GpuPort,
    *,
    own_pids: Collection[int] = (),
    weights_verified: bool | None = None,
    weights_detail: str = "",
    weights_hint: str = "",
    shm_path: Path = SHM,
    gpu_timeout_s: float = GPU_TIMEOUT_S,
    role: str | None = None,
    ib_sysfs: Path = pd_host.IB_SYSFS,
) -> PreflightFacts:
    """Look at the box. Blocks (NVML up to `gpu_timeout_s`, a psutil scan of sockets when
    the port is taken, the transfer library's import in the engine's python for a PD
    `role`: the launch's, None: cell.role): run it in a thread. Reads only; never raises for
    what it finds."""
    directory = model_dir(config)
    port, host = config.engine.port, engine_host(config)
    free, holder, port_error = _probe_port(host, port)
    exists, has_config, shards = _model_files(directory)
    shm_free, shm_total = disk_space(shm_path, nearest_parent=False) or (None, None)
    return PreflightFacts(
        gpus=snapshot_with_timeout(gpus, gpu_timeout_s),
        own_pids=_with_children(own_pids),
        engine_port=port,
        engine_host=host,
        port_free=free,
        port_holder=holder,
        port_error=port_error,
        model_dir=directory,
        model_dir_exists=exists,
        has_config_json=has_config,
        safetensors_count=shards,
        weights_verified=weights_verified,
        weights_detail=weights_detail,
        weights_hint=weights_hint,
        models_free_bytes=(disk_space(directory) or (None, None))[0],
        shm_total_bytes=shm_total,
        shm_free_bytes=shm_free,
        pd=pd_facts(config, role or config.cell.role, ib_sysfs),
    )


def pd_facts(config: Config, role: str, ib_sysfs: Path = pd_host.IB_SYSFS,
             ) -> pd_host.PdFacts | None:
    """The PD needs of a launch in `role` (None for unified): the engine venv's python, and
    the unit's RDMA drop-in when the engine runs under systemd."""
    if role not in ("prefill", "decode"):
        return None
    venv = config.engine.venv
    return pd_host.gather(
        role, config.cell.transfer_backend, config.cell.ib_device,
        python=venv / "bin" / "python" if venv is not None else None, sysfs=ib_sysfs,
        dropin=pd_host.RDMA_DROPIN if config.engine.runner == "systemd" else None)


def _model_files(directory: Path) -> tuple[bool, bool, int]:
    """(directory exists, has config.json, number of *.safetensors files); an unreadable
    directory counts as missing files."""
    try:
        if not directory.is_dir():
            return False, False, 0
        shards = sum(1 for p in directory.glob("*.safetensors") if p.is_file())
        return True, (directory / "config.json").is_file(), shards
    except OSError:
        return True, False, 0


def _with_children(pids: Collection[int]) -> frozenset[int]:
    """The given processes and all their descendants (SGLang's TP workers are children)."""
    found = set(pids)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    return frozenset(found)


def _probe_port(host: str, port: int) -> tuple[bool, PortHolder | None, str | None]:
    """(free, holder, other error): try to bind host:port as the engine will (127.0.0.1, or
    a cell's box's cell.listen_address, which may be IPv6; an address the box does not have
    is the "other error").

    SO_REUSEADDR as uvicorn sets it, so a connection of a previous engine lingering in
    TIME_WAIT does not count as "taken"; a listener (on the address or on any) does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return False, None, exc.strerror or str(exc)
            return False, _port_holder(port), None
    return True, None, None


def _port_holder(port: int) -> PortHolder | None:
    """The process listening on `port`, from psutil's socket table. Other users' sockets
    show without a pid unless the daemon runs as root; None when nothing is found."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    bound = [c for c in connections if c.laddr and c.laddr.port == port]
    listening = [c for c in bound if c.status == psutil.CONN_LISTEN]
    candidates = sorted(listening or bound, key=lambda c: c.pid is None)
    if not candidates:
        return None
    pid = candidates[0].pid
    if pid is None:
        return PortHolder(pid=None)
    name, command = "", ""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        name = process.name()
        command = " ".join(process.cmdline())[:200]
    return PortHolder(pid=pid, name=name, command=command)


