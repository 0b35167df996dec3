"""GPU checks: one GPU snapshot (and the one before it) in, `CheckResult`s of group "gpu" out.

Pure: no NVML, no clock, no IO. The monitor reads the GPUs through `appliance.gpu`
(`snapshot_with_timeout` in a thread) and hands the snapshot here with the previous one, which
is what makes a lost GPU nameable and rising ECC errors visible.

Ids (stable across polls; the monitor keys transitions, mutes and history by them):
- box: `gpu.nvml`, `gpu.driver`, `gpu.count`, `gpu.model`, `gpu.fabric`, `gpu.processes`;
- per GPU `i`: `gpu.i.responding`, `gpu.i.temperature`, `gpu.i.power`, `gpu.i.memory_errors`,
  `gpu.i.clocks`, `gpu.i.nvlink`, `gpu.i.xid`.

Invariants:
- NVML unusable (missing, no driver, hung past its timeout) is one CRITICAL `gpu.nvml` and
  nothing else: without a reading no other verdict is honest. With `gpu.expected_count = 0`
  (a box without GPUs by configuration) it is OK instead.
- A GPU that does not answer gets only `gpu.i.responding` (CRITICAL); its other checks are
  absent until it answers again.
- A reading that is None ("not read") is never a finding: the check says it is not reported.
- Each check's level is the worst of its findings; its summary names every finding, worst
  first, and its hint the next steps.
"""

from __future__ import annotations

from collections.abc import Collection

from appliance.config import GpuConfig
from appliance.gpu.port import FABRIC_COMPLETED, FABRIC_IN_PROGRESS, FABRIC_NOT_STARTED, GpuSnapshot
from appliance.health.gpu_each import Finding, label, per_gpu_checks, verdict
from appliance.health.model import CheckResult, Level
from appliance.sizes import gib_text


def gpu_checks(snapshot: GpuSnapshot, gpu: GpuConfig, previous: GpuSnapshot | None,
               own_pids: Collection[int] | None = None) -> list[CheckResult]:
    """Every GPU check for `snapshot`, box checks first, then each GPU's in index order.

    `previous` is the snapshot of the poll before (None on the first) and `own_pids` the
    processes this appliance started, children included (the engine and its TP workers);
    a compute process outside them is a stranger. None means they are not known: processes
    are then listed, not judged.
    """
    if snapshot.error is not None:
        return [_nvml(snapshot, gpu)]
    before = {g.uuid: g for g in previous.gpus if g.uuid} if previous else {}
    results = [
        _nvml(snapshot, gpu), _driver(snapshot, gpu), _count(snapshot, gpu, previous),
        _model(snapshot, gpu), _fabric(snapshot), _processes(snapshot, own_pids),
    ]
    for info in snapshot.gpus:
        results.extend(per_gpu_checks(info, gpu, before.get(info.uuid)))
    return results


# --- the box ---------------------------------------------------------------------------------


def _nvml(snapshot: GpuSnapshot, gpu: GpuConfig) -> CheckResult:
    if snapshot.error is None:
        return verdict("gpu.nvml", "NVML", (), "NVML answers")
    if gpu.expected_count == 0:
        return verdict("gpu.nvml", "NVML", (), f"GPUs not read ({snapshot.error}); none "
                       "expected (gpu.expected_count is 0)")
    return verdict("gpu.nvml", "NVML", [Finding(
        Level.CRITICAL, f"cannot read the GPUs: {snapshot.error}", snapshot.hint)], "")


def _version(text: str) -> tuple[int, ...] | None:
    parts = text.strip().split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _driver(snapshot: GpuSnapshot, gpu: GpuConfig) -> CheckResult:
    found, wanted = snapshot.driver_version, gpu.min_driver_version
    cuda = f", CUDA {snapshot.cuda_version}" if snapshot.cuda_version else ""
    have = _version(found) if found else None
    need = _version(wanted)
    findings = []
    if have is None:
        findings.append(Finding(Level.WARN, f"the NVIDIA driver version is unknown "
                                f"({found or 'not reported'})", "check `nvidia-smi`"))
    elif need is not None and have < need:
        findings.append(Finding(
            Level.CRITICAL, f"NVIDIA driver {found} is older than {wanted}, the oldest this "
            "appliance supports (gpu.min_driver_version)",
            f"install NVIDIA datacenter driver {wanted} or newer and reboot; the appliance "
            "checks drivers, it never installs them"))
    return verdict("gpu.driver", "NVIDIA driver", findings, f"NVIDIA driver {found}{cuda}")


