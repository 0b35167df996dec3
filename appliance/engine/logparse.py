"""What SGLang 0.5.23's startup log says about an engine: phase, weight progress, memory, failure.

A pure fold over log records: `feed(state, record) -> state`, starting from `initial()`. The
supervisor feeds it the engine's log as it grows; `appliance engine parse-log FILE` feeds it a
whole file an operator was sent. No IO, stdlib only; the formats are SGLang 0.5.23's
(shared/reference/sglang-0.5.23.md sections 3 and 5, checked against its source).

Invariants of `LogState`:

- `phase` never goes backwards; `phases` lists each phase once, in order, with the log timestamp
  of the record that entered it (the latest timestamp seen before it for the untimestamped tqdm
  bars), and `phases[-1][0] is phase`.
- `feed` never raises. A record it does not recognise changes nothing but `lines` (and, when it
  carries a log prefix, `last_timestamp`/`last_rank`).
- `ranks` is sorted by rank, one `RankMemory` per TP rank seen in a memory line.

Decisions the log format forces:

- **Draft (DSPARK) weights.** Per rank, the first `Load weight end` is the target model and any
  later one the draft; likewise the first `KV Cache is allocated` is the target's MLA pool and
  any later one the draft's. The shard bar belongs to the draft once rank 0 (the only rank that
  draws bars) has logged its own target `Load weight end`. When the `server_args` line names a
  `speculative_algorithm`, the engine stays in LOADING_WEIGHTS after the target's weights and
  enters ALLOCATING at the draft's `Load weight end` (SGLang loads the draft before it sizes the
  pools); without one, ALLOCATING starts at the target's `Load weight end`. Either way the first
  pool line (`Mamba Cache is allocated`, `KV Cache is allocated`) also enters ALLOCATING, so a
  speculative algorithm without a draft model (NGRAM) still advances.
- **Failures are refined, never downgraded.** Each failure line has a specificity: `unknown` (0,
  "Initialization failed") < `signal` (1, the engine tore itself down on SIGQUIT) <
  `scheduler_died` (2, a known TP rank died or raised) < a cause (3: `out_of_memory`,
  `weights_error`, `bad_argument`). A later line replaces the failure only when it is strictly
  more specific, so the traceback's `torch.OutOfMemoryError` refines the "Scheduler hit an
  exception" before it, and the SIGQUIT teardown after it changes nothing. Among equals the first
  wins (the first rank to report is the one that failed; the others are the cascade), except that
  a rank fills in when the earlier line had none. `Failure.line` is the first line of the
  winning classification; the rank survives a refinement that does not name one.
- Lines without a log prefix (traceback frames, exception lines) belong to the rank of the latest
  prefixed record (`last_rank`): SGLang writes a scheduler's whole traceback in one record.
- argparse's `prog: error: ...`, a `ValueError` the main process raises before the
  `server_args` line (SGLang resolving its arguments), and uvicorn failing to bind the port are
  `bad_argument`: the same launch fails the same way, so the supervisor should not retry it.
- A log line written while rank 0's bar was unfinished lands on the bar's physical line; each
  record is cut before any embedded `[YYYY-MM-DD HH:MM:SS` and after a complete shard bar.
- **One log, several runs.** Every launch appends to the same file, so figures are only ever
  folded from one run's text (`split_runs`; `parse_text` takes the latest unless told
  otherwise). A run starts at the main process's `server_args=` line, or at argparse's
  `usage: ` (a launch refused before `server_args`). The records the main process logs while
  it resolves its arguments (`Max running requests is reset to ...`, `Kimi-K3 DCP ...`, the
  engine emulator's banner) come just before `server_args=` and start its run with them.
  Text before the first marker (a log whose head was rotated away) is a run of its own,
  `marked=False`. A `ValueError` traceback SGLang prints before `server_args` has no marker:
  it reads as the tail of the run before it.

- **Disaggregation (a cell's prefill or decode engine) is not a startup failure.** A KV transfer
  that fails or times out, or a peer that goes away, fails requests while the engine keeps
  serving (SGLang aborts them with a 500 and carries on), so those lines never set `failure`:
  they fold into `transfer_issues`, one `TransferIssue` per kind with a count, the latest line,
  the peer it names and a hint. `bootstrap_server` is where a prefill engine's bootstrap server
  listens, from its `... started successfully on HOST:PORT` line. A bootstrap port another
  process holds is still the bind failure above, its hint naming the bootstrap port.

- **The stop.** SGLang's SIGTERM handler, its drain watchdog and uvicorn's shutdown lines
  take the phase on to DRAINING and STOPPED (`StopSeen`), whenever in the start they come.

Long for one reason: it is the grammar of one log format (markers, `server_args`, runs, the
stop); the failure table is `logfailures`, and secrets come out through `logsecrets`, so a
new SGLang release's wording changes are these files' diff.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from appliance.engine.logfailures import EXCEPTION_LINE, SPECIFICITY, Finding, Reason, classify
from appliance.engine.logsecrets import redact, redact_pairs


class Phase(enum.Enum):
    """The phases the log can show, in the order the engine goes through them: its start,
    then its stop (`StopSeen`), which may come at any point of the start."""

    LAUNCHING = 1
    LOADING_WEIGHTS = 2
    ALLOCATING = 3
    CAPTURING_GRAPHS = 4
    WARMING = 5
    READY = 6
    DRAINING = 7  # SGLang's SIGTERM handler: finishing the requests in flight
    STOPPED = 8  # the drain is over, or the server shut down


# What went wrong between a cell's prefill and decode engines (see `TransferIssue`).
IssueKind = Literal[
    "bootstrap_timeout", "waiting_timeout", "peer_lost", "layout_mismatch", "handshake_failed",
    "register_failed", "transfer_failed",
]


class LineSplitter:
    """Cuts a growing text stream into complete records at every `\\n` and `\\r`.

    tqdm redraws its bar after a `\\r` on one physical line, so `\\r` ends a record too. Empty
    records (from `\\r\\n`, or tqdm's `\\n` after its last `\\r`) are dropped. The unfinished tail
    is kept for the next `feed`; `flush` returns it at end of stream. A record longer than
    `max_record_chars` keeps its first `max_record_chars` characters and drops the rest, so a
    stream with no line breaks cannot grow memory without bound. The caller decodes bytes
    (`errors="replace"`); this class does no IO.
    """

    def __init__(self, max_record_chars: int = 1 << 20) -> None:
        self._max = max_record_chars
        self._tail: list[str] = []
        self._tail_len = 0

    def feed(self, chunk: str) -> list[str]:
        parts = _SEPARATOR.split(chunk)
        self._keep(parts[0])
        if len(parts) == 1:
            return []
        records = ["".join(self._tail), *parts[1:-1]]
        self._tail, self._tail_len = [], 0
        self._keep(parts[-1])
        return [record[: self._max] for record in records if record]

    @property
    def pending(self) -> str:
        """The unfinished tail, unconsumed. tqdm writes `\r` *before* each bar state, so the
        newest state of a bar sits here until the next one: a stalled load's last state."""
        return "".join(self._tail)

    def flush(self) -> list[str]:
        record = "".join(self._tail)
        self._tail, self._tail_len = [], 0
        return [record] if record else []

    def _keep(self, piece: str) -> None:
        room = self._max - self._tail_len
        if piece and room > 0:
            self._tail.append(piece[:room])
            self._tail_len += min(len(piece), room)


@dataclass(frozen=True)
class RankMemory:
    """One TP rank's memory figures, in SGLang's GB (GiB), as its log lines state them.

    Target figures come from the rank's first `Load weight end` / `KV Cache is allocated`, draft
    figures from later ones. `avail_after_pools_gb` is the latest `Memory pool end` on the rank:
    what is left for CUDA graphs and activations once every pool (draft included) is allocated.
    `weight_loads_done` and `kv_pools_done` count those lines; the parser uses them to tell target
    from draft.
    """

    rank: int
    weights_gb: float | None = None
    avail_after_weights_gb: float | None = None
    state_slots: int | None = None
    conv_gb: float | None = None
    ssm_gb: float | None = None
    kv_tokens: int | None = None
    kv_gb: float | None = None
    kv_dtype: str | None = None
    avail_after_pools_gb: float | None = None
    draft_weights_gb: float | None = None
    draft_kv_tokens: int | None = None
    draft_kv_gb: float | None = None
    weight_loads_done: int = 0
    kv_pools_done: int = 0

    @property
    def state_gb(self) -> float | None:
        """KDA recurrent state (conv + ssm) for `state_slots` slots, when both are known."""
        if self.conv_gb is None or self.ssm_gb is None:
            return None
        return round(self.conv_gb + self.ssm_gb, 2)


@dataclass(frozen=True)
class LaunchFigures:
    """The TP0 scheduler's sizing line, `max_total_num_tokens=...` (per-rank KV rows)."""

    max_total_num_tokens: int
    chunked_prefill_size: int | None
    max_prefill_tokens: int | None
    max_running_requests: int
    context_len: int
    available_gpu_mem_gb: float | None


@dataclass(frozen=True)
class Failure:
    """Why the engine failed, as far as its log tells.

    `line` is the first line of the winning classification; `hint` a sentence an operator can act
    on; `detail` the first exception line of a traceback that followed `line`, if any.
    """

    reason: Reason
    rank: int | None
    line: str
    hint: str
    detail: str | None = None


@dataclass(frozen=True)
class TransferIssue:
    """One kind of prefill/decode trouble, as SGLang 0.5.23's disaggregation code logs it.

    `count` counts the log lines that reported it (a lost peer is one summary line plus one line
    per failed request); `line` is the latest of them, without its prefix, and `peer` the
    latest bootstrap address one named. `first_at`/`last_at` are log timestamps.
    """

    kind: IssueKind
    count: int
    line: str
    hint: str
    peer: str | None = None
    first_at: str | None = None
    last_at: str | None = None


@dataclass(frozen=True)
class StopSeen:
    """How the engine's stop shows in its log (SGLang 0.5.23 `tokenizer_manager.py`
    `SignalHandler.sigterm_handler` and `sigterm_watchdog`; uvicorn's shutdown lines).

    `drained` says SGLang's drain handler ran (its `SIGTERM received ... Draining requests`
    or `Gracefully exiting...` lines): SGLang installs it only once a first request reaches
    its tokenizer manager, so an engine that has only answered `/health` stops with uvicorn's
    lines alone, or none, and no drain. `in_flight` is the first count of requests the drain
    waited for, `remaining` the latest; `ended_at` the timestamp of the record that shows the
    stop is over (the last request drained, a forced exit, or uvicorn's shutdown); `forced`
    the line of a forced exit (health check failed, `SGL_FORCE_SHUTDOWN`)."""

    signal_at: str | None = None
    drained: bool = False
    in_flight: int | None = None
    remaining: int | None = None
    ended_at: str | None = None
    forced: str | None = None


@dataclass(frozen=True)
class LogState:
    """Everything learnt from the records fed so far; see the module docstring for invariants.

    `lines` counts the records fed. `server_args` holds the `server_args=` line's key/value
    text; `dcp_size` and `tp_size` come from it (`tp_size` falls back to the highest TP rank
    seen + 1). `warnings` keeps each known warning once, without its log prefix.
    `startup_timings` flattens `cuda_graph={target_decode=..}` to `cuda_graph.target_decode`.
    `last_rank` is the TP rank of the latest prefixed record (None for the main process).
    `stop` is None until the log shows the engine stopping. Secret values (the engine key in
    `server_args`, a URL's password) are redacted here already (`logsecrets`).
    """

    phase: Phase = Phase.LAUNCHING
    phases: tuple[tuple[Phase, str | None], ...] = ((Phase.LAUNCHING, None),)
    shards_done: int = 0
    shards_total: int | None = None
    draft_shards_done: int = 0
    draft_shards_total: int | None = None
    weight_load_seconds: float | None = None
    draft_weight_load_seconds: float | None = None
    ranks: tuple[RankMemory, ...] = ()
    figures: LaunchFigures | None = None
    dcp_size: int = 1
    tp_size: int = 1
    server_args: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = ()
    startup_timings: tuple[tuple[str, float], ...] = ()
    ready: bool = False
    failure: Failure | None = None
    bootstrap_server: str | None = None
    transfer_issues: tuple[TransferIssue, ...] = ()
    stop: StopSeen | None = None
    lines: int = 0
    last_timestamp: str | None = None
    last_rank: int | None = None
    # Which run of the file this was folded from (`parse_text`); None for a stream followed
    # from a launch's own offset. Metadata, not a figure: equality ignores it.
    origin: RunOrigin | None = field(default=None, compare=False)

    @property
    def kv_token_capacity(self) -> int | None:
        """Logical MLA KV capacity: rank 0's rows times `dcp_size` (each rank holds 1/dcp of a
        sequence's latent KV)."""
        rank0 = self.rank(0)
        if rank0 is None or rank0.kv_tokens is None:
            return None
        return rank0.kv_tokens * self.dcp_size

    @property
    def expects_draft(self) -> bool:
        """Whether `server_args` names a speculative algorithm (a DSPARK draft load follows)."""
        algorithm = self.server_arg("speculative_algorithm")
        return algorithm is not None and algorithm not in ("", "None", "none")

    def rank(self, rank: int) -> RankMemory | None:
        return next((memory for memory in self.ranks if memory.rank == rank), None)

    def server_arg(self, key: str) -> str | None:
        return next((value for name, value in self.server_args if name == key), None)


def initial() -> LogState:
    """The state before any record: LAUNCHING, nothing known."""
    return LogState()


def feed(state: LogState, record: str) -> LogState:
    """Fold one log record into `state`. Pure; an unknown or malformed record is ignored."""
    lines = state.lines + 1
    new = state
    for fragment in _fragments(record):
        new = _interpret(new, fragment, lines)
    return new if new.lines == lines else replace(new, lines=lines)


def parse_text(text: str, run: int = -1) -> LogState:
    """Fold one run of `text` (split into records the way `LineSplitter` does): `run` is its
    1-based number in file order, or counts back from the latest when negative (-1, the
    default, is the latest). The state's `origin` says which run it is. Raises ValueError,
    naming how many runs there are, for a run the text does not hold."""
    bounds = _run_bounds(text)
    index = run - 1 if run > 0 else len(bounds) + run
    if run == 0 or not 0 <= index < len(bounds):
        raise ValueError(f"the log holds {_runs_phrase(len(bounds))}; there is no run {run}")
    return _parse_run(text, bounds, index)


def parse_runs(text: str) -> list[LogState]:
    """Every run of `text`, each folded on its own, in file order."""
    bounds = _run_bounds(text)
    return [_parse_run(text, bounds, index) for index in range(len(bounds))]


def _parse_run(text: str, bounds: list[_Bound], index: int) -> LogState:
    bound = bounds[index]
    end = bounds[index + 1].offset if index + 1 < len(bounds) else len(text)
    splitter = LineSplitter()
    state = replace(initial(), origin=bound.origin(len(bounds)))
    for record in [*splitter.feed(text[bound.offset:end]), *splitter.flush()]:
        state = feed(state, record)
    return state


# --- Runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOrigin:
    """Which run of a log a `LogState` was folded from, for labelling what is shown.

    `number` is 1-based in file order, of `of` runs; `started_at` is the log timestamp of the
    run's first record (SGLang writes the box's local time, without a zone); `start_line` the
    1-based physical line it starts on; `marked` is False for text before any start marker.
    """

    number: int
    of: int
    started_at: str | None
    start_line: int
    marked: bool = True

    @property
    def label(self) -> str:
        """`run 3 of 3, started 2026-11-30 09:00:00 local time, at line 1,234`."""
        parts = [f"run {self.number} of {self.of}"]
        if self.started_at is not None:
            parts.append(f"started {self.started_at} local time")
        parts.append(f"at line {self.start_line:,}")
        return ", ".join(parts)


@dataclass(frozen=True)
class RunText:
    """One run's part of a log: its `origin` and its text (see the module docstring)."""

    origin: RunOrigin
    text: str
    launched: bool  # the main process logged its `server_args=` line

    @property
    def number(self) -> int:
        return self.origin.number


def split_runs(text: str) -> list[RunText]:
    """The runs `text` holds, in file order; always at least one (an empty text is one empty,
    unmarked run). Pure; the texts concatenate back to `text` minus blank leading text."""
    bounds = _run_bounds(text)
    ends = [bound.offset for bound in bounds[1:]] + [len(text)]
    return [RunText(bound.origin(len(bounds)), text[bound.offset:end], bound.launched)
            for bound, end in zip(bounds, ends, strict=True)]


@dataclass
class _Bound:
    offset: int
    line: int
    started_at: str | None
    marked: bool
    launched: bool
    number: int = 0

    def origin(self, of: int) -> RunOrigin:
        return RunOrigin(self.number, of, self.started_at, self.line, self.marked)


# The main process's records have no rank parts: `[ts] server_args=...`.
_RUN_MARK = re.compile(
    r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?\] ?(?P<args>server_args=)"
    r"|(?:^|(?<=[\r\n]))usage: ",
    re.M,
)
# What the main process logs while it resolves its arguments, before `server_args=`.
_PRELAUNCH = re.compile(
    r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?\] ?"
    r"(?:Max running requests is reset to|Kimi-K3 DCP |Kimi-K3 DSPARK|Could not resolve DFLASH"
    r"|fake_sglang: SGLang |Cuda graph is disabled|Fail to set RLIMIT_NOFILE"
    r"|Triton is not supported|The current platform does not support Intel AMX)"
)
# A Python warning as `warnings` prints it (`/x/awq.py:70: UserWarning: ...`), no log prefix;
# the line after it, indented, is the source line that warned.
_PY_WARNING = re.compile(r"[^\s\[][^\r\n]{0,400}?\.py:\d{1,7}: [A-Za-z]{0,40}Warning: [^\r\n]*")
_PRELAUNCH_RECORDS = 64  # how far back from `server_args=` a launch's own records may go


