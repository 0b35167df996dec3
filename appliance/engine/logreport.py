"""Renders a parsed engine log (`logparse.LogState`) for people and for JSON.

`render_text` is what `appliance engine parse-log FILE` prints: phases with their timestamps,
weight progress, the per-rank memory table, the logical KV capacity, launch figures, warnings,
and, on failure, the classified reason, rank and the operator's next step. `render_json` is the
same content as plain dicts, lists, str, int, float, bool and None, ready for `json.dumps`, the
admin API and the run record. Both are pure and never raise on a valid `LogState`.

A log holds every run appended to it; a state is folded from one run only, and says which
(`LogState.origin`). The text report opens with that run's label, and each figure group names
its run when the log holds more than one, so a pasted fragment still says where it came from.
`render_runs_text` renders several runs in turn, each under its own label.
"""

from __future__ import annotations

from typing import Any

from appliance.engine.logparse import LogState, Phase, RankMemory, RunOrigin

TIMES = "\u00d7"  # the multiplication sign, spelled out so linters do not take it for an x


def render_text(state: LogState) -> str:
    """A plain-text report, one fact per line, for a terminal or a support ticket."""
    out: list[str] = []
    origin = state.origin
    tag = f" (run {origin.number})" if origin is not None and origin.of > 1 else ""
    if origin is not None:
        out.append(f"Log: {origin.label}{_unmarked(origin)}")
    if state.ready and state.stop is not None:
        out.append(f"Ready{tag}: it was, until its stop (last phase reached: {state.phase.name})")
    elif state.ready:
        out.append(f"Ready{tag}: yes (\"The server is fired up and ready to roll!\" seen)")
    else:
        out.append(f"Ready{tag}: no (last phase reached: {state.phase.name})")
    out += _stop(state, tag)
    out.append(f"Phases{tag}:")
    out += [f"  {phase.name:<17} {at or '(no timestamp)'}" for phase, at in state.phases]
    out += _weights(state, tag)
    out += _memory_table(state, tag)
    capacity = state.kv_token_capacity
    rank0 = state.rank(0)
    if capacity is not None and rank0 is not None and rank0.kv_tokens is not None:
        out.append(f"Logical KV capacity{tag}: {rank0.kv_tokens:,} tokens per rank {TIMES} "
                   f"DCP{state.dcp_size} = {capacity:,} tokens")
    out.append(f"Parallelism{tag}: TP{state.tp_size}, DCP{state.dcp_size}")
    figures = state.figures
    if figures is not None:
        out.append(f"Launch figures{tag}:")
        out.append(f"  max_total_num_tokens   {figures.max_total_num_tokens:,} (per rank)")
        out.append(f"  max_running_requests   {figures.max_running_requests:,}")
        out.append(f"  context_len            {figures.context_len:,}")
        out.append(f"  chunked_prefill_size   {_count(figures.chunked_prefill_size)}")
        out.append(f"  max_prefill_tokens     {_count(figures.max_prefill_tokens)}")
        out.append(f"  available_gpu_mem      {_gb(figures.available_gpu_mem_gb)} GiB")
    if state.startup_timings:
        timings = ", ".join(f"{key}={value:.2f}" for key, value in state.startup_timings)
        out.append(f"Startup timings (s){tag}: {timings}")
    if state.warnings:
        out.append(f"Warnings{tag}:")
        out += [f"  - {warning}" for warning in state.warnings]
    failure = state.failure
    if failure is None:
        out.append(f"Failure{tag}: none seen")
    else:
        where = f" on TP{failure.rank}" if failure.rank is not None else ""
        out.append(f"Failure{tag}: {failure.reason}{where}")
        out.append(f"  line:   {failure.line}")
        if failure.detail:
            out.append(f"  detail: {failure.detail}")
        out.append(f"  next:   {failure.hint}")
    last = state.last_timestamp or "none"
    out.append(f"Records read{tag}: {state.lines:,} (last timestamp: {last})")
    return "\n".join(out) + "\n"


def _stop(state: LogState, tag: str) -> list[str]:
    """The stop, when the log shows one: whether SGLang drained, and how it ended."""
    stop = state.stop
    if stop is None:
        return []
    signal = f"SIGTERM at {stop.signal_at}" if stop.signal_at else "no SIGTERM line"
    if stop.forced:
        how = f"forced exit at {stop.ended_at}: {stop.forced}"
    elif stop.drained and stop.remaining == 0:
        waited = stop.in_flight or 0
        drained = (f"drained {waited} request{'' if waited == 1 else 's'} in flight" if waited
                   else "drained (no request was in flight)")
        how = f"{drained}, stopped at {stop.ended_at}"
    elif stop.drained:
        left = "an unknown number of" if stop.remaining is None else str(stop.remaining)
        how = f"draining, {left} requests still in flight when the log ends"
    else:
        how = (f"stopped at {stop.ended_at} without a drain (SGLang drains only once a "
               "request has reached it; none had)")
    return [f"Stop{tag}: {signal}; {how}"]


def render_runs_text(states: list[LogState]) -> str:
    """Several runs' reports in turn, each opening with its own run label, a rule between
    them."""
    return ("\n" + "-" * 40 + "\n").join(render_text(state) for state in states)


