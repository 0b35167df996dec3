"""What a prefill or decode engine needs of its box that a unified engine does not, checked
before a 90-minute load is spent on it: the KV transfer library in the engine's environment,
the RDMA devices `cell.ib_device` names (present, a port up), and under systemd the engine
unit's RDMA drop-in.

A pure core over frozen facts and a thin shell, as the preflight is (appliance.engine.preflight
turns each `Finding` into a launch-blocking check; `appliance doctor` into a report line).

What SGLang 0.5.23 does without them, and so why each is checked:
- the transfer library: the sglang wheel depends on neither backend; a PD engine fails at
  start with "Please install mooncake ..." (distributed/device_communicators/
  mooncake_transfer_engine.py 119-126) or the NIXL equivalent (disaggregation/nixl/conn.py
  543-549). The import is tried with the engine environment's own python, which is the only
  way to know (the daemon never imports sglang or its libraries);
- the devices: with `--disaggregation-ib-device` set, SGLang refuses to start unless
  /sys/class/infiniband and every named device exist (arg_groups/validation_hook.py 535-545,
  its list of valid devices); a device whose ports are all down is accepted there and fails
  only at the first transfer, so the link state is read too (`ports/N/state`, "4: ACTIVE");
- the drop-in: appliance-engine.service allows only the NVIDIA device classes
  (DevicePolicy=closed); the installer adds /dev/infiniband/uverbs* and rdma_cm for a PD
  role (systemd/appliance-engine-rdma.conf); without it every verbs call is denied.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The KV transfer backends (`--disaggregation-transfer-backend`): the module SGLang imports,
# the distribution that provides it, and its pin (installer/engine-requirements.txt pins the
# chosen one; tests/test_installer.py keeps the two equal). mooncake is the product's default
# (cell.transfer_backend, SGLang's own default) and the one installed: CUDA 13 builds, as
# torch 2.14.1 under sglang 0.5.23 is (cuda-python>=13).
TRANSFER_BACKENDS: dict[str, tuple[str, str, str]] = {
    "mooncake": ("mooncake.engine", "mooncake-transfer-engine-cuda13", "0.3.14"),
    "nixl": ("nixl._api", "nixl-cu13", "1.5.1"),
}
INSTALLED_BACKEND = "mooncake"
IB_SYSFS = Path("/sys/class/infiniband")
# Where the installer puts the engine unit's RDMA drop-in for a PD role (its vendor unit dir).
RDMA_DROPIN = Path("/usr/local/lib/systemd/system/appliance-engine.service.d/rdma.conf")
ACTIVE = "4: ACTIVE"
IMPORT_TIMEOUT_S = 60.0  # a cold import of a CUDA library from a slow disk


@dataclass(frozen=True)
class IbDevice:
    """One RDMA device as sysfs shows it: `ports` are (port number, state text)."""

    name: str
    exists: bool
    ports: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PdFacts:
    """What the box looked like for a PD launch. `import_error` None: the backend imported
    (or was not tried: `python` None); `dropin_present` None: no systemd unit to check."""

    role: str
    backend: str
    ib_device: str  # cell.ib_device as configured ("" : the backend picks)
    sysfs: Path
    sysfs_exists: bool
    devices: tuple[IbDevice, ...]  # the named devices, else every device sysfs lists
    python: Path | None
    import_error: str | None
    dropin: Path
    dropin_present: bool | None


@dataclass(frozen=True)
class Finding:
    """One verdict: `ok`, what was found, what to do. `blocking` False: a warning."""

    name: str
    ok: bool
    message: str
    hint: str = ""
    blocking: bool = True


def named_devices(ib_device: str) -> tuple[str, ...]:
    """The device names in `cell.ib_device`: a comma list ("mlx5_0,mlx5_1"), or SGLang's
    per-GPU JSON mapping ({"0": "mlx5_0", ...}) whose values are comma lists; order kept,
    repeats dropped. A path to a JSON file is not read here (its devices go unchecked)."""
    text = ib_device.strip()
    groups: list[str] = [text]
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except ValueError:
            mapping = {}
        groups = [v for v in mapping.values() if isinstance(v, str)] if isinstance(
            mapping, dict) else []
    elif text.startswith("/") or text.endswith(".json"):
        return ()
    names = [n.strip() for group in groups for n in group.split(",") if n.strip()]
    return tuple(dict.fromkeys(names))


# --- the pure core ----------------------------------------------------------------------------


def evaluate(facts: PdFacts) -> tuple[Finding, ...]:
    """Every PD check, in a stable order (transfer library, devices, drop-in); none for a
    unified box."""
    if facts.role not in ("prefill", "decode"):
        return ()
    found = [_transfer(facts), *_devices(facts)]
    if facts.dropin_present is not None:
        found.append(_dropin(facts))
    return tuple(found)


def install_command(backend: str) -> str:
    _, dist, pin = TRANSFER_BACKENDS[backend]
    return f"{dist}=={pin}"


def _transfer(facts: PdFacts) -> Finding:
    backend = facts.backend
    if backend not in TRANSFER_BACKENDS:
        return Finding("kv_transfer", False, f"the KV transfer backend {backend!r} "
                       "(cell.transfer_backend) is not one this appliance knows",
                       "set cell.transfer_backend to mooncake (installed) or nixl")
    module, dist, _ = TRANSFER_BACKENDS[backend]
    if facts.python is None:
        return Finding("kv_transfer", False, f"the KV transfer library ({dist}) was not "
                       "checked: engine.venv is not set", "set engine.venv to the engine's "
                       "environment", blocking=False)
    if facts.import_error is None:
        return Finding("kv_transfer", True, f"the engine's environment imports {module} "
                       f"({dist}, for --disaggregation-transfer-backend {backend})")
    venv = facts.python.parent.parent
    extra = "" if backend == INSTALLED_BACKEND else (
        f" (the installer installs {TRANSFER_BACKENDS[INSTALLED_BACKEND][1]} only: "
        "cell.transfer_backend = \"mooncake\" needs nothing more)")
    return Finding(
        "kv_transfer", False,
        f"the engine's environment {venv} cannot import {module}, the {backend} KV transfer "
        f"library a {facts.role} engine loads at start: {facts.import_error}",
        f"install it into that environment: sudo {facts.python} -m pip install "
        f"'{install_command(backend)}'{extra}, or run the installer again (it installs "
        "installer/engine-requirements.txt)")


def _devices(facts: PdFacts) -> list[Finding]:
    where = facts.sysfs
    drivers = ("install the RDMA drivers (MLNX_OFED/DOCA or the distribution's rdma-core "
               "with the mlx5 modules) and check `ibv_devices`")
    wanted = named_devices(facts.ib_device)
    if not facts.sysfs_exists:
        if facts.ib_device:
            return [Finding("ib_devices", False, f"{where} does not exist, so SGLang refuses "
                            f"cell.ib_device {facts.ib_device!r} at start", drivers)]
        return [Finding("ib_devices", False, f"{where} does not exist: this box has no RDMA "
                        "device for the KV transfer", drivers, blocking=False)]
    if not facts.ib_device:
        up = [d.name for d in facts.devices if any(s == ACTIVE for _, s in d.ports)]
        if not up:
            listed = ", ".join(d.name for d in facts.devices) or "none"
            return [Finding("ib_devices", False, f"no RDMA device with a port up in {where} "
                            f"(devices: {listed}); cell.ib_device is empty, so the backend "
                            "picks among these", "connect and bring up the cell network's "
                            "ports (`ibstat`), or set cell.ib_device", blocking=False)]
        return [Finding("ib_devices", True, f"RDMA devices with a port up: {', '.join(up)} "
                        "(cell.ib_device empty: the backend picks)")]
    listed = ", ".join(sorted(d.name for d in facts.devices if d.exists)) or "none"
    missing = [d.name for d in facts.devices if not d.exists]
    if missing:
        return [Finding("ib_devices", False,
                        f"cell.ib_device names {', '.join(missing)}, not in {where} "
                        f"(present: {listed}); SGLang refuses to start with it",
                        "set cell.ib_device to devices `ibv_devices` lists, or load the "
                        "driver of the missing one")]
    down = [f"{d.name} port {p} is {s or 'unknown'}" for d in facts.devices if d.exists
            for p, s in d.ports if s != ACTIVE]
    dead = [d.name for d in facts.devices if not any(s == ACTIVE for _, s in d.ports)]
    if dead:
        return [Finding("ib_devices", False,
                        f"no port up on {', '.join(dead)}: " + "; ".join(down),
                        "check the cable and the switch port (`ibstat`, `ip link`); a port "
                        "is up when its state reads \"4: ACTIVE\"")]
    return [Finding("ib_devices", True, f"{', '.join(wanted)}: present, a port up on each")]


def _dropin(facts: PdFacts) -> Finding:
    if facts.dropin_present:
        return Finding("rdma_unit", True, f"the engine unit may use the RDMA devices "
                       f"({facts.dropin})")
    return Finding("rdma_unit", False,
                   f"the engine unit does not allow the RDMA devices ({facts.dropin} is "
                   f"missing), so a {facts.role} engine's verbs calls would be denied",
                   "run the installer again (`sudo installer/install.sh` from the release): "
                   "it writes that drop-in for a prefill or decode box, configured or chosen "
                   "by its head")


# --- the IO shell -----------------------------------------------------------------------------


def gather(role: str, backend: str, ib_device: str, *, python: Path | None,
           sysfs: Path = IB_SYSFS, dropin: Path | None = None) -> PdFacts:
    """Look at the box for a PD launch (nothing for a unified one). Blocks (an import in a
    child python, up to IMPORT_TIMEOUT_S): run it in a thread. `dropin` None: no systemd
    unit to check (a process runner)."""
    pd = role in ("prefill", "decode")
    sysfs_exists = pd and sysfs.is_dir()
    names = named_devices(ib_device) or (_listed(sysfs) if sysfs_exists else ())
    devices = tuple(_device(sysfs, name) for name in names) if sysfs_exists else ()
    import_error = None
    if pd and python is not None and backend in TRANSFER_BACKENDS:
        import_error = try_import(python, TRANSFER_BACKENDS[backend][0])
    return PdFacts(role=role, backend=backend, ib_device=ib_device, sysfs=sysfs,
                   sysfs_exists=sysfs_exists, devices=devices, python=python,
                   import_error=import_error, dropin=dropin or RDMA_DROPIN,
                   dropin_present=None if dropin is None or not pd else dropin.is_file())


def try_import(python: Path, module: str) -> str | None:
    """None when `python -c 'import module'` succeeds, else its last line of error."""
    try:
        done = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                              text=True, timeout=IMPORT_TIMEOUT_S, check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run: {exc}"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {done.returncode}"


def _listed(sysfs: Path) -> tuple[str, ...]:
    with contextlib.suppress(OSError):
        return tuple(sorted(p.name for p in sysfs.iterdir()))
    return ()


def _device(sysfs: Path, name: str) -> IbDevice:
    root = sysfs / name
    if not root.exists():
        return IbDevice(name, False)
    ports: list[tuple[str, str]] = []
    with contextlib.suppress(OSError):
        for port in sorted((root / "ports").iterdir(), key=lambda p: p.name):
            try:
                state = (port / "state").read_text().strip()
            except OSError:
                state = ""
            ports.append((port.name, state))
    return IbDevice(name, True, tuple(ports))