def _run_bounds(text: str) -> list[_Bound]:
    bounds: list[_Bound] = []
    for mark in _RUN_MARK.finditer(text):
        floor = bounds[-1].offset + 1 if bounds else 0
        launched = mark.group("args") is not None
        start = _launch_start(text, mark.start(), floor) if launched else mark.start()
        bounds.append(_Bound(start, 0, None, True, launched))
    if not bounds:
        bounds.append(_Bound(0, 0, None, False, False))
    elif text[:bounds[0].offset].strip():
        if _is_preamble(text[:bounds[0].offset]):
            bounds[0].offset = 0  # the first launch's own records, before its server_args
        else:
            bounds.insert(0, _Bound(0, 0, None, False, False))
    line, counted = 1, 0
    for number, bound in enumerate(bounds, start=1):
        line += text.count("\n", counted, bound.offset)
        counted = bound.offset
        end = bounds[number].offset if number < len(bounds) else len(text)
        stamp = _PREFIX.search(text, bound.offset, min(end, bound.offset + (64 << 10)))
        bound.number, bound.line = number, line
        bound.started_at = stamp.group(1)[:19] if stamp else None
    return bounds


# What says a text belongs to a run already under way: a scheduler's record (`[ts TP0]`), an
# HTTP request the server answered, a batch line.
_RUN_UNDER_WAY = re.compile(
    r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?(?: [A-Z][A-Z_]{0,15}\d{1,6})+\]"
    r"| HTTP/\d(?:\.\d)?\"|(?:Prefill|Decode) batch")