def _count(snapshot: GpuSnapshot, gpu: GpuConfig, previous: GpuSnapshot | None) -> CheckResult:
    found, expected = len(snapshot.gpus), gpu.expected_count
    findings = []
    if previous is not None and previous.error is None and found < len(previous.gpus):
        now = {g.uuid for g in snapshot.gpus}
        gone = [g for g in previous.gpus if g.uuid and g.uuid not in now]
        if gone:
            names = ", ".join(f"{g.uuid} (was {label(g)})" for g in gone)
            findings.append(Finding(
                Level.CRITICAL, f"{len(gone)} GPU(s) no longer enumerated since the last check: "
                f"{names}", "see `dmesg` for Xid 79 and `nvidia-smi -L`; a GPU that fell off "
                "the bus needs a reset or a reboot, and one that stays gone needs the "
                "hardware vendor"))
    if expected and found < expected:
        findings.append(Finding(
            Level.CRITICAL, f"found {found} GPU(s), expected {expected}",
            "see `nvidia-smi -L` and `dmesg` for Xid errors (a GPU that fell off the bus needs "
            "a reset or a reboot); if this box really has fewer GPUs, set gpu.expected_count "
            "and engine.tp_size to match"))
    elif expected and found > expected:
        findings.append(Finding(
            Level.WARN, f"found {found} GPUs, expected {expected}",
            "the engine uses the first ones; set gpu.expected_count if the box has more"))
    ok = (f"{found} GPU(s), as expected" if expected
          else f"{found} GPU(s); count not checked (gpu.expected_count is 0)")
    return verdict("gpu.count", "GPU count", findings, ok)


def _model(snapshot: GpuSnapshot, gpu: GpuConfig) -> CheckResult:
    model = gpu.expected_model
    if not model:
        return verdict("gpu.model", "GPU model", (), "model not checked "
                       "(gpu.expected_model is empty)")
    wrong = [g for g in snapshot.gpus if g.error is None and model.lower() not in g.name.lower()]
    findings = [] if not wrong else [Finding(
        Level.CRITICAL,
        ", ".join(f"GPU {g.index} is {g.name!r}" for g in wrong) + f"; expected {model!r}",
        f"this appliance is sized for {model} GPUs (gpu.expected_model); run it on the box it "
        "was set up for, or change gpu.expected_model if you know the engine fits")]
    return verdict("gpu.model", "GPU model", findings, f"every GPU is a {model}")


def _fabric(snapshot: GpuSnapshot) -> CheckResult:
    alive = [g for g in snapshot.gpus if g.error is None]
    fix = ("see `systemctl status nvidia-fabricmanager` (and `nvidia-smi -q | grep -A2 "
           "Fabric`); start it with `sudo systemctl enable --now nvidia-fabricmanager` (on "
           "Blackwell HGX boards the NVLink subnet manager, nvlsm, too) and check its log")
    findings = []
    failed = [g for g in alive if g.fabric_error]
    if failed:
        findings.append(Finding(Level.CRITICAL, "the NVLink fabric set-up failed on " + ", ".join(
            f"GPU {g.index} ({g.fabric_error})" for g in failed), fix))
    for state, level, words in (
            (FABRIC_NOT_STARTED, Level.CRITICAL, "the NVLink fabric is not set up on GPU"),
            (FABRIC_IN_PROGRESS, Level.WARN, "the NVLink fabric is still being set up on GPU")):
        waiting = [str(g.index) for g in alive if g.fabric_state == state]
        if waiting:
            then = (": CUDA programs fail until it is" if state == FABRIC_NOT_STARTED
                    else " (normal for a minute or two after boot)")
            findings.append(Finding(level, f"{words} {', '.join(waiting)}{then}", fix))
    done = sum(1 for g in alive if g.fabric_state == FABRIC_COMPLETED)
    ok = (f"the NVLink fabric is set up ({done} GPU(s))" if done
          else "no NVSwitch fabric reported (not needed on this box, or not reported)")
    return verdict("gpu.fabric", "NVLink fabric", findings, ok)


def _processes(snapshot: GpuSnapshot, own_pids: Collection[int] | None) -> CheckResult:
    held: dict[int, list[tuple[int, int]]] = {}  # pid -> [(gpu index, bytes)]
    names: dict[int, str] = {}
    for info in snapshot.gpus:
        for proc in info.processes:
            if own_pids is None or proc.pid not in own_pids:
                held.setdefault(proc.pid, []).append((info.index, proc.used_bytes))
                names[proc.pid] = names.get(proc.pid) or proc.name
    parts = []
    for pid, where in sorted(held.items()):
        total = sum(b for _, b in where)
        parts.append(f"pid {pid}" + (f" ({names[pid]})" if names[pid] else "")
                     + f" on GPU {', '.join(str(i) for i, _ in where)} "
                     f"({gib_text(total) if total else 'memory not reported'})")
    if own_pids is None:
        listing = "; ".join(parts) if parts else "none"
        return verdict("gpu.processes", "GPU processes", (), f"compute processes: {listing}")
    findings = [] if not held else [Finding(
        Level.WARN, "compute processes this appliance did not start hold GPU memory: "
        + "; ".join(parts),
        f"they take memory the engine sized its caches for, and block its next start: stop "
        f"them (see `nvidia-smi`; e.g. `kill {' '.join(str(p) for p in sorted(held))}` as "
        "their owner); the appliance never stops processes it did not start")]
    return verdict("gpu.processes", "GPU processes", findings,
                   "no other compute process on the GPUs")
