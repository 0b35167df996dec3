"""The failure table of SGLang 0.5.23's log: which lines say the engine failed, why, and what
an operator does next.

`classify` reads one record's message and names the failure it reports, if any, with a hint
that names the cause and the next step; `logparse` folds the findings into a `LogState` (a
later finding replaces the failure only when strictly more specific, `SPECIFICITY`; see its
module docstring). Pure; the strings are SGLang 0.5.23's (shared/reference/sglang-0.5.23.md),
so a release's wording change is this file's diff. Split from `logparse`: the grammar of
failures is a table of its own, read apart from the startup markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol

Reason = Literal[
    "out_of_memory", "scheduler_died", "signal", "bad_argument", "weights_error", "unknown"
]
_INT = r"(-?\d{1,18})"


class LogFacts(Protocol):
    """What a classification reads of the log so far (a `logparse.LogState` is one)."""

    @property
    def server_args(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def last_rank(self) -> int | None: ...

    def server_arg(self, key: str) -> str | None: ...


@dataclass(frozen=True)
class Finding:
    """A failure one line reports: its reason, the rank it names, the operator's next step."""

    reason: Reason
    rank: int | None
    hint: str


SPECIFICITY: dict[str, int] = {
    "unknown": 0, "signal": 1, "scheduler_died": 2,
    "out_of_memory": 3, "weights_error": 3, "bad_argument": 3,
}
_SIGNALS = {
    -9: "SIGKILL", -11: "SIGSEGV", -6: "SIGABRT", -15: "SIGTERM", -7: "SIGBUS", -4: "SIGILL",
    -3: "SIGQUIT", -2: "SIGINT",
}
EXCEPTION_LINE = re.compile(
    r"(?:[A-Za-z_]\w{0,60}\.){0,6}[A-Za-z_]\w{0,60}(?:Error|Exception)(?:: .*)?"
)
_ARGPARSE_ERROR = re.compile(r"[\w][\w .\-/]{0,80}: error: \S.*")
_SCHEDULER_DIED = re.compile(
    rf"Rank (\d{{1,6}}) scheduler died during initialization \(exit code: {_INT}\)"
)
_SUBPROCESS_CRASHED = re.compile(
    rf"Subprocess (\S{{1,80}}) \(pid=\S{{1,20}}\) crashed with exit code {_INT}"
)
_BIND_FAILED = re.compile(
    r"error while attempting to bind on address (\(.{1,80}?\)): address already in use"
)
_SCHEDULER_NAME = re.compile(r"scheduler_(\d{1,6})")
_SHARD_PATH = re.compile(r"No such file or directory: '?([^\s']{0,400}\.safetensors)")
_WEIGHTS_MARKERS = (
    "SafetensorError", "Error while deserializing header", "incomplete metadata",
    "file is truncated", "HeaderTooLarge", "MetadataIncompleteBuffer",
    "InvalidHeaderDeserialization",
)
_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory")