def _is_preamble(head: str) -> bool:
    """Whether the text before a log's first launch marker is that launch's own start (import
    warnings, `Cuda graph is disabled ...`, `Fail to set RLIMIT_NOFILE ...`: what SGLang's
    main process prints before `server_args=`) rather than the rotated tail of a run before
    it: it shows nothing of a run under way, and folding it finds no phase, figure, failure
    or stop."""
    if len(head) > (1 << 20) or _RUN_UNDER_WAY.search(head):
        return False
    splitter, state = LineSplitter(), initial()
    for record in [*splitter.feed(head), *splitter.flush()]:
        state = feed(state, record)
    return (state.phase is Phase.LAUNCHING and state.failure is None and not state.ranks
            and state.figures is None and state.stop is None and not state.transfer_issues
            and state.shards_total is None)


def _launch_start(text: str, start: int, floor: int) -> int:
    """Where the launch whose `server_args=` record starts at `start` began: back over the
    whole records just before it that the main process logs while resolving its arguments.
    Like `_fragments`, a record may begin mid-line, glued after an unfinished tqdm bar."""
    for _ in range(_PRELAUNCH_RECORDS):
        end = start
        while end > floor and text[end - 1] in "\r\n":
            end -= 1
        if end == start or end <= floor:
            break  # glued to an unfinished bar, or nothing before it
        line = _line_start(text, floor, end)
        begin = max((m.start() for m in _TIMESTAMP_START.finditer(text, line, end)),
                    default=line)
        if begin == line and line > floor and text[line] in " \t":
            begin = _line_start(text, floor, line - 1)  # a warning's source line: its header
        if (_PRELAUNCH.match(text, begin, end) is None
                and _PY_WARNING.match(text, begin, _line_end(text, begin)) is None):
            break
        start = begin
        if begin > line:
            break  # what precedes it on its line is the run before
    return start


