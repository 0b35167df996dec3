"""What a GPU's Xid error means for this box, and what to do: a table, pure.

Xids are the NVIDIA driver's numbered error reports (`dmesg`: "NVRM: Xid (PCI:...): 79").
NVML hands the critical ones to `appliance.gpu` as events; `gpu_checks` turns them into one
finding per GPU using this table. The levels follow NVIDIA's Xid catalog resolution buckets,
read for an inference box: an application-level fault (the engine's, usually) warns; memory
that could not be corrected, a lost GPU, a failed repair or firmware that stopped answering
is critical; benign clean-up is OK. An Xid not listed warns and points at the catalog.
`{gpu}` in a hint is replaced by the GPU's index.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.health.model import Level

CATALOG = "https://docs.nvidia.com/deploy/xid-errors/"


@dataclass(frozen=True)
class XidMeaning:
    level: Level
    meaning: str  # short, after "Xid 79 (...)"
    hint: str


_APP_FAULT = (
    "usually a software fault in the process using the GPU (the engine may have crashed or "
    "been restarted): read the engine log around that time; if it repeats without an engine "
    "error, collect `nvidia-smi -q` and `dmesg` and contact support"
)
_RESET = ("stop the engine and reset the GPU (`sudo nvidia-smi -r -i {gpu}`) or reboot the "
          "box; if it happens again, the GPU needs service from the hardware vendor")
_MEMORY_LOST = ("an uncorrectable memory error: the processes on GPU {gpu} were killed. "
                + _RESET)

_TABLE: dict[int, XidMeaning] = {
    8: XidMeaning(Level.WARN, "GPU stopped processing", _APP_FAULT),
    13: XidMeaning(Level.WARN, "graphics engine exception", _APP_FAULT),
    31: XidMeaning(Level.WARN, "GPU memory page fault", _APP_FAULT),
    43: XidMeaning(Level.WARN, "GPU stopped processing", _APP_FAULT),
    45: XidMeaning(Level.OK, "preemptive clean-up after a process ended", ""),
    48: XidMeaning(Level.CRITICAL, "double-bit ECC error", _MEMORY_LOST),
    61: XidMeaning(Level.CRITICAL, "internal micro-controller breakpoint", _RESET),
    62: XidMeaning(Level.CRITICAL, "internal micro-controller halt", _RESET),
    63: XidMeaning(Level.WARN, "memory row remapping (or page retirement) recorded",
                   "a bad memory row was recorded for repair: reset GPU {gpu} at a convenient "
                   "time (or reboot) so the repair takes effect; repeats mean wearing memory"),
    64: XidMeaning(Level.CRITICAL, "memory row remapping (or page retirement) failed",
                   "GPU {gpu} could not repair its memory: it needs replacing; contact the "
                   "hardware vendor (RMA) and run the engine without it only if you must"),
    74: XidMeaning(Level.CRITICAL, "NVLink error",
                   "check `nvidia-smi nvlink -s -i {gpu}` and `systemctl status "
                   "nvidia-fabricmanager`; a GPU reset or a reboot usually clears it; if it "
                   "repeats, the board or cabling needs service"),
    79: XidMeaning(Level.CRITICAL, "GPU fell off the bus",
                   "GPU {gpu} needs a reset (`sudo nvidia-smi -r -i {gpu}`) or the box a "
                   "reboot; if it recurs, call the hardware vendor"),
    92: XidMeaning(Level.WARN, "high single-bit ECC error rate",
                   "GPU {gpu}'s memory is wearing: plan a replacement and watch its memory "
                   "errors check"),
    94: XidMeaning(Level.WARN, "contained uncorrectable ECC error",
                   "the process that touched the bad memory was killed (the engine may have "
                   "crashed); reset GPU {gpu} at the next convenient time so the bad row is "
                   "remapped"),
    95: XidMeaning(Level.CRITICAL, "uncontained uncorrectable ECC error", _MEMORY_LOST),
    119: XidMeaning(Level.CRITICAL, "GPU system processor (GSP) timeout", _RESET),
    120: XidMeaning(Level.CRITICAL, "GPU system processor (GSP) error", _RESET),
    140: XidMeaning(Level.CRITICAL, "unrecovered ECC error", _MEMORY_LOST),
    154: XidMeaning(Level.CRITICAL, "the driver asks for a recovery action",
                    "see `nvidia-smi -q -i {gpu}` (GPU Recovery Action) and do what it says: "
                    "a GPU reset, a reboot or a power cycle"),
}


def xid_meaning(xid: int) -> XidMeaning:
    """The table's entry for `xid`; an unlisted one warns and points at NVIDIA's catalog."""
    return _TABLE.get(xid) or XidMeaning(
        Level.WARN, "not in this appliance's table",
        f"look it up in NVIDIA's Xid catalog ({CATALOG}) and read `dmesg` around that time")