def render_json(state: LogState) -> dict[str, Any]:
    """The state as JSON-ready values; enum members become their names."""
    failure = state.failure
    figures = state.figures
    return {
        "run": _origin_json(state.origin),
        "phase": state.phase.name,
        "ready": state.ready,
        "phases": [{"phase": phase.name, "at": at} for phase, at in state.phases],
        "shards": {"done": state.shards_done, "total": state.shards_total},
        "draft_shards": {"done": state.draft_shards_done, "total": state.draft_shards_total},
        "weight_load_seconds": state.weight_load_seconds,
        "draft_weight_load_seconds": state.draft_weight_load_seconds,
        "ranks": [_rank_json(memory) for memory in state.ranks],
        "kv_token_capacity": state.kv_token_capacity,
        "tp_size": state.tp_size,
        "dcp_size": state.dcp_size,
        "figures": None if figures is None else {
            "max_total_num_tokens": figures.max_total_num_tokens,
            "chunked_prefill_size": figures.chunked_prefill_size,
            "max_prefill_tokens": figures.max_prefill_tokens,
            "max_running_requests": figures.max_running_requests,
            "context_len": figures.context_len,
            "available_gpu_mem_gb": figures.available_gpu_mem_gb,
        },
        "server_args": dict(state.server_args),
        "warnings": list(state.warnings),
        "startup_timings": dict(state.startup_timings),
        "failure": None if failure is None else {
            "reason": failure.reason,
            "rank": failure.rank,
            "line": failure.line,
            "hint": failure.hint,
            "detail": failure.detail,
        },
        "stop": None if state.stop is None else {
            "signal_at": state.stop.signal_at,
            "drained": state.stop.drained,
            "in_flight": state.stop.in_flight,
            "remaining": state.stop.remaining,
            "ended_at": state.stop.ended_at,
            "forced": state.stop.forced,
        },
        "lines": state.lines,
        "last_timestamp": state.last_timestamp,
    }


def _unmarked(origin: RunOrigin) -> str:
    if origin.marked:
        return ""
    return " (no start line before it: the log begins inside a run)"


def _origin_json(origin: RunOrigin | None) -> dict[str, Any] | None:
    if origin is None:
        return None
    return {"number": origin.number, "of": origin.of, "started_at": origin.started_at,
            "start_line": origin.start_line, "label": origin.label}


def _weights(state: LogState, tag: str) -> list[str]:
    lines: list[str] = []
    if state.shards_total is not None or state.phase.value >= Phase.LOADING_WEIGHTS.value:
        total = state.shards_total if state.shards_total is not None else "?"
        took = (f", loaded in {_duration(state.weight_load_seconds)}"
                if state.weight_load_seconds is not None else "")
        lines.append(f"Weights{tag}: {state.shards_done}/{total} shards{took}")
    if state.draft_shards_total is not None or state.draft_weight_load_seconds is not None:
        total = state.draft_shards_total if state.draft_shards_total is not None else "?"
        took = (f", loaded in {_duration(state.draft_weight_load_seconds)}"
                if state.draft_weight_load_seconds is not None else "")
        lines.append(f"Draft weights{tag}: {state.draft_shards_done}/{total} shards{took}")
    return lines


def _memory_table(state: LogState, tag: str) -> list[str]:
    if not state.ranks:
        return []
    draft = any(m.draft_weights_gb is not None or m.draft_kv_gb is not None for m in state.ranks)
    # GiB, as nvidia-smi: SGLang's log prints these very figures as "GB" (the title says so).
    header = ["rank", "weights GiB", "KDA state GiB (conv+ssm)", "MLA KV GiB = tokens/rank"]
    if draft:
        header += ["draft weights GiB", "draft KV GiB = tokens"]
    header.append("free after pools GiB")
    rows = [header]
    for memory in state.ranks:
        row = [str(memory.rank), _gb(memory.weights_gb), _state(memory),
               _pool(memory.kv_gb, memory.kv_tokens)]
        if draft:
            row += [_gb(memory.draft_weights_gb), _pool(memory.draft_kv_gb, memory.draft_kv_tokens)]
        row.append(_gb(memory.avail_after_pools_gb))
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    dtypes = sorted({m.kv_dtype for m in state.ranks if m.kv_dtype is not None})
    title = f"Memory per rank{tag}" + (
        f" (MLA KV dtype {', '.join(dtypes)})" if dtypes else "") + (
        ", in GiB (SGLang's log says GB for GiB):")
    return [title, *("  " + "  ".join(cell.rjust(width) for cell, width in zip(
        row, widths, strict=True)) for row in rows)]


def _state(memory: RankMemory) -> str:
    if memory.state_gb is None:
        return "-"
    slots = f" for {memory.state_slots:,} slots" if memory.state_slots is not None else ""
    return f"{memory.state_gb:.2f}{slots}"


def _pool(size_gb: float | None, tokens: int | None) -> str:
    if size_gb is None:
        return "-"
    return f"{size_gb:.2f} = {tokens:,}" if tokens is not None else f"{size_gb:.2f}"


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, rest = divmod(round(seconds), 60)
    return f"{seconds:.2f} s ({minutes} min {rest} s)" if minutes else f"{seconds:.2f} s"


def _rank_json(memory: RankMemory) -> dict[str, Any]:
    return {
        "rank": memory.rank,
        "weights_gb": memory.weights_gb,
        "avail_after_weights_gb": memory.avail_after_weights_gb,
        "state_slots": memory.state_slots,
        "conv_gb": memory.conv_gb,
        "ssm_gb": memory.ssm_gb,
        "state_gb": memory.state_gb,
        "kv_tokens": memory.kv_tokens,
        "kv_gb": memory.kv_gb,
        "kv_dtype": memory.kv_dtype,
        "avail_after_pools_gb": memory.avail_after_pools_gb,
        "draft_weights_gb": memory.draft_weights_gb,
        "draft_kv_tokens": memory.draft_kv_tokens,
        "draft_kv_gb": memory.draft_kv_gb,
    }