def _line_start(text: str, floor: int, end: int) -> int:
    return max(text.rfind("\n", floor, end), text.rfind("\r", floor, end)) + 1


def _line_end(text: str, start: int) -> int:
    ends = [at for at in (text.find("\n", start), text.find("\r", start)) if at >= 0]
    return min(ends, default=len(text))


def _runs_phrase(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


# --- Record anatomy ---------------------------------------------------------------------------

_SEPARATOR = re.compile(r"[\r\n]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# `[%(asctime)s{.mmm}{prefix}] message`; prefix parts ` DP0 PP1 ATTN_CP0 MOE_DP0 TP3 EP3`.
_PREFIX = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?)((?: [A-Z][A-Z_]{0,15}\d{1,6}){0,8})\] ?"
)
_TIMESTAMP_START = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_TP_PART = re.compile(r" TP(\d{1,6})\b")
_SHARD_BAR = re.compile(
    r"(Multi-thread loading shards|Loading safetensors checkpoint shards): *"
    r"\d{1,3}% Completed \| (\d{1,9})/(\d{1,9}) (?:\[[^\]\r\n]{0,80}\])?"
)


def _fragments(record: str) -> Iterator[str]:
    """One record's pieces: a log line glued after an unfinished tqdm bar is its own piece."""
    for piece in _SEPARATOR.split(_ANSI.sub("", record)):
        starts = [m.start() for m in _TIMESTAMP_START.finditer(piece) if m.start() > 0]
        bounds = [0, *starts, len(piece)]
        for begin, end in itertools.pairwise(bounds):
            if piece[begin:end].strip():
                yield piece[begin:end]