def classify(state: LogFacts, text: str, rank: int | None, *, bare: bool) -> Finding | None:
    """The failure `text` reports, if any: causes first, then who died, then teardown.

    argparse errors and a `ValueError` raised before the `server_args` line (SGLang resolving
    its arguments) are recognised only on lines without a log prefix, as Python prints them.
    """
    if "Loaded weights leave no GPU memory for the KV cache" in text:
        return Finding("out_of_memory", rank, (
            "Target and draft weights fill the static budget: raise "
            f"--mem-fraction-static{_now(state)} above the value this line suggests, then "
            "restart; unchanged it fails the same way."))
    if "Not enough GPU memory for hybrid" in text:
        return Finding("out_of_memory", rank, (
            f"No room for the KDA state pool: raise --mem-fraction-static{_now(state)} or "
            "--mamba-full-memory-ratio, or lower --max-running-requests, then restart."))
    if "Not enough memory" in text:
        return Finding("out_of_memory", rank, (
            f"The MLA KV pool got no tokens: raise --mem-fraction-static{_now(state)} or lower "
            "--mamba-full-memory-ratio to give the KV cache more of the budget, then restart."))
    if any(marker in text for marker in _OOM_MARKERS):
        where = f"TP{rank}" if rank is not None else "A GPU"
        return Finding("out_of_memory", rank, (
            f"{where} ran out of GPU memory beyond SGLang's static budget: lower "
            f"--mem-fraction-static{_now(state)} by about 0.02, or lower --max-running-requests or "
            "--cuda-graph-max-bs-decode (they size the unbudgeted buffers), then restart; "
            "unchanged it fails the same way."))
    shard = _SHARD_PATH.search(text)
    if shard is not None or any(marker in text for marker in _WEIGHTS_MARKERS):
        named = f"Shard {shard.group(1)} is missing" if shard else "A weight shard is corrupt"
        return Finding("weights_error", rank, (
            f"{named}: verify the model's shards (size, safetensors header, sha256) against "
            "the manifest and re-download the bad one; restarting alone fails the same way."))
    bind = _BIND_FAILED.search(text)
    if bind is not None:
        return Finding("bad_argument", None, _bind_hint(state, bind.group(1)))
    if bare and (_ARGPARSE_ERROR.fullmatch(text) or (
        text.startswith("ValueError: ") and not state.server_args and state.last_rank is None
    )):
        return Finding("bad_argument", None, (
            "SGLang rejected its launch arguments before starting any GPU process: fix or "
            "remove what this line names; restarting with the same arguments fails the same way."))
    died = _SCHEDULER_DIED.search(text)
    if died is not None:
        dead = int(died.group(1))
        return Finding("scheduler_died", dead, _exit_hint(f"TP{dead}", int(died.group(2))))
    crashed = _SUBPROCESS_CRASHED.search(text)
    if crashed is not None:
        name, code = crashed.group(1), int(crashed.group(2))
        scheduler = _SCHEDULER_NAME.fullmatch(name)
        if scheduler is not None:
            dead = int(scheduler.group(1))
            return Finding("scheduler_died", dead, _exit_hint(f"TP{dead}", code))
        return Finding("signal", None, _exit_hint(f"The {name} process", code))
    if "Scheduler hit an exception" in text:
        who = f"TP{rank}" if rank is not None else "A scheduler"
        return Finding("scheduler_died", rank, (
            f"{who} raised an exception: the traceback after this line names the cause; fix it "
            "before restarting."))
    if "watchdog timeout" in text and "soft=False" in text:
        who = f"TP{rank}" if rank is not None else "A scheduler"
        return Finding("scheduler_died", rank, (
            f"{who} made no progress for --watchdog-timeout seconds (a hang, often NCCL or a "
            "GPU fault): check `nvidia-smi` and `dmesg -T` for Xid errors before restarting."))
    if "Received sigquit from a child process" in text or "SIGQUIT received." in text:
        return Finding("signal", None, (
            "A child process failed and the engine tore its process tree down: find the first "
            "traceback or crash above this line, and check `dmesg -T` for the OOM killer or GPU "
            "Xid errors, before restarting."))
    if text.startswith("Initialization failed.") or " Initialization failed." in text:
        return Finding("unknown", rank, (
            "Startup failed for a reason this parser does not classify: read the error above "
            "this line (or the warmup traceback in it) before restarting."))
    return None


def _bind_hint(state: LogFacts, address: str) -> str:
    port = state.server_arg("disaggregation_bootstrap_port")
    if state.server_arg("disaggregation_mode") == "prefill" and port and \
            address.rstrip(")").endswith(f", {port}"):
        return (f"Another process holds {address}, this prefill engine's bootstrap port, so "
                "decode engines cannot reach it: stop that process or choose another "
                "cell.bootstrap_port (and the router's --prefill port) before restarting.")
    return (f"Another process holds {address}, so the engine could not open its HTTP port "
            "after loading: stop that process or choose another --port before restarting.")


def _now(state: LogFacts) -> str:
    """` (now 0.93)`: the --mem-fraction-static the failed launch used, when the log says."""
    value = state.server_arg("mem_fraction_static")
    return f" (now {value})" if value else ""


def _exit_hint(who: str, code: int) -> str:
    if code == -9:
        return (f"{who} was killed with SIGKILL, most often by the kernel OOM killer (host RAM): "
                "check `dmesg -T | grep -i oom` and free host memory before restarting.")
    if code < 0:
        name = _SIGNALS.get(code, f"signal {-code}")
        return (f"{who} was killed by {name}: check `dmesg -T` for GPU Xid or segfault "
                "messages before restarting.")
    return (f"{who} exited with code {code}: its own traceback above this line names the "
            "cause; fix it before restarting.")