def _interpret(state: LogState, text: str, lines: int) -> LogState:
    prefix = _PREFIX.match(text)
    if prefix is None:
        return _bare(state, text, lines)
    timestamp, parts = prefix.group(1), prefix.group(2)
    rank: int | None = None
    if parts:  # only scheduler processes carry a prefix; TP rank 0 when TP is 1
        tp = _TP_PART.search(parts)
        rank = int(tp.group(1)) if tp else 0
    # One `replace` for the prefix and the line count: most records change nothing else.
    state = replace(state, last_timestamp=timestamp, last_rank=rank, lines=lines)
    if state.phases[0][1] is None:
        state = replace(state, phases=((Phase.LAUNCHING, timestamp), *state.phases[1:]))
    message = text[prefix.end():]
    for handler in _MESSAGE_HANDLERS:
        handled = handler(state, message, rank, timestamp)
        if handled is not None:
            return handled
    return _failure_or_detail(state, text, message, rank, bare=False)


def _bare(state: LogState, text: str, lines: int) -> LogState:
    bar = _SHARD_BAR.match(text)
    if bar is not None:
        state = _shard_progress(state, int(bar.group(2)), int(bar.group(3)))
        rest = text[bar.end():]
        return _interpret(state, rest, lines) if rest.strip() else state
    if text.startswith("Capturing batches ("):
        return _advance(state, Phase.CAPTURING_GRAPHS, state.last_timestamp)
    return _failure_or_detail(state, text, text, state.last_rank, bare=True)


def _advance(state: LogState, phase: Phase, timestamp: str | None) -> LogState:
    if phase.value <= state.phase.value:
        return state
    return replace(state, phase=phase, phases=(*state.phases, (phase, timestamp)))


def _with_rank(state: LogState, rank: int, **changes: Any) -> LogState:
    current = state.rank(rank) or RankMemory(rank=rank)
    updated = replace(current, **changes)
    others = [memory for memory in state.ranks if memory.rank != rank]
    ranks = tuple(sorted([*others, updated], key=lambda memory: memory.rank))
    tp_size = state.tp_size
    if state.server_arg("tp_size") is None:
        tp_size = max(tp_size, rank + 1)
    return replace(state, ranks=ranks, tp_size=tp_size)


def _shard_progress(state: LogState, done: int, total: int) -> LogState:
    rank0 = state.rank(0)
    if rank0 is not None and rank0.weight_loads_done >= 1:
        if state.draft_shards_total == total:
            done = max(done, state.draft_shards_done)
        return replace(state, draft_shards_done=done, draft_shards_total=total)
    if state.shards_total == total:
        done = max(done, state.shards_done)
    state = _advance(state, Phase.LOADING_WEIGHTS, state.last_timestamp)  # head cut off
    return replace(state, shards_done=done, shards_total=total)


# --- Startup markers ----------------------------------------------------------------------------

_NUM = r"(-?\d{1,12}(?:\.\d{1,6})?)"
_INT = r"(-?\d{1,18})"
_WEIGHT_END = re.compile(
    rf"Load weight end\. elapsed={_NUM} s, .{{0,300}}?avail mem={_NUM} GB, mem usage={_NUM} GB"
)
_MAMBA = re.compile(
    rf"Mamba Cache is allocated\. max_mamba_cache_size: {_INT}, "
    rf"conv_state size: {_NUM} ?GB, ssm_state size: {_NUM} ?GB"
)
_KV = re.compile(
    rf"KV Cache is allocated\. dtype: ([\w.]{{1,40}}), #tokens: {_INT}, "
    rf"(?:KV size: {_NUM} GB|K size: {_NUM} GB, V size: {_NUM} GB)"
)
_POOL_END = re.compile(rf"Memory pool end\. avail mem={_NUM} GB")
_CAPTURE = re.compile(r"Capture .{1,80}? CUDA graph begin\.")
_FIGURES = re.compile(
    rf"max_total_num_tokens={_INT}, chunked_prefill_size=(\S{{1,20}}), "
    rf"max_prefill_tokens=(\S{{1,20}}), max_running_requests={_INT}, context_len={_INT}, "
    rf"available_[cg]pu_mem={_NUM} GB"
)
_TIMING = re.compile(r"(\w{1,40})=(\{[^}]{0,2000}\}|-?\d{1,12}(?:\.\d{1,6})?)")
_WARNINGS = (
    "Max running requests is reset to",
    "max_running_requests is capped to",
    "Kimi-K3 DCP keeps decode attention backend",
    "Kimi-K3 DCP disables --enable-symm-mem",
    "Kimi-K3 DSPARK: decode attention backend",
    "Could not resolve DFLASH draft KV bytes/token",
)

_Handler = Callable[[LogState, str, int | None, str], LogState | None]


def _on_server_args(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("server_args="):
        return None
    pairs = redact_pairs(_parse_server_args(msg[len("server_args="):]))
    values = dict(pairs)
    return replace(
        state,
        server_args=pairs,
        dcp_size=_positive_int(values.get("dcp_size"), 1),
        tp_size=_positive_int(values.get("tp_size"), state.tp_size),
    )


def _on_weight_begin(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("Load weight begin."):
        return None
    return _advance(state, Phase.LOADING_WEIGHTS, ts)


def _on_weight_end(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("Load weight end."):
        return None
    match = _WEIGHT_END.match(msg)
    if match is None:  # overlap mode's "Committed real weights after CUDA graph capture"
        return state
    rank = rank or 0
    elapsed, avail, usage = (float(group) for group in match.groups())
    memory = state.rank(rank) or RankMemory(rank=rank)
    loads = memory.weight_loads_done + 1
    if loads == 1:
        state = _with_rank(
            state, rank, weights_gb=usage, avail_after_weights_gb=avail, weight_loads_done=loads
        )
        if rank == 0 or state.weight_load_seconds is None:
            state = replace(state, weight_load_seconds=elapsed)
        if state.expects_draft:
            return state
    else:
        state = _with_rank(state, rank, draft_weights_gb=usage, weight_loads_done=loads)
        if rank == 0 or state.draft_weight_load_seconds is None:
            state = replace(state, draft_weight_load_seconds=elapsed)
    return _advance(state, Phase.ALLOCATING, ts)


def _on_mamba(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("Mamba Cache is allocated."):
        return None
    state = _advance(state, Phase.ALLOCATING, ts)
    match = _MAMBA.match(msg)
    if match is None:
        return state
    return _with_rank(
        state,
        rank or 0,
        state_slots=int(match.group(1)),
        conv_gb=float(match.group(2)),
        ssm_gb=float(match.group(3)),
    )


def _on_kv(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    # Labelled pools ("SWA KV Cache ...") and the post-capture "VA upper bound" are not K3's.
    if not msg.startswith("KV Cache is allocated."):
        return None
    state = _advance(state, Phase.ALLOCATING, ts)
    match = _KV.match(msg)
    if match is None:
        return state
    rank = rank or 0
    dtype, tokens = match.group(1), int(match.group(2))
    if match.group(3) is not None:
        size = float(match.group(3))
    else:
        size = round(float(match.group(4)) + float(match.group(5)), 2)
    memory = state.rank(rank) or RankMemory(rank=rank)
    pools = memory.kv_pools_done + 1
    if pools == 1:
        return _with_rank(
            state, rank, kv_tokens=tokens, kv_gb=size, kv_dtype=dtype, kv_pools_done=pools
        )
    return _with_rank(state, rank, draft_kv_tokens=tokens, draft_kv_gb=size, kv_pools_done=pools)


def _on_pool_end(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    match = _POOL_END.match(msg)
    if match is None:
        return None
    return _with_rank(state, rank or 0, avail_after_pools_gb=float(match.group(1)))


def _on_capture(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if _CAPTURE.match(msg) is None:
        return None
    return _advance(state, Phase.CAPTURING_GRAPHS, ts)


def _on_figures(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("max_total_num_tokens="):
        return None
    state = _advance(state, Phase.WARMING, ts)
    match = _FIGURES.match(msg)
    if match is None or state.figures is not None:
        return state
    figures = LaunchFigures(
        max_total_num_tokens=int(match.group(1)),
        chunked_prefill_size=_optional_int(match.group(2).rstrip(",")),
        max_prefill_tokens=_optional_int(match.group(3).rstrip(",")),
        max_running_requests=int(match.group(4)),
        context_len=int(match.group(5)),
        available_gpu_mem_gb=float(match.group(6)),
    )
    return replace(state, figures=figures)


def _on_timings(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("Engine startup timings (s): "):
        return None
    timings: list[tuple[str, float]] = []
    for key, value in _TIMING.findall(msg):
        if value.startswith("{"):
            timings += [(f"{key}.{k}", float(v)) for k, v in _TIMING.findall(value)
                        if not v.startswith("{")]
        else:
            timings.append((key, float(value)))
    return replace(_advance(state, Phase.WARMING, ts), startup_timings=tuple(timings))


def _on_uvicorn(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if "Uvicorn running on " not in msg:
        return None
    return _advance(state, Phase.WARMING, ts)


def _on_ready(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith("The server is fired up and ready to roll!"):
        return None
    return replace(_advance(state, Phase.READY, ts), ready=True)


# SGLang's SIGTERM handler and drain watchdog (tokenizer_manager.py 4066-4069, 3508-3540),
# then uvicorn's shutdown (uvicorn/server.py), as the main process logs them.
_SIGTERM = "SIGTERM received."
_DRAINING = "Draining requests and shutting down"
_REMAINING = re.compile(rf"Gracefully exiting\.\.\. Remaining number of requests {_INT}\b")
_FORCED = re.compile(r"Signal SIGTERM received while .{1,80}\. Force exiting\.")
_SERVER_DOWN = re.compile(r"(?:INFO:\s+)?(?:Shutting down|Finished server process \[\d{1,10}\])\s*")


def _on_stop(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    """The stop's lines: a drain (DRAINING until the last request is done), a forced exit,
    or uvicorn's shutdown with no drain before it; each ends in STOPPED but the SIGTERM."""
    if rank is not None:
        return None  # only the main process logs its stop
    stop = state.stop or StopSeen()
    if msg.startswith(_SIGTERM) and _DRAINING in msg:
        stop = replace(stop, signal_at=stop.signal_at or ts, drained=True)
        return replace(_advance(state, Phase.DRAINING, ts), stop=stop)
    remaining = _REMAINING.match(msg)
    if remaining is not None:
        count = int(remaining.group(1))
        stop = replace(stop, drained=True, remaining=count,
                       in_flight=stop.in_flight if stop.in_flight is not None else count)
        state = _advance(state, Phase.DRAINING, ts)
        if count == 0:
            return replace(_advance(state, Phase.STOPPED, ts), stop=replace(stop, ended_at=ts))
        return replace(state, stop=stop)
    if _FORCED.match(msg):
        stop = replace(stop, forced=msg.strip(), ended_at=ts)
        return replace(_advance(state, Phase.STOPPED, ts), stop=stop)
    if _SERVER_DOWN.fullmatch(msg):
        stop = replace(stop, ended_at=stop.ended_at or ts)
        return replace(_advance(state, Phase.STOPPED, ts), stop=stop)
    return None


_BOOTSTRAP_UP = "KVBootstrapServer started successfully on "  # common/conn.py:3321
_PEER = re.compile(r"bootstrap_addr: ?([^\s),]{1,300})")
_SESSION_FAILED = re.compile(r"Session \S{1,300} failed\.")
_BOOT_TIMEOUT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
_WAIT_TIMEOUT = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
# (kind, any of these in the message), most specific first: a request's failure line carries
# its cause after "with exception", so the cause decides. Strings from SGLang 0.5.23's
# srt/disaggregation/: common/conn.py, mooncake/conn.py, prefill.py, decode.py.
_ISSUES: tuple[tuple[IssueKind, tuple[str, ...]], ...] = (
    ("bootstrap_timeout", ("in KVPoll.Bootstrapping",
                           "Some requests timed out when bootstrapping")),
    ("waiting_timeout", ("in KVPoll.WaitingForInput", "Timed out waiting for prefill completion",
                         "fail to receive KV Cache transfer done signal")),
    ("transfer_failed", ("Transfer thread failed because of",)),
    ("peer_lost", ("Lost connection with prefill instance", "is healthy before, but now it is down",
                   "Decode instance could be dead", "from prefill instance, it might be dead")),
    ("layout_mismatch", ("mismatch: prefill server has", "Both servers must use the same")),
    ("register_failed", ("Prefill instance failed to register to bootstrap server",)),
    ("handshake_failed", ("Decode handshake failed for request", "Prefill bootstrap failed for "
                          "request", "Could not fetch prefill parallel info from",
                          "Error fetching prefill info from bootstrap",
                          "Error fetching prefill server info from bootstrap",
                          "Failed to get prefill server info")),
    ("transfer_failed", ("Prefill transfer failed for request", "Decode transfer failed for "
                         "request", "Failed to send kv chunk of")),
)
_ISSUE_HINTS: dict[IssueKind, str] = {
    "bootstrap_timeout": (
        "The decode engine the router paired with this prefill never asked for these "
        f"requests' KV within {_BOOT_TIMEOUT} (300 s): check that the decode box is up and "
        "reaches this box's bootstrap port; if it is only slow (a long decode queue), raise "
        f"{_BOOT_TIMEOUT} in the engine's environment. The engine itself needs no restart."),
    "waiting_timeout": (
        f"The prefill engine did not finish sending these requests' KV within {_WAIT_TIMEOUT} "
        "(300 s): check the prefill box's queue and health, and the RDMA link "
        f"(cell.ib_device, `ibv_devinfo`); raise {_WAIT_TIMEOUT} only if a slower first token "
        "is acceptable. The engine itself needs no restart."),
    "peer_lost": (
        "The other member of the pair went away mid-transfer (its heartbeat or its transfer "
        "session failed), so its requests failed: bring that box's engine back (its own log "
        "says why it stopped); this engine keeps serving and needs no restart."),
    "layout_mismatch": (
        "The prefill and decode engines lay out KV differently, so no request can be handed "
        "over: give both the same --page-size, --kv-cache-dtype and attention backends (the "
        "same profile and SGLang pin on every member), then restart the one that differs."),
    "register_failed": (
        "The prefill engine could not register with its own bootstrap server, so decode "
        "engines cannot find its ranks: check that nothing else holds cell.bootstrap_port on "
        "this box (`ss -ltnp`), then restart this engine."),
    "handshake_failed": (
        "A decode engine could not reach the prefill's bootstrap server or agree on a handover: "
        "check that the router's --prefill names the prefill's cell.bootstrap_port, that the "
        "port is open between the boxes, and that the prefill engine is up."),
    "transfer_failed": (
        "Moving KV between the boxes failed: check the RDMA link on both (cell.ib_device, "
        "`ibv_devinfo`, `ibstat`) and that both engines use the same cell.transfer_backend; "
        "requests that failed this way got a 500, the engines keep serving."),
}


def _on_bootstrap_up(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    at = msg.find(_BOOTSTRAP_UP)
    if at < 0:
        return None
    return replace(state, bootstrap_server=msg[at + len(_BOOTSTRAP_UP):].strip()[:300] or None)


def _on_transfer_issue(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    kind = next((k for k, markers in _ISSUES if any(m in msg for m in markers)), None)
    if kind is None and _SESSION_FAILED.fullmatch(msg.strip()):
        kind = "transfer_failed"
    if kind is None:
        return None
    peer = _PEER.search(msg)
    line = redact(msg.strip()[:2000])
    issues = list(state.transfer_issues)
    at = next((i for i, issue in enumerate(issues) if issue.kind == kind), None)
    if at is None:
        issues.append(TransferIssue(kind, 1, line, _ISSUE_HINTS[kind],
                                    peer.group(1) if peer else None, ts, ts))
    else:
        old = issues[at]
        issues[at] = replace(old, count=old.count + 1, line=line, last_at=ts,
                             peer=peer.group(1) if peer else old.peer)
    return replace(state, transfer_issues=tuple(issues))


def _on_warning(state: LogState, msg: str, rank: int | None, ts: str) -> LogState | None:
    if not msg.startswith(_WARNINGS):
        return None
    text = msg.strip()
    if text in state.warnings:
        return state
    return replace(state, warnings=(*state.warnings, text))


_MESSAGE_HANDLERS: tuple[_Handler, ...] = (
    _on_server_args, _on_weight_begin, _on_weight_end, _on_mamba, _on_kv, _on_pool_end,
    _on_capture, _on_figures, _on_timings, _on_uvicorn, _on_ready, _on_stop, _on_warning,
    _on_bootstrap_up, _on_transfer_issue,
)


def _parse_server_args(text: str) -> tuple[tuple[str, str], ...]:
    """Key/value text of `ServerArgs(k=v, ...)` (the reference's form) or `{'k': v, ...}`
    (0.5.23's `resolved_dict()`); a value keeps its literal text minus one pair of enclosing
    quotes. A line cut short still yields the pairs before the cut."""
    body = text.strip()
    if body.startswith("ServerArgs("):
        body, keyed = body[len("ServerArgs("):], re.compile(r"(\w{1,100})=(.*)", re.S)
    elif body.startswith("{"):
        body, keyed = body[1:], re.compile(r"'(\w{1,100})'\s*:\s*(.*)", re.S)
    else:
        return ()
    pairs: list[tuple[str, str]] = []
    for item in _top_level_items(body):
        match = keyed.fullmatch(item.strip())
        if match is not None:
            pairs.append((match.group(1), _unquote(match.group(2).strip())))
    return tuple(pairs)


def _top_level_items(body: str) -> list[str]:
    """Split at commas outside quotes and brackets; stop at the bracket that closes `body`."""
    items: list[str] = []
    depth, quote, escaped, start = 0, "", False, 0
    for index, char in enumerate(body):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                items.append(body[start:index])
                return items
            depth -= 1
        elif char == "," and depth == 0:
            items.append(body[start:index])
            start = index + 1
    return items  # cut short: the unfinished last item is dropped


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _optional_int(text: str) -> int | None:
    try:
        return int(text) if len(text) <= 18 else None
    except ValueError:
        return None


def _positive_int(text: str | None, default: int) -> int:
    value = _optional_int(text) if text is not None else None
    return value if value is not None and value > 0 else default


# --- Failures (the table: `logfailures`) ------------------------------------------------------


def _failure_or_detail(
    state: LogState, line: str, message: str, rank: int | None, *, bare: bool
) -> LogState:
    """Classify `message` (the record minus its log prefix); `line` is the whole record."""
    finding = classify(state, message.strip(), rank, bare=bare)
    line = line.strip()
    if finding is not None:
        return replace(state, failure=_refine(state.failure, finding, redact(line)))
    failure = state.failure
    if (bare and failure is not None and failure.detail is None
            and EXCEPTION_LINE.fullmatch(line) and failure.line != (line := redact(line))):
        return replace(state, failure=replace(failure, detail=line))
    return state


def _refine(current: Failure | None, found: Finding, line: str) -> Failure:
    if current is None or SPECIFICITY[found.reason] > SPECIFICITY[current.reason]:
        rank = found.rank if found.rank is not None else (current.rank if current else None)
        detail = current.detail if current is not None and current.detail != line else None
        return Failure(found.reason, rank, line, found.hint, detail)
    if found.reason == current.reason and current.rank is None and found.rank is not None:
        return replace(current, rank=found.rank, hint=found.hint)
    return current
